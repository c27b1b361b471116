"""Peak training memory: rlrun full fine-tuning vs LoRA vs LoRA + gradient checkpointing, and TRL + peft.

SFT and DPO on ``tiny:llama-125m`` (random-init Llama, 123M parameters), batch 8, max_length 512 (HH-RLHF
dialogues from ``tests/data/hh-rlhf``, long enough to fill it), AdamW, fp32 on CPU, 2 optimizer steps.
Every configuration runs in a fresh Python process (``--one``), so no allocator state carries over:

- ``full``: rlrun, the whole model trains (DPO: reference log-probs precomputed, no second copy);
- ``lora``: rlrun with a LoRA adapter (r 16, alpha 32, all linear layers), reference = adapter off;
- ``lora+gc``: the same with ``gradient_checkpointing``;
- ``lora+gc+pack``: the same with ``packing`` (padding-free rows, trainer/data/packing.py);
- ``trl``: TRL's SFTTrainer / DPOTrainer with the same peft LoraConfig, gradient checkpointing on, the
  same batch, length, learning rate and steps (TRL's own loop and collator).

Peak memory is the process's peak RSS (``ru_maxrss``) minus its RSS once the libraries are imported and
the data is ready, every process with the same allocator setting (``ALLOCATOR``); with ``--cuda`` (a GPU
machine: ``scripts/gpu_checks.sh`` runs it) every configuration trains on the GPU in bf16 (rlrun
``precision: bf16``, TRL ``bf16=True``) and peak memory is ``torch.cuda.max_memory_allocated``. tokens/s
counts the batch's tokens over the training time. It prints
``lora+gc peak / full peak`` (goal <= 0.35) and ``rlrun peak / TRL peak`` (goal <= 1.0), per task, twice:
like for like (rlrun's padded lora+gc against TRL+peft, both padding every row to the batch's longest),
and rlrun's packed lora+gc against the same TRL run (TRL's own ``padding_free`` needs flash-attention 2,
a CUDA kernel, so on this machine TRL pads).

Run: ``.venv/bin/python bench/memory.py`` after ``.venv/bin/pip install -e '.[dev,bench]'`` (about 10
minutes on 2 cores; ``--tasks sft`` for half).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

PRESET = os.environ.get("RLRUN_BENCH_PRESET", "llama-125m")  # a smaller one for a smoke run
BATCH, MAX_LENGTH, MAX_PROMPT, STEPS, LR = 8, 512, 256, 2, 1e-4
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
HH = Path(__file__).resolve().parents[1] / "tests" / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"
CONFIGS = ("full", "lora", "lora+gc", "lora+gc+pack", "trl")
# Every measured process, ours and TRL's alike: glibc serves allocations over 1 MB with mmap and gives them
# back on free, instead of raising its mmap threshold as it goes and keeping freed tensors in the heap. Peak
# RSS then follows the live tensors; without it, it mostly measures the heap's high-water mark (rlrun
# lora+gc SFT measured 3,681 MB without it and 1,146 MB with a trimming allocator, the same run). Set the
# same on a worker (docs/settings.md) to keep its memory near what training holds.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cuda_peak_mb() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rows(task: str) -> list[dict[str, Any]]:
    from rlrun.formats import normalize_preference

    pairs = [
        normalize_preference(json.loads(line))[0] for line in HH.read_text().splitlines()[: BATCH * STEPS]
    ]
    if task == "dpo":
        return pairs
    return [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs]


CUDA = os.environ.get("RLRUN_BENCH_CUDA") == "1"  # set by --cuda for the child processes


def run_rlrun(task: str, config: str, cache: Path, data: list[dict[str, Any]]) -> tuple[float, float]:
    from tests.loop_context import loop_ctx
    from trainer.loops import LOOPS
    from trainer.reporting import MemoryReporter, RunData
    from trainer.specs import parse_spec

    hp: dict[str, Any] = {
        "max_steps": STEPS,
        "batch_size": BATCH,
        "max_length": MAX_LENGTH,
        "learning_rate": LR,
        "eval_max_rows": BATCH,
        "gradient_checkpointing": config.startswith("lora+gc"),
        "precision": "bf16" if CUDA else "fp32",
        "packing": config == "lora+gc+pack",
    }
    if task == "dpo":  # the padded layout, as the figures in docs/benchmarks.md were measured (and TRL pads)
        hp |= {"max_prompt_length": MAX_PROMPT, "reference_mode": "precompute", "shared_prompt": False}
    spec = parse_spec(
        {
            "algorithm": task,
            "model": f"tiny:{PRESET}",
            "dataset_id": str(uuid.uuid4()),
            "adapter": LORA if config != "full" else None,
            "hyperparameters": hp,
        }
    )
    reporter = MemoryReporter()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        LOOPS[task](spec, RunData(train=data), reporter, loop_ctx(cache, Path(out)))
        wall = time.perf_counter() - t0
    rates = reporter.series("perf/tokens_per_s")
    return sum(rates) / max(len(rates), 1), wall


def run_trl(task: str, cache: Path, data: list[dict[str, Any]]) -> tuple[float, float]:
    import datasets
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trainer.models import load_causal_lm, tiny_model_dir

    model, tokenizer = load_causal_lm(str(tiny_model_dir(PRESET, cache)))
    peft_config = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    common: dict[str, Any] = {
        "output_dir": str(cache / f"trl-{task}"),
        "max_steps": STEPS,
        "per_device_train_batch_size": BATCH,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "max_length": MAX_LENGTH,
        "gradient_checkpointing": True,
        "bf16": CUDA,
        "fp16": False,
        "use_cpu": not CUDA,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "log_level": "error",
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
    }
    tokens: list[int] = []

    class CountTokens(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tokens.append(0)

    if task == "sft":
        from trl import SFTConfig, SFTTrainer

        dataset = datasets.Dataset.from_list(data)
        trainer: Any = SFTTrainer(
            model=model,
            args=SFTConfig(**common, completion_only_loss=True),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    else:
        from trl import DPOConfig, DPOTrainer

        dataset = datasets.Dataset.from_list(data)
        trainer = DPOTrainer(
            model=model,
            args=DPOConfig(**common, beta=0.1, loss_type=["sigmoid"]),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    return trl_tokens(trainer.train_dataset, task) / wall, wall


def trl_tokens(dataset: Any, task: str) -> float:
    """Tokens TRL trained on (each sequence cut to max_length), from its tokenized dataset; NaN when its
    columns are not the ones known here."""
    cols = set(dataset.column_names)
    if task == "sft" and "input_ids" in cols:
        return float(sum(min(len(x), MAX_LENGTH) for x in dataset["input_ids"]))
    for names in (
        ("prompt_ids", "chosen_ids", "rejected_ids"),
        ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"),
    ):
        if set(names) <= cols:  # TRL 1.x names first, then the 0.x ones
            total = 0
            for p, c, r in zip(*(dataset[n] for n in names), strict=True):
                total += min(len(p) + len(c), MAX_LENGTH) + min(len(p) + len(r), MAX_LENGTH)
            return float(total)
    return float("nan")


def one(task: str, config: str, cache: Path) -> None:
    """Child process: one configuration; prints one JSON line."""
    import torch  # noqa: F401 - imported before the baseline, like every library the run needs
    import transformers  # noqa: F401

    import trainer.loops  # noqa: F401

    if config == "trl":
        import trl  # noqa: F401
    data = rows(task)
    base = rss_mb()
    if CUDA:
        import torch

        torch.cuda.reset_peak_memory_stats()
    tokens_per_s, wall = (
        run_trl(task, cache, data) if config == "trl" else run_rlrun(task, config, cache, data)
    )
    print(
        json.dumps(
            {
                "task": task,
                "config": config,
                "peak_mb": cuda_peak_mb() if CUDA else peak_mb() - base,
                "tokens_per_s": tokens_per_s,
                "wall_s": wall,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="sft,dpo")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--cuda", action="store_true", help="train on the GPU in bf16 (CUDA peak memory)")
    parser.add_argument("--one", nargs=3, metavar=("TASK", "CONFIG", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one[0], args.one[1], Path(args.one[2]))
        return
    from trainer.models import tiny_model_dir

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        tiny_model_dir(PRESET, cache)  # built once, outside the measured processes
        print(
            f"peak training memory (MB, {'CUDA max allocated' if args.cuda else 'over post-import RSS'}), "
            f"{PRESET}, batch {BATCH}, "
            f"max_length {MAX_LENGTH}, {STEPS} steps, " + ("bf16 CUDA" if args.cuda else "fp32 CPU")
        )
        for task in args.tasks.split(","):
            results: dict[str, dict[str, Any]] = {}
            for config in args.configs.split(","):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", task, config, str(cache)],
                    capture_output=True,
                    text=True,
                    cwd=root,
                    env={
                        **os.environ,
                        "PYTHONPATH": str(root),
                        **ALLOCATOR,
                        "RLRUN_BENCH_CUDA": "1" if args.cuda else "0",
                    },
                    check=False,
                )
                line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
                if line is None:
                    print(f"{task} {config}: failed\n{out.stderr[-2000:]}")
                    continue
                results[config] = json.loads(line)
                r = results[config]
                print(
                    f"{task:>4} {config:>8}: peak {r['peak_mb']:8.0f} MB   "
                    f"{r['tokens_per_s']:8.0f} tokens/s   {r['wall_s']:6.1f} s"
                )
            if "full" in results and "lora+gc" in results:
                ratio = results["lora+gc"]["peak_mb"] / results["full"]["peak_mb"]
                print(f"{task:>4} lora+gc peak / full peak: {ratio:.2f} (goal <= 0.35)")
            for ours, label in (("lora+gc", "padded, like for like"), ("lora+gc+pack", "rlrun packed")):
                if "trl" in results and ours in results:
                    ratio = results[ours]["peak_mb"] / results["trl"]["peak_mb"]
                    print(f"{task:>4} rlrun peak / TRL peak ({label}): {ratio:.2f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
