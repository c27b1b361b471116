"""Fault drills with real processes: PostgreSQL, a private redis-server on a spare loopback port, an API
process (`rlrun serve --no-worker`, which runs the reconciler) and worker processes. Each drill kills or
restarts only processes it started itself; the machine's shared PostgreSQL and Redis are never touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.migrate import upgrade_head
from rlrun.demo import addition_pairs, stop_process, wait_healthy
from tests.conftest import pg_test_database
from tests.factories import jsonl
from tests.integration.flow import FINISHED, all_metrics, wait_for
from trainer.ports import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not installed"),
]


class Proc:
    """A child process with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logdir: Path):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, logdir / f"{name}.log"
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self.p = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def kill9(self) -> None:
        assert self.p is not None
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            stop_process(self.p)


class Stack:
    """PostgreSQL database + private Redis + API + workers, all on loopback."""

    def __init__(self, home: Path, db_url: str):
        self.home, self.redis_port, self.api_port = home, free_port(), free_port()
        self.env = {
            **os.environ,
            "RLRUN_HOME": str(home),
            "RLRUN_DATABASE_URL": db_url,
            "RLRUN_BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "RLRUN_PORT": str(self.api_port),
            "RLRUN_QUEUE": f"drill-{uuid.uuid4().hex[:6]}",
            "RLRUN_LEASE_SECONDS": "4",
            "RLRUN_RECONCILE_SECONDS": "1",
            "RLRUN_RESEND_AFTER_SECONDS": "3",
        }
        self.redis = Proc(
            "redis",
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            self.env,
            home,
        )
        self.api = Proc(
            "api",
            [sys.executable, "-m", "rlrun.cli", "serve", "--no-worker", "--no-inference"],
            self.env,
            home,
        )
        self.workers: list[Proc] = []
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.api_port}", timeout=30)

    def start_worker(self) -> Proc:
        w = Proc(
            f"worker{len(self.workers)}", [sys.executable, "-m", "rlrun.cli", "worker"], self.env, self.home
        )
        self.workers.append(w.start())
        return w

    def start_api(self) -> None:
        assert self.api.start().p is not None
        wait_healthy(self.client, self.api.p)  # type: ignore[arg-type]

    def close(self) -> None:
        """Workers and the API asked to stop together (each takes ~1-1.5 s of warm shutdown: one after the
        other, a drill's teardown took up to 5.6 s), then Redis, which their shutdowns may still use."""
        running = [p.p for p in [*self.workers, self.api] if p.p is not None and p.p.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()
        self.client.close()


@contextmanager
def open_stack(home: Path, **env: str) -> Iterator[Stack]:
    """A Stack on a fresh PostgreSQL database with Redis and the API started (workers are the test's);
    ``env`` overrides the environment of every process it starts. Prints the logs at the end."""
    gen = pg_test_database()
    db_url = next(gen)
    upgrade_head(db_url)
    s = Stack(home, db_url)
    s.env.update(env)
    try:
        s.redis.start()
        time.sleep(0.3)
        s.start_api()
        yield s
    finally:
        s.close()
        for log in sorted(home.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        next(gen, None)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with open_stack(tmp_path) as s:
        yield s


def upload(client: httpx.Client, n: int = 64) -> str:
    resp = client.post(
        "/v1/datasets", files={"file": ("p.jsonl", jsonl(addition_pairs(n)))}, data={"kind": "preference"}
    )
    assert resp.status_code == 201, resp.text
    dataset_id: str = resp.json()["id"]
    return dataset_id


def submit(client: httpx.Client, dataset_id: str, **hp: Any) -> str:
    spec = {
        "algorithm": "dpo",
        "model": hp.pop("model", "tiny:llama-0.4m"),
        "dataset_id": dataset_id,
        "hyperparameters": {"learning_rate": 1e-3, "batch_size": 8, **hp},
    }
    resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    run_id: str = resp.json()["id"]
    return run_id


def loss_steps(client: httpx.Client, run_id: str) -> list[int]:
    return sorted(m["step"] for m in all_metrics(client, run_id) if m["key"] == "loss")


def status_events(client: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    events = client.get(f"/v1/runs/{run_id}/events", params={"limit": 1000}).json()["data"]
    return [e for e in events if e["kind"] == "status"]


def test_drill_kill_9_worker_mid_run_resumes_from_checkpoint(stack: Stack) -> None:
    first = stack.start_worker()
    ds = upload(stack.client)
    run_id = submit(
        stack.client, ds, model="tiny:llama-10m", max_steps=120, checkpoint_every=20, keep_last_checkpoints=10
    )
    wait_for(stack.client, run_id, lambda r: r["progress"]["step"] >= 45, timeout=180)
    first.kill9()
    stack.start_worker()
    done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED, timeout=240)
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 2
    assert loss_steps(stack.client, run_id) == list(range(1, 121))  # exactly once: no gaps, no duplicates
    messages = [
        e["message"]
        for e in stack.client.get(f"/v1/runs/{run_id}/events", params={"limit": 1000}).json()["data"]
    ]
    assert any(m.startswith("resumed from checkpoint at step") and int(m.split()[-1]) >= 40 for m in messages)
    # Either the reconciler requeued it after the lease expired, or the redelivered message reached the
    # new worker first and it re-claimed the expired lease directly; both count attempt 2.
    starts = [e["data"]["attempt"] for e in status_events(stack.client, run_id) if e["message"] == "running"]
    assert starts == [1, 2]


def test_drill_redis_restarted_and_flushed_mid_run(stack: Stack) -> None:
    stack.start_worker()
    ds = upload(stack.client)
    running = submit(stack.client, ds, model="tiny:llama-10m", max_steps=80)
    wait_for(stack.client, running, lambda r: r["progress"]["step"] >= 5, timeout=180)
    stack.redis.kill9()  # no persistence: the restarted Redis is empty
    queued_while_down = submit(stack.client, ds, max_steps=20)
    warnings = stack.client.get(f"/v1/runs/{queued_while_down}/events").json()["data"]
    assert any(e["kind"] == "warning" and "broker" in e["message"] for e in warnings)
    time.sleep(1)
    stack.redis.start()
    for run_id in (running, queued_while_down):
        done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED, timeout=240)
        assert done["status"] == "succeeded", done
    assert loss_steps(stack.client, running) == list(range(1, 81))


def test_drill_api_restarted_mid_run(stack: Stack) -> None:
    stack.start_worker()
    ds = upload(stack.client)
    run_id = submit(stack.client, ds, model="tiny:llama-10m", max_steps=60)
    wait_for(stack.client, run_id, lambda r: r["progress"]["step"] >= 3, timeout=180)
    stack.api.kill9()
    with pytest.raises(httpx.TransportError):
        stack.client.get("/healthz")
    stack.start_api()
    done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED, timeout=240)
    assert done["status"] == "succeeded" and done["attempt"] == 1
    assert loss_steps(stack.client, run_id) == list(range(1, 61))


def test_drill_cancel_during_long_steps_keeps_checkpoints(stack: Stack) -> None:
    stack.start_worker()
    ds = upload(stack.client, 256)
    run_id = submit(
        stack.client, ds, model="tiny:llama-10m", max_steps=100_000, batch_size=64, checkpoint_every=5
    )
    wait_for(stack.client, run_id, lambda r: r["progress"]["step"] >= 6, timeout=180)
    at_cancel = stack.client.post(f"/v1/runs/{run_id}/cancel").json()["progress"]["step"]
    done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED, timeout=60)
    assert done["status"] == "cancelled"
    # Within one step: the loop checks the flag before every step (+1 for metrics still being flushed).
    assert max(loss_steps(stack.client, run_id)) <= at_cancel + 2
    ckpts = stack.client.get(f"/v1/runs/{run_id}/checkpoints").json()
    assert ckpts and all(Path(stack.home).exists() for _ in ckpts)


def test_drill_two_workers_ten_runs_each_exactly_once(stack: Stack) -> None:
    stack.start_worker()
    stack.start_worker()
    ds = upload(stack.client, 16)
    run_ids = [submit(stack.client, ds, max_steps=15) for _ in range(10)]
    workers = set()
    for run_id in run_ids:
        done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED, timeout=300)
        assert done["status"] == "succeeded" and done["attempt"] == 1, done
        starts = [e for e in status_events(stack.client, run_id) if e["message"] == "running"]
        assert len(starts) == 1  # the loop started exactly once
        workers.add(starts[0]["data"]["worker"])
    assert len(workers) == 2  # both workers took work
