"""Long phases of a run (loading a model, tokenising, a reference pass, rollouts, evaluation, final
metrics, writing a checkpoint): their names, their progress, and the stop that ends one early.

A loop wraps each long phase in ``with reporter.phase(name, total) as p:`` and calls ``p.advance(n)`` as
items are done. In the worker (``trainer/stop_watch.py``) a watcher thread then writes the progress and,
when a cancel or pause is asked for while the phase runs, raises ``RunStopped`` inside it: the phase ends
within a second, whatever library code it is in, and the run stops (a paused run resumes from its last
checkpoint). Between phases the step loop's own check stops the run and keeps the work (``session.py``).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Protocol

PHASES = ("model_load", "tokenize", "reference", "rollouts", "eval", "final_metrics", "checkpoint")

# Test-only hook: the path of a JSON file {"<phase>": seconds}. Each phase named there first waits that
# long (interruptibly, like any phase), so a test can stretch a phase a tiny preset runs in milliseconds
# and prove that a cancel lands inside it. Unset (always, outside tests): no file is read.
TEST_DELAY_ENV = "RLRUN_TEST_PHASE_DELAY"


class RunStopped(BaseException):  # noqa: N818 - a control-flow signal like KeyboardInterrupt, not an error
    """A cancel or pause landed inside a long phase. A BaseException, so library code that catches
    ``Exception`` cannot swallow it on its way out of the phase."""


class Phase(Protocol):
    """A phase under way: ``advance`` counts items done (cheap: no I/O in the loop's thread)."""

    def advance(self, n: int = 1) -> None: ...


class PhaseHost(Protocol):
    """What opens phases: the run's Reporter."""

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]: ...


class Counter:
    """A phase's progress: items done of ``total`` (None: not known)."""

    def __init__(self, name: str, total: int | None):
        self.name, self.total, self.done = name, total, 0
        self.started = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n


class NoPhase(AbstractContextManager[Counter]):
    """A phase nobody watches (a loop run without a reporter that tracks phases)."""

    def __init__(self, name: str = "", total: int | None = None):
        self.counter = Counter(name, total)

    def __enter__(self) -> Counter:
        return self.counter

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


def stretch_seconds(name: str) -> float:
    """Seconds the test hook stretches phase ``name`` by (0 unless ``RLRUN_TEST_PHASE_DELAY`` names a
    readable JSON file that lists it)."""
    path = os.environ.get(TEST_DELAY_ENV)
    if not path:
        return 0.0
    try:
        delays = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0.0
    value = delays.get(name, 0) if isinstance(delays, dict) else 0
    return float(value) if isinstance(value, int | float) else 0.0


def sleep_interruptibly(seconds: float) -> None:
    """Wait ``seconds`` in short sleeps, so an exception raised into this thread lands within 50 ms."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.05, left))
