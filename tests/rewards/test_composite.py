"""CompositeReward: weighted sums by hand, failures and timeouts scored 0 and counted, config errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from tests.rewards.helpers import sample
from trainer.rewards.composite import CompositeReward, RewardComponent, RewardResult, run_each_with_timeout
from trainer.rewards.verifiers import VERIFIERS, Sample, VerifierFn
from trainer.stop_watch import raise_in_thread

THINK_42 = "<think>6*7</think><answer>42</answer>"


def _batch() -> list[Sample]:
    return [
        sample(THINK_42, "42", n_tokens=10, max_new_tokens=100),  # right, formatted, short
        sample("It is 41", "42", n_tokens=60, max_new_tokens=100),  # wrong, unformatted, 40 over target
        sample("<think>x</think><answer>\\boxed{7}</answer>", "#### 7", n_tokens=30, max_new_tokens=100),
    ]


def test_weighted_sum_by_hand() -> None:
    reward = CompositeReward(
        [
            RewardComponent("numeric", weight=2.0),
            RewardComponent("format", weight=0.5),
            RewardComponent("length_penalty", weight=1.0, params={"target_tokens": 20, "scale": 0.5}),
            RewardComponent("exact_match", weight=0.0),  # logged only
        ]
    )
    result = reward(_batch())
    assert result.components == {
        "numeric": [1.0, 0.0, 1.0],
        "format": [1.0, 0.0, 1.0],
        "length_penalty": [0.0, -0.5 * 40 / 100, -0.5 * 10 / 100],
        "exact_match": [0.0, 0.0, 0.0],
    }
    assert result.total == pytest.approx([2.0 + 0.5, -0.2, 2.0 + 0.5 - 0.05], abs=1e-12)
    assert result.failures == 0


def test_repeated_names_get_suffixes_in_order() -> None:
    reward = CompositeReward(
        [
            RewardComponent("regex", params={"pattern": "42"}),
            RewardComponent("format"),
            RewardComponent("regex", weight=-1.0, params={"pattern": "41"}),
            RewardComponent("regex", weight=3.0, params={"pattern": "think"}),
        ]
    )
    result = reward(_batch())
    assert list(result.components) == ["regex", "format", "regex_2", "regex_3"]
    assert result.components["regex_2"] == [0.0, 1.0, 0.0]
    assert result.total == [1.0 + 1.0 + 3.0, 1.0 * 0 - 1.0, 1.0 + 3.0]


def test_empty_batch() -> None:
    scorer = FakeScorer([])
    reward = CompositeReward(
        [RewardComponent("numeric"), RewardComponent("reward_model")], reward_model=scorer
    )
    assert reward([]) == RewardResult(total=[], components={"numeric": [], "reward_model": []}, failures=0)
    assert scorer.calls == []


def _raises_on_bad(s: Sample) -> float:
    if s.completion == "bad":
        raise RuntimeError("cannot judge")
    return 1.0


def _returns(value: Any) -> VerifierFn:
    return lambda s: value if s.completion == "bad" else 1.0


def test_a_raising_verifier_scores_zero_counts_and_the_rest_is_scored() -> None:
    verifiers: Mapping[str, VerifierFn] = {"boom": _raises_on_bad, "len": VERIFIERS["length_penalty"]}
    reward = CompositeReward(
        [RewardComponent("boom", weight=2.0), RewardComponent("len", params={"target_tokens": 0})],
        verifiers=verifiers,
    )
    batch = [sample("ok", n_tokens=10), sample("bad", n_tokens=20), sample("ok", n_tokens=0)]
    result = reward(batch)
    assert result.components == {"boom": [1.0, 0.0, 1.0], "len": [-0.1, -0.2, 0.0]}
    assert result.total == pytest.approx([1.9, -0.2, 2.0])
    assert result.failures == 1


def test_a_real_verifier_raising_on_a_missing_reference_is_a_failure() -> None:
    reward = CompositeReward([RewardComponent("numeric"), RewardComponent("exact_match")])
    result = reward([sample("42", "42"), sample("42", None), sample("7", "#### 7")])
    assert result.components == {"numeric": [1.0, 0.0, 1.0], "exact_match": [1.0, 0.0, 1.0]}
    assert result.failures == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None])
def test_non_finite_or_non_numeric_returns_are_failures(value: Any) -> None:
    reward = CompositeReward([RewardComponent("odd")], verifiers={"odd": _returns(value)})
    result = reward([sample("ok"), sample("bad")])
    assert result.total == [1.0, 0.0] and result.failures == 1


def test_bool_and_int_returns_are_numbers() -> None:
    reward = CompositeReward([RewardComponent("b")], verifiers={"b": _returns(True)})
    assert reward([sample("bad")]).total == [1.0]


class Sleeper:
    """A verifier that hangs on "slow" until released (so the abandoned thread can finish at the end)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def __call__(self, s: Sample) -> float:
        if s.completion == "slow":
            self.started += 1
            self.release.wait(timeout=30)
        return 1.0


def test_a_hung_verifier_times_out_counts_and_later_calls_still_work() -> None:
    sleeper = Sleeper()
    reward = CompositeReward(
        [RewardComponent("sleepy"), RewardComponent("regex", params={"pattern": "o"})],
        timeout_s=0.2,
        verifiers={"sleepy": sleeper, "regex": VERIFIERS["regex"]},
    )
    try:
        t0 = time.perf_counter()
        result = reward([sample("fast"), sample("slow"), sample("fast"), sample("slow")])
        elapsed = time.perf_counter() - t0
        # Each hung call costs one timeout; the samples after it and the other component are still scored.
        assert result.components == {"sleepy": [1.0, 0.0, 1.0, 0.0], "regex": [0.0, 1.0, 0.0, 1.0]}
        assert result.failures == 2 and sleeper.started == 2
        assert 0.4 <= elapsed < 5.0

        t0 = time.perf_counter()  # the hung calls are still blocked: a new batch must not wait for them
        again = reward([sample("fast"), sample("fast")])
        assert again.total == [1.0, 1.0] and again.failures == 0
        assert time.perf_counter() - t0 < 2.0  # far below the 30 s the hung calls stay blocked
    finally:
        sleeper.release.set()


def test_a_batch_runs_in_order_on_one_worker_thread_not_the_callers() -> None:
    """Every call of a batch on the same worker thread (not the caller's), in order, each result in place."""
    seen: list[tuple[int, int]] = []

    def call(i: int) -> float:
        seen.append((i, threading.get_ident()))
        return float(i)

    out = run_each_with_timeout([lambda i=i: call(i) for i in range(500)], timeout_s=5.0)
    assert out == [float(i) for i in range(500)]
    assert [i for i, _ in seen] == list(range(500))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()


def test_an_abandoned_last_call_that_returns_later_changes_nothing() -> None:
    release = threading.Event()
    workers: list[threading.Thread] = []

    def hung() -> float:
        workers.append(threading.current_thread())
        release.wait(timeout=30)
        return 7.0

    out = run_each_with_timeout([lambda: 1.0, hung], timeout_s=0.2)
    assert out[0] == 1.0 and isinstance(out[1], TimeoutError)
    release.set()
    workers[0].join(timeout=5)  # the disowned worker has returned from its call and exited
    assert not workers[0].is_alive()
    assert out[0] == 1.0 and isinstance(out[1], TimeoutError)


class Stopped(Exception):
    pass


def test_a_stop_raised_into_the_caller_lands_within_a_second_and_ends_the_batch() -> None:
    """A run's stop arrives as an asynchronous exception (trainer/stop_watch.py): it must reach a caller
    waiting on slow calls (each well inside the timeout) and no call may start after the one running."""
    ran: list[int] = []

    def slow(i: int) -> float:
        ran.append(i)
        time.sleep(0.2)
        return 1.0

    raised: list[BaseException] = []

    def caller() -> None:
        try:
            run_each_with_timeout([lambda i=i: slow(i) for i in range(50)], timeout_s=30.0)
        except Stopped as exc:
            raised.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.5)
    assert raise_in_thread(thread.ident or 0, Stopped) == 1
    t0 = time.perf_counter()
    thread.join(timeout=5)
    assert not thread.is_alive() and raised and time.perf_counter() - t0 < 1.5
    started = len(ran)
    time.sleep(0.6)  # three more calls' time
    assert len(ran) <= started + 1 < 10  # at most the call running when the stop landed finished


def test_a_verifier_raising_timeout_error_itself_is_an_ordinary_failure() -> None:
    def own_timeout(s: Sample) -> float:
        if s.completion == "bad":
            raise TimeoutError("socket timed out")
        return 1.0

    reward = CompositeReward([RewardComponent("t")], timeout_s=5.0, verifiers={"t": own_timeout})
    t0 = time.perf_counter()
    assert reward([sample("bad"), sample("ok")]).total == [0.0, 1.0]
    assert time.perf_counter() - t0 < 1.0


class FakeScorer:
    """Returns preset scores and records each call."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores
        self.calls: list[tuple[list[str], list[str]]] = []

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        self.calls.append((list(prompts), list(completions)))
        return list(self.scores)


def test_reward_model_component_scores_the_whole_batch_in_one_call() -> None:
    scorer = FakeScorer([0.5, -1.5, 2.0])
    reward = CompositeReward(
        [RewardComponent("reward_model", weight=0.5), RewardComponent("numeric", weight=1.0)],
        reward_model=scorer,
    )
    batch = [sample("42", "42", prompt="P1"), sample("1", "42", prompt="P2"), sample("7", "7", prompt="P3")]
    result = reward(batch)
    assert scorer.calls == [(["P1", "P2", "P3"], ["42", "1", "7"])]
    assert result.components["reward_model"] == [0.5, -1.5, 2.0]  # unweighted
    assert result.total == pytest.approx([0.25 + 1.0, -0.75 + 0.0, 1.0 + 1.0])


def test_reward_model_errors() -> None:
    with pytest.raises(ValueError, match="needs a reward model scorer"):
        CompositeReward([RewardComponent("reward_model")])
    with pytest.raises(ValueError, match="takes no params"):
        CompositeReward([RewardComponent("reward_model", params={"x": 1})], reward_model=FakeScorer([]))
    reward = CompositeReward([RewardComponent("reward_model")], reward_model=FakeScorer([1.0]))
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        reward([sample("a"), sample("b")])


def test_configuration_errors_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown verifier 'nope'; valid names: exact_match"):
        CompositeReward([RewardComponent("nope")])
    with pytest.raises(ValueError, match="'regex': bad params"):
        CompositeReward([RewardComponent("regex")])  # pattern is required
    with pytest.raises(ValueError, match="'length_penalty': bad params"):
        CompositeReward([RewardComponent("length_penalty", params={"target": 3})])  # a typo
    with pytest.raises(ValueError, match="at least one component"):
        CompositeReward([])
    with pytest.raises(ValueError, match="timeout_s"):
        CompositeReward([RewardComponent("format")], timeout_s=0)
    with pytest.raises(ValueError, match="unknown verifier 'numeric'"):  # only the given mapping counts
        CompositeReward([RewardComponent("numeric")], verifiers={"mine": _raises_on_bad})
