"""A run's tools and environment are checked at submit (issue 39 items 1 and 2): bad Python names its
line, a tool its source does not define, an environment without `reset(row)` and `step(messages, row)`, a
name that is not an identifier, an episode that cannot fit `max_length`, tools and an environment
together; nothing is stored for a refused run, and an accepted run keeps them in its resolved spec."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Run
from tests.factories import api_client, make_dataset
from trainer.graders.sandbox import isolation_problem

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))

SOURCE = "def add(a, b):\n    return a + b\n"
ADD = {"type": "function", "function": {"name": "add", "description": "a + b"}}


def spec(dataset_id: Any, algorithm: str = "grpo", hp: dict[str, Any] | None = None, **tools: Any) -> dict:
    return {
        "algorithm": algorithm,
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "rewards": [{"name": "exact_match"}],
        "tools": {"source": SOURCE, "definitions": [ADD], **tools},
        "hyperparameters": {"max_steps": 2, "max_new_tokens": 16, "max_prompt_length": 32, **(hp or {})},
    }


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Run)) or 0)


@pytest.mark.parametrize(
    ("tools", "hp", "field", "words"),
    [
        ({"source": "def add(a, b):\n    return a +\n"}, {}, "tools.source", "not valid Python"),
        (
            {"source": "def sub(a, b):\n    return a - b\n"},
            {},
            "tools.source",
            "defines no top-level function 'add'",
        ),
        (
            {"definitions": [{"type": "function", "function": {"name": "add me"}}]},
            {},
            "tools.definitions.0.function.name",
            "not a Python identifier",
        ),
        ({"definitions": [ADD, ADD]}, {}, "tools.definitions", "each tool needs its own name"),
        ({"max_turns": 1}, {}, "tools.max_turns", "greater than or equal to 2"),
        ({"source": SOURCE + "# \x00\n"}, {}, "tools.source", "contains a NUL character"),
        (
            {"definitions": [{"type": "function", "function": {"name": "add", "description": "a\x00"}}]},
            {},
            "tools.definitions.0.function.description",
            "contains a NUL character",
        ),
        (
            {"definitions": [{"type": "function", "function": {"name": "add", "parameters": {"k": "\x00"}}}]},
            {},
            "tools.definitions.0.function.parameters",
            "contains a NUL character",
        ),
        ({"max_turns": 8}, {"max_new_tokens": 64}, None, "must not exceed hyperparameters.max_length (256)"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(
    session: Session, tools: dict[str, Any], hp: dict[str, Any], field: str | None, words: str
) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    assert_refused(session, spec(prompts.id, hp=hp, **tools), field, words)


def assert_refused(session: Session, body: dict[str, Any], field: str | None, words: str) -> None:
    """POST /v1/runs answers 422 with ``words`` in the message and ``field`` named; nothing is stored."""
    before = count(session)
    with api_client(session) as client:
        resp = client.post("/v1/runs", json=body)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert words in error["message"], error
    if field is not None:
        assert error["field"] == field, error
    assert count(session) == before


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "remax", "ppo"])
def test_tools_are_kept_in_the_resolved_spec(session: Session, algorithm: str) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    with api_client(session) as client:
        resp = client.post("/v1/runs", json=spec(prompts.id, algorithm, max_turns=3))
    assert resp.status_code == 201, resp.text
    tools = resp.json()["spec"]["tools"]
    assert tools["source"] == SOURCE and tools["max_turns"] == 3 and tools["max_episode_tokens"] is None
    assert tools["definitions"][0]["function"]["parameters"] == {"type": "object", "properties": {}}


ENV = (
    "def reset(row):\n    return row['prompt']\n\n"
    "def step(messages, row):\n    return {'reward': 1.0, 'done': True}\n"
)


def env_spec(dataset_id: Any, algorithm: str = "grpo", **over: Any) -> dict[str, Any]:
    out = spec(dataset_id, algorithm)
    del out["tools"]
    return {**out, "environment": {"source": ENV}, **over}


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"environment": {"source": "def reset(row):\n    return 1\n"}}, "environment.source", "`step`"),
        (
            {"environment": {"source": ENV.replace("step(messages, row)", "step(messages)")}},
            "environment.source",
            "`step` (line 4) must take (messages, row)",
        ),
        ({"environment": {"source": "def reset(row:\n"}}, "environment.source", "not valid Python"),
        ({"tools": {"source": SOURCE, "definitions": [ADD]}}, None, "tools and environment: give one"),
        ({"environment": {"source": ENV, "max_turns": 0}}, "environment.max_turns", "greater than or equal"),
    ],
)
def test_bad_environments_are_refused_naming_the_field(
    session: Session, over: dict[str, Any], field: str | None, words: str
) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    assert_refused(session, env_spec(prompts.id, **over), field, words)


def test_an_environment_run_needs_no_other_reward_and_others_need_one(session: Session) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    with api_client(session) as client:
        env_only = client.post("/v1/runs", json=env_spec(prompts.id, "ppo", rewards=[]))
        no_reward = client.post("/v1/runs", json={**spec(prompts.id), "tools": None, "rewards": []})
    assert env_only.status_code == 201, env_only.text
    assert env_only.json()["spec"]["environment"]["source"] == ENV
    assert (
        no_reward.status_code == 422
        and "at least one reward component" in no_reward.json()["error"]["message"]
    )


def test_episodes_on_sharded_ranks_are_refused_and_on_ddp_ranks_accepted(session: Session) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    body = spec(prompts.id, hp={"prompts_per_step": 2})
    with api_client(session) as client:
        fsdp = client.post("/v1/runs", json={**body, "resources": {"devices": 2, "sharding": "fsdp"}})
        ddp = client.post("/v1/runs", json={**body, "resources": {"devices": 2, "sharding": "ddp"}})
    assert (
        fsdp.status_code == 422 and "sharding 'fsdp' is not supported yet" in fsdp.json()["error"]["message"]
    )
    assert ddp.status_code == 201, ddp.text
