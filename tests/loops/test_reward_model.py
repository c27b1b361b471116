"""Reward-model loop on the tiny model: losses by value, learning a separable task, stats file, resume."""

from __future__ import annotations

import itertools
import math
import statistics
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.data.reward import collate_groups, tokenize_group, tokenize_groups
from trainer.loops.reward_model import (
    REWARD_LOSSES,
    RewardLossParams,
    group_scores,
    ranking_stats,
    run_reward_model,
    score_groups,
)
from trainer.loops.session import seed_everything
from trainer.models import REWARD_STATS_FILE, load_reward_model, read_reward_stats, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

CPU = torch.device("cpu")
GOOD = [" good good", " good yes good", " yes good", " good answer good"]
BAD = [" bad bad", " bad no bad", " no bad", " bad answer bad"]


def pairs(n: int, offset: int = 0) -> list[dict[str, Any]]:
    """Separable pairs: the chosen response says "good", the rejected one "bad" (wording varies)."""
    return [
        {"prompt": f"Q{i + offset}:", "chosen": GOOD[i % 4], "rejected": BAD[(i // 4) % 4]} for i in range(n)
    ]


RANKING = [
    {"prompt": f"Q{i}:", "responses": [GOOD[i % 4], " yes", " no", BAD[i % 4], " bad"][: 2 + i % 4]}
    for i in range(12)
]
TRAIN_KEYS = {
    "loss",
    "accuracy",
    "margin",
    "scores/mean",
    "scores/std",
    "grad_norm",
    "lr",
    "perf/tokens_per_s",
    "tokens/trained",
}
EVAL_KEYS = {"eval/loss", "eval/accuracy", "eval/margin", "eval/scores_mean", "eval/scores_std"}
FINAL_KEYS = {"final/score_mean", "final/score_std", "final/accuracy"}


_ctx = loop_ctx


def _spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "reward_model",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {
                "max_steps": 3,
                "batch_size": 4,
                "learning_rate": 1e-2,
                "max_length": 32,
                **hp,
            },
        }
    )


def _start_model(tiny_cache: Path, seed: int = 0) -> tuple[Any, Any]:
    """The loop's starting point: the tiny LM with the score head drawn after seeding."""
    path = str(tiny_model_dir("llama-0.4m", tiny_cache))  # may build the preset, which draws from the RNG
    seed_everything(seed)
    return load_reward_model(path)


@torch.no_grad()
def _score_alone(model: Any, ids: list[int]) -> float:
    """One unpadded sequence, batch of one: the head's output at its last token."""
    return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_kwise_loss_of_a_4_way_ranking_is_the_mean_over_its_6_pairs(tiny_cache: Path) -> None:
    model, tok = _start_model(tiny_cache)
    with torch.no_grad():
        model.score.weight.mul_(30.0)  # spread the scores: order then changes the loss far beyond tolerance
    rows: list[dict[str, Any]] = [
        {"prompt": "Q1:", "responses": [" good good", " yes", " the answer is no", " bad"]},
        {"prompt": [{"role": "user", "content": "hi"}], "responses": [" good", " bad bad bad"]},
    ]
    groups = [tokenize_group(r, "ranking", tok, max_length=32) for r in rows]
    batch = collate_groups(groups, tok.pad_token_id)
    with torch.no_grad():
        scores = group_scores(model, batch, CPU)  # right-padded, both rows in one pass
    loss = REWARD_LOSSES["ranking"](scores, batch.mask, batch.margins, RewardLossParams(center_coef=0.5))
    stats = ranking_stats(scores, batch.mask)

    by_hand, pair_diffs = [], []
    for g in groups:
        s = [_score_alone(model, seq) for seq in g.sequences]  # better first
        diffs = [s[i] - s[j] for i, j in itertools.combinations(range(len(s)), 2)]
        by_hand.append(sum(_neg_logsigmoid(d) for d in diffs) / len(diffs))
        pair_diffs += diffs
    assert len(pair_diffs) == 6 + 1
    assert float(loss) == pytest.approx(sum(by_hand) / 2, abs=1e-5)
    # The scores are spread enough that the order matters: ranked worst first, row 0's loss moves a lot.
    worst_first = statistics.fmean(_neg_logsigmoid(-d) for d in pair_diffs[:6])
    assert abs(by_hand[0] - worst_first) > 0.1
    assert float(stats["accuracy"]) == pytest.approx(sum(d > 0 for d in pair_diffs) / 7)
    assert float(stats["margin"]) == pytest.approx(statistics.fmean(pair_diffs), abs=1e-5)


def test_bradley_terry_step_uses_margin_and_centering(tiny_cache: Path, tmp_path: Path) -> None:
    rows = pairs(4)
    rows[0]["margin"], rows[1]["margin"], rows[2]["margin"] = 1.5, -2.0, 0.25  # rows[3] has none: 0
    reporter = MemoryReporter()
    run_reward_model(
        _spec(max_steps=1, batch_size=4, center_coef=0.5),
        RunData(train=rows),
        reporter,
        # A cache where the preset is not built yet: building it must not shift the score head's init.
        _ctx(tmp_path / "fresh_cache", tmp_path / "a"),
    )
    model, tok = _start_model(tiny_cache)  # step 1's loss is computed with the starting model
    losses, diffs = [], []
    for row, margin in zip(rows, [1.5, -2.0, 0.25, 0.0], strict=True):
        g = tokenize_group(row, "preference", tok, max_length=32)
        c, r = (_score_alone(model, s) for s in g.sequences)
        losses.append(_neg_logsigmoid(c - r - margin) + 0.5 * (c + r) ** 2)
        diffs.append(c - r)
    assert reporter.series("loss")[0] == pytest.approx(statistics.fmean(losses), abs=1e-5)
    assert reporter.series("margin")[0] == pytest.approx(statistics.fmean(diffs), abs=1e-5)

    no_margin = MemoryReporter()
    run_reward_model(
        _spec(max_steps=1, batch_size=4, use_margin=False),
        RunData(train=rows),
        no_margin,
        _ctx(tiny_cache, tmp_path / "b"),
    )
    plain = statistics.fmean(_neg_logsigmoid(d) for d in diffs)
    assert no_margin.series("loss")[0] == pytest.approx(plain, abs=1e-5)


def test_learns_a_separable_task_to_high_validation_accuracy(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=pairs(64), validation=pairs(16, offset=100))
    model, tok = _start_model(tiny_cache)
    before = score_groups(
        model, tokenize_groups(data.validation, "preference", tok, max_length=32), tok.pad_token_id, CPU, 16
    )
    assert float(ranking_stats(before.scores, before.mask)["accuracy"]) < 0.5  # there is something to learn

    reporter = MemoryReporter()
    result = run_reward_model(
        _spec(max_steps=30, batch_size=8, learning_rate=3e-3, eval_every=10),
        data,
        reporter,
        _ctx(tiny_cache, tmp_path),
    )
    assert sorted(s for s, k, _ in reporter.metrics if k == "eval/accuracy") == [10, 20, 30]
    assert reporter.series("eval/accuracy")[-1] > 0.9
    assert result.final_metrics["final/accuracy"] > 0.9
    assert reporter.series("loss")[-1] < reporter.series("loss")[0]


class AnnounceChecker(MemoryReporter):
    """Records whether the final checkpoint already held reward_stats.json when it was announced."""

    def __init__(self) -> None:
        super().__init__()
        self.had_stats: dict[int, bool] = {}

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]) -> None:
        self.had_stats[step] = (path / REWARD_STATS_FILE).exists()
        super().checkpoint_saved(step, path, size_bytes, metrics)


def test_every_parameter_changes_and_the_saved_stats_match_the_saved_model(
    tiny_cache: Path, tmp_path: Path
) -> None:
    start, tok = _start_model(tiny_cache)
    data = RunData(train=pairs(12), validation=pairs(5, offset=50))
    reporter = AnnounceChecker()
    result = run_reward_model(
        _spec(checkpoint_every=2, keep_last_checkpoints=5), data, reporter, _ctx(tiny_cache, tmp_path / "out")
    )
    assert result.status == "succeeded" and result.output_path == tmp_path / "out" / "step-00000003"
    assert reporter.had_stats == {2: False, 3: True}

    trained, trained_tok = load_reward_model(str(result.output_path))
    assert type(trained).__name__ == "LlamaForSequenceClassification"
    assert trained.config.pad_token_id == trained_tok.pad_token_id == tok.pad_token_id
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    assert "score.weight" in before and before.keys() == after.keys()
    assert [n for n, p in before.items() if torch.equal(p, after[n])] == []

    keys = {k for _, k, _ in reporter.metrics}
    assert keys == TRAIN_KEYS | EVAL_KEYS | FINAL_KEYS
    assert sorted({s for s, k, _ in reporter.metrics if k == "loss"}) == [1, 2, 3]

    stats = read_reward_stats(result.output_path)
    assert stats is not None and stats["source"] == "validation" and stats["n"] == 10
    scores = [
        _score_alone(trained, seq)
        for g in tokenize_groups(data.validation, "preference", trained_tok, max_length=32)
        for seq in g.sequences
    ]
    assert stats["mean"] == pytest.approx(statistics.fmean(scores), abs=1e-5)
    assert stats["std"] == pytest.approx(statistics.pstdev(scores), abs=1e-5)
    assert result.final_metrics["final/score_mean"] == pytest.approx(stats["mean"])
    assert read_reward_stats(tiny_model_dir("llama-0.4m", tiny_cache)) is None


def test_ranking_with_variable_k_trains_without_nan(tiny_cache: Path, tmp_path: Path) -> None:
    assert {len(r["responses"]) for r in RANKING} == {2, 3, 4, 5}
    reporter = MemoryReporter()
    result = run_reward_model(
        _spec(max_steps=8, batch_size=4, center_coef=0.1),
        RunData(train=RANKING),
        reporter,
        _ctx(tiny_cache, tmp_path),
    )
    assert result.status == "succeeded" and result.output_path is not None
    values = [v for _, _, v in reporter.metrics]
    assert values and all(math.isfinite(v) for v in values)
    assert all(0.0 <= a <= 1.0 for a in reporter.series("accuracy"))
    assert (
        "warning",
        "center_coef applies to preference pairs only; ignored for rankings",
        None,
    ) in reporter.events
    stats = read_reward_stats(result.output_path)  # no validation set: statistics of the training responses
    assert stats is not None and stats["source"] == "train"
    assert stats["n"] == sum(len(r["responses"]) for r in RANKING)


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tiny_cache: Path, tmp_path: Path) -> None:
    data = RunData(train=pairs(12), validation=pairs(4, offset=50))
    spec = _spec(max_steps=6, checkpoint_every=3, keep_last_checkpoints=5)
    straight = run_reward_model(spec, data, MemoryReporter(), _ctx(tiny_cache, tmp_path / "a"))
    # Interrupted: cancel after 4 steps (checkpoint at 3 exists), then resume from step 3 in a fresh call.
    first = MemoryReporter(stop_after=4)
    assert run_reward_model(spec, data, first, _ctx(tiny_cache, tmp_path / "b")).status == "cancelled"
    assert list(first.checkpoints) == [3, 4]  # 4: the checkpoint saved when it stopped
    resumed_rep = MemoryReporter()
    resumed = run_reward_model(
        spec, data, resumed_rep, _ctx(tiny_cache, tmp_path / "b", resume_from=first.checkpoints[3])
    )
    assert sorted({s for s, k, _ in resumed_rep.metrics if k == "loss"}) == [4, 5, 6]
    assert straight.output_path is not None and resumed.output_path is not None
    a, _ = load_reward_model(str(straight.output_path))
    b, _ = load_reward_model(str(resumed.output_path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert read_reward_stats(straight.output_path) == read_reward_stats(resumed.output_path)
    # Resuming from the final checkpoint has nothing left to do.
    done = run_reward_model(
        spec, data, MemoryReporter(), _ctx(tiny_cache, tmp_path / "b", resumed.output_path)
    )
    assert done.status == "succeeded" and done.output_path == resumed.output_path


def test_truncation_keeps_the_response_and_eos_only_when_it_is_not_the_pad(tiny_cache: Path) -> None:
    _, tok = _start_model(tiny_cache)
    long_prompt = " ".join(str(i) for i in range(200))
    row = {"prompt": long_prompt, "chosen": " good answer", "rejected": " the answer " * 30}
    chosen, rejected = tokenize_group(row, "preference", tok, max_length=24).sequences
    response = tok(" good answer", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert len(chosen) == 24 and chosen[-len(response) :] == response
    assert chosen[: 24 - len(response)] == tok(long_prompt).input_ids[-(24 - len(response)) :]
    assert rejected == tok(" the answer " * 30, add_special_tokens=False).input_ids[:24]

    tok.pad_token = tok.eos_token  # pad == EOS: a trailing EOS would be skipped as padding when scoring
    (seq,) = tokenize_group(
        {"prompt": "Q:", "responses": [" a", " b"]}, "ranking", tok, max_length=24
    ).sequences[:1]
    assert seq == tok("Q:").input_ids + tok(" a", add_special_tokens=False).input_ids


def test_mixed_or_malformed_rows_are_refused(tiny_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="validation rows"):
        run_reward_model(
            _spec(),
            RunData(train=pairs(4), validation=RANKING[:2]),
            MemoryReporter(),
            _ctx(tiny_cache, tmp_path),
        )
    bad = [*RANKING[:2], {"prompt": "Q:", "responses": [" only one"]}]
    with pytest.raises(ValueError, match="ranking row 2"):
        run_reward_model(_spec(), RunData(train=bad), MemoryReporter(), _ctx(tiny_cache, tmp_path))
