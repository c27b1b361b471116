"""``rlrun demo``: start the service on the embedded defaults, upload pairs, train DPO, print the numbers.

Talks to the service only over HTTP, exactly as a user would.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from api.pagination import encode_cursor

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "preference_addition.jsonl"
SHOWN = ("loss", "rewards/accuracy", "rewards/margin", "perf/tokens_per_s")


def addition_pairs(n: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """Preference pairs ``a+b=`` -> the right sum (chosen) vs a near miss (rejected)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(client: httpx.Client, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rlrun serve exited with {proc.returncode}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("rlrun serve did not answer /healthz in time")


def watch(client: httpx.Client, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """Poll the run, print metrics every 25 steps as they arrive, return the finished run."""
    after: str | None = None
    deadline = time.monotonic() + timeout
    while True:
        run = client.get(f"/v1/runs/{run_id}").json()  # read status first: then the metrics are complete
        params: dict[str, Any] = {"key": list(SHOWN), "limit": 1000}
        if after:
            params["after"] = after
        page = client.get(f"/v1/runs/{run_id}/metrics", params=params).json()
        by_step: dict[int, dict[str, float]] = {}
        for m in page["data"]:
            by_step.setdefault(m["step"], {})[m["key"]] = m["value"]
        for step in sorted(s for s in by_step if s % 25 == 0):
            print(
                f"  step {step:4d}  "
                + "  ".join(f"{k}={by_step[step].get(k, float('nan')):.3f}" for k in SHOWN)
            )
        if page["data"]:
            last = page["data"][-1]
            after = page["next_cursor"] or encode_cursor(last["step"], last["key"])
        if page["has_more"]:
            continue
        if run["status"] in ("succeeded", "failed", "cancelled"):
            return dict(run)
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {run['status']} after {timeout}s")
        time.sleep(0.5)


def run_demo(steps: int = 300, keep: bool = False) -> int:
    home = Path(tempfile.mkdtemp(prefix="rlrun-demo-"))
    port = int(os.environ.get("RLRUN_PORT") or free_port())
    env = {**os.environ, "RLRUN_HOME": str(home), "RLRUN_PORT": str(port)}
    env.pop("RLRUN_DATABASE_URL", None)  # the demo is the embedded defaults: SQLite + SQL broker
    env.pop("RLRUN_BROKER_URL", None)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_path = home / "serve.log"
    print(f"rlrun demo: starting API + worker on http://127.0.0.1:{port} (data and logs in {home})")
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve"], env=env, stdout=log_file, stderr=subprocess.STDOUT
    )
    ok = False
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
            data = (
                EXAMPLE.read_bytes()
                if EXAMPLE.exists()
                else "\n".join(json.dumps(r) for r in addition_pairs()).encode()
            )
            resp = client.post(
                "/v1/datasets",
                files={"file": ("addition.jsonl", data)},
                data={"kind": "preference", "name": "addition pairs"},
            )
            resp.raise_for_status()
            ds = resp.json()
            print(
                f"uploaded dataset {ds['id']}: {ds['row_count']} rows, stats {ds['stats']['source_formats']}"
            )
            spec = {
                "algorithm": "dpo",
                "name": "demo",
                "model": "tiny:llama-0.4m",
                "dataset_id": ds["id"],
                "hyperparameters": {"learning_rate": 1e-3, "max_steps": steps, "batch_size": 8, "beta": 0.1},
            }
            resp = client.post("/v1/runs", json=spec)
            resp.raise_for_status()
            run = resp.json()
            print(f"submitted DPO run {run['id']} ({steps} steps on tiny:llama-0.4m); status {run['status']}")
            run = watch(client, run["id"])
            finals = client.get(f"/v1/runs/{run['id']}/metrics", params={"min_step": steps}).json()["data"]
            print(f"run {run['id']} {run['status']}" + (f": {run['error']}" if run["error"] else ""))
            for m in finals:
                if m["key"].startswith("final/"):
                    print(f"  {m['key']:28s} {m['value']:.4f}")
            if run["output_path"]:
                print(f"  model saved to {run['output_path']}")
            ok = run["status"] == "succeeded"
            return 0 if ok else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
        if not ok:
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            print("rlrun demo failed; last lines of the service log:\n  " + "\n  ".join(tail))
            print(f"(kept {home})")
        elif not keep:
            shutil.rmtree(home, ignore_errors=True)
