"""A child process that `rlrun serve` starts again whenever it exits on its own (its worker, its inference
process).

Without it, a worker that died (killed by the OOM killer, or stopped by Celery on an error it cannot
recover from) left `rlrun serve` answering requests while every run sat ``queued``: the reconciler puts a
lost worker's run back in the queue, but nothing was left to take it. Restarts back off (``first_delay``
doubling up to ``max_delay``) so a child that cannot start does not spin, and the backoff starts over once
a child has lived ``healthy_after`` seconds.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable

log = logging.getLogger("rlrun.serve")


class KeptProcess(threading.Thread):
    """Starts ``start()`` now and again each time its process exits, until :meth:`stop`."""

    def __init__(
        self,
        name: str,
        start: Callable[[], subprocess.Popen[bytes]],
        *,
        first_delay: float = 1.0,
        max_delay: float = 60.0,
        healthy_after: float = 60.0,
    ):
        super().__init__(name=f"rlrun-keep-{name}", daemon=True)
        self.what = name
        self._start = start
        self._first_delay, self._max_delay, self._healthy_after = first_delay, max_delay, healthy_after
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.process = start()
        self.restarts = 0
        self.delays: list[float] = []  # the wait before each start after the first

    def run(self) -> None:
        delay = self._first_delay
        while True:
            began = time.monotonic()
            code = self.process.wait()
            if self._stopped.is_set():
                return
            if time.monotonic() - began >= self._healthy_after:
                delay = self._first_delay
            log.warning("the %s exited with code %s; starting another in %.0f s", self.what, code, delay)
            self.delays.append(delay)
            if self._stopped.wait(delay):
                return
            with self._lock:  # stop() either sees the new process or stops this loop before it starts
                if self._stopped.is_set():
                    return
                try:
                    self.process = self._start()
                    self.restarts += 1
                except OSError:  # the old one, exited, is waited on again: tried after the next delay
                    log.exception("could not start the %s", self.what)
            delay = min(2 * delay, self._max_delay)

    def no_more_restarts(self) -> None:
        """Start no other process from now on (what a signal handler may call: it only sets an event)."""
        self._stopped.set()

    def stop(self) -> subprocess.Popen[bytes]:
        """No more restarts; SIGTERM to the process now running (waiting on it is the caller's)."""
        with self._lock:
            self._stopped.set()
            process = self.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        return process
