"""The inference process's HTTP surface (trainer/inference/server.py), in-process: OpenAI's answer and
chunk shapes, streaming equal to the whole answer, and every refusal naming its parameter."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.settings import Settings
from trainer.inference.server import MODEL_SOURCE_HEADER, create_app
from trainer.models import tiny_model_dir

TINY = {MODEL_SOURCE_HEADER: "tiny:llama-0.4m"}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inference-home")


@pytest.fixture(scope="module")
def client(home: Path, tiny_cache: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(home=home, cache_dir=tiny_cache))) as c:
        yield c


def chat(**over: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "12+30="}], "max_tokens": 6} | over


def events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body, headers=TINY) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_answers_n_choices_in_openais_shape(client: TestClient) -> None:
    answer = client.post(
        "/v1/chat/completions", json=chat(n=3, seed=4, logprobs=True, top_logprobs=2), headers=TINY
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "m"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        tokens = choice["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in tokens)
        # The best of the top 2 is at least as likely as the chosen token.
        assert all(t["top_logprobs"][0]["logprob"] >= t["logprob"] - 1e-6 for t in tokens)
    usage = body["usage"]
    assert (
        usage["completion_tokens"] >= 3
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )


def test_streamed_chunks_add_up_to_the_whole_answer(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json=chat(n=2, seed=9), headers=TINY).json()
    chunks = events(
        client, "/v1/chat/completions", chat(n=2, seed=9, stream=True, stream_options={"include_usage": True})
    )
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert (
            "".join(m["delta"].get("content", "") for m in mine) == whole["choices"][i]["message"]["content"]
        )
        assert mine[-1]["finish_reason"] == whole["choices"][i]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completions_take_a_list_of_prompts_prompt_major(client: TestClient) -> None:
    body = {
        "model": "m",
        "prompt": ["1+1=", "2+2="],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 1,
    }
    answer = client.post("/v1/completions", json=body, headers=TINY).json()
    assert answer["object"] == "text_completion" and [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: each prompt's two choices agree
    alone = client.post("/v1/completions", json=body | {"prompt": "2+2=", "n": 1}, headers=TINY).json()
    assert alone["choices"][0]["text"] == texts[2]
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"])
    streamed = events(client, "/v1/completions", body | {"stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"][0]["index"] == 3) == texts[3]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
        (chat(presence_penalty=0.5), "presence_penalty", "not supported"),
        (chat(n=17), "n", "less than or equal to 16"),
        (chat(temperature=2.5), "temperature", "less than or equal to 2"),
        (chat(top_logprobs=2), "top_logprobs", "needs logprobs"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(max_tokens=5000), "max_tokens", "less than or equal to 4096"),
        (chat(messages=[]), "messages", "at least 1"),
        (chat(max_tokens=4090), "messages", "maximum context length is 2048"),
    ],
)
def test_bad_requests_are_refused_naming_the_parameter(
    client: TestClient, body: dict[str, Any], param: str, fragment: str
) -> None:
    answer = client.post("/v1/chat/completions", json=body, headers=TINY)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (
        error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"
    )


def test_only_folders_where_models_live_are_loaded(client: TestClient, home: Path, tiny_cache: Path) -> None:
    missing = client.post("/v1/chat/completions", json=chat())
    assert missing.status_code == 400 and MODEL_SOURCE_HEADER in missing.json()["error"]["message"]
    outside = client.post("/v1/chat/completions", json=chat(), headers={MODEL_SOURCE_HEADER: "/etc"})
    assert outside.status_code == 403
    unknown = client.post("/v1/chat/completions", json=chat(), headers={MODEL_SOURCE_HEADER: "tiny:nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    scorer = home / "artifacts" / "rm"
    shutil.copytree(tiny_model_dir("llama-0.4m", tiny_cache), scorer)
    config = json.loads((scorer / "config.json").read_text())
    (scorer / "config.json").write_text(
        json.dumps(config | {"architectures": ["LlamaForSequenceClassification"]})
    )
    refused = client.post("/v1/chat/completions", json=chat(), headers={MODEL_SOURCE_HEADER: str(scorer)})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_generative"
    assert client.post("/v1/chat/completions", content=b"{", headers=TINY).status_code == 400
