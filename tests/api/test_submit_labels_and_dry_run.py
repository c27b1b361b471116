"""POST /v1/runs takes the run's tags and note as PATCH does (kept on the run, not in its stored spec), and
POST /v1/runs?validate_only=true answers what a submit would store, or its 422, storing and queueing nothing
(issue 41 item 3)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Pipeline, Run
from tests.factories import FakeEnqueue, api_client, dpo_spec, make_dataset


def count(session: Session, model: Any = Run) -> int:
    return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_tags_and_note_at_submit_are_the_runs_and_not_its_specs(session: Session) -> None:
    ds = make_dataset(session)
    body = dpo_spec(ds.id) | {"tags": ["Baseline", "lr:1e-3", "baseline"], "note": "first try"}
    with api_client(session) as client:
        created = client.post("/v1/runs", json=body)
        run = created.json()
        read = client.get(f"/v1/runs/{run['id']}").json()
        found = client.get("/v1/runs", params={"tag": "lr:1e-3"}).json()["data"]
        # the same spec with other labels under the same key is the same run (labels are not the spec)
        retried = client.post("/v1/runs", json=body | {"tags": ["other"]}, headers={"Idempotency-Key": "k1"})
        again = client.post("/v1/runs", json=body | {"tags": []}, headers={"Idempotency-Key": "k1"})
        patched = client.patch(f"/v1/runs/{run['id']}", json={"tags": ["moved"]}).json()
    assert created.status_code == 201, created.text
    assert run["tags"] == ["baseline", "lr:1e-3"] and run["note"] == "first try"
    assert read["tags"] == run["tags"] and read["note"] == "first try"
    assert "tags" not in read["spec"] and "note" not in read["spec"]
    assert run["id"] in {r["id"] for r in found}
    assert retried.status_code == 201 and again.json()["id"] == retried.json()["id"]
    assert patched["tags"] == ["moved"] and "tags" not in patched["spec"]


def test_bad_tags_or_note_at_submit_are_refused_naming_the_field_and_store_nothing(session: Session) -> None:
    ds = make_dataset(session)
    before = count(session)
    bodies = [
        {"tags": ["has space"]},
        {"tags": [f"t{i}" for i in range(21)]},
        {"tags": "baseline"},
        {"note": "n" * 4001},
        {"note": "a\x00b"},
    ]
    with api_client(session) as client:
        answers = [client.post("/v1/runs", json=dpo_spec(ds.id) | extra) for extra in bodies]
    assert [a.status_code for a in answers] == [422] * len(bodies), [a.text for a in answers]
    fields = [a.json()["error"]["field"] for a in answers]
    assert fields[0].startswith("tags") and fields[1] == "tags" and fields[2] == "tags"
    assert fields[3] == "note" and fields[4] == "note"
    assert count(session) == before


def test_a_pipeline_stages_tags_reach_its_run(session: Session) -> None:
    ds = make_dataset(session)
    body = {
        "name": "labelled",
        "stages": [{"name": "dpo", "spec": dpo_spec(ds.id) | {"tags": ["sweep-a"], "note": "stage note"}}],
    }
    with api_client(session) as client:
        created = client.post("/v1/pipelines", json=body)
        run_id = created.json()["stages"][0]["run_id"]
        run = client.get(f"/v1/runs/{run_id}").json()
    assert created.status_code == 201, created.text
    assert run["tags"] == ["sweep-a"] and run["note"] == "stage note" and "tags" not in run["spec"]


def test_a_dry_run_answers_the_resolved_spec_and_stores_and_queues_nothing(session: Session) -> None:
    ds = make_dataset(session)
    before, pipelines = count(session), count(session, Pipeline)
    enqueue = FakeEnqueue()
    body = dpo_spec(ds.id, max_steps=7) | {"tags": ["Dry"]}
    del body["hyperparameters"]["learning_rate"]  # filled in by the size rules, as a submit fills it
    with api_client(session, enqueue=enqueue) as client:
        ok = client.post("/v1/runs?validate_only=true", json=body)
        submitted_later = client.post("/v1/runs", json=body).json()
        bad = client.post("/v1/runs?validate_only=true", json=dpo_spec(ds.id, beta=-1))
        unknown = dpo_spec(ds.id) | {"model": f"run:{'0' * 32}"}
        missing = client.post("/v1/runs?validate_only=true", json=unknown)
        missing_submit = client.post("/v1/runs", json=unknown)
    assert ok.status_code == 200, ok.text
    answer = ok.json()
    # what the submit then stored: the same spec (presets and the default learning rate filled in)
    assert answer["spec"] == submitted_later["spec"]
    assert answer["spec"]["hyperparameters"]["learning_rate"] > 0
    assert answer["total_steps"] == submitted_later["progress"]["total_steps"] == 7
    assert answer["tags"] == ["dry"] and answer["note"] is None
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "hyperparameters.beta"
    # a reference the project cannot use: the dry run answers as the submit does
    assert missing.status_code == missing_submit.status_code >= 400
    assert missing.json()["error"] == missing_submit.json()["error"]
    assert count(session) == before + 1  # only the real submit
    assert count(session, Pipeline) == pipelines
    assert len(enqueue.sent) == 1
