"""Eval runs at submit (SQLite): accepted with total steps = the prompts it reads, refused with the field
named where the spec cannot work, and an eval run (which makes no model) is refused as a model anywhere."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Run
from tests.factories import api_client, dpo_spec, make_dataset, make_run

PROMPTS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(7)]


def eval_spec(dataset_id: uuid.UUID, **over: Any) -> dict[str, Any]:
    hp = over.pop("hyperparameters", {})
    return {
        "algorithm": "eval",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "rewards": [{"name": "numeric"}],
        "hyperparameters": hp,
        **over,
    }


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def test_an_eval_is_stored_with_its_resolved_sampling_and_a_step_per_prompt(session: Session) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    with api_client(session) as client:
        every = client.post("/v1/runs", json=eval_spec(prompts.id, hyperparameters={"samples_per_prompt": 8}))
        capped = client.post("/v1/runs", json=eval_spec(prompts.id, hyperparameters={"max_rows": 3}))
    assert every.status_code == 201, every.text
    hp = every.json()["spec"]["hyperparameters"]
    assert hp["temperature"] == 1.0 and hp["pass_k"] == [1, 8] and "learning_rate" not in hp
    assert every.json()["progress"]["total_steps"] == len(PROMPTS)
    assert capped.json()["progress"]["total_steps"] == 3
    assert capped.json()["spec"]["hyperparameters"]["temperature"] == 0.0


def test_specs_that_cannot_work_are_refused_naming_the_field(session: Session) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    prefs = make_dataset(session)
    cases = {
        "hyperparameters.pass_k": eval_spec(
            prompts.id, hyperparameters={"samples_per_prompt": 4, "pass_k": [1, 8]}
        ),
        "hyperparameters.temperature": eval_spec(
            prompts.id, hyperparameters={"samples_per_prompt": 4, "temperature": 0}
        ),
        "dataset_id": eval_spec(prefs.id),
        "rewards": eval_spec(prompts.id, rewards=[]),
        "adapter": eval_spec(prompts.id, adapter={"type": "lora"}),
        "resources.devices": eval_spec(prompts.id, resources={"devices": 2}),
    }
    before = count(session)
    with api_client(session) as client:
        answers = {field: client.post("/v1/runs", json=spec) for field, spec in cases.items()}
    assert count(session) == before
    for field, resp in answers.items():
        assert resp.status_code == (409 if field == "dataset_id" else 422), (field, resp.text)
        error = resp.json()["error"]
        assert field.split(".")[-1] in f"{error.get('field')} {error['message']}", (field, error)


def test_an_eval_run_is_no_model(session: Session) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    prefs = make_dataset(session)
    done = make_run(
        session,
        prompts,
        algorithm="eval",
        status="succeeded",
        spec=eval_spec(prompts.id) | {"hyperparameters": {"max_steps": 1}},
    )
    with api_client(session) as client:
        as_policy = client.post("/v1/runs", json={**dpo_spec(prefs.id), "model": f"run:{done.id}"})
        listed = client.get("/v1/models").json()["data"]
        retrieved = client.get(f"/v1/models/run:{done.id}")
        chat = client.post("/v1/completions", json={"model": f"run:{done.id}", "prompt": "hi"})
        stage = client.post(
            "/v1/pipelines",
            json={
                "stages": [
                    {"name": "ev", "spec": eval_spec(prompts.id)},
                    {"name": "dpo", "spec": {**dpo_spec(prefs.id), "model": "stage:ev"}},
                ]
            },
        )
        alone = {"stages": [{"name": "ev", "spec": eval_spec(prompts.id)}]}
        pipeline = client.post("/v1/pipelines", json=alone)
    assert as_policy.status_code == 409 and "makes no model" in as_policy.json()["error"]["message"]
    assert f"run:{done.id}" not in {m["id"] for m in listed}
    assert retrieved.status_code == 404 and "makes no model" in retrieved.json()["error"]["message"]
    assert chat.status_code == 404 and "makes no model" in chat.json()["error"]["message"]
    assert stage.status_code == 422 and stage.json()["error"]["field"] == "stages[1].spec.model", stage.text
    assert pipeline.status_code == 201, pipeline.text  # an eval may be a pipeline stage
