"""Running a user's Python where it can harm nothing: a ``python`` grader's ``grade(sample, item)``
(``run_grader``) or a run's tool functions (``run_tools``, trainer/rollout/tool_episodes.py).

One sandbox process per batch of calls, started by ``unshare`` (util-linux) in new network, process, mount,
IPC and UTS namespaces (and a user namespace when this process is not root). Inside, before any user code
runs, a boot script (``BOOT``, stdlib only):

1. reads the whole batch (JSON) from stdin;
2. builds a new root on a tmpfs holding only read-only bind mounts of the Python installation and the
   shared libraries it needs, ``/dev/null``, and a small writable ``/tmp``; ``chroot``s into it (no ``/etc``,
   no ``/proc``, none of the host's files: a read of ``/etc/passwd`` or of this server's data fails);
3. sets limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), one process (``RLIMIT_NPROC``:
   ``fork`` fails, so a fork bomb cannot start), file size and open files;
4. drops to user ``nobody`` (65534) when it started as root;
5. points stdout and stderr at ``/dev/null`` (a flood of prints goes nowhere), compiles the source, and
   calls ``grade`` on each sample (or the named tool function with each call's arguments) under a
   per-call timer (``setitimer``), writing one JSON result per call to a kept descriptor.

The network namespace has only a loopback interface, down: no connection goes anywhere. The parent reads at
most ``MAX_RESULT_BYTES``, kills the whole process group (and with it the namespace's init, which takes every
process in the namespace) at the wall-clock limit, and counts each call without a result as failed.

``isolation_problem()`` probes once whether this host allows all this (``unshare`` present, namespaces
permitted); where it does not, python graders are refused at submit with its reason.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

MAX_RESULT_BYTES = 4 * 1024 * 1024
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    call_seconds: float = 5.0  # one grade() call
    wall_seconds: float = 60.0  # the whole batch
    cpu_seconds: int = 60
    memory_bytes: int = 1024 * 1024 * 1024
    file_bytes: int = 16 * 1024 * 1024
    tmp_bytes: int = 32 * 1024 * 1024


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class CallResult:
    """One ``grade`` call: its score, or why it has none."""

    score: float | None
    error: str | None = None


BOOT = r"""
import ctypes, json, os, resource, signal, sys
payload = json.loads(sys.stdin.buffer.read())
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {src} on {dst}: {os.strerror(ctypes.get_errno())}")
mount(None, "/", None, MS_REC | MS_PRIVATE)
root = "/tmp"  # a fresh tmpfs over /tmp in this mount namespace only: nothing is left on the host
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=755" % payload["tmp_bytes"])
for src in payload["binds"]:
    if not os.path.exists(src):
        continue
    dst = root + src
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_REC)
os.makedirs(root + "/tmp", mode=0o1777)
os.chmod(root + "/tmp", 0o1777)
os.chroot(root)
os.chdir("/tmp")
out = os.dup(1)
null = os.open("/dev/null", os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
for limit, value in ((resource.RLIMIT_CPU, payload["cpu_seconds"]),
                     (resource.RLIMIT_AS, payload["memory_bytes"]),
                     (resource.RLIMIT_FSIZE, payload["file_bytes"]),
                     (resource.RLIMIT_NOFILE, 32), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if os.getuid() == 0 and payload["drop_to"] is not None:
    os.setgroups([])
    os.setgid(payload["drop_to"])
    os.setuid(payload["drop_to"])
resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
def emit(obj):
    os.write(out, (json.dumps(obj) + "\n").encode())
class CallTimeout(BaseException):
    pass
def on_alarm(*_):
    raise CallTimeout()
signal.signal(signal.SIGALRM, on_alarm)
sys.stdout = sys.stderr = open(os.devnull, "w")
tools = payload["mode"] == "tools"
namespace = {"__name__": "tools" if tools else "grader"}
try:
    signal.setitimer(signal.ITIMER_REAL, payload["call_seconds"])
    exec(compile(payload["source"], "<tools>" if tools else "<grader>", "exec"), namespace)
    signal.setitimer(signal.ITIMER_REAL, 0)
    grade = None if tools else namespace["grade"]
except BaseException as exc:
    signal.setitimer(signal.ITIMER_REAL, 0)
    emit({"setup_error": f"{type(exc).__name__}: {exc}"[:500]})
    os._exit(0)
def as_text(value):
    if payload["as_json"]:
        text = json.dumps(value, allow_nan=False)
        if len(text) > payload["max_text_chars"]:
            raise ValueError(f"the result is over {payload['max_text_chars']} characters of JSON")
        return text
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[: payload["max_text_chars"]]
for first, second in payload["calls"]:
    try:
        signal.setitimer(signal.ITIMER_REAL, payload["call_seconds"])
        if tools:
            fn = namespace.get(first)
            if not callable(fn):
                raise NameError(f"no function {first!r} in the tools' source")
            value = as_text(fn(*second) if isinstance(second, list) else fn(**second))
        else:
            value = float(grade(first, second))
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit({"text": value} if tools else {"score": value})
    except CallTimeout:
        emit({"error": "timed out"})
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            emit({"error": f"{type(exc).__name__}: {exc}"[:500]})
        except BaseException:
            emit({"error": type(exc).__name__})
os._exit(0)
"""


def _python() -> str:
    """The interpreter's real file (the venv's ``python`` is a link into the base installation)."""
    return os.path.realpath(sys.executable)


def _binds() -> list[str]:
    """What the sandbox sees, read-only: the Python installation, the shared libraries, /dev/null."""
    prefixes = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(_python()))}
    libs = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"]
    return sorted({p for p in prefixes if p and p != "/"} | set(libs)) + ["/dev/null", "/dev/urandom"]


def _command() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise OSError("the `unshare` program (util-linux) is not installed")
    flags = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        flags += ["--user", "--map-root-user"]
    return [unshare, *flags, _python(), "-I", "-S", "-c", BOOT]


def _read_capped(stream: Any, out: bytearray, cap: int, overflow: threading.Event) -> None:
    while chunk := stream.read1(65536):
        if len(out) + len(chunk) > cap:
            overflow.set()
            return
        out.extend(chunk)


def run_grader(
    source: str, calls: list[tuple[dict[str, Any], dict[str, Any]]], limits: Limits = DEFAULT_LIMITS
) -> list[CallResult]:
    """``grade(sample, item)`` of ``source`` on each call, in the sandbox; a result per call, in order."""
    if not calls:
        return []
    out, reason = _run_batch(source, "grade", calls, limits)
    return _results(out, len(calls), reason)


@dataclass(frozen=True)
class ToolResult:
    """One tool call: the text it returned (a non-string value as JSON), or why it has none."""

    text: str | None
    error: str | None = None


def run_tools(
    source: str,
    calls: Sequence[tuple[str, dict[str, Any] | list[Any]]],
    limits: Limits = DEFAULT_LIMITS,
    max_text_chars: int = 4096,
    as_json: bool = False,
) -> list[ToolResult]:
    """``name(**arguments)`` (or ``name(*arguments)`` for a list) of the functions ``source`` defines, for
    each ``(name, arguments)`` call, in one sandbox (the same isolation and limits as python graders; a
    call that raises, runs past ``limits.call_seconds`` or exhausts the memory limit fails alone); a
    result per call, in order, each text cut to ``max_text_chars``. ``as_json``: every value comes back as
    its JSON text (an error where it has none, or where it is longer than ``max_text_chars``). The
    batch's results may take ``max_text_chars`` per call (JSON-escaped), beyond ``MAX_RESULT_BYTES``."""
    if not calls:
        return []
    cap = max(MAX_RESULT_BYTES, len(calls) * (6 * max_text_chars + 256))  # \uXXXX escapes: 6 bytes a char
    out, reason = _run_batch(source, "tools", list(calls), limits, max_text_chars, as_json, cap)
    return _tool_results(out, len(calls), reason)


def _run_batch(
    source: str,
    mode: str,
    calls: list[Any],
    limits: Limits,
    max_text_chars: int = 0,
    as_json: bool = False,
    max_bytes: int = MAX_RESULT_BYTES,
) -> tuple[bytes, str]:
    """Run one batch of calls in a fresh sandbox: the result lines it wrote, and (when it did not end by
    itself) why it was stopped."""
    payload = json.dumps(
        {
            "source": source,
            "mode": mode,
            "calls": calls,
            "binds": _binds(),
            "call_seconds": limits.call_seconds,
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "file_bytes": limits.file_bytes,
            "tmp_bytes": limits.tmp_bytes,
            "max_text_chars": max_text_chars,
            "as_json": as_json,
            "drop_to": NOBODY if os.geteuid() == 0 else None,
        }
    ).encode()
    try:
        proc = subprocess.Popen(
            _command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    except OSError as exc:
        return b"", f"the sandbox did not start: {exc}"
    out, err = bytearray(), bytearray()
    overflow = threading.Event()
    readers = [
        threading.Thread(target=_read_capped, args=(proc.stdout, out, max_bytes, overflow)),
        threading.Thread(target=_read_capped, args=(proc.stderr, err, 65536, threading.Event())),
    ]
    for r in readers:
        r.start()
    killed = ""
    try:
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.wall_seconds
    while proc.poll() is None:
        if overflow.is_set():
            killed = f"more than {max_bytes} bytes of results"
        elif time.monotonic() > deadline:
            killed = f"the batch ran past {limits.wall_seconds} s"
        if killed:
            _kill(proc)
            break
        time.sleep(0.01)
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    return bytes(out), killed or _stderr_reason(bytes(err), proc.returncode)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def _stderr_reason(err: bytes, code: int | None) -> str:
    text = err.decode(errors="replace").strip().splitlines()
    return f"the sandbox exited with {code}" + (f": {text[-1][:300]}" if text else "")


def _results(out: bytes, n: int, reason: str) -> list[CallResult]:
    results: list[CallResult] = []
    for obj in _result_lines(out)[:n]:
        if "setup_error" in obj:
            return [CallResult(None, f"the source failed to load: {obj['setup_error']}")] * n
        score = obj.get("score")
        if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
            results.append(CallResult(float(score)))
        else:
            results.append(CallResult(None, str(obj.get("error") or f"grade returned {score!r}")))
    missing = n - len(results)
    return results + [CallResult(None, reason or "no result")] * missing


def _result_lines(out: bytes) -> list[dict[str, Any]]:
    """The sandbox's result objects, up to the first line that is not one."""
    lines: list[dict[str, Any]] = []
    for line in out.decode(errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            break
        if not isinstance(obj, dict):
            break
        lines.append(obj)
    return lines


def _tool_results(out: bytes, n: int, reason: str) -> list[ToolResult]:
    results: list[ToolResult] = []
    for obj in _result_lines(out)[:n]:
        if "setup_error" in obj:
            return [ToolResult(None, f"the tools' source failed to load: {obj['setup_error']}")] * n
        text = obj.get("text")
        results.append(ToolResult(text) if isinstance(text, str) else ToolResult(None, str(obj.get("error"))))
    return results + [ToolResult(None, reason or "no result")] * (n - len(results))


@cache
def isolation_problem() -> str | None:
    """Why python graders cannot run on this host (None: they can). Probed once per process."""
    if not sys.platform.startswith("linux"):
        return f"python graders need Linux namespaces; this host is {sys.platform}"
    try:
        (result,) = run_grader(
            "import os\ndef grade(sample, item):\n    return 0.0 if os.path.exists('/etc') else 1.0\n",
            [({"output_text": ""}, {})],
            Limits(wall_seconds=30),
        )
    except OSError as exc:
        return f"the python grader sandbox cannot start here: {exc}"
    if result.score != 1.0:
        return (
            f"the python grader sandbox cannot isolate here: {result.error or 'the host file system shows'}"
        )
    return None
