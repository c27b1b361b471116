"""The worker's metric mirror: a thread that hands the points a run writes to its metric sinks.

The training loop never waits on a sink: the run's reporter ``put``s each batch it has just written to
rlrun's own store and goes on. The thread sends what is pending to every sink about once a second
(``interval``), one batch per call; a sink that fails (down, refused, slow past its timeout) keeps its
points and is tried again after a doubling pause (``backoff`` to ``max_backoff`` seconds), and the run gets
one warning per sink (code ``metric_sink_<label>``) and an event when it recovers. ``close`` makes one last
try per sink, closes the ones that opened and says how many points never left (they stay in rlrun:
``rlrun runs export-metrics`` sends them later). A sink past ``max_pending`` points drops its oldest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainer.metric_sinks import Point, Sink
from trainer.reporting import one_line

log = logging.getLogger("rlrun.sinks")

Warn = Callable[[str, int, str], None]  # (code, step, message): Reporter.warn
Notify = Callable[[str], None]  # an info event


@dataclass
class _SinkState:
    sink: Sink
    pending: deque[Point] = field(default_factory=deque)
    tags: dict[str, str] = field(default_factory=dict)
    opened: bool = False
    failures: int = 0
    next_try: float = 0.0
    dropped: int = 0


class SinkMirror(threading.Thread):
    def __init__(
        self,
        sinks: Sequence[Sink],
        warn: Warn,
        notify: Notify,
        *,
        interval: float = 1.0,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        max_pending: int = 1_000_000,
    ):
        super().__init__(name="rlrun-sink-mirror", daemon=True)
        self.states = [_SinkState(s) for s in sinks]
        self.warn, self.notify = warn, notify
        self.interval, self.backoff, self.max_backoff = interval, backoff, max_backoff
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.closing = threading.Event()
        self.final_status = "failed"  # what close() says the run ended as
        self.step = 0

    # -- the training side: never blocks on a sink -------------------------------------------------
    def put(self, points: Sequence[Point]) -> None:
        if not points:
            return
        with self.lock:
            self.step = max(self.step, max(p.step for p in points))
            for st in self.states:
                st.pending.extend(points)
                over = len(st.pending) - self.max_pending
                for _ in range(max(over, 0)):
                    st.pending.popleft()
                st.dropped += max(over, 0)

    def tag(self, name: str, value: str) -> None:
        """Record a path (a checkpoint, the output model) on every sink's run."""
        with self.lock:
            for st in self.states:
                st.tags[name] = value

    def close(self, status: str, timeout: float = 60.0) -> None:
        """One last try per sink, then close them (``status``: the run's end). Waits up to ``timeout``
        seconds for a sink that hangs, then leaves the daemon thread behind."""
        self.final_status = status
        self.closing.set()
        self.wake.set()
        if self.is_alive():
            self.join(timeout)

    # -- the mirror's thread ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self.closing.is_set():
            self.wake.wait(self.interval)
            self.wake.clear()
            if self.closing.is_set():
                break
            now = time.monotonic()
            for st in self.states:
                if now >= st.next_try:
                    self._send(st)
        for st in self.states:  # the last try, whatever the backoff says
            self._send(st)
            self._finish(st)

    def _send(self, st: _SinkState) -> None:
        with self.lock:
            batch = list(st.pending)
            tags = dict(st.tags)
        try:
            if not st.opened:
                st.sink.open()
                st.opened = True
            if batch:
                st.sink.log(batch)
                with self.lock:  # sent: never sent twice, whatever fails next
                    for _ in range(len(batch)):
                        st.pending.popleft()
            for name, value in tags.items():
                st.sink.tag(name, value)
                with self.lock:
                    if st.tags.get(name) == value:
                        del st.tags[name]
        except Exception as exc:  # noqa: BLE001 - a sink never fails the run: kept, retried, reported
            self._failed(st, exc)
            return
        if st.failures:
            self.notify(f"{st.sink.label} sink at {st.sink.where} reachable again; {len(batch)} points sent")
        st.failures, st.next_try = 0, 0.0

    def _failed(self, st: _SinkState, exc: BaseException) -> None:
        st.failures += 1
        pause = min(self.max_backoff, self.backoff * 2 ** (st.failures - 1))
        st.next_try = time.monotonic() + pause
        log.warning("%s sink failed (try %d, next in %.0f s): %s", st.sink.label, st.failures, pause, exc)
        if st.failures == 1:
            self.warn(
                f"metric_sink_{st.sink.label}",
                self.step,
                f"{st.sink.label} sink at {st.sink.where} failed: {one_line(exc, 300)}; retrying, and rlrun "
                "keeps every point",
            )

    def _finish(self, st: _SinkState) -> None:
        if st.opened:
            try:
                st.sink.close(self.final_status)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s sink: close failed: %s", st.sink.label, exc)
        left = len(st.pending) + st.dropped
        if left:
            self.warn(
                f"metric_sink_{st.sink.label}_incomplete",
                self.step,
                f"{left} metric points were not sent to the {st.sink.label} sink at {st.sink.where}; rlrun "
                "keeps them all, and `rlrun runs export-metrics` sends them",
            )
