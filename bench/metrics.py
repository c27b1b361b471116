"""Metric ingest points/s and chart-query ms: rlrun's worker writer on SQLite and PostgreSQL against MLflow.

One run gets ``--keys`` x ``--steps`` metric points (default 20 x 50,000 = 1M), logged step by step as a
training loop does (all keys of a step together). Values are a seeded random walk per key, built before
any clock starts.

- rlrun: a fresh database (a SQLite file in a temp folder; a fresh PostgreSQL database created on the
  local server and dropped at the end), migrated to head, with one dataset and one run row that is
  ``running`` and held by the bench's worker id. The clock covers ``DbReporter.log_metrics(step, {...})``
  for every step and the final ``flush()``; the reporter flushes by size (``flush_rows`` 20,000, time
  flushes off), and each flush is one transaction that renews the lease and writes the points and their
  chart tiers (api/metric_store.py), exactly as a worker does. Chart query: ``chart_series`` for one
  key, 1,000 points, over that key's whole series (50k points of the 1M-point run), and the same through
  the HTTP route ``GET /v1/runs/{id}/metrics?key=K&max_points=1000&format=columns`` (what the dashboard
  asks; FastAPI ``TestClient``: the whole app stack, in process, no socket).
- MLflow: ``mlflow server`` (one worker, SQLite backend store in a temp folder) as a subprocess on a free
  loopback port; ``MlflowClient.log_batch`` with 1,000 ``Metric``s a call (MLflow's per-call limit), in
  the same step order, building the ``Metric`` objects inside the clock as rlrun builds its rows. At most
  ``--mlflow-points`` points are logged and timed (a prefix of the steps, all keys; default 100,000, since
  MLflow logs some 3k points/s on 2 cores and 1M would take ~6 min alone); MLflow's points/s comes from
  that prefix (its rate is taken to hold for 1M), and the chart key is then topped up to all ``--steps``
  steps off the clock, so both chart queries read the same series length.
  Chart query analogue: ``get_metric_history`` for that key over HTTP: its full series (MLflow has no
  server-side downsampling).

Query times are the median of ``REPEATS`` calls after one warm-up call. ``ratio = rlrun points/s /
MLflow points/s``; the goal is >= 10x for ingest and < 50 ms for the 1,000-point chart query at 1M
points (issue 23).
Wall times swing with other load on a shared machine; the load average is printed at start and end.

Run: ``make bench`` (runs every file in bench/) or ``.venv/bin/python bench/metrics.py [--steps N] [--keys K]
[--mlflow-points P] [--skip-postgres]`` after ``.venv/bin/pip install -e '.[dev,bench]'`` (the bench extra
carries MLflow). PostgreSQL is ``RLRUN_BENCH_POSTGRES_URL`` (an admin URL; default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); it is skipped with a note when unreachable.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from common import throwaway_postgres  # a sibling module: python puts bench/ first on sys.path
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.db import make_engine, make_session_factory
from api.main import create_app
from api.migrate import upgrade_head
from api.models import Dataset, Metric, Run, utcnow
from api.services.runs import chart_series
from api.settings import Settings
from trainer.ports import free_port
from trainer.worker import DbReporter

PG_ADMIN_URL = os.environ.get(
    "RLRUN_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
WORKER_ID = "bench-worker"
FLUSH_ROWS = 20_000
MAX_POINTS = 1000
MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
REPEATS = 5
SEED = 0

Steps = list[dict[str, float]]


@dataclass
class Result:
    backend: str
    points: int  # points logged and timed
    ingest_s: float
    query_ms: float | None  # in-process service call (rlrun only)
    http_ms: float  # through HTTP: TestClient for rlrun, the real server for MLflow
    returned: int  # points the chart query returned
    note: str = ""

    @property
    def points_per_s(self) -> float:
        return self.points / self.ingest_s


def make_steps(n_steps: int, n_keys: int) -> tuple[list[str], Steps]:
    """Per step, {key: value}: a seeded random walk per key (noisy like a loss curve)."""
    rng = random.Random(SEED)
    keys = [f"train/metric_{k:02d}" for k in range(n_keys)]
    level = [1.0] * n_keys
    steps: Steps = []
    for _ in range(n_steps):
        for k in range(n_keys):
            level[k] += rng.gauss(0.0, 0.01)
        steps.append(dict(zip(keys, level, strict=True)))
    return keys, steps


def median_ms(call: Callable[[], int]) -> tuple[float, int]:
    """Median wall ms of ``call`` over REPEATS calls after one warm-up; and what the call returned."""
    returned = call()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), returned


def reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url.replace("+psycopg", ""))
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), 1):
            return True
    except OSError:
        return False


def insert_running_run(session_factory: Any, total_steps: int) -> uuid.UUID:
    """A dataset and a run that is running and held by WORKER_ID, as after ``claim_run``."""
    now = utcnow()
    with session_factory.begin() as session:
        ds = Dataset(id=uuid.uuid4(), name="bench", kind="preference", row_count=0, size_bytes=0, stats={})
        session.add(ds)
        session.flush()
        spec = {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(ds.id),
            "hyperparameters": {"max_steps": total_steps},
        }
        run = Run(
            id=uuid.uuid4(),
            algorithm="dpo",
            status="running",
            spec=spec,
            dataset_id=ds.id,
            attempt=1,
            worker_id=WORKER_ID,
            lease_expires_at=now + timedelta(seconds=3600),
            step=0,
            total_steps=total_steps,
            cancel_requested=False,
            created_at=now,
            started_at=now,
        )
        session.add(run)
        return run.id


def bench_rlrun(backend: str, url: str, keys: list[str], steps: Steps) -> Result:
    upgrade_head(url)
    engine = make_engine(url)
    try:
        sf = make_session_factory(engine)
        run_id = insert_running_run(sf, len(steps))
        reporter = DbReporter(sf, run_id, WORKER_ID, 3600, flush_seconds=1e9, flush_rows=FLUSH_ROWS)
        start = time.perf_counter()
        for step, metrics in enumerate(steps, start=1):
            reporter.log_metrics(step, metrics)
        reporter.flush()
        ingest_s = time.perf_counter() - start
        points = len(steps) * len(keys)
        with sf() as session:
            stored = session.scalar(select(func.count()).select_from(Metric).where(Metric.run_id == run_id))
        assert stored == points, f"{backend}: {stored} rows stored, {points} logged"

        key = keys[0]

        def service_query() -> int:
            with sf() as session:
                series = chart_series(
                    session=session,
                    run_id=run_id,
                    keys=[key],
                    min_step=None,
                    max_step=None,
                    max_points=MAX_POINTS,
                )
            return len(series[key])

        query_ms, returned = median_ms(service_query)
        app = create_app(Settings(database_url=url), session_factory=sf, enqueue=lambda _run_id: None)
        with TestClient(app) as client:

            def http_query() -> int:
                params = {"key": key, "max_points": MAX_POINTS, "format": "columns"}
                resp = client.get(f"/v1/runs/{run_id}/metrics", params=params)
                resp.raise_for_status()
                return len(resp.json()[key]["step"])

            http_ms, http_returned = median_ms(http_query)
        assert http_returned == returned
        return Result(f"rlrun {backend}", points, ingest_s, query_ms, http_ms, returned)
    finally:
        engine.dispose()


@contextmanager
def mlflow_server(work: Path) -> Iterator[str]:
    """``mlflow server`` with a SQLite backend store, one worker, on a free loopback port."""
    port = free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow_bin),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{work / 'mlflow.db'}",
        "--default-artifact-root",
        str(work / "mlflow-artifacts"),
    ]
    env = os.environ | {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    log_path = work / "mlflow-server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer in 180 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker processes, nothing else
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def bench_mlflow(keys: list[str], steps: Steps, cap: int, work: Path) -> Result:
    from mlflow.entities import Metric as MlflowMetric
    from mlflow.tracking import MlflowClient

    timed_steps = max(1, min(len(steps), cap // len(keys)))
    with mlflow_server(work) as uri:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = client.create_experiment(f"bench-{uuid.uuid4().hex[:8]}")
        run_id = client.create_run(experiment_id).info.run_id
        batch: list[Any] = []
        start = time.perf_counter()
        for step, metrics in enumerate(steps[:timed_steps], start=1):
            ts = int(time.time() * 1000)
            batch += [MlflowMetric(key, value, ts, step) for key, value in metrics.items()]
            while len(batch) >= MLFLOW_BATCH:
                client.log_batch(run_id, metrics=batch[:MLFLOW_BATCH], synchronous=True)
                batch = batch[MLFLOW_BATCH:]
        if batch:
            client.log_batch(run_id, metrics=batch, synchronous=True)
        ingest_s = time.perf_counter() - start
        key = keys[0]
        rest = [  # off the clock: the chart key gets its whole series, as on the rlrun side
            MlflowMetric(key, metrics[key], int(time.time() * 1000), step)
            for step, metrics in enumerate(steps[timed_steps:], start=timed_steps + 1)
        ]
        for i in range(0, len(rest), MLFLOW_BATCH):
            client.log_batch(run_id, metrics=rest[i : i + MLFLOW_BATCH], synchronous=True)
        query_ms, returned = median_ms(lambda: len(client.get_metric_history(run_id, key)))
    assert returned == len(steps), f"MLflow history has {returned} points, {len(steps)} logged"
    points = timed_steps * len(keys)
    note = "" if timed_steps == len(steps) else f"(first {timed_steps} steps; points/s from these)"
    return Result("MLflow", points, ingest_s, None, query_ms, returned, note)


def print_table(results: list[Result]) -> None:
    header = f"{'backend':18}{'points':>10}{'ingest s':>10}{'points/s':>11}"
    header += f"{'chart query ms':>16}{'via HTTP ms':>13}{'pts returned':>14}"
    print(header)
    for r in results:
        query = f"{r.query_ms:.1f}" if r.query_ms is not None else "-"
        row = f"{r.backend:18}{r.points:>10}{r.ingest_s:>10.2f}{r.points_per_s:>11.0f}"
        row += f"{query:>16}{r.http_ms:>13.1f}{r.returned:>14}"
        print(row + (f"  {r.note}" if r.note else ""))


def print_ratios(results: list[Result], total_points: int) -> None:
    mlflow = next((r for r in results if r.backend == "MLflow"), None)
    for r in results:
        if r is mlflow:
            continue
        if mlflow is not None:
            ratio = r.points_per_s / mlflow.points_per_s
            goal = "met" if ratio >= 10 else "NOT met"
            print(f"ratio {r.backend} points/s / MLflow points/s = {ratio:.2f}  (goal >= 10x: {goal})")
        assert r.query_ms is not None
        met = "met" if r.query_ms < 50 and r.http_ms < 50 else "NOT met"
        print(
            f"{r.backend}: {MAX_POINTS}-point chart query at {total_points} points: {r.query_ms:.1f} ms "
            f"in process, {r.http_ms:.1f} ms via HTTP  (goal < 50 ms: {met})"
        )


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000, help="steps of the run")
    parser.add_argument("--keys", type=int, default=20, help="metric keys logged at every step")
    parser.add_argument(
        "--mlflow-points",
        type=int,
        default=100_000,
        help="at most this many points are logged and timed through MLflow (a prefix of the steps)",
    )
    parser.add_argument("--skip-postgres", action="store_true", help="leave out rlrun on PostgreSQL")
    parser.add_argument("--skip-mlflow", action="store_true", help="leave out MLflow")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.keys < 1 or args.mlflow_points < 1:
        parser.error("--steps, --keys and --mlflow-points must be at least 1")
    import sqlalchemy

    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    versions = f"sqlalchemy {sqlalchemy.__version__}"
    if not args.skip_mlflow:
        import mlflow

        versions += f", mlflow {mlflow.__version__}"
    total = args.steps * args.keys
    print(
        f"{args.keys} keys x {args.steps} steps = {total} points, one run; {versions}; "
        f"{os.cpu_count()} cpus, load average {load()}"
    )
    keys, steps = make_steps(args.steps, args.keys)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        work = Path(tmp)
        results.append(bench_rlrun("SQLite", f"sqlite:///{work / 'rlrun.db'}", keys, steps))
        if args.skip_postgres:
            pass
        elif not reachable(PG_ADMIN_URL, 5432):
            print(f"note: PostgreSQL at {PG_ADMIN_URL} is not reachable: left out")
        else:
            with throwaway_postgres(PG_ADMIN_URL) as url:
                results.append(bench_rlrun("PostgreSQL", url, keys, steps))
        if not args.skip_mlflow:
            results.append(bench_mlflow(keys, steps, args.mlflow_points, work))
    print_table(results)
    print_ratios(results, total)
    capped = [r for r in results if r.backend == "MLflow" and r.points < total]
    if capped:
        print(
            f"note: MLflow logged and timed {capped[0].points} of the {total} points (--mlflow-points); its "
            f"points/s is extrapolated to {total}, and ingest s is for those {capped[0].points} only."
        )
    print(
        f"note: chart query = rlrun's {MAX_POINTS}-point min-max downsampled series of one key "
        f"({args.steps} points read); MLflow = get_metric_history of one key, all {args.steps} points "
        "(it has no server-side downsampling). rlrun's HTTP column is TestClient (in process, no socket); "
        f"MLflow's is its real server over loopback. Each is the median of {REPEATS} after one warm-up."
    )
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
