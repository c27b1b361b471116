"""Inputs that fault and abuse drills answered with a 500 (issue 12 items 5, 6, 10, 12): each is now a
4xx naming the field, on SQLite and PostgreSQL alike, and stores nothing."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.main import create_app
from api.models import Pipeline, Run, Webhook
from api.settings import Settings
from tests.factories import FakeEnqueue, api_client, dpo_spec, make_dataset, make_run

NUL = "a\x00b"


def counts(session: Session) -> tuple[int | None, ...]:
    return tuple(session.scalar(select(func.count()).select_from(t)) for t in (Run, Pipeline, Webhook))


def grpo_spec(dataset_id: uuid.UUID, **over: Any) -> dict[str, Any]:
    return {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "rewards": [{"name": "exact_match"}],
        "hyperparameters": {"max_steps": 2},
        **over,
    }


def test_nul_in_names_and_params_is_refused_with_the_field(session: Session) -> None:
    prefs = make_dataset(session)
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    before = counts(session)
    with api_client(session, settings=Settings(webhook_allow_loopback=True)) as client:
        answers = {
            "name": client.post("/v1/runs", json={**dpo_spec(prefs.id), "name": NUL}),
            "rewards.0.params": client.post(
                "/v1/runs",
                json=grpo_spec(prompts.id, rewards=[{"name": "regex", "params": {"pattern": NUL}}]),
            ),
            "pipeline name": client.post(
                "/v1/pipelines", json={"name": NUL, "stages": [{"name": "a", "spec": dpo_spec(prefs.id)}]}
            ),
            "description": client.post(
                "/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", "description": NUL}
            ),
            "suffix": client.post(
                "/v1/fine_tuning/jobs",
                json={"model": "tiny:llama-0.4m", "training_file": f"file-{prefs.id.hex}", "suffix": NUL},
            ),
        }
    for what, resp in answers.items():
        assert resp.status_code in (400, 422), (what, resp.text)
        assert "NUL" in resp.text, (what, resp.text)
    assert answers["name"].json()["error"]["field"] == "name"
    assert answers["rewards.0.params"].json()["error"]["field"].startswith("rewards.0.params")
    assert answers["pipeline name"].json()["error"]["field"] == "name"
    assert answers["description"].json()["error"]["field"] == "description"
    assert answers["suffix"].json()["error"]["param"] == "suffix"
    assert counts(session) == before


def cursor(*key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode().rstrip("=")


def test_steps_and_cursors_beyond_the_columns_are_422(session: Session) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds, status="succeeded", output_path="/tmp/x")
    base = f"/v1/runs/{run.id}"
    with api_client(session) as client:
        for big in (2**31, 2**63, 2**70):
            for url, field in (
                (f"{base}/metrics?min_step={big}", "min_step"),
                (f"{base}/metrics?max_step={big}&max_points=10", "max_step"),
                (f"{base}/samples?step={big}", "step"),
                (f"{base}/checkpoints/{big}/download", "step"),
                (f"{base}/metrics?after={cursor(big, 'loss')}", "after"),
                (f"{base}/events?after={cursor(big)}", "after"),
            ):
                resp = client.get(url)
                assert resp.status_code == 422, (url, resp.text)
                assert resp.json()["error"]["field"] == field, (url, resp.json())
            ref = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": f"run:{run.id}@{big}"})
            assert ref.status_code == 422 and ref.json()["error"]["field"] == "model", ref.text
        largest = client.get(f"{base}/metrics?min_step={2**31 - 1}")
    assert largest.status_code == 200 and largest.json()["data"] == []


def test_a_preset_that_breaks_a_rule_is_refused_before_anything_is_stored(session: Session) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    before = counts(session)
    enqueue = FakeEnqueue()
    with api_client(session, enqueue=enqueue) as client:
        dapo = client.post(
            "/v1/runs",
            json=grpo_spec(prompts.id, algorithm="dapo", hyperparameters={"samples_per_prompt": 1}),
        )
        explicit_off = client.post(
            "/v1/runs",
            json=grpo_spec(
                prompts.id,
                algorithm="dapo",
                hyperparameters={
                    "samples_per_prompt": 1,
                    "dynamic_sampling": False,
                    "advantage": "reinforce",
                },
            ),
        )
    assert dapo.status_code == 422, dapo.text
    # dapo's group advantage with one sample: refused with the root cause (every advantage is 0), which
    # also rules out its preset's dynamic sampling.
    assert dapo.json()["error"]["field"] == "hyperparameters.samples_per_prompt"
    assert "every advantage is 0" in dapo.json()["error"]["message"]
    assert counts(session)[0] == before[0] + 1 and len(enqueue.sent) == 1  # only the explicit one
    assert explicit_off.status_code == 201, explicit_off.text


def test_runs_stored_with_a_spec_this_version_refuses_stay_readable(session: Session) -> None:
    prompts = make_dataset(session, rows=[{"prompt": "1+1=", "answer": "2"}], kind="prompts")
    bad = {
        **grpo_spec(prompts.id, algorithm="dapo"),
        "hyperparameters": {"max_steps": 2, "samples_per_prompt": 1, "dynamic_sampling": True},
    }
    run = make_run(session, prompts, spec=bad, algorithm="dapo")
    with api_client(session) as client:
        listed = client.get("/v1/runs")
        one = client.get(f"/v1/runs/{run.id}")
    assert listed.status_code == 200 and str(run.id) in {r["id"] for r in listed.json()["data"]}
    assert one.status_code == 200 and one.json()["spec"]["hyperparameters"]["samples_per_prompt"] == 1


def test_schema_and_behaviour_agree_on_empty_cursors_and_models(session: Session) -> None:
    ds = make_dataset(session)
    with api_client(session) as client:
        openapi = client.get("/openapi.json").json()
        empty_after = client.get("/v1/runs?after=")
        empty_model = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": ""})
        trace = client.request("TRACE", "/v1/runs")
    params = {p["name"]: p for p in openapi["paths"]["/v1/runs"]["get"]["parameters"]}
    assert params["after"]["schema"]["anyOf"][0]["minLength"] == 1
    assert openapi["components"]["schemas"]["DpoSpec"]["properties"]["model"]["minLength"] == 1
    assert empty_after.status_code == 422 and empty_after.json()["error"]["field"] == "after"
    assert empty_model.status_code == 422 and empty_model.json()["error"]["field"] == "model"
    assert trace.status_code == 405 and set(trace.headers["allow"].split(", ")) == {"GET", "POST"}


def test_an_unexpected_error_is_answered_500_without_escaping_the_app() -> None:
    """Starlette's outermost middleware answers 500 too but then re-raises, which makes the server drop
    the keep-alive connection; with ``raise_server_exceptions`` the test client shows that re-raise."""
    app = create_app(Settings(), session_factory=None, enqueue=FakeEnqueue())

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=True) as client:
        resp = client.get("/v1/boom")
        again = client.get("/v1/boom")
    assert resp.status_code == again.status_code == 500
    assert resp.json() == {"error": {"code": "internal_error", "message": "internal server error"}}
