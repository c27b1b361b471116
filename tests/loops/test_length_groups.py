"""Length-grouped passes (trainer/data/length_groups.py, DPO's ``PairGrouping``): the dynamic programme's
split is the cheapest of every partition found by brute force; fixed-count groups are equal runs; and a DPO
run whose pairs travel in length groups is the run with the batch's pairs in one padded pass, step for
step, on real HH-RLHF pairs of very different lengths."""

from __future__ import annotations

import itertools
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlrun.formats import normalize_preference
from tests.loop_context import loop_ctx
from trainer.algorithms.preference_losses import PREFERENCE_LOSSES, PairObjective, PreferenceParams
from trainer.data.length_groups import PaddingCost, attention_span_of, group_by_length
from trainer.data.pair_layout import PairGrouping, pair_collate, pair_tokens
from trainer.data.preference import tokenize_pair
from trainer.loops import pair_plan
from trainer.loops.dpo import in_row_order, micro_losses, run_dpo
from trainer.loops.pair_plan import pair_grouping
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

HH = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"


def set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty sets."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1 :]]


def cost_of(groups: list[list[int]], lengths: list[int], cost: PaddingCost) -> float:
    return sum(cost.of(len(g), max(lengths[i] for i in g)) for g in groups)


@pytest.mark.parametrize("seed", range(12))
def test_the_split_is_the_cheapest_partition_of_all(seed: int) -> None:
    rng = random.Random(seed)
    n, max_rows = rng.randint(1, 7), rng.randint(1, 4)
    lengths = [rng.randint(1, 600) for _ in range(n)]
    cost = PaddingCost(overhead=rng.choice([0, 16, 64, 400]), attention_span=rng.choice([300, 1280, 1e9]))
    groups = group_by_length(lengths, max_rows, cost)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(1 <= len(g) <= max_rows for g in groups)
    partitions = [p for p in set_partitions(list(range(n))) if all(len(g) <= max_rows for g in p)]
    brute = min(cost_of(p, lengths, cost) for p in partitions)
    assert cost_of(groups, lengths, cost) == pytest.approx(brute)


def test_what_the_split_does_by_hand() -> None:
    lengths = [500, 20, 480, 30, 25, 490]
    # Free of overhead every row is its own pass; at a huge overhead the rows fill max_rows passes.
    assert sorted(map(len, group_by_length(lengths, 8, PaddingCost(0)))) == [1] * 6
    assert group_by_length(lengths, 8, PaddingCost(10**6)) == [[1, 4, 3, 2, 5, 0]]
    # At 64 tokens a pass: short rows together, long rows together (one 500-row pass, not 6).
    assert group_by_length(lengths, 8, PaddingCost(64)) == [[1, 4, 3], [2, 5, 0]]
    # Equal runs: ceil(6 / 4) = 2 consecutive runs of the sorted order, whatever the cost; never empty.
    assert group_by_length(lengths, 4, PaddingCost(64), equal_runs=True) == [[1, 4, 3], [2, 5, 0]]
    assert group_by_length(lengths, 4, PaddingCost(0), equal_runs=True) == [[1, 4, 3], [2, 5, 0]]
    assert group_by_length([3, 1], 1, PaddingCost(10**6), equal_runs=True) == [[1], [0]]
    assert group_by_length([], 4, PaddingCost(64)) == []
    with pytest.raises(ValueError, match="max_rows"):
        group_by_length([1], 0, PaddingCost(64))
    assert attention_span_of(10_000_000, 500, 4) == 1250


def hh_rows(n: int) -> list[dict[str, str]]:
    if not HH.is_file():
        pytest.skip(f"{HH} is missing")
    return [normalize_preference(json.loads(line))[0] for line in HH.read_text().splitlines()[:n]]


def dpo(tiny_cache: Path, out: Path, rows: list[dict[str, str]], mode: str) -> MemoryReporter:
    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {
                "max_steps": 4,
                "batch_size": 8,
                "learning_rate": 1e-3,
                "max_length": 256,
                "max_prompt_length": 128,
                "reference_mode": mode,
                "log_every": 1,
            },
        }
    )
    reporter = MemoryReporter()
    assert run_dpo(spec, RunData(train=rows), reporter, loop_ctx(tiny_cache, out)).status == "succeeded"
    return reporter


@pytest.mark.parametrize("mode", ["lazy", "precompute"])
def test_a_dpo_run_in_length_groups_is_the_one_pass_run(
    mode: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = hh_rows(40)
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    pairs = [tokenize_pair(r, tokenizer, max_length=256, max_prompt_length=128) for r in rows[:8]]
    grouping = pair_grouping(model, torch.device("cpu"), packing=False, shared_prompt=True)
    assert len(grouping.groups(pairs, 8)) > 1  # these pairs do travel in several groups

    grouped = dpo(tiny_cache, tmp_path / "grouped", rows, mode)
    monkeypatch.setattr(pair_plan, "pair_grouping", lambda *args: PairGrouping(None))
    one_pass = dpo(tiny_cache, tmp_path / "one-pass", rows, mode)
    # Step 1 runs on the same weights: the grouped passes give the one pass's values to float rounding.
    # Later steps start from weights one Adam step apart by that rounding, which Adam amplifies on
    # near-zero gradients (~3e-5 in the loss by step 2): a wiring error (a pair matched with another's
    # reference values, metrics out of order) moves them by far more.
    # (Not rewards/accuracy: at step 1 policy = reference, so a pair's reward is float noise and its sign,
    # which accuracy counts, is a coin flip; margins and rewards are the same values without the sign.)
    for key in ("loss", "rewards/margin", "rewards/chosen", "rewards/rejected"):
        first, other = grouped.series(key), one_pass.series(key)
        assert first[0] == pytest.approx(other[0], abs=1e-5), key
        assert first == pytest.approx(other, abs=2e-4), key
    for key in ("logps/chosen", "logps/rejected"):  # sums of ~250 token log-probs near -530: float32 rounding
        assert grouped.series(key)[0] == pytest.approx(one_pass.series(key)[0], rel=1e-6), key
        assert grouped.series(key) == pytest.approx(one_pass.series(key), rel=1e-5), key
    assert grouped.series("grad_norm")[0] == pytest.approx(one_pass.series("grad_norm")[0], rel=1e-5)


def test_grouped_passes_give_the_one_pass_gradient(tiny_cache: Path) -> None:
    """The fast path's contract on fixed weights: per-pair log-probs (in row order) and every parameter's
    gradient of the batch loss equal the one padded pass's."""
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    pairs = [tokenize_pair(r, tokenizer, max_length=256, max_prompt_length=128) for r in hh_rows(8)]
    ref = -torch.rand(len(pairs), 2) * 500  # any fixed reference values
    collate = pair_collate(tokenizer.pad_token_id, None, shared_prompt=True)
    cpu = torch.device("cpu")
    params = PreferenceParams(beta=0.1)
    grads, values = [], []
    for grouping in (pair_grouping(model, cpu, False, True), PairGrouping(None)):
        groups = grouping.groups(pairs, len(pairs))
        parts = [(g, collate([pairs[q] for q in g])) for g in groups]
        out: dict[str, list[torch.Tensor]] = {}
        model.zero_grad()
        objective = PairObjective(PREFERENCE_LOSSES["sigmoid"], params)
        tokens = pair_tokens(pairs)
        for loss in micro_losses(model, parts, ref, tokens, objective, cpu, out, len(pairs)):
            loss.backward()
        values.append(torch.stack([in_row_order(out, "chosen"), in_row_order(out, "rejected")]))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(pair_grouping(model, cpu, False, True).groups(pairs, len(pairs))) > 1
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-4)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_equal_passes_give_every_rank_the_same_count() -> None:
    """Ranks with different pairs (precompute shares) run ceil(n / max_rows) passes each."""
    cost = PaddingCost(64, 1280)
    for lengths in ([10, 500, 20, 490, 30, 480, 40], [5] * 7, list(range(1, 8))):
        for max_rows in (1, 2, 3, 8):
            groups = group_by_length(lengths, max_rows, cost, equal_runs=True)
            assert len(groups) == -(-len(lengths) // max_rows)
            assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))
            assert max(map(len, groups)) - min(map(len, groups)) <= 1
            assert max(map(len, groups)) <= max_rows
