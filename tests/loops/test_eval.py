"""Eval runs on the tiny model: pass@k and the mean reward recomputed from the stored samples by brute
force, sampling independent of the batch size, greedy by default, max_rows, cancel."""

from __future__ import annotations

import itertools
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PROMPTS, VOWEL_REWARD
from trainer.loops import LOOPS
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec


def _spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "eval",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": VOWEL_REWARD,
            "hyperparameters": {"max_new_tokens": 6, **hp},
        }
    )


def _run(spec: Any, tiny_cache: Path, tmp_path: Path, reporter: MemoryReporter | None = None) -> Any:
    reporter = reporter or MemoryReporter()
    result = LOOPS["eval"](spec, RunData(train=PROMPTS), reporter, loop_ctx(tiny_cache, tmp_path))
    return result, reporter


def _subset_pass(labels: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(labels, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_what_the_stored_samples_give(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec(samples_per_prompt=4, pass_k=[1, 2, 4], prompts_per_batch=6)
    result, reporter = _run(spec, tiny_cache, tmp_path)
    assert result.status == "succeeded" and result.output_path is None
    samples = [s for _, s in reporter.samples]
    assert len(samples) == len(PROMPTS) * 4
    by_prompt: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        vowel = any(ch in "aeiou" for ch in s["completion"])
        assert s["reward"] == float(vowel) and s["correct"] is vowel
        by_prompt[s["prompt"]].append(vowel)
    assert len(by_prompt) == len(PROMPTS)
    final = result.final_metrics
    for k in (1, 2, 4):
        expected = sum(_subset_pass(labels, k) for labels in by_prompt.values()) / len(by_prompt)
        assert final[f"eval/pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert 0 < final["eval/pass@1"] < final["eval/pass@4"] <= 1  # the random model is right sometimes
    assert final["eval/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    assert final["eval/reward/regex/mean"] == final["eval/reward_mean"]
    assert final["eval/prompts"] == len(PROMPTS) and isinstance(final["eval/prompts"], int)
    # The reference answers travel with the samples; running metrics after each batch of 6 prompts.
    assert {s["reference"] for s in samples} == {r["answer"] for r in PROMPTS}
    assert sorted({step for step, _, _ in reporter.metrics}) == [6, 12, 16]
    assert reporter.series("eval/pass@4")[-1] == final["eval/pass@4"]


def test_samples_do_not_depend_on_the_batch_size(tiny_cache: Path, tmp_path: Path) -> None:
    texts = []
    for batch in (3, 16):
        _, reporter = _run(_spec(samples_per_prompt=2, prompts_per_batch=batch), tiny_cache, tmp_path)
        texts.append([(s["prompt"], s["sample"], s["completion"]) for _, s in reporter.samples])
    assert texts[0] == texts[1]
    assert len({t for _, _, t in texts[0]}) > len(PROMPTS)  # sampled: a prompt's two samples differ


def test_one_sample_is_greedy_and_max_rows_draws_the_same_rows(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec(max_rows=5, stored_samples=3)
    assert spec.hyperparameters.temperature == 0 and spec.hyperparameters.pass_k == [1]
    first, reporter = _run(spec, tiny_cache, tmp_path)
    again, reporter2 = _run(spec, tiny_cache, tmp_path)
    assert first.final_metrics == again.final_metrics and first.final_metrics["eval/prompts"] == 5
    assert len(reporter.samples) == 3  # stored_samples caps what is kept, not what is scored
    assert [s for _, s in reporter.samples] == [s for _, s in reporter2.samples]


def test_a_cancel_stops_between_batches(tiny_cache: Path, tmp_path: Path) -> None:
    reporter = MemoryReporter(stop_after=1)
    result, _ = _run(_spec(prompts_per_batch=4), tiny_cache, tmp_path, reporter)
    assert result.status == "cancelled"
    assert sorted({step for step, _, _ in reporter.metrics}) == [4]
