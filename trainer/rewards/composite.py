"""The reward of a batch of completions: a weighted sum of verifier and reward-model components.

``CompositeReward(components)(samples)`` scores every sample with every component and returns the weighted
sum per sample plus each component's unweighted scores (for logging). Components with weight 0 are still
computed and reported, which makes them a cheap way to monitor e.g. accuracy while training on another
reward.

Failures. A verifier call that raises an Exception, returns something other than a finite real number,
or runs longer than ``timeout_s`` scores 0 for that sample and component and counts in
``RewardResult.failures``; nothing raises out of ``__call__`` because of a verifier. Configuration errors
(unknown name, missing or unknown parameters, a reward_model component without a scorer) raise ValueError
at construction instead, so a bad spec fails the run at once rather than training on zeros. The reward
model itself is not guarded: its errors (e.g. out of memory) propagate.

Timeouts, and their trade-off. One verifier's calls over a batch run one at a time, in order, on a daemon
worker thread of their own (gone when the batch is scored); the caller sleeps until the batch is done or
the call running has taken ``timeout_s``. A call that overruns is *abandoned*, not killed (Python threads
cannot be killed): its worker is disowned (it exits once that call returns, its results dropped) and a
fresh worker takes the remaining calls, so a hung call never blocks later calls or later batches. The
costs:

* an abandoned call keeps running (and holding whatever it holds) until it returns; one that never returns
  leaks its thread for the life of the process (daemon threads do not block interpreter exit);
* a call stuck in C code that holds the GIL cannot be waited out at all: the waiting thread needs the GIL
  to notice the timeout. Catastrophic backtracking in ``re`` is the usual case (``re`` never releases the
  GIL), which is why user regex patterns must be linear. Killing such calls needs a process pool (a
  ``fork`` per call, or pickled samples per batch), which costs far more than the verifiers themselves;
* each batch pays one thread hand-off, not each call: handing every call over on its own (a future per
  call) cost ~100 us a call, 11 s of the demo's 96 s GRPO stage (105k exact-match calls).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from trainer.algorithms._registry import lookup
from trainer.rewards.verifiers import VERIFIERS, Sample, VerifierFn

log = logging.getLogger("rlrun.rewards")

REWARD_MODEL = "reward_model"


class CompletionScorer(Protocol):
    """What the ``reward_model`` component needs; ``RewardModelScorer`` is one."""

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]: ...


@dataclass(frozen=True)
class RewardComponent:
    """One term of the reward.

    Attributes:
        name: a ``VERIFIERS`` key (or a key of the mapping given to ``CompositeReward``), or
            ``"reward_model"``.
        weight: multiplier in the weighted sum (0 keeps the component for logging only).
        params: keyword arguments of the verifier; must be empty for ``reward_model``.
    """

    name: str
    weight: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)
    batch: BatchScorer | None = None  # scores a whole batch itself (a grader); ``name`` is then its label


class BatchScorer(Protocol):
    """A component that scores a batch in one call (a grader: trainer/rewards/grader_reward.py): per sample
    its score (0 where it failed) and whether it failed, plus the first error."""

    def __call__(self, samples: Sequence[Sample]) -> tuple[list[float], list[bool], str | None]: ...


@dataclass
class RewardResult:
    """Rewards of a batch.

    Attributes:
        total: per sample, the weighted sum of the components.
        components: per component, its unweighted per-sample scores; a repeated name gets ``_2``, ``_3``.
        failures: verifier calls that raised, returned a non-finite value or timed out (each scored 0).
    """

    total: list[float]
    components: dict[str, list[float]]
    failures: int


def _verify(fn: VerifierFn, sample: Sample, params: Mapping[str, Any]) -> float:
    """``fn(sample, **params)`` as a float; TypeError/ValueError unless it returned a finite real number."""
    value = fn(sample, **params)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a verifier returned {type(value).__name__}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"a verifier returned {out}")
    return out


def _unique_keys(names: Sequence[str]) -> list[str]:
    """``["format", "format", "numeric"]`` -> ``["format", "format_2", "numeric"]``."""
    keys: list[str] = []
    for name in names:
        key, i = name, 1
        while key in keys:
            i += 1
            key = f"{name}_{i}"
        keys.append(key)
    return keys


class CompositeReward:
    """Weighted sum of reward components over a batch of samples (see the module docstring).

    Args:
        components: the terms, in order; at least one.
        timeout_s: longest wait for one verifier call, in seconds (> 0).
        reward_model: scores all samples of a batch in one call for the ``reward_model`` components;
            required if there is one.
        verifiers: where component names are looked up (tests pass their own; default ``VERIFIERS``).

    Raises:
        ValueError: no components, a bad timeout, an unknown name, parameters the verifier does not accept
            (or lacks required ones), or a ``reward_model`` component without a scorer or with parameters.
    """

    def __init__(
        self,
        components: Sequence[RewardComponent],
        *,
        timeout_s: float = 5.0,
        reward_model: CompletionScorer | None = None,
        verifiers: Mapping[str, VerifierFn] = VERIFIERS,
    ) -> None:
        if not components:
            raise ValueError("a reward needs at least one component")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.components = list(components)
        self.keys = _unique_keys([c.name for c in self.components])
        self.timeout_s = timeout_s
        self.reward_model = reward_model
        self._fns: list[VerifierFn | None] = []  # None marks a reward_model or batch component
        for c in self.components:
            if c.batch is not None:
                if c.params:
                    raise ValueError(
                        f"the batch component {c.name!r} takes no params, got {sorted(c.params)}"
                    )
                self._fns.append(None)
                continue
            if c.name == REWARD_MODEL:
                if reward_model is None:
                    raise ValueError("a 'reward_model' component needs a reward model scorer")
                if c.params:
                    raise ValueError(f"the 'reward_model' component takes no params, got {sorted(c.params)}")
                self._fns.append(None)
                continue
            fn = lookup(verifiers, c.name, "verifier")
            _check_params(c.name, fn, c.params)
            self._fns.append(fn)

    def __call__(self, samples: Sequence[Sample]) -> RewardResult:
        """Score ``samples`` with every component; never raises because of a verifier (see module doc)."""
        n = len(samples)
        needs_model = any(c.name == REWARD_MODEL and c.batch is None for c in self.components)
        model_scores = self._model_scores(samples) if needs_model and n else None
        components: dict[str, list[float]] = {}
        total = [0.0] * n
        failures = 0
        for key, component, fn in zip(self.keys, self.components, self._fns, strict=True):
            if component.batch is not None:
                scores, failed_each, first = component.batch(samples) if n else ([], [], None)
                if any(failed_each):
                    failures += sum(failed_each)
                    log.warning(
                        "grader %r failed on %d of %d samples (first: %s)",
                        key,
                        sum(failed_each),
                        n,
                        first,
                    )
            elif fn is None:
                scores = list(model_scores) if model_scores is not None else []
            else:
                scores, failed = self._run_verifier(key, fn, component.params, samples)
                failures += failed
            components[key] = scores
            total = [t + component.weight * s for t, s in zip(total, scores, strict=True)]
        return RewardResult(total=total, components=components, failures=failures)

    def _model_scores(self, samples: Sequence[Sample]) -> list[float]:
        assert self.reward_model is not None
        scores = self.reward_model.score([s.prompt for s in samples], [s.completion for s in samples])
        if len(scores) != len(samples):
            raise ValueError(f"the reward model returned {len(scores)} scores for {len(samples)} samples")
        return [float(s) for s in scores]

    def _run_verifier(
        self, key: str, fn: VerifierFn, params: Mapping[str, Any], samples: Sequence[Sample]
    ) -> tuple[list[float], int]:
        """Per-sample scores of one verifier (0 where a call failed) and the number of failed calls."""
        scores, failed, first_error = [], 0, ""
        outcomes = run_each_with_timeout([partial(_verify, fn, s, params) for s in samples], self.timeout_s)
        for outcome in outcomes:
            if isinstance(outcome, float):
                scores.append(outcome)
                continue
            if not isinstance(outcome, Exception):  # KeyboardInterrupt, SystemExit: not the verifier's score
                raise outcome
            scores.append(0.0)
            failed += 1
            first_error = first_error or f"{type(outcome).__name__}: {outcome}"
        if failed:
            log.warning(
                "verifier %r failed on %d of %d samples (first: %s)", key, failed, len(samples), first_error
            )
        return scores, failed


# The waiting caller wakes at least this often: a run's stop is raised into its thread as an asynchronous
# exception (trainer/stop_watch.py), which lands only when the thread runs Python again, not inside a wait.
WAKE_EVERY_S = 0.5


def run_each_with_timeout(
    calls: Sequence[Callable[[], float]], timeout_s: float
) -> list[float | BaseException]:
    """Run ``calls`` in order on a daemon worker thread; per call its result or the exception it raised,
    a ``TimeoutError`` for a call still running ``timeout_s`` after it started (abandoned: its worker is
    disowned and a fresh one goes on with the next call). The caller sleeps until the batch is done, the
    running call's deadline or ``WAKE_EVERY_S``, whichever comes first, so a batch of fast calls costs one
    hand-off; an exception raised into the caller (a stop) ends the batch after the call running."""
    if not calls:
        return []
    batch = _Batch(calls)
    with batch.changed:
        try:
            batch.start_worker(0)
            while batch.done < len(calls):
                left = batch.started + timeout_s - time.monotonic()
                if left > 0:
                    batch.changed.wait(min(left, WAKE_EVERY_S))
                    continue
                hung = batch.done  # the call running since batch.started: abandon it, go on with the next
                batch.owner += 1  # disowned: whatever it returns is dropped
                batch.results[hung] = TimeoutError(f"no result within {timeout_s} s (call abandoned)")
                batch.done = hung + 1
                if batch.done < len(calls):
                    batch.start_worker(batch.done)
        finally:
            batch.owner += 1  # however the wait ended (a stop raised into it): no call after the current
    return batch.results


class _Batch:
    """Calls, their outcomes so far, and which worker owns the batch (``changed`` guards them all).

    ``done`` counts the calls finished, in order: the call running is ``calls[done]``, started at ``started``.
    A disowned worker (its call was abandoned) writes nothing more and exits when its call returns.
    """

    def __init__(self, calls: Sequence[Callable[[], float]]) -> None:
        self.calls = calls
        self.results: list[float | BaseException] = [TimeoutError()] * len(calls)  # until each is done
        self.done = 0
        self.started = time.monotonic()
        self.owner = 0
        self.changed = threading.Condition()

    def start_worker(self, first: int) -> None:
        """Hand ``calls[first:]`` to a fresh worker, the batch's owner now (the caller holds ``changed``)."""
        self.owner += 1
        self.started = time.monotonic()
        threading.Thread(
            target=self._work, args=(self.owner, first), name="rlrun-verifier", daemon=True
        ).start()

    def _work(self, me: int, first: int) -> None:
        for i in range(first, len(self.calls)):
            outcome: float | BaseException
            try:
                outcome = self.calls[i]()
            except BaseException as exc:  # noqa: B036 (handed to the waiting thread, which decides)
                outcome = exc
            with self.changed:
                if self.owner != me:  # this call was abandoned while it ran: the batch has gone on
                    return
                self.results[i] = outcome
                self.done = i + 1
                self.started = time.monotonic()
                if self.done == len(self.calls):
                    self.changed.notify()


def _check_params(name: str, fn: VerifierFn, params: Mapping[str, Any]) -> None:
    """ValueError unless ``fn(sample, **params)`` binds: catches typos and missing required parameters."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without an introspectable signature: checked when called
        return
    try:
        signature.bind(None, **params)
    except TypeError as exc:
        raise ValueError(f"verifier {name!r}: bad params {dict(params)}: {exc}") from None
