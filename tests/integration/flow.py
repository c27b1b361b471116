"""The user's path over HTTP, shared by the integration tests: upload, submit, poll, read metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from rlrun.demo import addition_pairs, stop_process, wait_healthy
from tests.factories import jsonl
from trainer.ports import free_port

FINISHED = ("succeeded", "failed", "cancelled")


def upload_pairs(client: Any, n: int = 200) -> dict[str, Any]:
    resp = client.post(
        "/v1/datasets", files={"file": ("pairs.jsonl", jsonl(addition_pairs(n)))}, data={"kind": "preference"}
    )
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


def submit_dpo(client: Any, dataset_id: str, steps: int, **hp: Any) -> dict[str, Any]:
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": dataset_id,
        "hyperparameters": {"learning_rate": 1e-3, "max_steps": steps, "batch_size": 8, **hp},
    }
    resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


def wait_for(client: Any, run_id: str, predicate: Any, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        run: dict[str, Any] = client.get(f"/v1/runs/{run_id}").json()
        if predicate(run):
            return run
        if time.monotonic() > deadline:
            events = client.get(f"/v1/runs/{run_id}/events").json()
            raise AssertionError(f"run {run_id} stuck: {run}\nevents: {events}")
        time.sleep(0.2)


def all_metrics(client: Any, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 500} | ({"after": after} if after else {})
        page = client.get(f"/v1/runs/{run_id}/metrics", params=params).json()
        out += page["data"]
        if not page["has_more"]:
            return out
        after = page["next_cursor"]


@contextmanager
def embedded_server(
    home: Path, env: dict[str, str] | None = None, *, inference: bool = False
) -> Iterator[httpx.Client]:
    """`rlrun serve` (API + one worker, and the inference process with ``inference``: the tests that call
    models ask for it, the others save its start-up) on the embedded defaults in ``home`` and a free port,
    with extra ``env`` settings; a client for it (its ``base_url`` is the server's). The server is stopped
    afterwards and must exit cleanly (its log tail is the failure message)."""
    extra = env or {}
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RLRUN_DATABASE_URL", "RLRUN_BROKER_URL")}
    env |= {"RLRUN_HOME": str(home), "RLRUN_PORT": str(port)} | extra
    log = (home / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlrun.cli", "serve", *([] if inference else ["--no-inference"])],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
            yield client
    except BaseException:  # a failing test shows what the server (and its worker) said meanwhile
        print(f"--- the end of {home / 'serve.log'} ---\n{(home / 'serve.log').read_text()[-6000:]}")
        raise
    finally:
        stop_process(proc, timeout=40)
        log.close()
    assert proc.returncode == 0, (home / "serve.log").read_text()[-3000:]


def processes_of(home: Path) -> Iterator[tuple[int, list[bytes], int]]:
    """(pid, argv, parent pid) of each process running with RLRUN_HOME ``home`` (Linux /proc)."""
    marker = f"RLRUN_HOME={home}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        yield int(entry.name), argv, parent


def serve_workers(home: Path) -> list[int]:
    """The pids of the `rlrun worker` processes running with RLRUN_HOME ``home``."""
    return [pid for pid, argv, _ in processes_of(home) if argv[1:4] == [b"-m", b"rlrun.cli", b"worker"]]


def create_key(home: Path, project: str) -> str:
    """`rlrun keys create` (it writes straight to the server's database), as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "rlrun.cli", "keys", "create", "--project", project],
        env={k: v for k, v in os.environ.items() if not k.startswith("RLRUN_")} | {"RLRUN_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    key = out.strip().splitlines()[-1]
    assert key.startswith("rlrun_"), out
    return key


@contextmanager
def pg_redis_worker(home: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A fresh PostgreSQL database (migrated), the machine's Redis on a private queue, one real
    `rlrun worker` process (extra ``env``) and the API in-process: yields a TestClient for the API. The
    worker's log tail is printed at the end."""
    import uuid

    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.migrate import upgrade_head
    from api.settings import Settings
    from tests.conftest import REDIS_URL, pg_test_database

    gen = pg_test_database()
    db_url = next(gen)
    upgrade_head(db_url)
    queue = f"test-{uuid.uuid4().hex[:8]}"
    settings = Settings(home=home, database_url=db_url, broker_url=REDIS_URL, queue=queue)
    worker_env = {
        **os.environ,
        "RLRUN_HOME": str(home),
        "RLRUN_DATABASE_URL": db_url,
        "RLRUN_BROKER_URL": REDIS_URL,
        "RLRUN_QUEUE": queue,
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    log = (home / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rlrun.cli", "worker"], env=worker_env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        with TestClient(create_app(settings)) as client:
            yield client
    finally:
        stop_process(worker)
        log.close()
        print(Path(log.name).read_text()[-3000:])
        next(gen, None)
