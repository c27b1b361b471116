"""What DPO does to the policy's answers, not only to its pair accuracy: held-out greedy exact match on the
demo's 2-digit addition before and after DPO, plain and with RPO's NLL term (``rpo_alpha``).

The starting point is the demo's SFT stage (``tiny:llama-char-0.4m``, 350 steps, batch 64, lr 1e-3 on
the demo's SFT rows). DPO then trains on preference pairs built from the demo's RL problems (never the
held-out ones): chosen = the right sum, rejected = a wrong sum off by 1 to 10 (at the same fixed width), 1
pair per problem. For each learning rate and seed, DPO runs with ``rpo_alpha`` 0 (plain DPO) and 1.0 (the
RPO paper's value), the same steps, batch and beta; and, as a control, SFT continued on the chosen answers
alone for the same steps, batch and lr (``sft``): RPO's NLL term is that SFT loss, so the control says how
much of RPO's gain the preference part adds. Held-out exact match is greedy decoding of the 200 held-out
problems (the demo's ``exact_match`` metric) with the run's final model, through the same HF engine the RL
runs evaluate with. Each line also names the run-health warnings the run raised (``code@step``;
trainer/run_health.py), so the bench shows whether ``chosen_falling`` catches the runs that hurt.

Run: ``.venv/bin/python bench/dpo_generation.py`` (``--seeds 0,1,2 --steps 150 --lrs 1e-4,1e-3``); a few
minutes on 2 CPU cores. Every run goes through the real loops (``run_sft``, ``run_dpo``) with the spec
parser.
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
from learning import Workspace, addition, held_out_accuracy  # sibling script: bench/ is first on sys.path

from trainer.reporting import RunData

MODEL = "tiny:llama-char-0.4m"
SFT_STEPS = 350


def preference_pairs(rows: list[dict[str, Any]], seed: int) -> list[dict[str, str]]:
    """One pair per problem: the right sum chosen, a sum off by 1..10 rejected (3 digits, like the answer)."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        right = int(row["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        if wrong < 0:
            wrong = right + rng.randint(1, 10)
        pairs.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": f"{wrong:03d}"})
    return pairs


def train(ws: Workspace, spec: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[Path, list[str]]:
    """The run's final model and the warning codes its run-health rules fired."""
    run, reporter = ws.train(spec, RunData(train=rows))
    return ws.outputs[run], [f"{code}@{step}" for code, step, _ in reporter.warnings]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="DPO seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=150, help="DPO steps")
    parser.add_argument("--lrs", default="1e-4,1e-3", help="learning rates, comma-separated")
    parser.add_argument("--alphas", default="0,1", help="rpo_alpha values, comma-separated")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__}, {MODEL}; SFT {SFT_STEPS} steps (the demo's), then DPO {args.steps} "
        f"steps, batch 16, lr {lrs}, beta 0.1, sigmoid; held-out: the demo's 200 problems, greedy"
    )
    task = addition()
    sft_rows, rl_rows = task.sft, task.rl
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        ws = Workspace(Path(tmp))
        sft_spec = {
            "algorithm": "sft",
            "model": MODEL,
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {
                "learning_rate": 1e-3,
                "max_steps": SFT_STEPS,
                "batch_size": 64,
                "max_length": 16,
                "log_every": 50,
                "checkpoint_every": 0,
            },
        }
        sft_run, _ = ws.train(sft_spec, RunData(train=sft_rows))
        start = held_out_accuracy(ws.outputs[sft_run], task)
        print(f"after SFT: held-out exact match {start:.1%}")
        arms = [f"rpo_alpha {a:g}" for a in alphas] + ["sft"]
        results: dict[tuple[float, str], list[float]] = {(lr, arm): [] for lr in lrs for arm in arms}
        for lr in lrs:
            for seed in seeds:
                pairs = preference_pairs(rl_rows, seed)
                for arm in arms:
                    began = time.perf_counter()
                    hp = {
                        "learning_rate": lr,
                        "max_steps": args.steps,
                        "batch_size": 16,
                        "max_length": 16,
                        "seed": seed,
                        "log_every": 1,  # the run-health rules read logged steps
                        "checkpoint_every": 0,
                    }
                    if arm == "sft":
                        rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs]
                        spec = {"algorithm": "sft", "hyperparameters": hp}
                    else:
                        rows = pairs
                        alpha = float(arm.split()[1])
                        hp |= {"beta": 0.1, "max_prompt_length": 8, "rpo_alpha": alpha}
                        spec = {"algorithm": "dpo", "hyperparameters": hp}
                    spec["model"] = sft_run
                    model_path, warned = train(ws, spec, rows)
                    end = held_out_accuracy(model_path, task)
                    results[(lr, arm)].append(end)
                    print(
                        f"lr {lr:g} seed {seed} {arm}: held-out exact match {start:.1%} -> {end:.1%} "
                        f"({100 * (end - start):+.1f} points; {time.perf_counter() - began:.0f} s); "
                        f"warnings: {', '.join(warned) or 'none'}"
                    )
    print(f"held-out exact match after SFT: {start:.1%}; after {args.steps} more steps of:")
    print(f"{'lr':>8}{'arm':>16}{'mean after':>12}{'min':>8}{'max':>8}{'mean change, points':>22}")
    for (lr, arm), ends in results.items():
        mean = sum(ends) / len(ends)
        row = f"{lr:>8g}{arm:>16}{mean:>12.1%}{min(ends):>8.1%}{max(ends):>8.1%}"
        print(row + f"{100 * (mean - start):>+22.1f}")


if __name__ == "__main__":
    main()
