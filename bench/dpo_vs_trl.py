"""Seconds per DPO step: rlrun's ``run_dpo`` against TRL's ``DPOTrainer``, same model, data and settings.

Both train the built-in ``tiny:llama-10m`` (random-init Llama, ~11M parameters) from the same folder, 8
pairs per step, AdamW lr 1e-3 constant, beta 0.1, sigmoid loss, fp32 on CPU, no eval and no saving during
training, on two datasets (``--data``):

- ``addition``: 200 addition preference pairs (``rlrun.demo.addition_pairs``), max_length 64, 40 steps;
- ``hh``: the first 200 pairs of the HH-RLHF file (``tests/data/hh-rlhf``, a copy of shared/data; prompt =
  the shared conversation up to the last Assistant turn, by the upload path's own converter) whose prompt
  and longer answer fit 512 tokens, so neither trainer truncates (TRL 1.16 has only ``max_length``; rlrun
  ``max_prompt_length`` 256 is not reached), max_length 512, 20 steps;

and in both reference modes (``--modes``), each trainer in the mode that matches the other's:

- ``precompute``: every pair's reference log-probs in one pass before step 1 (rlrun
  ``reference_mode: precompute``, TRL ``precompute_ref_log_probs=True``), counted in setup and total;
- ``per-step``: the reference forward for a step's pairs during the step (rlrun ``lazy``, which computes
  a pair's values the first time a step uses it and keeps them; TRL's default, every step).

Model FLOPs utilisation (MFU): ``6 * N * tokens`` per step for the policy's forward and backward (N the
parameter count) over the steady step time and this machine's fp32 matmul peak (a 2048 x 2048 matmul on
all threads), with ``tokens`` the real (unpadded) tokens each trainer runs: TRL's standard layout runs each
pair's prompt twice (``2P + C + R``), rlrun's shared-prompt layout once (``P + C + R``, 0.73 of it on HH).
The same task's work as a rate, for both trainers alike, is ``std tok/s``: the standard layout's tokens
per steady second. (Counting rlrun's utilisation in the standard layout's tokens, as this bench did until
2026-12-06, printed 102% and 95% for its HH precompute cells: work it never did.)

Where the time goes (torch.profiler, rlrun's steady steps, 2026-12-04): on HH per-step, ``aten::mm``
65% of CPU time (the weight matmuls, forward and backward), SDPA flash attention forward + backward
13.5%, elementwise ``mul``/``add``/``pow``/``silu`` (RoPE, RMSNorm, SwiGLU) 9%, Python 4%, fused AdamW
0.4%; on addition precompute ``aten::mm`` 63%, fused AdamW 8%, Python 8%, clipping's norms 2%,
attention 2%. Both are bound by the matmuls, so what is left to gain is tokens not computed: each pair's
prompt runs once (``shared_prompt``) and pairs travel in length groups, so no row pays the batch's
longest (trainer/data/length_groups.py). On HH at 512 that is about 2,340 token positions a step (8
pairs) against TRL's 6,520 padded; on the addition pairs (about 9 tokens a pair, one group) 74 against
TRL's 115: a ceiling near 1.6x at the same matmul rate, which the steady ratios reach.

What is timed, for each, from one clock start to the end of the last optimizer step:

- rlrun: the ``run_dpo`` call, with the model loading replaced by an already loaded copy. This includes
  tokenizing the pairs and the one-time pass that precomputes the reference log-probs of every pair.
  Our final eval (over at most eval_max_rows pairs) and the final-model save after the last step are not
  timed (TRL does neither); no validation set, so no eval during training. ``reference_mode`` is set to
  ``precompute`` (the default, ``lazy``, spreads the same pass over the steps).
- TRL: ``DPOTrainer(...)`` (dataset tokenization, accelerator setup) plus ``trainer.train()``, with the
  policy and the reference model passed in already loaded. TRL's default is the peer: the reference
  forward runs at every step (``precompute_ref_log_probs=False``).

``s/step`` is that total over the steps; ``steady s/step`` leaves out setup and the first warm-up steps;
``cpu s/step`` is the process's CPU time (all threads) over the same span as ``s/step``. Wall times
swing with other load on a shared machine; CPU time much less so (it is still inflated a little when
torch's worker threads wait on a descheduled sibling).
``ratio = TRL s/step / rlrun s/step``: above 1 means rlrun is faster. Our reference pass costs one
forward over all 200 pairs; TRL's costs one forward over the batch at every step, so the total ratio
grows with --steps (break-even near steps * 8 = 200) while the steady ratio does not. The loss and
reward accuracy are train-batch means over the last logging window (10 steps): a check that both trained.

Run: ``make bench`` (runs every file in bench/) or ``.venv/bin/python bench/dpo_vs_trl.py`` (``--data
addition --modes precompute --steps N`` for one cell) after ``.venv/bin/pip install -e '.[dev,bench]'``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import common  # sibling modules (common, clock): python puts bench/ first on sys.path
import torch
from clock import StepTimes, TimedReporter, loop_context, stamp, trl_step_clock

from rlrun.demo import addition_pairs
from rlrun.formats import normalize_preference
from trainer.data.preference import tokenize_pair
from trainer.loops import dpo as dpo_loop
from trainer.loops import session as session_module
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import RunData
from trainer.specs import parse_spec

PRESET = "llama-10m"
N_PAIRS = 200
BATCH = 8
LR = 1e-3
BETA = 0.1
SEED = 0
LOG_WINDOW = 10  # TRL averages its logged metrics over this many steps; ours are averaged the same way


HH = Path(__file__).resolve().parents[1] / "tests" / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"


@dataclass(frozen=True)
class Case:
    """One dataset at its lengths, and the step budget it is run for by default."""

    name: str
    rows: list[dict[str, str]]
    max_length: int
    max_prompt_length: int
    steps: int


def addition_case() -> Case:
    return Case("addition", addition_pairs(N_PAIRS), 64, 32, 40)


def hh_case(tokenizer: Any) -> Case:
    """The first N_PAIRS HH-RLHF pairs whose prompt fits 256 tokens and prompt + answer 512 (each tokenised
    as rlrun does; so neither trainer truncates anything)."""
    rows = []
    for line in HH.read_text().splitlines():
        row = normalize_preference(json.loads(line))[0]
        prompt = len(tokenizer(row["prompt"])["input_ids"])
        longest = max(len(tokenizer(row["prompt"] + row[k])["input_ids"]) for k in ("chosen", "rejected"))
        if prompt <= 256 and longest <= 510:
            rows.append(row)
        if len(rows) == N_PAIRS:
            break
    return Case("hh", rows, 512, 256, 20)


@dataclass(frozen=True)
class PairTokens:
    """Mean real tokens of a pair, as rlrun tokenises it: in the standard layout (prompt + chosen, prompt
    + rejected: ``2P + C + R``) and in the shared-prompt one (the prompt once: ``P + C + R``)."""

    standard: float
    shared: float

    def computed_by(self, trainer: str) -> float:
        """What ``trainer`` runs: rlrun shares each prompt (``shared_prompt``, its default), TRL does not."""
        return self.shared if trainer == "rlrun" else self.standard


def tokens_per_pair(case: Case, tokenizer: Any) -> PairTokens:
    pairs = [
        tokenize_pair(r, tokenizer, max_length=case.max_length, max_prompt_length=case.max_prompt_length)
        for r in case.rows
    ]
    prompts = sum(len(p.prompt) for p in pairs) / len(pairs)
    answers = sum(len(p.chosen) + len(p.rejected) for p in pairs) / len(pairs)
    return PairTokens(standard=2 * prompts + answers, shared=prompts + answers)


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """This machine's fp32 matmul rate on all of torch's threads (FLOP/s), best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@dataclass
class Timing(StepTimes):
    """Clock readings of one training run and its last-window metrics."""

    loss: float
    accuracy: float
    case: str = ""
    mode: str = ""


def window_mean(values: list[float], steps: int) -> float:
    """Mean over the last full logging window, the one TRL's last log line covers."""
    window = min(LOG_WINDOW, steps)
    end = steps - steps % window
    return sum(values[end - window : end]) / window


def warm_up(model_dir: Path) -> None:
    """One forward/backward so neither contender pays torch's first-call costs."""
    model, tokenizer = load_causal_lm(str(model_dir))
    ids = tokenizer(["12+30=42"] * BATCH, return_tensors="pt").input_ids
    model(input_ids=ids, labels=ids).loss.backward()


def run_rlrun(model_dir: Path, case: Case, mode: str, steps: int, work: Path) -> Timing:
    rows = case.rows
    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": f"tiny:{PRESET}",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {
                "loss_type": "sigmoid",
                # precompute: one reference pass over every pair before step 1; lazy: a step's pairs
                # when first used (the same values, spread over the steps), TRL's per-step peer.
                "reference_mode": "precompute" if mode == "precompute" else "lazy",
                "beta": BETA,
                "learning_rate": LR,
                "batch_size": BATCH,
                "max_steps": steps,
                "max_length": case.max_length,
                "max_prompt_length": case.max_prompt_length,
                "seed": SEED,
                "log_every": 1,
                "eval_every": 0,
                "checkpoint_every": 0,
            },
        }
    )
    ctx = loop_context(model_dir, work)
    loaded = load_causal_lm(str(model_dir))  # loading is outside the clock, as for TRL
    # a training step logs "loss" (the final eval does not); setup ends after the reference pass
    reporter = TimedReporter(step_key="loss", setup_ends=lambda message: message.startswith("training on"))
    # the loop loads the policy through the session (load_trainable); the already loaded copy stands in (the
    # reference is a copy of it: the same model, not loaded again)
    with mock.patch.object(session_module, "load_causal_lm", lambda _path, *args, **kwargs: loaded):
        start = stamp()
        result = dpo_loop.run_dpo(spec, RunData(train=rows), reporter, ctx)
    assert result.status == "succeeded" and reporter.setup_end is not None
    return Timing(
        name="rlrun",
        start=start,
        setup_end=reporter.setup_end,
        step_ends=[reporter.step_ends[s] for s in range(1, steps + 1)],
        loss=window_mean(reporter.series("loss"), steps),
        accuracy=window_mean(reporter.series("rewards/accuracy"), steps),
        case=case.name,
        mode=mode,
    )


def trl_config(steps: int, work: Path, case: Case, mode: str) -> Any:
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(work / "trl-out"),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=case.max_length,
        precompute_ref_log_probs=mode == "precompute",  # TRL's default (False): a reference forward per step
        precompute_ref_batch_size=BATCH,
        gradient_checkpointing=False,  # TRL defaults to True; rlrun does not checkpoint
        bf16=False,  # TRL defaults to bf16; both run fp32
        fp16=False,
        use_cpu=True,
        seed=SEED,
        logging_steps=min(LOG_WINDOW, steps),
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_level="error",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )


def run_trl(model_dir: Path, case: Case, mode: str, steps: int, work: Path) -> Timing:
    import datasets
    from transformers import PrinterCallback
    from trl import DPOTrainer

    args = trl_config(steps, work, case, mode)
    model, tokenizer = load_causal_lm(str(model_dir))
    ref_model, _ = load_causal_lm(str(model_dir))  # passed in, so TRL does not reload it inside the clock
    dataset = datasets.Dataset.from_list(case.rows)
    clock = trl_step_clock()
    start = stamp()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for printed logs
    trainer.train()
    # Per-window log lines; the end-of-training summary (train_loss) may also carry a partial window.
    logs = [entry for entry in trainer.state.log_history if {"loss", "rewards/accuracies"} <= entry.keys()]
    assert clock.first_begin is not None and len(clock.ends) == steps and logs
    return Timing(
        name="TRL",
        start=start,
        setup_end=clock.first_begin,
        step_ends=clock.ends,
        loss=float(logs[-1]["loss"]),
        accuracy=float(logs[-1]["rewards/accuracies"]),
        case=case.name,
        mode=mode,
    )


def quiet() -> None:
    os.environ["TQDM_DISABLE"] = "1"  # TRL's reference pass draws a progress bar whatever disable_tqdm says
    common.quiet()


def print_table(results: list[Timing], tokens: dict[str, PairTokens], flops_per_token: float) -> None:
    """One row per trainer and cell, then each cell's ratios. ``tokens``: each case's tokens per pair;
    ``flops_per_token``: ``6 N`` over the peak, seconds of peak per token (``main``)."""
    header = f"{'':8}{'data':>9}{'mode':>11}{'steps':>6}{'setup s':>9}{'total s':>9}{'s/step':>9}"
    header += f"{'steady':>9}{'cpu s/step':>11}{'MFU %':>7}{'std tok/s':>10}{'loss':>8}{'acc':>6}"
    print(header)
    for r in results:
        computed = tokens[r.case].computed_by(r.name) * BATCH
        row = f"{r.name:8}{r.case:>9}{r.mode:>11}{r.steps:>6}{r.setup_s:>9.2f}{r.total_s:>9.2f}"
        row += f"{r.per_step_s:>9.4f}{r.steady_s:>9.4f}{r.cpu_per_step_s:>11.4f}"
        row += f"{100 * flops_per_token * computed / r.steady_s:>7.2f}"
        row += f"{tokens[r.case].standard * BATCH / r.steady_s:>10.0f}{r.loss:>8.4f}{r.accuracy:>6.2f}"
        print(row)
    for cell in dict.fromkeys((r.case, r.mode) for r in results):
        ours = [r for r in results if (r.case, r.mode) == cell and r.name == "rlrun"]
        trl = [r for r in results if (r.case, r.mode) == cell and r.name == "TRL"]

        def ratio(value: Any, ours: list[Timing] = ours, trl: list[Timing] = trl) -> float:
            return sum(map(value, trl)) / len(trl) / (sum(map(value, ours)) / len(ours))

        print(
            f"ratio TRL / rlrun, {cell[0]} {cell[1]} (means of {len(ours)} runs each): "
            f"s/step {ratio(lambda r: r.per_step_s):.2f}, steady {ratio(lambda r: r.steady_s):.2f}, "
            f"cpu {ratio(lambda r: r.cpu_per_step_s):.2f}  (goal >= 2.0)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="addition,hh", help="addition, hh, or both (comma-separated)")
    parser.add_argument("--modes", default="precompute,per-step", help="precompute, per-step, or both")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (default: 40 addition, 20 hh)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each contender per cell, in the order AB BA AB ..."
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    modes = args.modes.split(",")
    if set(modes) - {"precompute", "per-step"}:
        parser.error("--modes takes precompute and/or per-step")
    quiet()
    import transformers
    import trl

    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, trl {trl.__version__}; tiny:{PRESET}, {N_PAIRS} pairs, "
        f"batch {BATCH}, lr {LR}, beta {BETA}, sigmoid, fp32, cpu"
    )
    peak = matmul_peak_flops()
    print(f"fp32 matmul peak here (2048 x 2048, best of 5): {peak / 1e9:.1f} GFLOP/s")
    results: list[Timing] = []
    tokens: dict[str, PairTokens] = {}
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        work = Path(tmp)
        model_dir = tiny_model_dir(PRESET, work / "cache")
        model, tokenizer = load_causal_lm(str(model_dir))
        n_params = sum(p.numel() for p in model.parameters())
        del model
        warm_up(model_dir)
        for name in args.data.split(","):
            if name not in ("addition", "hh"):
                parser.error(f"unknown --data {name!r}: addition or hh")
            case = addition_case() if name == "addition" else hh_case(tokenizer)
            tokens[case.name] = pair = tokens_per_pair(case, tokenizer)
            print(
                f"{case.name}: {len(case.rows)} pairs, {pair.standard:.0f} tokens/pair ({pair.shared:.0f} "
                f"with the prompt once), max_length {case.max_length}"
            )
            for mode in modes:
                steps = args.steps or case.steps
                for round_ in range(args.rounds):
                    # Whoever runs first runs slower (allocator and page first touches; GRPO's bench
                    # measured 0.84 with rlrun first, 1.04 with TRL first): the order alternates.
                    order = (run_rlrun, run_trl) if round_ % 2 == 0 else (run_trl, run_rlrun)
                    for run in order:
                        torch.manual_seed(SEED)
                        out = work / f"{case.name}-{mode}-{round_}"
                        results.append(run(model_dir, case, mode, steps, out))
                        gc.collect()
    print_table(results, tokens, 6 * n_params / peak)
    print(
        "note: the reference pass (precompute: all pairs before step 1; per-step: a step's pairs) is in each "
        "trainer's time; MFU counts the policy's forward and backward only (6 N per token each trainer "
        "runs: the prompt once for rlrun, twice for TRL); std tok/s is the same task's tokens for both."
    )


if __name__ == "__main__":
    main()
