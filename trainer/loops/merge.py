"""Merge runs (``algorithm: merge``): load an adapter over its base, fold it in (peft's
``merge_and_unload``: W <- W + (alpha / r) B A for every adapted layer), and save a plain Hugging Face
folder. One step; nothing trained. The folder is written under a temporary name and renamed when
complete, so a merge stopped half-way leaves nothing that looks finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from trainer.adapter_folders import ADAPTER_CONFIG, is_adapter_folder, root_base
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import MergeSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_dtype(folder: str) -> torch.dtype:
    """The dtype a model folder's config names (``dtype`` or ``torch_dtype``), float32 when none."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(str(name), torch.float32)


def run_merge(
    spec: MergeSpec,
    data: RunData,  # noqa: ARG001 - every loop takes the same arguments; a merge reads no rows
    reporter: Reporter,
    ctx: LoopContext,
) -> LoopResult:
    """Merge the adapter ``spec.model`` into its base; the merged folder is the run's model."""
    path = ctx.resolve_model(spec.model)
    if not is_adapter_folder(path):
        raise ValueError(
            f"{spec.model} is not a LoRA adapter (no {ADAPTER_CONFIG}): nothing to merge; a run that "
            "trained the whole model exports with format=hf as it is"
        )
    chosen = spec.hyperparameters.dtype
    dtype = base_dtype(root_base(path)) if chosen == "auto" else DTYPES[chosen]
    with reporter.phase("model_load"):
        model, tokenizer = load_causal_lm(path, dtype=dtype)  # the base with the adapter merged in
    if reporter.should_stop():
        return LoopResult(status="cancelled", output_path=None)
    out = ctx.checkpoint_dir / "merged"
    partial = out.with_name("merged.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with reporter.phase("checkpoint"):
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    metrics = {"merge/parameters": float(n_params)}
    reporter.log_metrics(1, metrics)
    reporter.event("info", f"adapter merged into its base ({n_params:,} parameters, {dtype}) at {out}")
    return LoopResult(status="succeeded", output_path=out, final_metrics=metrics)
