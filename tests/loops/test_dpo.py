"""DPO loop on a tiny random model: all parameters move, metrics reported, cancel obeyed, losses wired."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.completion_logps import sequence_logps
from trainer.data.preference import collate_pairs, tokenize_pair
from trainer.loops.dpo import run_dpo
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(4)
    for b in range(3)
]
DATA = RunData(train=ROWS)
EXPECTED_KEYS = {
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",
    "lr",
    "perf/tokens_per_s",
    "tokens/trained",
}


_ctx = loop_ctx


def _spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 3, "batch_size": 4, "learning_rate": 1e-2, **hp},
        }
    )


def test_train_changes_every_parameter_and_saves_a_loadable_model(tiny_cache: Path, tmp_path: Path) -> None:
    start, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    reporter = MemoryReporter()
    result = run_dpo(_spec(), DATA, reporter, _ctx(tiny_cache, tmp_path / "out"))
    assert result.status == "succeeded" and result.output_path == tmp_path / "out" / "step-00000003"
    assert list(reporter.checkpoints) == [3]
    trained, _ = load_causal_lm(str(result.output_path))
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n])]
    assert unchanged == []
    assert {k for _, k, _ in reporter.metrics if not k.startswith("final/")} == EXPECTED_KEYS
    assert sorted({s for s, k, _ in reporter.metrics if k == "loss"}) == [1, 2, 3]
    assert 0.0 <= result.final_metrics["final/rewards/accuracy"] <= 1.0


def test_first_step_loss_is_log2_because_policy_starts_at_the_reference(
    tiny_cache: Path, tmp_path: Path
) -> None:
    reporter = MemoryReporter()
    run_dpo(_spec(max_steps=1), DATA, reporter, _ctx(tiny_cache, tmp_path))
    # At step 1 the policy equals the reference: every log-ratio is 0, so the sigmoid loss is log 2.
    assert reporter.series("loss")[0] == pytest.approx(math.log(2), abs=1e-5)
    assert reporter.series("rewards/margin")[0] == pytest.approx(0.0, abs=1e-5)


def test_cancel_is_obeyed_before_the_next_step(tiny_cache: Path, tmp_path: Path) -> None:
    reporter = MemoryReporter(stop_after=2)
    result = run_dpo(_spec(max_steps=50), DATA, reporter, _ctx(tiny_cache, tmp_path / "out"))
    assert result.status == "cancelled" and result.output_path is None
    assert sorted({s for s, k, _ in reporter.metrics if k == "loss"}) == [1, 2]
    assert list(reporter.checkpoints) == [2]  # the work done so far is kept on stop


@pytest.mark.parametrize("loss_type", ["sigmoid", "cdpo", "robust", "ipo", "hinge"])
def test_each_loss_type_is_taken_from_the_registry(tiny_cache: Path, tmp_path: Path, loss_type: str) -> None:
    smoothing = 0.1 if loss_type in ("cdpo", "robust") else 0.0
    reporter = MemoryReporter()
    run_dpo(
        _spec(max_steps=1, loss_type=loss_type, label_smoothing=smoothing, beta=0.5),
        DATA,
        reporter,
        _ctx(tiny_cache, tmp_path),
    )
    # Step 1: all log-ratios are 0, so each loss takes its value at h = 0 (hand-derived per paper).
    at_zero = {
        "sigmoid": math.log(2),
        "cdpo": math.log(2),  # -(1-e)log s(0) - e log s(0) = log 2
        "robust": math.log(2),  # ((1-e) log 2 - e log 2) / (1 - 2e) = log 2
        "ipo": (1 / (2 * 0.5)) ** 2,  # (0 - 1/(2 beta))^2
        "hinge": 1.0,  # relu(1 - beta * 0)
    }[loss_type]
    assert reporter.series("loss")[0] == pytest.approx(at_zero, abs=1e-5)


def test_sequence_logps_scores_only_completion_tokens(tiny_cache: Path) -> None:
    model, tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    pair = tokenize_pair(
        {"prompt": "12+3=", "chosen": "15", "rejected": "16"}, tok, max_length=64, max_prompt_length=32
    )
    batch = collate_pairs([pair], tok.pad_token_id)
    got = sequence_logps(model, batch, torch.device("cpu"))
    # Independent: full log_softmax over the whole sequence, summed over completion positions only.
    with torch.no_grad():
        for row, completion in enumerate((pair.chosen, pair.rejected)):
            ids = torch.tensor([pair.prompt + completion])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            expected = sum(logp[t - 1, ids[0, t]] for t in range(len(pair.prompt), ids.shape[1]))
            assert got[row].item() == pytest.approx(float(expected), abs=1e-4)


def test_truncation_keeps_prompt_tail_and_fits_max_length(tiny_cache: Path) -> None:
    _, tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    long_prompt = " ".join(str(i) for i in range(200))
    pair = tokenize_pair(
        {"prompt": long_prompt, "chosen": "the answer " * 20, "rejected": "no"},
        tok,
        max_length=40,
        max_prompt_length=16,
    )
    assert len(pair.prompt) == 16
    assert pair.prompt == tok(long_prompt).input_ids[-16:]
    assert len(pair.prompt) + len(pair.chosen) == 40
    assert pair.rejected[-1] == tok.eos_token_id


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec(max_steps=6, checkpoint_every=3, keep_last_checkpoints=5)
    straight = run_dpo(spec, DATA, MemoryReporter(), _ctx(tiny_cache, tmp_path / "a"))
    # Interrupted: cancel after 4 steps (checkpoint at 3 exists), then resume from step 3 in a fresh call.
    first = MemoryReporter(stop_after=4)
    assert run_dpo(spec, DATA, first, _ctx(tiny_cache, tmp_path / "b")).status == "cancelled"
    assert list(first.checkpoints) == [3, 4]  # 4: the checkpoint saved when it stopped
    resumed_rep = MemoryReporter()
    resumed = run_dpo(
        spec, DATA, resumed_rep, _ctx(tiny_cache, tmp_path / "b", resume_from=first.checkpoints[3])
    )
    assert sorted({s for s, k, _ in resumed_rep.metrics if k == "loss"}) == [4, 5, 6]
    a, _ = load_causal_lm(str(straight.output_path))
    b, _ = load_causal_lm(str(resumed.output_path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_validation_eval_and_retention_keep_last_and_best(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=ROWS[:8], validation=ROWS[8:])
    spec = _spec(
        max_steps=6,
        checkpoint_every=1,
        eval_every=2,
        keep_last_checkpoints=2,
        best_metric="eval/loss",
        best_mode="min",
    )
    reporter = MemoryReporter()
    run_dpo(spec, data, reporter, _ctx(tiny_cache, tmp_path))
    evals = {s: v for s, k, v in reporter.metrics if k == "eval/loss"}
    assert sorted(evals) == [2, 4, 6]
    assert all(math.isfinite(v) and v > 0 for v in evals.values())
    best_step = min(evals, key=lambda s: evals[s])
    # A checkpoint carries the latest eval, so the best-by-eval/loss is one of the eval steps.
    assert set(reporter.checkpoints) == {5, 6} | {best_step}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"step-{s:08d}" for s in reporter.checkpoints)


def test_nan_loss_fails_the_step_without_touching_the_weights(tiny_cache: Path, tmp_path: Path) -> None:
    from trainer.loops.session import NonFiniteError, backward_and_step

    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nan_loss = sum(p.sum() for p in model.parameters()) * float("nan")
    with pytest.raises(NonFiniteError, match="loss is nan at step 7"):
        backward_and_step(model, optimizer, nan_loss, 1.0, step=7)
    first = next(iter(model.parameters()))
    bad_grad = torch.sqrt((first * 0).sum())  # value 0 (finite); d sqrt(u)/du at u = 0 is inf -> nan gradient
    with pytest.raises(NonFiniteError, match="gradient norm is nan at step 8"):
        backward_and_step(model, optimizer, bad_grad, 1.0, step=8)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_skip_mode_skips_a_nan_batch_with_an_event_and_keeps_training(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.loops import dpo

    real = dpo.PREFERENCE_LOSSES["sigmoid"]
    calls = {"n": 0}

    def nan_on_second_call(c: torch.Tensor, r: torch.Tensor, p: Any) -> torch.Tensor:
        calls["n"] += 1
        out = real(c, r, p)
        return out * float("nan") if calls["n"] == 2 else out

    monkeypatch.setattr(dpo, "PREFERENCE_LOSSES", {"sigmoid": nan_on_second_call})
    reporter = MemoryReporter()
    result = run_dpo(_spec(max_steps=3, on_nonfinite="skip"), DATA, reporter, _ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    assert any(k == "warning" and "step 2: non-finite" in m for k, m, _ in reporter.events)
    assert [(code, step) for code, step, _ in reporter.warnings] == [("nonfinite_skipped", 2)]  # run health
    with pytest.raises(Exception, match="loss is nan at step 2"):
        calls["n"] = 0
        run_dpo(_spec(max_steps=3), DATA, MemoryReporter(), _ctx(tiny_cache, tmp_path / "fail"))


def test_rpo_adds_the_chosen_answers_nll_per_token_to_the_first_step_loss(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """At step 1 policy = reference, so the preference loss is log 2 and the loss is log 2 + alpha times
    the mean over pairs of -log pi(chosen | prompt) / |chosen| (RPO, Pang et al. 2024 eq. 1), each term
    worked out here from a plain forward pass per pair."""
    model, tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    spec = _spec(batch_size=len(ROWS), max_steps=1, rpo_alpha=0.5)
    hp = spec.hyperparameters
    nll = []
    with torch.no_grad():
        for row in ROWS:
            pair = tokenize_pair(row, tok, max_length=hp.max_length, max_prompt_length=hp.max_prompt_length)
            ids = torch.tensor([pair.prompt + pair.chosen])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            chosen = sum(float(logp[t - 1, ids[0, t]]) for t in range(len(pair.prompt), ids.shape[1]))
            nll.append(-chosen / len(pair.chosen))
    reporter = MemoryReporter()
    assert run_dpo(spec, DATA, reporter, _ctx(tiny_cache, tmp_path / "out")).status == "succeeded"
    assert reporter.series("nll/chosen")[0] == pytest.approx(sum(nll) / len(nll), abs=1e-4)
    assert reporter.series("loss")[0] == pytest.approx(math.log(2) + 0.5 * sum(nll) / len(nll), abs=1e-4)
    assert len(reporter.series("final/nll/chosen")) == 1


def test_rpo_holds_the_chosen_answers_up(tiny_cache: Path, tmp_path: Path) -> None:
    """Plain DPO widens the margin and lets the chosen answers' log-probs fall; with the NLL term they end
    higher (same data, seed and steps)."""
    chosen = {}
    for alpha in (0.0, 1.0):
        reporter = MemoryReporter()
        spec = _spec(max_steps=8, rpo_alpha=alpha, log_every=1)
        assert run_dpo(spec, DATA, reporter, _ctx(tiny_cache, tmp_path / str(alpha))).status == "succeeded"
        chosen[alpha] = reporter.series("logps/chosen")
        assert bool(reporter.series("nll/chosen")) == (alpha > 0)
    assert chosen[1.0][-1] > chosen[0.0][-1] + 0.5, chosen
