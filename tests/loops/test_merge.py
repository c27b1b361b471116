"""Merge runs on the tiny model: the merged folder loads with plain transformers (no peft) and gives the
logits of the base under its unmerged adapter (peft's forward); dtype kept or chosen; whole models refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.loop_context import loop_ctx
from tests.loops.test_adapters import run, spec
from trainer.adapters import is_adapter_folder
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec


def merge_spec(model: str, **hp: Any) -> Any:
    return parse_spec({"algorithm": "merge", "model": model, "hyperparameters": hp})


def adapter_run(tiny_cache: Path, out: Path) -> Path:
    result, _ = run(spec("sft"), "sft", tiny_cache, out)
    assert is_adapter_folder(result.output_path)
    return Path(result.output_path)


def merge(model_ref: str, folder: Path, tiny_cache: Path, out: Path, **hp: Any) -> Any:
    reporter = MemoryReporter()
    ctx = loop_ctx(tiny_cache, out, runs={model_ref: folder})
    return LOOPS["merge"](merge_spec(model_ref, **hp), RunData(train=[]), reporter, ctx), reporter


def test_the_merged_model_answers_as_base_plus_adapter(tiny_cache: Path, tmp_path: Path) -> None:
    folder = adapter_run(tiny_cache, tmp_path / "sft")
    result, reporter = merge(f"run:{uuid.uuid4()}", folder, tiny_cache, tmp_path / "merge")
    assert result.status == "succeeded" and not is_adapter_folder(result.output_path)
    assert not (tmp_path / "merge" / "merged.partial").exists()
    merged = AutoModelForCausalLM.from_pretrained(result.output_path)  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama-0.4m", tiny_cache))
    _, tokenizer = load_causal_lm(str(result.output_path))
    ids = torch.tensor([tokenizer("3+4=12").input_ids])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, folder)  # the adapter applied, not merged
        expected, got = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, got)  # the adapter changed the answer
    assert next(merged.parameters()).dtype == torch.float32  # auto: the base's dtype
    assert reporter.metrics[-1][1] == "merge/parameters"


def test_a_chosen_dtype_is_what_is_saved(tiny_cache: Path, tmp_path: Path) -> None:
    folder = adapter_run(tiny_cache, tmp_path / "sft")
    result, _ = merge(f"run:{uuid.uuid4()}", folder, tiny_cache, tmp_path / "merge", dtype="bfloat16")
    config = json.loads((Path(result.output_path) / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
    merged = AutoModelForCausalLM.from_pretrained(result.output_path, dtype="auto")
    assert next(merged.parameters()).dtype == torch.bfloat16


def test_a_whole_model_is_refused_saying_why(tiny_cache: Path, tmp_path: Path) -> None:
    whole = tiny_model_dir("llama-0.4m", tiny_cache)
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        merge(f"run:{uuid.uuid4()}", whole, tiny_cache, tmp_path / "merge")
