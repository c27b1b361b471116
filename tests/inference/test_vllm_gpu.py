"""The vLLM inference backend on a GPU (skipped where vLLM or CUDA is missing; scripts/gpu_vllm_inference.sh
runs it): the same OpenAI answers as the HF backend, and concurrent streams all served.

The HF backend is the reference: both load the same tiny Llama folder in float32, so the first answer
token's log-probability under the model is the same number whichever backend computes it."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from api.settings import Settings
from trainer.inference.server import MODEL_SOURCE_HEADER, create_app

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
        reason="needs vLLM and CUDA",
    ),
]

TINY = {MODEL_SOURCE_HEADER: "tiny:llama-10m"}
PROMPTS = ["12+30=", "What is 7 times 6?", "Name a colour."]


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory, tiny_cache: Path) -> Iterator[dict[str, TestClient]]:
    home = tmp_path_factory.mktemp("vllm-home")
    settings = {
        name: Settings(home=home, cache_dir=tiny_cache, inference_backend=name, inference_max_models=1)
        for name in ("hf", "vllm")
    }
    with TestClient(create_app(settings["hf"])) as hf, TestClient(create_app(settings["vllm"])) as vllm:
        yield {"hf": hf, "vllm": vllm}


def first_token(client: TestClient, prompt: str) -> tuple[str, float]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
    }
    answer = client.post("/v1/chat/completions", json=body, headers=TINY)
    assert answer.status_code == 200, answer.text
    token = answer.json()["choices"][0]["logprobs"]["content"][0]
    return token["token"], token["logprob"]


def test_vllm_answers_as_the_hf_backend(backends: dict[str, TestClient]) -> None:
    assert backends["vllm"].get("/healthz").json()["backend"] == "vllm"
    for prompt in PROMPTS:
        hf_token, hf_logprob = first_token(backends["hf"], prompt)
        vllm_token, vllm_logprob = first_token(backends["vllm"], prompt)
        assert vllm_token == hf_token, prompt
        assert vllm_logprob == pytest.approx(hf_logprob, abs=2e-3), prompt


def test_vllm_serves_32_concurrent_streams(backends: dict[str, TestClient]) -> None:
    usages: list[dict[str, Any]] = []

    def ask(i: int) -> None:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"{i}+{i}="}],
            "max_tokens": 32,
            "seed": i,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with backends["vllm"].stream("POST", "/v1/chat/completions", json=body, headers=TINY) as answer:
            chunks = [json.loads(x[6:]) for x in answer.iter_lines() if x.startswith("data: {")]
        ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        finishes = {choice["index"] for choice in ends}
        assert finishes == {0, 1}
        usages.append(chunks[-1]["usage"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(usages) == 32
    assert all(0 < u["completion_tokens"] <= 64 for u in usages)
