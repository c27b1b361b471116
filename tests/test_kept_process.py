"""rlrun/kept_process.py: `rlrun serve`'s children are started again when they exit, with a backoff, and
not after stop()."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rlrun.kept_process import KeptProcess


def starter(code: str, starts: list[float]) -> Callable[[], subprocess.Popen[bytes]]:
    """Starts ``python -c code``, noting when in ``starts``."""

    def start() -> subprocess.Popen[bytes]:
        starts.append(time.monotonic())
        return subprocess.Popen([sys.executable, "-c", code])

    return start


def kept_for_starts(code: str, starts: list[float], n: int, **backoff: Any) -> KeptProcess:
    """A KeptProcess of ``python -c code``, stopped (and its last child ended) once it started ``n``."""
    kept = KeptProcess("child", starter(code, starts), **backoff)
    kept.start()
    deadline = time.monotonic() + 60
    while len(starts) < n:
        assert time.monotonic() < deadline, starts
        time.sleep(0.05)
    kept.stop().wait(timeout=30)
    return kept


def test_a_child_that_exits_is_started_again_with_a_doubling_delay() -> None:
    starts: list[float] = []
    kept = kept_for_starts("raise SystemExit(3)", starts, 4, first_delay=0.3, max_delay=0.6)
    assert kept.delays[:3] == [0.3, 0.6, 0.6]  # doubled, then held at max_delay
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(gap >= delay for gap, delay in zip(gaps, kept.delays, strict=False)), (gaps, kept.delays)
    assert kept.restarts == len(starts) - 1


def test_stop_ends_the_running_child_and_starts_no_other() -> None:
    starts: list[float] = []
    kept = KeptProcess("child", starter("import time; time.sleep(300)", starts), first_delay=0.05)
    kept.start()
    process = kept.stop()
    assert process.wait(timeout=30) == -15  # SIGTERM
    kept.join(timeout=30)
    assert not kept.is_alive() and len(starts) == 1 and kept.restarts == 0


def test_a_child_that_lived_long_enough_is_started_again_after_the_first_delay() -> None:
    starts: list[float] = []
    # each child lives at least 0.5 s, longer than healthy_after: the delay starts over every time
    code = "import time; time.sleep(0.5)"
    kept = kept_for_starts(code, starts, 4, first_delay=0.1, max_delay=10, healthy_after=0.4)
    assert kept.delays[:3] == [0.1, 0.1, 0.1]  # not 0.1, 0.2, 0.4
