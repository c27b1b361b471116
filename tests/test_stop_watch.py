"""The phase watcher on its own (trainer/stop_watch.py): a stop lands inside a running phase, never outside
one; progress is written for long phases only. Real threads, no database."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from trainer.phases import RunStopped
from trainer.stop_watch import StopWatch


class Flags:
    def __init__(self) -> None:
        self.stop = False
        self.progress: list[tuple[str, int, int | None] | None] = []

    def should_stop(self) -> bool:
        return self.stop

    def write(self, state: tuple[str, int, int | None] | None) -> None:
        self.progress.append(state)


@pytest.fixture
def flags() -> Flags:
    return Flags()


@pytest.fixture
def watch(flags: Flags) -> Iterator[StopWatch]:
    w = StopWatch(
        flags.should_stop,
        flags.write,
        poll_seconds=0.05,
        grace_seconds=0.2,
        report_after=0.2,
        report_every=0.1,
    )
    w.start()
    yield w
    w.close()
    w.join(timeout=5)


def busy(seconds: float) -> int:
    """Pure-Python work (like a library's loading loop): no sleep for the exception to wait out."""
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        n += 1
    return n


def test_stop_lands_inside_a_busy_phase_within_a_second(watch: StopWatch, flags: Flags) -> None:
    threading.Timer(0.5, lambda: setattr(flags, "stop", True)).start()
    t0 = time.monotonic()
    with pytest.raises(RunStopped):
        with watch.phase("reference", 100) as p:
            for _ in range(1000):
                busy(0.05)
                p.advance()
    waited = time.monotonic() - t0
    assert 0.5 <= waited < 1.5, waited  # 30 s of work, stopped ~0.5 s after the flag went up
    assert not watch.open_phases


def test_a_stop_never_lands_outside_a_phase(watch: StopWatch, flags: Flags) -> None:
    flags.stop = True  # asked for between phases: the step loop's own check handles it, not the watcher
    assert busy(0.6) > 0  # no RunStopped here
    with pytest.raises(RunStopped):
        with watch.phase("eval"):
            busy(5.0)
    assert busy(0.4) > 0  # and none pending after the phase


def test_a_short_phase_finishes_within_the_grace(watch: StopWatch, flags: Flags) -> None:
    flags.stop = True
    with watch.phase("rollouts"):
        busy(0.1)  # under grace_seconds: the phase completes, the step loop stops the run keeping its work
    time.sleep(0.3)


def test_a_stop_pending_at_close_is_raised_by_the_close(watch: StopWatch) -> None:
    # Simulate the race: the watcher set the exception just as the phase ended (delivery not yet done).
    with pytest.raises(RunStopped):
        with watch.phase("checkpoint") as counter:
            with watch.lock:
                watch.injected = True  # what _interrupt records; the close must clear and raise it
            counter.advance()
    assert not watch.injected
    assert busy(0.3) > 0


def test_nested_phases_report_the_inner_one_and_clear_at_the_end(watch: StopWatch, flags: Flags) -> None:
    with watch.phase("final_metrics", 4) as outer:
        busy(0.35)
        with watch.phase("reference", 10) as inner:
            for _ in range(10):
                busy(0.04)
                inner.advance()
        outer.advance(4)
        busy(0.3)
    time.sleep(0.3)
    names = [s[0] for s in flags.progress if s is not None]
    assert names[0] == "final_metrics" and "reference" in names
    assert flags.progress[-1] is None  # nothing shown once the phases closed
    dones = [s[1] for s in flags.progress if s is not None and s[0] == "reference"]
    assert dones == sorted(dones) and all(0 <= d <= 10 for d in dones)


def test_short_phases_write_nothing(watch: StopWatch, flags: Flags) -> None:
    for _ in range(5):
        with watch.phase("rollouts"):
            busy(0.02)
    time.sleep(0.3)
    assert flags.progress == []
