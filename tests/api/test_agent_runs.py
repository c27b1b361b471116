"""Agent runs (issue 39 item 3) at the API: the `agent` spec is checked at submit, and
/v1/runs/{id}/agent proxies an agent's episode, chat and reward calls to the gateway of the worker that
holds the run (here a real gateway in this process), with clear answers where there is none."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy.orm import Session

from tests.api.test_multi_turn_specs import assert_refused
from tests.factories import api_client, make_dataset, make_run
from tests.rollout.test_agent_episodes import CHATML, Scripted, episodes_engine, play_in_background
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.agent_episodes import AgentBoard
from trainer.rollout.agent_gateway import AgentGateway


def agent_spec(dataset_id: Any, **over: Any) -> dict[str, Any]:
    return {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "agent": {"max_turns": 3},
        "hyperparameters": {"max_steps": 2, "max_new_tokens": 16, "max_prompt_length": 32},
    } | over


@pytest.fixture
def prompts(session: Session) -> Any:
    return make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")


def test_an_agent_run_needs_no_reward_and_keeps_its_agent(session: Session, prompts: Any) -> None:
    with api_client(session) as client:
        resp = client.post("/v1/runs", json=agent_spec(prompts.id))
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["agent"] == {"timeout_s": 300.0, "max_turns": 3, "max_episode_tokens": None}


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"agent": {"max_turns": 65}}, "agent.max_turns", "less than or equal to 64"),
        ({"agent": {"timeout_s": 0}}, "agent.timeout_s", "greater than 0"),
        (
            {
                "environment": {
                    "source": "def reset(row):\n    return 'x'\n\ndef step(m, row):\n    return {}\n"
                }
            },
            None,
            "agent with tools or an environment",
        ),
        ({"resources": {"devices": 2, "sharding": "ddp"}}, None, "agent with resources.devices > 1"),
        ({"agent": {"max_episode_tokens": 5000}}, None, "agent.max_episode_tokens"),
    ],
)
def test_bad_agent_specs_are_refused(
    session: Session, prompts: Any, over: dict[str, Any], field: str | None, words: str
) -> None:
    assert_refused(session, agent_spec(prompts.id, **over), field, words)


@pytest.fixture(scope="module")
def tokenizer(tiny_cache: Path) -> Any:
    tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[1]
    tok.chat_template = CHATML
    return tok


def test_the_api_proxies_an_openai_sdk_agent_to_the_runs_gateway(
    session: Session, prompts: Any, tokenizer: Any
) -> None:
    board = AgentBoard()
    gateway = AgentGateway(board, host="127.0.0.1")
    try:
        run = make_run(
            session, prompts, spec=agent_spec(prompts.id), status="running", agent_gateway=gateway.address
        )
        engine = episodes_engine(Scripted(tokenizer, ["scripted reply"]), tokenizer, board)
        thread, out = play_in_background(engine, [{"prompt": "hi", "answer": "x"}])
        with api_client(session) as client:
            got = client.get(f"/v1/runs/{run.id}/agent/episodes/next", params={"wait": 10})
            assert got.status_code == 200, got.text
            episode = got.json()
            here = f"http://testserver/v1/runs/{run.id}/agent/episodes/{episode['id']}"
            assert episode == {
                "id": episode["id"],
                "row": {"prompt": "hi", "answer": "x"},
                "evaluation": False,
                "base_url": f"{here}/v1",
                "reward_url": f"{here}/reward",
            }
            sdk = openai.OpenAI(base_url=episode["base_url"], api_key="unused", http_client=client)
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
            assert refused.value.param == "n"  # type: ignore[attr-defined]
            reply = sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "scripted reply"
            assert reply.choices[0].finish_reason == "stop"
            bad = client.post(episode["reward_url"], json={"reward": "high"})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "reward"
            ok = client.post(episode["reward_url"], json={"reward": 0.25})
            assert ok.status_code == 200 and ok.json() == {"id": episode["id"], "reward": 0.25}
            thread.join(10)
            assert out[0].episode is not None and out[0].episode.env_return == 0.25
            late = client.post(episode["reward_url"], json={"reward": 1})
            assert late.status_code == 409 and "is closed" in late.json()["error"]["message"]
            idle = client.get(f"/v1/runs/{run.id}/agent/episodes/next", params={"wait": 0})
            assert idle.status_code == 204
    finally:
        gateway.close()
    with api_client(session) as client:  # the worker is gone but the run still says running
        gone = client.get(f"/v1/runs/{run.id}/agent/episodes/next", params={"wait": 0})
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "agent_gateway_unreachable"


@pytest.mark.parametrize(
    ("status", "spec", "code", "answer"),
    [
        ("queued", "agent", 409, "agent_not_ready"),
        ("paused", "agent", 409, "agent_not_ready"),
        ("succeeded", "agent", 410, "run_over"),
        ("running", "dpo", 400, "not_an_agent_run"),
    ],
)
def test_runs_without_an_open_gateway_answer_clearly(
    session: Session, prompts: Any, status: str, spec: str, code: int, answer: str
) -> None:
    over: dict[str, Any] = {"status": status}
    if spec == "agent":
        over["spec"] = agent_spec(prompts.id)
    run = make_run(session, prompts, **over)
    with api_client(session) as client:
        resp = client.get(f"/v1/runs/{run.id}/agent/episodes/next", params={"wait": 0})
        unknown = client.get(f"/v1/runs/{uuid.uuid4()}/agent/episodes/next")
    assert resp.status_code == code and resp.json()["error"]["code"] == answer, resp.text
    assert unknown.status_code == 404
