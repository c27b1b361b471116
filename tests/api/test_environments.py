"""/v1/environments (issue 39 item 2): environment code stored once, checked at upload with the line named,
listed per project, named by id in a run spec (the run stores its source at submit, so deleting it
changes no run), another project's id answered as an unknown one; on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Environment, Pipeline, Run
from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import api_client, make_dataset
from trainer.graders.sandbox import isolation_problem

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))

SOURCE = (
    "def reset(row):\n    return row['prompt']\n\n"
    "def step(messages, row):\n    return {'reward': 1.0, 'done': True}\n"
)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def client(session: Session, tmp_path: Path) -> Iterator[TestClient]:
    with api_client(session, settings=Settings(home=tmp_path, auth=True)) as c:
        yield c


def keys(session: Session) -> tuple[dict[str, str], dict[str, str], uuid.UUID, uuid.UUID]:
    """Headers of two projects' keys, and the projects."""
    key_a, row_a = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, row_b = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    return bearer(key_a), bearer(key_b), row_a.project_id, row_b.project_id


def grpo(dataset_id: Any, environment: dict[str, Any]) -> dict[str, Any]:
    return {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "environment": environment,
        "hyperparameters": {"max_steps": 2, "max_new_tokens": 16, "max_prompt_length": 32},
    }


def count(session: Session, table: Any) -> int:
    return int(session.scalar(select(func.count()).select_from(table)) or 0)


def test_store_read_list_and_delete(client: TestClient, session: Session) -> None:
    a, b, _, _ = keys(session)
    made = [
        client.post("/v1/environments", json={"name": f"env {i}", "source": SOURCE}, headers=a)
        for i in range(3)
    ]
    assert [r.status_code for r in made] == [201] * 3, made[0].text
    first = made[0].json()
    assert first["name"] == "env 0" and first["source"] == SOURCE and uuid.UUID(first["id"])
    assert client.get(f"/v1/environments/{first['id']}", headers=a).json() == first

    page = client.get("/v1/environments", params={"limit": 2}, headers=a).json()
    assert [e["name"] for e in page["data"]] == ["env 2", "env 1"] and page["has_more"]
    rest = client.get("/v1/environments", params={"limit": 2, "after": page["next_cursor"]}, headers=a).json()
    assert [e["name"] for e in rest["data"]] == ["env 0"] and not rest["has_more"]

    # another project sees none of them, and its answers are those of an unknown id
    assert client.get("/v1/environments", headers=b).json()["data"] == []
    theirs = client.get(f"/v1/environments/{first['id']}", headers=b)
    unknown = client.get(f"/v1/environments/{uuid.uuid4()}", headers=b)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["code"] == "environment_not_found"
    assert client.delete(f"/v1/environments/{first['id']}", headers=b).status_code == 404

    assert client.delete(f"/v1/environments/{first['id']}", headers=a).status_code == 204
    assert client.get(f"/v1/environments/{first['id']}", headers=a).status_code == 404


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"name": "x", "source": "def reset(row):\n    return [\n"}, "source", "line 2"),
        ({"name": "x", "source": "def reset(row):\n    return 'hi'\n"}, "source", "`step`"),
        ({"name": "x", "source": SOURCE + "# \x00"}, "source", "NUL"),
        ({"name": "", "source": SOURCE}, "name", "at least 1"),
        ({"name": "x"}, "source", "required"),
    ],
)
def test_bad_environments_are_refused_at_upload(
    client: TestClient, session: Session, body: dict[str, Any], field: str, words: str
) -> None:
    a, _, _, _ = keys(session)
    before = count(session, Environment)
    resp = client.post("/v1/environments", json=body, headers=a)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and words in error["message"], error
    assert count(session, Environment) == before


def test_a_run_names_an_environment_by_id_and_keeps_its_source(client: TestClient, session: Session) -> None:
    a, _, project_a, _ = keys(session)
    env = client.post("/v1/environments", json={"name": "e", "source": SOURCE}, headers=a).json()
    prompts = make_dataset(
        session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts", project_id=project_a
    )
    spec = grpo(prompts.id, {"id": env["id"], "max_turns": 2})
    run = client.post("/v1/runs", json=spec, headers=a | {"Idempotency-Key": "env-1"})
    assert run.status_code == 201, run.text
    stored = run.json()["spec"]["environment"]
    assert stored == {"id": env["id"], "source": SOURCE, "max_turns": 2, "max_episode_tokens": None}
    # the same request again with its key is the same run (the filled-in source is no difference)
    again = client.post("/v1/runs", json=spec, headers=a | {"Idempotency-Key": "env-1"})
    assert again.status_code in (200, 201) and again.json()["id"] == run.json()["id"]
    # deleting the environment changes no run, and the run's stored spec still submits (a clone)
    assert client.delete(f"/v1/environments/{env['id']}", headers=a).status_code == 204
    assert client.get(f"/v1/runs/{run.json()['id']}", headers=a).json()["spec"]["environment"] == stored
    clone = client.post("/v1/runs", json={**spec, "environment": stored}, headers=a)
    assert clone.status_code == 201 and clone.json()["spec"]["environment"] == stored, clone.text
    gone = client.post("/v1/runs", json=spec, headers=a)  # by id alone, nothing to run
    assert gone.status_code == 404 and gone.json()["error"]["field"] == "environment.id"


def test_another_projects_environment_is_an_unknown_one(client: TestClient, session: Session) -> None:
    a, b, _, project_b = keys(session)
    env = client.post("/v1/environments", json={"name": "e", "source": SOURCE}, headers=a).json()
    prompts = make_dataset(
        session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts", project_id=project_b
    )
    before = count(session, Run)
    answers = []
    for env_id in (env["id"], str(uuid.uuid4())):
        resp = client.post("/v1/runs", json=grpo(prompts.id, {"id": env_id}), headers=b)
        body = resp.json()["error"]
        answers.append(
            (resp.status_code, body["code"], body["field"], body["message"].replace(env_id, "<id>"))
        )
        stage = client.post(
            "/v1/pipelines",
            json={"stages": [{"name": "s", "spec": grpo(prompts.id, {"id": env_id})}]},
            headers=b,
        )
        assert stage.status_code == 404 and stage.json()["error"]["field"] == "stages[0].spec.environment.id"
    assert answers[0] == answers[1] and answers[0][:3] == (404, "environment_not_found", "environment.id")
    assert count(session, Run) == before


def test_a_pipeline_keeps_the_environments_code_from_its_creation(
    client: TestClient, session: Session
) -> None:
    a, _, project_a, _ = keys(session)
    env = client.post("/v1/environments", json={"name": "e", "source": SOURCE}, headers=a).json()
    prompts = make_dataset(
        session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts", project_id=project_a
    )
    sft = {
        "algorithm": "sft",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(
            make_dataset(
                session, rows=[{"prompt": "1+1=", "completion": "2"}], kind="sft", project_id=project_a
            ).id
        ),
    }
    rl = {**grpo(prompts.id, {"id": env["id"]}), "model": "stage:sft"}
    made = client.post(
        "/v1/pipelines",
        json={"stages": [{"name": "sft", "spec": sft}, {"name": "rl", "spec": rl}]},
        headers=a,
    )
    assert made.status_code == 201, made.text
    assert client.delete(f"/v1/environments/{env['id']}", headers=a).status_code == 204
    stored = session.get(Pipeline, uuid.UUID(made.json()["id"]))
    assert stored is not None and stored.stages[1]["spec"]["environment"]["source"] == SOURCE
