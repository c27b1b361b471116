"""The watcher behind a worker's long phases: progress written from its own thread, and a cancel or pause
that lands inside the phase within a second (``trainer/phases.py`` says what a phase is).

The loop's thread only counts (``Counter.advance``: no I/O). The watcher thread, every ``poll_seconds``
while a phase is open: reads the run's stop flags and, once one is set and the phase has run
``grace_seconds`` (a short phase just finishes, and the step loop's own check stops the run keeping its
work), raises ``RunStopped`` inside the loop's thread with ``PyThreadState_SetAsyncExc`` (CPython's way to
interrupt another thread: it lands at the next bytecode, so a C call such as one forward pass finishes
first); and writes the phase's progress once it has run ``report_after`` seconds (short phases write
nothing), then every ``report_every`` seconds while ``done`` moves.

The loop's thread writes nothing to the database inside a phase, so an interruption never lands in the
middle of a database call; a phase that needs one (a checkpoint's row) makes it after the phase closes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from trainer.phases import Counter, RunStopped, sleep_interruptibly, stretch_seconds

log = logging.getLogger("rlrun.worker")

# (phase, done, total) to record, or None when no phase is open any more.
ProgressWriter = Callable[[tuple[str, int, int | None] | None], None]


def raise_in_thread(thread_id: int, exc: type[BaseException] | None) -> int:
    """Set (or with None, clear) the exception pending in thread ``thread_id``; threads affected."""
    setter = ctypes.pythonapi.PyThreadState_SetAsyncExc
    return int(setter(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None))


class StopWatch(threading.Thread):
    """One per claimed run, for the life of its loop (``start`` / ``close``)."""

    def __init__(
        self,
        should_stop: Callable[[], bool],
        write_progress: ProgressWriter,
        *,
        poll_seconds: float = 0.25,
        grace_seconds: float = 1.0,
        report_after: float = 1.0,
        report_every: float = 2.0,
    ):
        super().__init__(name="phase-watch", daemon=True)
        self.should_stop, self.write_progress = should_stop, write_progress
        self.poll_seconds, self.grace_seconds = poll_seconds, grace_seconds
        self.report_after, self.report_every = report_after, report_every
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.open_phases: list[Counter] = []  # phases nest (final metrics -> reference pass)
        self.thread_id = 0
        self.injected = False
        self.reported: tuple[str, int, int | None] | None = None  # what the database shows now
        self.reported_at = 0.0

    # ---- the loop's side

    def phase(self, name: str, total: int | None = None) -> WatchedPhase:
        return WatchedPhase(self, Counter(name, total))

    @property
    def current(self) -> Counter | None:
        """The innermost open phase."""
        return self.open_phases[-1] if self.open_phases else None

    def _open(self, counter: Counter) -> None:
        with self.lock:
            self.open_phases.append(counter)
            self.thread_id = threading.get_ident()

    def _close(self, counter: Counter, interrupted: bool) -> None:
        """Close ``counter``'s phase. A stop raised into the loop's thread but not yet delivered is cleared
        and raised here instead, so it can never land after the phase, in code that does not expect it."""
        with self.lock:
            if counter in self.open_phases:
                self.open_phases.remove(counter)
            pending = self.injected
            if pending:
                raise_in_thread(self.thread_id, None)
                self.injected = False
        if pending and not interrupted:
            raise RunStopped("a cancel or pause was requested")

    # ---- the watcher's side

    def run(self) -> None:
        last_check = 0.0
        while not self.closed.wait(self.poll_seconds):
            try:
                now = time.monotonic()
                counter, phases = self.current, list(self.open_phases)
                self._report(counter, now)
                if counter is None or now - phases[0].started < self.grace_seconds:
                    continue
                if now - last_check >= self.poll_seconds and self.should_stop():
                    self._interrupt(counter)
                last_check = now
            except Exception:  # noqa: BLE001 - a missed tick is retried at the next one
                log.warning("phase watcher tick failed", exc_info=True)

    def _interrupt(self, counter: Counter) -> None:
        with self.lock:
            if counter in self.open_phases and not self.injected:
                self.injected = raise_in_thread(self.thread_id, RunStopped) == 1
                log.info("stop requested during phase %s: interrupting it", counter.name)

    def _report(self, counter: Counter | None, now: float) -> None:
        if counter is None or now - counter.started < self.report_after:
            if self.reported is not None:
                self.write_progress(None)
                self.reported = None
            return
        state = (counter.name, counter.done, counter.total)
        fresh = self.reported is None or self.reported[0] != counter.name
        if state != self.reported and (fresh or now - self.reported_at >= self.report_every):
            self.write_progress(state)
            self.reported, self.reported_at = state, now

    def close(self) -> None:
        self.closed.set()


class WatchedPhase:
    """``with watch.phase(name, total) as p:``: opens the phase (and waits out the test hook's stretch,
    interruptibly), closes it whatever happens."""

    def __init__(self, watch: StopWatch, counter: Counter):
        self.watch, self.counter = watch, counter

    def __enter__(self) -> Counter:
        self.watch._open(self.counter)
        try:
            if seconds := stretch_seconds(self.counter.name):
                sleep_interruptibly(seconds)
        except BaseException:
            self.watch._close(self.counter, interrupted=True)
            raise
        return self.counter

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any:
        self.watch._close(self.counter, interrupted=kind is not None)
        return None
