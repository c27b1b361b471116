"""Time a short DPO run spends outside its steps, on the real HH-RLHF file, for each ``reference_mode``.

The run: ``run_dpo`` (the worker's loop) on the 1,300 pairs of ``tests/data/hh-rlhf/`` (a copy of
``shared/data/hh-rlhf``, read through the upload path's own HH converter), ``tiny:llama-10m``, the spec's
defaults (batch 8, max_length 256, max_prompt_length 128, eval_max_rows 128), ``max_steps`` 5, fp32 on CPU.

A step is timed from the loop's stop check before it to the moment its metrics are logged (forward,
backward, update; with ``lazy`` also the reference log-probs of its 8 pairs). Everything else is outside
the steps: loading the model, tokenising, a precompute pass, final metrics, the final save. Each long
phase's own time is printed too (``trainer/phases.py`` names them).

``ratio = precompute outside / lazy outside``: how many times longer a user waits outside the steps
with today's precompute. Run: ``.venv/bin/python bench/dpo_phases.py`` (``--modes lazy`` for the quick
half; ``--steps N``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from rlrun.formats import normalize_preference
from trainer.loops.dpo import run_dpo
from trainer.models import resolve_model
from trainer.phases import Counter, Phase
from trainer.reporting import LoopContext, MemoryReporter, RunData
from trainer.specs import parse_spec

HH = Path(__file__).resolve().parents[1] / "tests" / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"
PHASE_ORDER = ("model_load", "tokenize", "reference", "eval", "final_metrics", "checkpoint")


class TimingReporter(MemoryReporter):
    """Times steps (stop check -> its `loss` logged) and each phase (enter -> exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.step_started = 0.0
        self.in_steps = 0.0
        self.phase_seconds: dict[str, float] = defaultdict(float)

    def should_stop(self) -> bool:
        self.step_started = time.perf_counter()
        return super().should_stop()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if "loss" in metrics:
            self.in_steps += time.perf_counter() - self.step_started
        super().log_metrics(step, metrics)

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]:
        return self._timed(name, total)

    @contextmanager
    def _timed(self, name: str, total: int | None) -> Iterator[Phase]:
        counter = Counter(name, total)
        self.phases.append(counter)
        t0 = time.perf_counter()
        try:
            yield counter
        finally:
            self.phase_seconds[name] += time.perf_counter() - t0


def hh_rows() -> list[dict[str, Any]]:
    return [normalize_preference(json.loads(line))[0] for line in HH.read_text().splitlines() if line.strip()]


def run(mode: str, steps: int, rows: list[dict[str, Any]], cache: Path) -> dict[str, Any]:
    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-10m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "reference_mode": mode},
        }
    )
    with tempfile.TemporaryDirectory() as out:
        ctx = LoopContext(
            cache_dir=cache,
            checkpoint_dir=Path(out),
            resolve_model=lambda ref: resolve_model(
                ref, cache_dir=cache, run_output=None, roots=[], allow_hub=False
            ),
        )
        reporter = TimingReporter()
        t0 = time.perf_counter()
        result = run_dpo(spec, RunData(train=rows), reporter, ctx)
        wall = time.perf_counter() - t0
    assert result.status == "succeeded"
    return {
        "mode": mode,
        "wall": wall,
        "in_steps": reporter.in_steps,
        "outside": wall - reporter.in_steps,
        "phases": dict(reporter.phase_seconds),
        "final_loss": reporter.series("final/loss")[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="lazy,precompute")
    args = parser.parse_args()
    rows = hh_rows()
    threads = torch.get_num_threads()
    print(f"DPO, {args.steps} steps, tiny:llama-10m, {len(rows)} HH-RLHF pairs, fp32, {threads} threads")
    results = []
    with tempfile.TemporaryDirectory() as cache:
        resolve_model("tiny:llama-10m", cache_dir=Path(cache), run_output=None, roots=[], allow_hub=False)
        for mode in args.modes.split(","):
            results.append(run(mode, args.steps, rows, Path(cache)))
            r = results[-1]
            phases = "  ".join(f"{p} {r['phases'][p]:.1f}" for p in PHASE_ORDER if p in r["phases"])
            print(
                f"{mode:>10}: wall {r['wall']:6.1f} s   in steps {r['in_steps']:6.1f} s   "
                f"outside steps {r['outside']:6.1f} s   [{phases}]   final/loss {r['final_loss']:.4f}"
            )
    by_mode = {r["mode"]: r for r in results}
    if {"lazy", "precompute"} <= set(by_mode):
        ratio = by_mode["precompute"]["outside"] / by_mode["lazy"]["outside"]
        print(f"outside steps, precompute / lazy: {ratio:.1f}x")


if __name__ == "__main__":
    main()
