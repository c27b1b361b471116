"""200 live SSE streams against API latency and training speed: ``rlrun serve`` with and without streams.

One ``rlrun serve`` (API + one worker) on a fresh home in a temp folder and a free loopback port, on its
embedded SQLite database or, with ``--database-url``, on a throwaway database created on that PostgreSQL
server (the URL names the server; the database is dropped at the end). It trains one long DPO run on the
tiny preset (``tiny:llama-0.4m``, 8 pairs a step, some ten metric keys logged every step), and measures
four windows while the run trains, three of them ``--seconds`` long:

1. no streams: the baseline;
2. ``--streams`` SSE streams of that run being opened all at once (one asyncio loop in this process,
   ``httpx``; the server's per-client cap is raised to fit, since all streams come from one address):
   this window lasts until every stream has caught up, i.e. received at least as many metric points as
   the run had logged when they were opened (its history, replayed to each);
3. the same streams open, from 2 s after the last one caught up;
4. no streams again, once they are closed: on a shared machine other load comes and goes, so the
   ratios compare window 3 with the mean of windows 1 and 4, and a drift between 1 and 4 shows.

In each window one client sends ``GET /v1/runs`` back to back (a 20 ms pause between calls) and keeps
every latency; the run's steps/s is counted from the ``loss`` rows whose ``logged_at`` falls inside the
window (the worker logs one per step). The table gives p50/p95/max latency and steps/s per window and
the ratio streams open / mean(before, after); goals: p95 < 200 ms while the streams catch up and while
they are open, steps/s ratio >= 0.8. The
streams' own health (answered 200, errors, metric points received, counted as ``"step"`` keys) is printed
under it.
Everything runs on this machine: the client's CPU competes with the server's, as a dashboard on the same
box would. Per window the table also gives the CPU cores used by the API process, the worker, this bench
and everything else on the machine (Linux ``/proc``), so that other load on a shared machine shows as
such; the load average is printed at start and end.

Run: ``.venv/bin/python bench/sse_streams.py [--streams 200] [--seconds 20]
[--database-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--strict]`` (``--strict``: exit 1
when a goal is missed; by default the numbers are only reported, as ``make bench`` runs every file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from common import throwaway_postgres  # a sibling module: python puts bench/ first on sys.path

from rlrun.demo import addition_pairs, stop_process, wait_healthy
from trainer.ports import free_port

GOAL_P95_MS = 200.0
GOAL_STEPS_RATIO = 0.8
PAUSE_S = 0.02


@contextmanager
def serve(home: Path, env: dict[str, str]) -> Iterator[tuple[httpx.Client, int]]:
    """``rlrun serve`` on a free port; a client for it and its pid. Stopped (and waited for) afterwards."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RLRUN_")}
    full = base | {"RLRUN_HOME": str(home), "RLRUN_PORT": str(port)} | env
    with (home / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlrun.cli", "serve"],
            env=full,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                wait_healthy(client, proc)
                yield client, proc.pid
        finally:
            stop_process(proc, timeout=40)


def start_run(client: httpx.Client) -> str:
    data = "".join(json.dumps(r) + "\n" for r in addition_pairs(400)).encode()
    resp = client.post("/v1/datasets", files={"file": ("pairs.jsonl", data)}, data={"kind": "preference"})
    resp.raise_for_status()
    spec = {
        "algorithm": "dpo",
        "name": "sse-bench",
        "model": "tiny:llama-0.4m",
        "dataset_id": resp.json()["id"],
        "hyperparameters": {"learning_rate": 1e-3, "max_steps": 1_000_000, "batch_size": 8},
    }
    resp = client.post("/v1/runs", json=spec)
    resp.raise_for_status()
    run_id: str = resp.json()["id"]
    deadline = time.monotonic() + 300
    while True:  # past model building and the first steps
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["status"] == "running" and run["progress"]["step"] >= 20:
            return run_id
        if run["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id} did not start training: {run['status']} {run['error']}")
        time.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have used so far (all cores; ``/proc/stat``)."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        )
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Processes:
    """Whose CPU a window counts: the API (``rlrun serve``), its worker, and this bench."""

    api: int
    worker: int
    bench: int = field(default_factory=os.getpid)

    @classmethod
    def of(cls, serve_pid: int) -> Processes:
        children = Path(f"/proc/{serve_pid}/task/{serve_pid}/children")
        pids = children.read_text().split() if children.exists() else []
        return cls(api=serve_pid, worker=int(pids[0]) if pids else 0)

    def sample(self) -> tuple[float, ...]:
        return (cpu_seconds(self.api), cpu_seconds(self.worker), cpu_seconds(self.bench), busy_seconds())


@dataclass
class Window:
    latencies_ms: list[float]
    steps_per_s: float
    errors: int
    cores: dict[str, float]  # CPU cores used on average: api, worker, bench (streams and calls), others

    def pct(self, q: float) -> float:
        if len(self.latencies_ms) < 2:
            return max(self.latencies_ms, default=0.0)
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[int(q) - 1]


def measure(
    client: httpx.Client, run_id: str, procs: Processes, seconds: float, until: threading.Event | None = None
) -> Window:
    """GET /v1/runs back to back for ``seconds`` (or until ``until`` is set); the run's steps/s over the
    same wall-clock window."""
    latencies, errors = [], 0
    cpu0, t0 = procs.sample(), time.time()
    while time.time() - t0 < seconds and not (until and until.is_set()):
        start = time.perf_counter()
        try:
            ok = client.get("/v1/runs", timeout=180).status_code == 200
        except httpx.HTTPError:
            ok = False
        latencies.append((time.perf_counter() - start) * 1000)
        errors += not ok
        time.sleep(PAUSE_S)
    cpu1, t1 = procs.sample(), time.time()
    api, worker, bench, machine = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    cores = {"api": api, "worker": worker, "bench": bench, "others": machine - api - worker - bench}
    time.sleep(2.0)  # the worker flushes metrics every second
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, str | int] = {"key": "loss", "limit": 10_000}
        if after:
            params["after"] = after
        page = client.get(f"/v1/runs/{run_id}/metrics", params=params, timeout=180).json()
        rows += page["data"]
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    stamps = [datetime.fromisoformat(m["logged_at"]).timestamp() for m in rows]
    steps = sum(t0 <= t < t1 for t in stamps)
    return Window(latencies, steps / (t1 - t0), errors, {k: v / (t1 - t0) for k, v in cores.items()})


@dataclass
class Streams:
    """``n`` SSE streams of one run, read in one asyncio loop on a thread of their own."""

    base_url: str
    run_id: str
    n: int
    codes: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    points: list[int] = field(default_factory=list)
    connected: threading.Event = field(default_factory=threading.Event)
    open_s: float = 0.0
    history: int = 0  # metric points the run had when the streams opened: each must receive them
    caught_up: threading.Event = field(default_factory=threading.Event)
    caught_up_s: float = 0.0
    behind: int = 0  # streams still short of `history`

    def __post_init__(self) -> None:
        self.points = [0] * self.n
        self.behind = self.n
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _one(self, client: httpx.AsyncClient, i: int, ready: list[int]) -> None:
        try:
            async with client.stream("GET", f"/v1/runs/{self.run_id}/stream") as resp:
                self.codes[resp.status_code] += 1
                ready.append(i)
                if len(ready) == self.n:
                    self.open_s = time.monotonic() - self.started
                    self.connected.set()
                if resp.status_code != 200:
                    await resp.aread()
                    return
                # Count `"step"` keys in the raw bytes: one per metric point (plus one per status message,
                # a handful): parsing 200 streams line by line would cost more CPU than the server spends.
                tail, counted = b"", False
                async for chunk in resp.aiter_raw():
                    data = tail + chunk
                    self.points[i] += data.count(b'"step"')
                    tail = data[-5:] if not data.endswith(b'"step"') else b""
                    if not counted and self.points[i] >= self.history:
                        counted = True
                        self._one_caught_up()
        except (httpx.HTTPError, OSError) as exc:
            self.errors[type(exc).__name__] += 1
            ready.append(i)
            if len(ready) == self.n:
                self.connected.set()
            self._one_caught_up()  # a failed stream never will: counted in `errors` instead

    def _one_caught_up(self) -> None:
        self.behind -= 1
        if self.behind == 0:
            self.caught_up_s = time.monotonic() - self.started
            self.caught_up.set()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.n + 10, max_keepalive_connections=self.n + 10)
        timeout = httpx.Timeout(120, read=None)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as client:
            ready: list[int] = []
            self.started = time.monotonic()
            tasks = [asyncio.create_task(self._one(client, i, ready)) for i in range(self.n)]
            await self.stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Streams:
        self.thread.start()  # `connected` is set once every stream has answered
        return self

    def __exit__(self, *_: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)


def table(before: Window, opening: Window, live: Window, after: Window, n: int) -> str:
    """One row per figure, one column per window; ratio = streams open / mean(before, after)."""
    figures: list[tuple[str, Callable[[Window], float], str]] = [
        ("GET /v1/runs p50 ms", lambda w: w.pct(50), ""),
        ("GET /v1/runs p95 ms", lambda w: w.pct(95), f"goal < {GOAL_P95_MS:.0f} ms with streams"),
        ("GET /v1/runs max ms", lambda w: max(w.latencies_ms, default=0.0), ""),
        ("GET /v1/runs calls", lambda w: len(w.latencies_ms), ""),
        ("GET /v1/runs errors", lambda w: w.errors, ""),
        ("training steps/s", lambda w: w.steps_per_s, f"goal ratio >= {GOAL_STEPS_RATIO}"),
        ("CPU cores: API", lambda w: w.cores["api"], "rlrun serve (uvicorn)"),
        ("CPU cores: worker", lambda w: w.cores["worker"], "the training run"),
        ("CPU cores: bench", lambda w: w.cores["bench"], "this process: the streams and calls"),
        ("CPU cores: others", lambda w: w.cores["others"], "the rest of the machine (noise)"),
    ]
    names = ("no streams", f"{n} streams", f"{n} streams", "no streams")
    out = [
        f"{'':20s} " + " ".join(f"{x:>11s}" for x in names) + f" {'ratio':>7s}",
        f"{'':20s} " + " ".join(f"{x:>11s}" for x in ("(before)", "(opening)", "(open)", "(after)")),
    ]
    for name, get, goal in figures:
        a, o, b, c = get(before), get(opening), get(live), get(after)
        ratio = f"{2 * b / (a + c):7.2f}" if a + c else f"{'-':>7s}"
        cells = " ".join(f"{x:11.2f}" if name.startswith("CPU") else f"{x:11.1f}" for x in (a, o, b, c))
        out.append(f"{name:20s} {cells} {ratio}  {goal}".rstrip())
    return "\n".join(out)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def history_points(client: httpx.Client, run_id: str) -> int:
    """The metric points the run has logged so far (every page of its rows)."""
    total, after = 0, None
    while True:
        params: dict[str, Any] = {"limit": 10_000} | ({"after": after} if after else {})
        page = client.get(f"/v1/runs/{run_id}/metrics", params=params).json()
        total += len(page["data"])
        if not page["has_more"]:
            return total
        after = page["next_cursor"]


def bench(args: argparse.Namespace, home: Path, database_url: str | None) -> bool:
    env = {"RLRUN_MAX_STREAMS_PER_CLIENT": str(args.streams + 10)}
    if database_url:
        env["RLRUN_DATABASE_URL"] = database_url
    with serve(home, env) as (client, serve_pid):
        run_id = start_run(client)
        procs = Processes.of(serve_pid)
        print(f"run {run_id} training; measuring {args.seconds:.0f} s without streams")
        before = measure(client, run_id, procs, args.seconds)
        history = history_points(client, run_id)
        print(
            f"opening {args.streams} streams, measuring until each has received the {history} points so far"
        )
        with Streams(str(client.base_url), run_id, args.streams, history=history) as streams:
            opening = measure(client, run_id, procs, 300, until=streams.caught_up)
            if not streams.caught_up.is_set():
                raise TimeoutError(
                    f"{streams.behind} of {args.streams} streams still catching up after 300 s"
                )
            print(
                f"all answered in {streams.open_s:.1f} s, caught up in {streams.caught_up_s:.1f} s; "
                f"measuring {args.seconds:.0f} s with them open"
            )
            time.sleep(2.0)
            live = measure(client, run_id, procs, args.seconds)
        print(f"streams closed; measuring {args.seconds:.0f} s without streams")
        time.sleep(2.0)
        after = measure(client, run_id, procs, args.seconds)
        client.post(f"/v1/runs/{run_id}/cancel")
    print()
    print(table(before, opening, live, after, args.streams))
    received = sorted(streams.points)
    print(
        f"streams: answered {dict(streams.codes)}, errors {dict(streams.errors) or 0}; metric points "
        f"received per stream: min {received[0]}, median {received[len(received) // 2]}, max {received[-1]}"
    )
    base_steps = (before.steps_per_s + after.steps_per_s) / 2
    ok = (
        max(opening.pct(95), live.pct(95)) < GOAL_P95_MS and live.steps_per_s >= GOAL_STEPS_RATIO * base_steps
    )
    ok = ok and streams.codes[200] == args.streams and not streams.errors and live.errors == 0
    print(f"goals met: {ok}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200, help="SSE streams open in the second window")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured window")
    parser.add_argument(
        "--database-url",
        help="a PostgreSQL server URL (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres): a "
        "throwaway database is created there and dropped afterwards; default: embedded SQLite",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    print(f"load average at start: {load()}")
    with tempfile.TemporaryDirectory(prefix="rlrun-sse-bench-") as tmp:
        if args.database_url:
            with throwaway_postgres(args.database_url) as url:
                print(f"backend: PostgreSQL (throwaway database {url.rsplit('/', 1)[1]})")
                ok = bench(args, Path(tmp), url)
        else:
            print("backend: SQLite (embedded)")
            ok = bench(args, Path(tmp), None)
    print(f"load average at end: {load()}")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
