"""Hostile python graders are contained (trainer/graders/sandbox.py). Each source tries an escape and returns
1.0 if it got out, another value if it was stopped; a stopped call that raised is a failure with its reason.
Real processes and namespaces throughout: on a host that cannot isolate, python graders are refused instead
(the last test)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from trainer.graders.sandbox import Limits, isolation_problem, run_grader

pytestmark = pytest.mark.skipif(
    isolation_problem() is not None, reason=f"no isolation: {isolation_problem()}"
)

QUICK = Limits(call_seconds=1.0, wall_seconds=20)


def one(
    source: str, item: dict[str, object] | None = None, limits: Limits = QUICK
) -> tuple[float | None, str | None]:
    (result,) = run_grader(source, [({"output_text": "x", "output_json": None}, item or {})], limits)
    return result.score, result.error


def test_a_plain_grader_scores_every_call_in_order() -> None:
    source = "def grade(sample, item):\n    return len(sample['output_text']) + item['bonus']\n"
    calls = [({"output_text": "a" * i, "output_json": None}, {"bonus": 0.5}) for i in range(5)]
    assert [r.score for r in run_grader(source, calls, QUICK)] == [0.5, 1.5, 2.5, 3.5, 4.5]


def test_reading_host_files_fails(tmp_path: Path) -> None:
    canary = tmp_path / "secret.txt"
    canary.write_text("the server's secret")
    source = f"""
def grade(sample, item):
    paths = ("/etc/passwd", "/etc/hostname", "/proc/1/environ", {str(canary)!r},
             {str(Path.cwd() / "pyproject.toml")!r})
    for path in paths:
        try:
            open(path).read()
            return 1.0
        except OSError:
            pass
    import os
    return 0.25 if not os.path.exists("/etc") and not os.path.exists("/proc") else 1.0
"""
    assert one(source) == (0.25, None)


def test_writing_outside_the_temporary_folder_fails_and_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    source = f"""
import os
def grade(sample, item):
    for path in ({str(target)!r}, "/usr/lib/planted", "/planted"):
        try:
            open(path, "w").write("x")
            return 1.0
        except OSError:
            pass
    open("/tmp/mine", "w").write("allowed")  # its own temporary folder
    return 0.25
"""
    assert one(source) == (0.25, None)
    assert not target.exists()


def test_opening_sockets_reaches_nothing() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(1.5)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    source = f"""
import socket
def grade(sample, item):
    for address in (("127.0.0.1", {port}), ("8.8.8.8", 53), ("1.1.1.1", 443)):
        try:
            socket.create_connection(address, timeout=1)
            return 1.0
        except OSError:
            pass
    return 0.25
"""
    try:
        assert one(source, limits=Limits(call_seconds=10, wall_seconds=30)) == (0.25, None)
    finally:
        waiter.join()
        server.close()
    assert accepted == []


def test_a_fork_bomb_cannot_start() -> None:
    source = """
import os, subprocess
def grade(sample, item):
    children = 0
    for _ in range(1000):
        try:
            if os.fork() == 0:
                while True:
                    pass
            children += 1
        except OSError:
            break
    try:
        subprocess.run(["/bin/sh", "-c", "true"])
        return 1.0
    except OSError:
        pass
    return 0.25 if children == 0 else 1.0
"""
    assert one(source) == (0.25, None)


def test_an_infinite_loop_times_out_and_the_next_call_still_runs() -> None:
    source = """
def grade(sample, item):
    if item["spin"]:
        while True:
            pass
    return 0.75
"""
    calls = [({"output_text": ""}, {"spin": True}), ({"output_text": ""}, {"spin": False})]
    first, second = run_grader(source, calls, Limits(call_seconds=0.5, wall_seconds=20))
    assert first.score is None and first.error == "timed out"
    assert second.score == 0.75


def test_a_loop_that_swallows_the_timer_is_killed_at_the_wall_limit_with_its_namespace() -> None:
    marker = f"rlrun-test-{os.getpid()}-{time.monotonic_ns()}"
    source = f"""
import os
def grade(sample, item):
    name = {marker!r}
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass
"""
    start = time.monotonic()
    (result,) = run_grader(source, [({"output_text": ""}, {})], Limits(call_seconds=0.2, wall_seconds=2))
    assert result.score is None and "ran past 2" in (result.error or "")
    assert time.monotonic() - start < 10
    time.sleep(0.5)
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "rlrun-sandbox" not in left and marker not in left


def test_memory_is_capped() -> None:
    source = "def grade(sample, item):\n    block = bytearray(3 * 1024 ** 3)\n    return 1.0\n"
    score, error = one(source, limits=Limits(call_seconds=5, wall_seconds=20, memory_bytes=512 * 1024**2))
    assert score is None and error is not None and "MemoryError" in error


def test_huge_output_is_dropped_or_cut_off() -> None:
    prints = """
import sys
def grade(sample, item):
    for _ in range(200000):
        print("x" * 100)
        sys.stderr.write("y" * 100)
    return 0.5
"""
    assert one(prints, limits=Limits(call_seconds=20, wall_seconds=40)) == (0.5, None)
    # writing straight to the result descriptor: the parent stops reading at its cap and kills the sandbox
    flood = """
import os
def grade(sample, item):
    for fd in range(3, 10):
        try:
            while True:
                os.write(fd, b"z" * 65536)
        except OSError:
            pass
    return 1.0
"""
    score, error = one(flood, limits=Limits(call_seconds=20, wall_seconds=40))
    assert score is None and error is not None


def test_it_runs_as_nobody_without_the_hosts_environment() -> None:
    source = """
import os
def grade(sample, item):
    leaked = "RLRUN_HOME" in os.environ or "PATH" not in os.environ
    return float(os.getuid()) + (0.5 if leaked else 0)
"""
    os.environ.setdefault("RLRUN_HOME", "/somewhere")
    score, _ = one(source)
    assert score == (65534.0 if os.geteuid() == 0 else 0.0)


def test_broken_sources_fail_every_call_with_the_reason() -> None:
    results = run_grader(
        "import nonexistent_module\ndef grade(s, i):\n    return 1.0\n", [({}, {}), ({}, {})], QUICK
    )
    assert [r.score for r in results] == [None, None]
    assert all("ModuleNotFoundError" in (r.error or "") for r in results)
    score, error = one("def grade(sample, item):\n    return 'high'\n")
    assert score is None and "ValueError" in (error or "")
    score, error = one("def grade(sample, item):\n    return float('nan')\n")
    assert score is None and "nan" in (error or "")
