"""Long phases in the real loops on the tiny model: DPO's lazy and precomputed reference log-probs agree
and each value is computed once; evaluations read at most eval_max_rows rows; a stop that lands in any
phase leaves the loop at once; the health rules flag a run that cannot learn."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.loops.dpo import run_dpo
from trainer.loops.group_rl import run_group_rl
from trainer.loops.reward_model import run_reward_model
from trainer.loops.session import eval_rows
from trainer.loops.sft import run_sft
from trainer.models import load_causal_lm
from trainer.phases import RunStopped
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

PAIRS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(4)
    for b in range(5)
]  # 20 pairs


def dpo_spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 5, "batch_size": 4, "learning_rate": 1e-2, **hp},
        }
    )


def phase_totals(reporter: MemoryReporter, name: str) -> list[int | None]:
    return [p.total for p in reporter.phases if p.name == name]


def test_lazy_and_precompute_train_alike_and_compute_each_reference_value_once(
    tiny_cache: Path, tmp_path: Path
) -> None:
    data = RunData(train=PAIRS[:16], validation=PAIRS[16:])
    lazy, pre = MemoryReporter(), MemoryReporter()
    run_dpo(dpo_spec(eval_every=2), data, lazy, loop_ctx(tiny_cache, tmp_path / "lazy"))
    run_dpo(
        dpo_spec(eval_every=2, reference_mode="precompute"), data, pre, loop_ctx(tiny_cache, tmp_path / "pre")
    )
    # The reference values match to float rounding (~1e-7: lazy computes them in the step's batches,
    # precompute in passes of 16), which Adam at lr 1e-2 grows to ~1e-5 in the losses by step 4.
    for key in ("loss", "eval/loss", "final/loss", "rewards/margin"):
        a, b = lazy.series(key), pre.series(key)
        assert len(a) == len(b) > 0 and a == pytest.approx(b, abs=1e-4), key
    assert lazy.series("loss")[0] == pytest.approx(0.6931472, abs=1e-5)  # policy == reference at step 1
    # precompute: every training pair (16) and the 4 held-out pairs, before step 1, in one pass each.
    assert phase_totals(pre, "reference") == [16, 4]
    # lazy: 5 steps of 4 pairs from an epoch of 16, then a new epoch: 16 values, each once; 4 held-out.
    lazy_totals = phase_totals(lazy, "reference")
    assert sum(t or 0 for t in lazy_totals) == 16 + 4 and all((t or 0) <= 4 for t in lazy_totals)
    first_loss_index = next(i for i, p in enumerate(pre.phases) if p.name == "eval")
    assert [p.name for p in pre.phases[:first_loss_index]] == [
        "model_load",
        "tokenize",
        "reference",
        "reference",
    ]


def test_lazy_resume_is_bit_exact_and_needs_no_value_twice(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=PAIRS)
    spec = dpo_spec(max_steps=6, checkpoint_every=2, keep_last_checkpoints=5, reference_mode="lazy")
    straight = run_dpo(spec, data, MemoryReporter(), loop_ctx(tiny_cache, tmp_path / "a"))
    first = MemoryReporter(stop_after=3)
    assert run_dpo(spec, data, first, loop_ctx(tiny_cache, tmp_path / "b")).status == "cancelled"
    resumed_rep = MemoryReporter()
    resumed = run_dpo(
        spec, data, resumed_rep, loop_ctx(tiny_cache, tmp_path / "b", resume_from=first.checkpoints[2])
    )
    # Steps 1-2 used 8 pairs (kept in the checkpoint); steps 3-6 use the other 12 of the epoch + 4 new = 16
    # more, minus those already known; the final metrics (all 20 rows) then need none.
    known_before = 8
    assert sum(t or 0 for t in phase_totals(resumed_rep, "reference")) == len(PAIRS) - known_before
    a, _ = load_causal_lm(str(straight.output_path))
    b, _ = load_causal_lm(str(resumed.output_path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_eval_max_rows_bounds_evaluation_and_final_metrics(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=PAIRS[:14], validation=PAIRS[14:])
    reporter = MemoryReporter()
    run_dpo(dpo_spec(max_steps=2, eval_max_rows=5), data, reporter, loop_ctx(tiny_cache, tmp_path))
    assert phase_totals(reporter, "eval") == [5]  # 6 held-out pairs, 5 read
    final = next(p for p in reporter.phases if p.name == "final_metrics")
    assert final.done == 5  # 14 training pairs, 5 scored
    drawn = eval_rows(14, 5, 0)
    assert drawn == sorted(set(drawn)) and len(drawn) == 5 and all(0 <= i < 14 for i in drawn)
    assert drawn != list(range(5)) or eval_rows(14, 5, 1) != drawn  # a seeded draw, not the first rows
    assert eval_rows(3, 5, 0) == [0, 1, 2]


@pytest.mark.parametrize(
    "phase", ["model_load", "tokenize", "reference", "eval", "final_metrics", "checkpoint"]
)
def test_a_stop_in_any_dpo_phase_leaves_the_loop(tiny_cache: Path, tmp_path: Path, phase: str) -> None:
    data = RunData(train=PAIRS[:16], validation=PAIRS[16:])
    reporter = MemoryReporter(stop_in_phase=phase)
    with pytest.raises(RunStopped):
        run_dpo(dpo_spec(max_steps=2, checkpoint_every=1), data, reporter, loop_ctx(tiny_cache, tmp_path))
    assert reporter.phases[-1].name == phase
    assert not list(tmp_path.glob(".tmp-*"))


def test_sft_and_reward_model_evaluate_at_most_eval_max_rows(tiny_cache: Path, tmp_path: Path) -> None:
    sft_rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]
    sft = parse_spec(
        {
            "algorithm": "sft",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "batch_size": 4, "learning_rate": 1e-3, "eval_max_rows": 3},
        }
    )
    reporter = MemoryReporter()
    run_sft(
        sft,
        RunData(train=sft_rows[:12], validation=sft_rows[12:]),
        reporter,
        loop_ctx(tiny_cache, tmp_path / "s"),
    )
    assert phase_totals(reporter, "eval") == [3]
    assert next(p for p in reporter.phases if p.name == "final_metrics").done == 3
    rm = parse_spec(
        {
            "algorithm": "reward_model",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "batch_size": 4, "learning_rate": 1e-3, "eval_max_rows": 3},
        }
    )
    reporter = MemoryReporter()
    run_reward_model(rm, RunData(train=PAIRS), reporter, loop_ctx(tiny_cache, tmp_path / "r"))
    assert next(p for p in reporter.phases if p.name == "final_metrics").done == 3


def test_grpo_with_no_reward_signal_is_flagged_zero_advantage(tiny_cache: Path, tmp_path: Path) -> None:
    # No tiny random model writes "123456789": every completion scores 0, every group has equal rewards.
    rows = [{"prompt": f"{a}+{b}=", "answer": "123456789"} for a in range(4) for b in range(4)]
    spec = parse_spec(
        {
            "algorithm": "grpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "numeric"}],
            "hyperparameters": {
                "max_steps": 3,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 3,
                "learning_rate": 1e-3,
            },
        }
    )
    reporter = MemoryReporter()
    result = run_group_rl(spec, RunData(train=rows), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"  # it ran, but it could not learn, and says so
    assert [(code, step) for code, step, _ in reporter.warnings] == [("zero_advantage", 3)]
    assert {p.name for p in reporter.phases} >= {"model_load", "tokenize", "rollouts", "checkpoint"}


def test_a_checkpoint_from_before_reference_mode_still_resumes(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=PAIRS)
    spec = dpo_spec(max_steps=4, checkpoint_every=2, keep_last_checkpoints=5)
    first = MemoryReporter(stop_after=2)
    run_dpo(spec, data, first, loop_ctx(tiny_cache, tmp_path))
    state_file = first.checkpoints[2] / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    train = state["extra"]["ref_logps"]["train"]
    # The old layout: a (train, validation) tuple of (N, 2) tensors, every pair precomputed.
    full = torch.full((len(PAIRS), 2), -5.0)
    full[train["known"]] = train["values"][train["known"]]
    state["extra"]["ref_logps"] = (full, torch.zeros(0, 2))
    torch.save(state, state_file)
    resumed = MemoryReporter()
    result = run_dpo(spec, data, resumed, loop_ctx(tiny_cache, tmp_path, resume_from=first.checkpoints[2]))
    assert result.status == "succeeded"
    assert phase_totals(resumed, "reference") == []  # every value came from the checkpoint
