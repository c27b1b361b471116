"""``rlrun demo``: start the service on the embedded defaults, upload pairs, train DPO, print the numbers.

Talks to the service only over HTTP, exactly as a user would. A server command: it starts ``rlrun serve``
and imports ``api`` (to resume polling metrics after their last page), so only ``rlrun demo`` imports it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from api.pagination import encode_cursor
from rlrun.client import FINISHED
from trainer.ports import free_port

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


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (a warm shutdown), then SIGKILL if ``proc`` has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def addition_tasks(
    seed: int = 0, n_heldout: int = 200, n_sft: int = 4000, n_rl: int = 4000
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """2-digit addition (a, b in 0..99) written at fixed width ("07+35=" -> "042", so every digit sits at
    the same position): SFT pairs, RL prompts with answers, and held-out prompts that neither stage ever
    trains on."""
    rng = random.Random(seed)
    pool = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pool)
    held, rest = pool[:n_heldout], pool[n_heldout:]
    sft = [{"prompt": f"{a:02d}+{b:02d}=", "completion": f"{a + b:03d}"} for a, b in rest[:n_sft]]
    rl = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a, b in rest[-n_rl:]]
    heldout = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a, b in held]
    return sft, rl, heldout


def _upload(client: httpx.Client, rows: list[dict[str, Any]], kind: str, name: str) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    resp = client.post(
        "/v1/datasets", files={"file": (f"{name}.jsonl", data)}, data={"kind": kind, "name": name}
    )
    resp.raise_for_status()
    dataset_id: str = resp.json()["id"]
    return dataset_id


def dpo_part(client: httpx.Client, steps: int) -> bool:
    """Part 1: DPO on 200 addition preference pairs; prints the metrics as they arrive."""
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
    print(f"uploaded dataset {ds['id']}: {ds['row_count']} rows, stats {ds['stats']['source_formats']}")
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
    return bool(run["status"] == "succeeded")


RL_SPEC = {
    "learning_rate": 2e-4,
    "prompts_per_step": 16,
    "samples_per_prompt": 8,
    "max_new_tokens": 4,
    "max_prompt_length": 8,
    "max_length": 16,
    "temperature": 1.0,
    "kl_coef": 0.0,
    "dynamic_sampling": True,
    "eval_every": 25,
    "log_every": 5,
    "sample_every": 50,
    "seed": 0,
}


def rl_part(
    client: httpx.Client, sft_steps: int, rl_steps: int, evaluate: bool = True
) -> dict[str, Any]:
    """Part 2: a pipeline SFT -> GRPO on 2-digit addition with an exact-match verifier; prints held-out
    greedy exact-match accuracy from the SFT start to the end of RL, then (``evaluate``) asks both models a
    few problems and runs an eval of each (pass@1 and pass@4 of sampled answers). Returns the numbers."""
    sft_rows, rl_rows, heldout = addition_tasks()
    sft_ds = _upload(client, sft_rows, "sft", "addition-sft")
    rl_ds = _upload(client, rl_rows, "prompts", "addition-prompts")
    held_ds = _upload(client, heldout, "prompts", "addition-heldout")
    body = {
        "name": "demo-sft-grpo",
        "stages": [
            {
                "name": "sft",
                "spec": {
                    "algorithm": "sft",
                    "model": "tiny:llama-char-0.4m",
                    "dataset_id": sft_ds,
                    "hyperparameters": {
                        "learning_rate": 1e-3,
                        "max_steps": sft_steps,
                        "batch_size": 64,
                        "max_length": 16,
                        "log_every": 50,
                    },
                },
            },
            {
                "name": "grpo",
                "spec": {
                    "algorithm": "grpo",
                    "model": "stage:sft",
                    "dataset_id": rl_ds,
                    "validation_dataset_id": held_ds,
                    "rewards": [{"name": "exact_match"}],
                    "eval_rewards": [{"name": "exact_match"}],
                    "hyperparameters": {**RL_SPEC, "max_steps": rl_steps},
                },
            },
        ],
    }
    resp = client.post("/v1/pipelines", json=body)
    resp.raise_for_status()
    pipeline = resp.json()
    print(
        f"pipeline {pipeline['id']}: SFT ({sft_steps} steps) then GRPO ({rl_steps} steps), "
        f"held-out exact match on {len(heldout)} problems never trained on"
    )
    seen: set[int] = set()
    while True:
        pipeline = client.get(f"/v1/pipelines/{pipeline['id']}").json()
        grpo = pipeline["stages"][1]
        if grpo["run_id"]:
            evals = client.get(
                f"/v1/runs/{grpo['run_id']}/metrics",
                params={"key": ["eval/accuracy", "reward/mean"], "limit": 10_000},
            ).json()["data"]
            acc = {m["step"]: m["value"] for m in evals if m["key"] == "eval/accuracy"}
            reward = {m["step"]: m["value"] for m in evals if m["key"] == "reward/mean"}
            for step in sorted(set(acc) - seen):
                seen.add(step)
                r = f"  train reward {reward[step]:.3f}" if step in reward else ""
                print(f"  GRPO step {step:4d}  held-out exact match {acc[step]:.3f}{r}")
        if pipeline["status"] != "running":
            break
        time.sleep(1.0)
    result: dict[str, Any] = {"status": pipeline["status"], "reason": pipeline["reason"]}
    if grpo["run_id"] and acc:
        run = client.get(f"/v1/runs/{grpo['run_id']}").json()
        start, end = acc[min(acc)], acc[max(acc)]
        minutes = (
            (
                datetime.fromisoformat(run["finished_at"]) - datetime.fromisoformat(run["started_at"])
            ).total_seconds()
            / 60
            if run["finished_at"] and run["started_at"]
            else float("nan")
        )
        result |= {"start": start, "end": end, "points": 100 * (end - start), "rl_minutes": minutes}
        print(
            f"pipeline {pipeline['status']}: held-out exact match {start:.1%} after SFT -> {end:.1%} after "
            f"GRPO ({100 * (end - start):+.1f} points) in {minutes:.1f} min of RL"
        )
        if pipeline["status"] == "succeeded" and evaluate:
            both = [pipeline["stages"][0]["run_id"], grpo["run_id"]]
            ask(client, both, heldout[:4])
            result["pass_at_k"] = eval_part(client, held_ds, both)
    else:
        print(f"pipeline {pipeline['status']}: {pipeline['reason']}")
    return result


EVAL_SAMPLES = 4


def wait_finished(client: httpx.Client, run_id: str, timeout: float = 600) -> dict[str, Any]:
    """The run once it has ended; TimeoutError after ``timeout`` seconds (as ``watch``)."""
    deadline = time.monotonic() + timeout
    while (run := client.get(f"/v1/runs/{run_id}").json())["status"] not in FINISHED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {run['status']} after {timeout}s")
        time.sleep(0.5)
    return dict(run)


def eval_part(client: httpx.Client, dataset_id: str, run_ids: list[str]) -> dict[str, dict[str, float]]:
    """An eval run of each model on the held-out prompts: 4 answers each sampled at temperature 1, scored
    by exact match, pass@1 and pass@4 (Chen et al.'s estimator). Returns {"SFT"|"GRPO": {metric: value}}."""
    print(f"eval runs: {EVAL_SAMPLES} sampled answers (temperature 1) per held-out problem, exact match")
    out: dict[str, dict[str, float]] = {}
    for label, run_id in zip(("SFT", "GRPO"), run_ids, strict=True):
        spec = {
            "algorithm": "eval",
            "name": f"demo-eval-{label.lower()}",
            "model": f"run:{run_id}",
            "dataset_id": dataset_id,
            "rewards": [{"name": "exact_match"}],
            "hyperparameters": {
                "samples_per_prompt": EVAL_SAMPLES,
                "max_new_tokens": 4,
                "max_prompt_length": 8,
                "prompts_per_batch": 50,
            },
        }
        resp = client.post("/v1/runs", json=spec)
        resp.raise_for_status()
        run = wait_finished(client, resp.json()["id"])
        if run["status"] != "succeeded":
            print(f"  {label}: eval {run['status']}: {run['error']}")
            continue
        keys = [f"eval/pass@{k}" for k in (1, EVAL_SAMPLES)]
        values = client.get(f"/v1/runs/{run['id']}/metrics", params={"key": keys, "limit": 10_000}).json()
        last = {m["key"]: m["value"] for m in sorted(values["data"], key=lambda m: m["step"])}
        out[label] = last
        shown = "  ".join(f"{k.removeprefix('eval/')} {last[k]:.1%}" for k in keys if k in last)
        print(f"  {label:4s} {shown}   (run {run['id']})")
    return out


def ask(client: httpx.Client, run_ids: list[str], rows: list[dict[str, Any]]) -> None:
    """Call the SFT and the GRPO model on a few held-out problems through the OpenAI-compatible
    ``/v1/completions`` (the inference process `rlrun serve` started), greedy, side by side."""
    print("asking both models through /v1/completions (greedy):")
    for row in rows:
        answers = []
        for run_id in run_ids:
            resp = client.post(
                "/v1/completions",
                json={"model": f"run:{run_id}", "prompt": row["prompt"], "max_tokens": 6, "temperature": 0},
                timeout=120,
            )
            answers.append(
                resp.json()["choices"][0]["text"].strip() if resp.status_code == 200 else resp.text
            )
        print(f"  {row['prompt']:8s} answer {row['answer']:>4s}   SFT {answers[0]!r:8s}  GRPO {answers[1]!r}")


def real_settings() -> tuple[str, str]:
    """(engine, precision) for ``rlrun demo --real`` on this machine: vLLM where ``make engine`` built its
    environment, else transformers; bf16 where the CPU (or a GPU) computes it in hardware, else fp32. The
    demo starts the worker here, so what holds here holds there."""
    import torch

    from trainer.precision import cpu_bf16_is_fast
    from trainer.rollout.engine_process import EngineUnavailable, engine_python

    try:
        engine_python()
        engine = "vllm_server"
    except EngineUnavailable:
        engine = "hf"
    fast_bf16 = (torch.cuda.is_available() and torch.cuda.is_bf16_supported()) or cpu_bf16_is_fast()
    return engine, "bf16" if fast_bf16 else "fp32"


def run_demo(
    steps: int = 300,
    keep: bool = False,
    sft_steps: int = 350,
    rl_steps: int = 300,
    rl: bool = True,
    real_steps: int | None = None,
) -> int:
    """The tiny demo (DPO, then SFT -> GRPO unless ``rl`` is False), or with ``real_steps`` the real-model
    part alone (rlrun/demo_real.py)."""
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
        [sys.executable, "-m", "rlrun.cli", "serve"], env=env, stdout=log_file, stderr=subprocess.STDOUT
    )
    ok = False
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
            if real_steps is not None:
                from rlrun.demo_real import real_part

                engine, precision = real_settings()
                print("== a real model: SmolLM2-135M-Instruct, GRPO with LoRA on word problems, then chat")
                try:
                    result = real_part(client, real_steps, engine=engine, precision=precision)
                except (RuntimeError, TimeoutError) as exc:  # refused by the API, or a run out of time
                    print(f"rlrun demo --real: FAILED: {exc}")
                    return 1
                ok = result["status"] == "succeeded"
                print("rlrun demo --real: done" if ok else "rlrun demo --real: FAILED")
                return 0 if ok else 1
            print("== part 1: DPO on preference pairs")
            ok = dpo_part(client, steps)
            if ok and rl:
                print("== part 2: SFT then GRPO with a verifier (online RL)")
                ok = rl_part(client, sft_steps, rl_steps)["status"] == "succeeded"
            print("rlrun demo: done" if ok else "rlrun demo: FAILED")
            return 0 if ok else 1
    finally:
        stop_process(proc)
        log_file.close()
        if not ok:
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            print("rlrun demo failed; last lines of the service log:\n  " + "\n  ".join(tail))
            print(f"(kept {home})")
        elif not keep:
            shutil.rmtree(home, ignore_errors=True)
