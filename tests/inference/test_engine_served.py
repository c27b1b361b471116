"""The inference process's engine backend (trainer/inference/engine_served.py): OpenAI's routes answered by
a real vLLM engine process from the engine environment, started once for this module, against the HF
backend on the same weights (greedy answers and log-probs equal, an adapter served as a LoRA equal to the
HF backend's adapter, streaming equal to the whole answer, concurrent requests each equal to their answer
alone, the context limit named); then the engine's stream read on a recorded chunk, without an engine."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.settings import Settings
from tests.conftest import IN_CI
from tests.inference.test_loaded import make_adapter
from trainer.inference.decode import DecodeParams
from trainer.inference.engine_served import (
    EngineModels,
    completion_body,
    deltas_from_chunk,
    dtype_of,
    max_context_of,
)
from trainer.inference.loaded import LoadError
from trainer.inference.server import MODEL_SOURCE_HEADER, create_app
from trainer.models import tiny_model_dir
from trainer.rollout.engine_process import EngineOptions, EngineUnavailable, engine_python

TINY = "tiny:llama-0.4m"
MAX_CONTEXT = 96
LOGPROB_TOLERANCE = 1e-3  # fp32 on both sides (as tests/rollout/test_served_engine.py)


def engine_or_skip() -> None:
    try:
        engine_python()
    except EngineUnavailable as exc:
        if IN_CI:
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-inference-home")


@pytest.fixture(scope="module")
def adapter(home: Path, tiny_cache: Path) -> str:
    folder = home / "artifacts" / "adapter-run"
    folder.mkdir(parents=True)
    return make_adapter(tiny_model_dir("llama-0.4m", tiny_cache), folder, seed=3)


@pytest.fixture(scope="module")
def hf(home: Path, tiny_cache: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(home=home, cache_dir=tiny_cache))) as client:
        yield client


@pytest.fixture(scope="module")
def engine(home: Path, tiny_cache: Path) -> Iterator[TestClient]:
    engine_or_skip()
    settings = Settings(
        home=home, cache_dir=tiny_cache, inference_backend="vllm_server", inference_max_context=MAX_CONTEXT
    )
    with TestClient(create_app(settings)) as client:
        yield client
        processes = [e.process.proc for e in client.app.state.backend.engines.values()]  # type: ignore[attr-defined]
    assert processes and all(p is not None and p.poll() is not None for p in processes)  # stopped at shutdown


def complete(client: TestClient, source: str, **over: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": "12+30=", "max_tokens": 8, "temperature": 0} | over
    answer = client.post("/v1/completions", json=body, headers={MODEL_SOURCE_HEADER: source})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def chat(client: TestClient, source: str, **over: Any) -> dict[str, Any]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "7+8="}],
        "max_tokens": 8,
        "temperature": 0,
    }
    answer = client.post("/v1/chat/completions", json=body | over, headers={MODEL_SOURCE_HEADER: source})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def text(choice: dict[str, Any]) -> str:
    """A choice's text without a trailing replacement character: a random model's bytes can end mid-way
    through a UTF-8 character, which HF's decode shows as U+FFFD and vLLM's detokenizer holds back."""
    return str(choice["text"]).rstrip("\ufffd")


def assert_same_greedy(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert [text(c) for c in got["choices"]] == [text(c) for c in expected["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in expected["choices"]]
    assert got["usage"] == expected["usage"]
    for mine, theirs in zip(got["choices"], expected["choices"], strict=True):
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert mine["logprobs"]["token_logprobs"] == pytest.approx(
            theirs["logprobs"]["token_logprobs"], abs=LOGPROB_TOLERANCE
        )
        for row, other in zip(
            mine["logprobs"]["top_logprobs"], theirs["logprobs"]["top_logprobs"], strict=True
        ):
            assert list(row) == list(other)  # the same 2 most likely tokens, most likely first
            assert list(row.values()) == pytest.approx(list(other.values()), abs=LOGPROB_TOLERANCE)


def test_greedy_answers_and_log_probs_equal_the_hf_backends(engine: TestClient, hf: TestClient) -> None:
    for over in ({}, {"prompt": ["1+1=", "40+2=", "9"], "n": 2}):  # greedy n > 1: identical choices
        got = complete(engine, TINY, logprobs=2, **over)
        assert_same_greedy(got, complete(hf, TINY, logprobs=2, **over))
    assert len(got["choices"]) == 6 and got["choices"][0]["text"] == got["choices"][1]["text"]
    chatted = chat(engine, TINY)
    theirs = chat(hf, TINY)["choices"][0]["message"]
    assert chatted["choices"][0]["message"]["content"].rstrip("\ufffd") == theirs["content"].rstrip("\ufffd")


def test_an_adapter_is_served_as_a_lora_on_its_base(engine: TestClient, hf: TestClient, adapter: str) -> None:
    got = complete(engine, adapter, logprobs=2)
    assert_same_greedy(got, complete(hf, adapter, logprobs=2))
    assert text(got["choices"][0]) != text(complete(engine, TINY)["choices"][0])  # not the base's answer
    loaded = engine.get("/healthz").json()
    assert loaded["backend"] == "vllm_server"
    assert [entry["adapters"] for entry in loaded["loaded"]] == [[adapter]]  # one engine, the base's


def test_streamed_chunks_add_up_to_the_whole_answer(engine: TestClient) -> None:
    body = {"model": "m", "prompt": "3+4=", "max_tokens": 40, "temperature": 0, "stream": True}
    with engine.stream("POST", "/v1/completions", json=body, headers={MODEL_SOURCE_HEADER: TINY}) as answer:
        assert answer.status_code == 200
        lines = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) > 2  # streamed token by token, not in one piece
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == complete(engine, TINY, prompt="3+4=", max_tokens=40)["choices"][0]["text"]


def test_concurrent_requests_each_get_their_own_answer(engine: TestClient) -> None:
    prompts = [f"{a}+{a * 3}=" for a in range(8)]
    alone = {p: complete(engine, TINY, prompt=p)["choices"][0]["text"] for p in prompts}
    together: dict[str, str] = {}

    def ask(prompt: str) -> None:
        together[prompt] = complete(engine, TINY, prompt=prompt)["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_a_request_over_the_engines_context_gets_a_400_naming_the_limit(engine: TestClient) -> None:
    answer = engine.post(
        "/v1/completions",
        json={"model": "m", "prompt": "1+2=", "max_tokens": MAX_CONTEXT},
        headers={MODEL_SOURCE_HEADER: TINY},
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (
        error["code"] == "context_length_exceeded"
        and f"maximum context length is {MAX_CONTEXT}" in error["message"]
    )


def test_sampled_answers_come_back_for_every_choice(engine: TestClient) -> None:
    got = complete(engine, TINY, temperature=1.0, n=4, max_tokens=6, seed=5)  # the seed is not passed on
    assert len(got["choices"]) == 4 and all(c["finish_reason"] in ("stop", "length") for c in got["choices"])
    assert len({c["text"] for c in got["choices"]}) > 1


# ---------- without an engine ----------


def test_without_the_engine_environment_the_backend_names_the_setting_and_the_install(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=r"RLRUN_ENGINE_PYTHON.*make engine"):
        EngineModels(1, python=str(tmp_path / "no-python"))


# A chunk vLLM 0.32 streamed for /v1/completions with logprobs 2, return_token_ids and
# return_tokens_as_token_ids: its top entries hold the 2 most likely tokens and the sampled one.
CHUNK = {
    "choices": [
        {
            "index": 1,
            "text": " 12",
            "logprobs": {
                "text_offset": [0],
                "token_logprobs": [-5.82],
                "tokens": ["token_id:343"],
                "top_logprobs": [{"token_id:343": -5.82, "token_id:267": -4.86, "token_id:452": -5.08}],
            },
            "finish_reason": None,
            "token_ids": [343],
        }
    ]
}


def test_a_streamed_chunk_becomes_the_backends_delta() -> None:
    (delta,) = deltas_from_chunk(CHUNK, top_logprobs=2, eos_id=2)
    assert (delta.index, delta.text, delta.token_ids, delta.logprobs) == (1, " 12", [343], [-5.82])
    assert delta.top_logprobs == [[(267, -4.86), (452, -5.08)]]  # ranked, the sampled one outside the top 2
    assert delta.finish_reason is None


def test_an_eos_at_the_end_is_dropped_as_the_hf_backend_drops_it() -> None:
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {"token_logprobs": [-0.1], "top_logprobs": [{"token_id:2": -0.1}]},
        "finish_reason": "stop",
        "token_ids": [2],
    }
    (delta,) = deltas_from_chunk({"choices": [choice]}, top_logprobs=0, eos_id=2)
    assert (delta.token_ids, delta.logprobs, delta.finish_reason) == ([], [], "stop")


def test_the_engine_request_asks_one_sample_when_greedy() -> None:
    greedy = completion_body([5, 6], 3, DecodeParams(temperature=0, top_p=0.5, max_new_tokens=4), "policy")
    assert (greedy["n"], greedy["top_p"], greedy["stream"], greedy["prompt"]) == (1, 1.0, True, [5, 6])
    sampled = completion_body([5], 3, DecodeParams(temperature=0.7, top_p=0.9, seed=3), "adapter1")
    assert (sampled["n"], sampled["temperature"], sampled["top_p"], sampled["model"]) == (
        3,
        0.7,
        0.9,
        "adapter1",
    )
    assert "seed" not in sampled  # a per-request seed crashes vLLM's CPU sampler


def test_the_context_and_dtype_are_the_models_own(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 2048, "torch_dtype": "float32"})
    )
    assert (max_context_of(str(tmp_path), 4096), max_context_of(str(tmp_path), 1024)) == (2048, 1024)
    assert max_context_of(str(tmp_path / "missing"), 512) == 512
    assert (dtype_of(str(tmp_path)), dtype_of(str(tmp_path / "missing"))) == ("float32", "auto")


def test_an_engine_that_serves_adapters_is_started_for_them(tmp_path: Path) -> None:
    options = EngineOptions(model_dir=tmp_path, logprobs_mode="raw_logprobs", max_lora_rank=16, max_loras=2)
    command = options.command(Path("python"), 1234)
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs" and "--enable-lora" in command
    assert (
        command[command.index("--max-lora-rank") + 1] == "16"
        and command[command.index("--max-loras") + 1] == "2"
    )
    assert options.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = EngineOptions(model_dir=tmp_path)
    assert "--enable-lora" not in plain.command(Path("python"), 1)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.environment()
