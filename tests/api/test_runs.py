"""Runs API: submit (validation, idempotency, enqueue order), list, read, cancel, metrics, events, errors."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Event, Metric, Run, utcnow
from tests.factories import FakeEnqueue, api_client, dpo_spec, make_dataset, make_run


def count_runs(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def test_submit_stores_queued_run_commits_then_enqueues(session: Session) -> None:
    ds = make_dataset(session)
    enqueue = FakeEnqueue()
    with api_client(session, enqueue=enqueue) as client:
        resp = client.post("/v1/runs", json=dpo_spec(ds.id, beta=0.2))
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["status"] == "queued" and body["algorithm"] == "dpo"
    assert body["progress"] == {"step": 0, "total_steps": 3, "phase": None, "done": None, "total": None}
    assert body["spec"]["hyperparameters"]["beta"] == 0.2
    assert body["spec"]["hyperparameters"]["loss_type"] == "sigmoid"  # defaults are filled in and stored
    assert enqueue.sent == [uuid.UUID(body["id"])]
    run = session.get(Run, uuid.UUID(body["id"]))
    assert run is not None and run.status == "queued"
    events = session.scalars(select(Event).where(Event.run_id == run.id)).all()
    assert [e.message for e in events] == ["queued"]


def test_bad_specs_are_refused_with_the_field_named_and_store_nothing(session: Session) -> None:
    ds = make_dataset(session)
    before = count_runs(session)
    cases = {
        "hyperparameters.bta": {**dpo_spec(ds.id), "hyperparameters": {"bta": 0.1}},
        "hyperparameters.beta": {**dpo_spec(ds.id), "hyperparameters": {"beta": -1}},
        "model": {**dpo_spec(ds.id), "model": "tiny:nope"},
        "dataset_id": {**dpo_spec(ds.id), "dataset_id": "not-a-uuid"},
        "algorithm": {**dpo_spec(ds.id), "algorithm": "dpoo"},
        "hyperparameters.loss_type": {**dpo_spec(ds.id), "hyperparameters": {"loss_type": "nope"}},
        "hyperparameters": {**dpo_spec(ds.id), "hyperparameters": {"label_smoothing": 0.1}},
        "hyperparameters.micro_batch_size": {
            **dpo_spec(ds.id),
            "hyperparameters": {"batch_size": 8, "micro_batch_size": 3},
        },
        "hyperparameters.eval_max_rows": {**dpo_spec(ds.id), "hyperparameters": {"eval_max_rows": 0}},
        "hyperparameters.rpo_alpha": {**dpo_spec(ds.id), "hyperparameters": {"rpo_alpha": -0.5}},
        "hyperparameters.reference_mode": {**dpo_spec(ds.id), "hyperparameters": {"reference_mode": "eager"}},
        "adapter.target_modules": {**dpo_spec(ds.id), "adapter": {"target_modules": []}},
        "adapter.type": {**dpo_spec(ds.id), "adapter": {"type": "dora"}},
        "adapter.quantize": {**dpo_spec(ds.id), "adapter": {"quantize": "2bit"}},
        "adapter.r": {**dpo_spec(ds.id), "adapter": {"r": 0}},
    }
    with api_client(session) as client:
        for field, body in cases.items():
            resp = client.post("/v1/runs", json=body)
            assert resp.status_code == 422, (field, resp.text)
            err = resp.json()["error"]
            assert err["code"] == "validation_error"
            assert err["field"] == field, (field, err)
        unknown_ds = client.post("/v1/runs", json=dpo_spec(uuid.uuid4()))
    assert unknown_ds.status_code == 404
    assert unknown_ds.json()["error"] == {
        "code": "dataset_not_found",
        "message": unknown_ds.json()["error"]["message"],
        "field": "dataset_id",
    }
    assert count_runs(session) == before


def test_model_reference_to_an_unfinished_run_is_refused(session: Session) -> None:
    ds = make_dataset(session)
    running = make_run(session, ds, status="running")
    with api_client(session) as client:
        resp = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": f"run:{running.id}"})
        missing = client.post("/v1/runs", json={**dpo_spec(ds.id), "reference_model": f"run:{uuid.uuid4()}"})
    assert resp.status_code == 409 and resp.json()["error"]["field"] == "model"
    assert "running" in resp.json()["error"]["message"]
    assert missing.status_code == 409 and missing.json()["error"]["field"] == "reference_model"


def test_idempotency_key_returns_the_same_run(session: Session) -> None:
    ds = make_dataset(session)
    enqueue = FakeEnqueue()
    with api_client(session, enqueue=enqueue) as client:
        key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
        a = client.post("/v1/runs", json=dpo_spec(ds.id), headers=key)
        b = client.post("/v1/runs", json=dpo_spec(ds.id), headers=key)
        other = client.post("/v1/runs", json=dpo_spec(ds.id, beta=0.5), headers=key)
    assert a.status_code == 201 and b.status_code == 201
    assert a.json()["id"] == b.json()["id"]
    assert len(enqueue.sent) == 1
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"


def test_broker_failure_still_answers_201_and_leaves_a_warning(session: Session) -> None:
    ds = make_dataset(session)
    with api_client(session, enqueue=FakeEnqueue(fail=True)) as client:
        resp = client.post("/v1/runs", json=dpo_spec(ds.id))
        events = client.get(f"/v1/runs/{resp.json()['id']}/events").json()["data"]
    assert resp.status_code == 201 and resp.json()["status"] == "queued"
    assert [e["kind"] for e in events] == ["status", "warning"]
    assert "broker" in events[1]["message"]
    # Marked unsent, so the next reconciler pass in any process sends it, not only after the re-send period.
    assert session.get(Run, uuid.UUID(resp.json()["id"])).enqueued_at is None  # type: ignore[union-attr]


def test_every_path_that_sends_a_run_warns_when_the_broker_is_down(session: Session) -> None:
    ds = make_dataset(session)
    paused = make_run(session, ds, status="paused")
    with api_client(session, enqueue=FakeEnqueue(fail=True)) as client:
        resumed = client.post(f"/v1/runs/{paused.id}/resume")
        pipeline = client.post("/v1/pipelines", json={"stages": [{"name": "a", "spec": dpo_spec(ds.id)}]})
        job = client.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "tiny:llama-0.4m",
                "training_file": f"file-{ds.id.hex}",
                "method": {"type": "dpo"},
            },
        )
    assert resumed.status_code == 200 and pipeline.status_code == 201 and job.status_code == 200, job.text
    sent = [
        paused.id,
        uuid.UUID(pipeline.json()["stages"][0]["run_id"]),
        uuid.UUID(job.json()["id"].removeprefix("ftjob-")),
    ]
    for run_id in sent:
        kinds = [e.kind for e in session.scalars(select(Event).where(Event.run_id == run_id))]
        assert "warning" in kinds, (run_id, kinds)
        assert session.get(Run, run_id).enqueued_at is None  # type: ignore[union-attr]


def test_list_filters_by_status_and_pages_without_overlap(session: Session) -> None:
    ds = make_dataset(session)
    base = utcnow()
    made = [make_run(session, ds, created_at=base + timedelta(seconds=i)) for i in range(5)]
    made[1].status = "failed"
    session.flush()
    with api_client(session) as client:
        p1 = client.get("/v1/runs", params={"limit": 2}).json()
        p2 = client.get("/v1/runs", params={"limit": 2, "after": p1["next_cursor"]}).json()
        failed = client.get("/v1/runs", params={"status": "failed"}).json()
        bad = client.get("/v1/runs", params={"status": "weird"})
    ours = {r.id for r in made}
    got = [uuid.UUID(r["id"]) for r in p1["data"] + p2["data"]]
    assert got == [r.id for r in made[::-1][:4]]
    assert p1["has_more"] and len(set(got)) == 4
    assert [uuid.UUID(r["id"]) for r in failed["data"] if uuid.UUID(r["id"]) in ours] == [made[1].id]
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "status"


def test_flagged_lists_runs_with_warnings_and_the_run_shows_them_and_its_phase(session: Session) -> None:
    ds = make_dataset(session)
    warning = {"code": "zero_advantage", "step": 3, "message": "no learning signal at steps 1-3"}
    flagged = make_run(session, ds, status="running", warnings=[warning], warning_count=1)
    flagged.phase, flagged.phase_done, flagged.phase_total = "reference", 120, 1300
    clean = make_run(session, ds)
    session.flush()
    with api_client(session) as client:
        only_flagged = client.get("/v1/runs", params={"flagged": "true", "limit": 200}).json()["data"]
        unflagged = client.get("/v1/runs", params={"flagged": "false", "limit": 200}).json()["data"]
        one = client.get(f"/v1/runs/{flagged.id}").json()
        bad = client.get("/v1/runs", params={"flagged": "maybe"})
    assert str(flagged.id) in {r["id"] for r in only_flagged} and str(clean.id) not in {
        r["id"] for r in only_flagged
    }
    assert all(r["warnings"] for r in only_flagged) and not any(r["warnings"] for r in unflagged)
    assert str(clean.id) in {r["id"] for r in unflagged}
    assert one["warnings"] == [warning]
    assert one["progress"] == {"step": 0, "total_steps": 3, "phase": "reference", "done": 120, "total": 1300}
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "flagged"


def test_cancel_queued_running_and_finished(session: Session) -> None:
    ds = make_dataset(session)
    queued, running = make_run(session, ds), make_run(session, ds, status="running")
    done = make_run(session, ds, status="succeeded")
    with api_client(session) as client:
        q = client.post(f"/v1/runs/{queued.id}/cancel")
        r = client.post(f"/v1/runs/{running.id}/cancel")
        d = client.post(f"/v1/runs/{done.id}/cancel")
        again = client.post(f"/v1/runs/{queued.id}/cancel")
        missing = client.post(f"/v1/runs/{uuid.uuid4()}/cancel")
    assert q.status_code == 200 and q.json()["status"] == "cancelled"
    assert r.status_code == 200 and r.json()["status"] == "running" and r.json()["cancel_requested"]
    assert d.status_code == 409 and d.json()["error"]["code"] == "invalid_transition"
    assert again.status_code == 409
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "run_not_found"


def test_metrics_filter_and_page_by_step(session: Session) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds)
    for step in range(1, 6):
        session.add(Metric(run_id=run.id, key="loss", step=step, value=1.0 / step, logged_at=utcnow()))
        session.add(Metric(run_id=run.id, key="lr", step=step, value=0.1, logged_at=utcnow()))
    session.flush()
    with api_client(session) as client:
        loss = client.get(f"/v1/runs/{run.id}/metrics", params={"key": "loss", "min_step": 2, "max_step": 4})
        p1 = client.get(f"/v1/runs/{run.id}/metrics", params={"limit": 3}).json()
        p2 = client.get(
            f"/v1/runs/{run.id}/metrics", params={"limit": 100, "after": p1["next_cursor"]}
        ).json()
    assert [(m["step"], m["value"]) for m in loss.json()["data"]] == [(2, 0.5), (3, 1 / 3), (4, 0.25)]
    pairs = [(m["step"], m["key"]) for m in p1["data"] + p2["data"]]
    assert pairs == [(s, k) for s in range(1, 6) for k in ("loss", "lr")]
    assert p1["has_more"] and not p2["has_more"]


def test_unknown_routes_and_bad_ids_use_the_error_shape(session: Session) -> None:
    with api_client(session) as client:
        nope = client.get("/v1/nothing")
        bad_id = client.get("/v1/runs/not-a-uuid")
        method = client.delete("/v1/runs")
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "not_found"
    assert bad_id.status_code == 422 and bad_id.json()["error"]["field"] == "run_id"
    assert method.status_code == 405 and "error" in method.json()


def test_openapi_documents_every_route_and_spec_field(session: Session) -> None:
    with api_client(session) as client:
        doc = client.get("/openapi.json").json()
    assert {"/v1/datasets", "/v1/runs", "/v1/runs/{run_id}/cancel", "/v1/runs/{run_id}/metrics"} <= set(
        doc["paths"]
    )
    hp = doc["components"]["schemas"]["DpoHyperparameters"]["properties"]
    assert all(field.get("description") for field in hp.values())
    assert set(doc["paths"]["/v1/datasets"]["post"]["requestBody"]["content"]) == {
        "multipart/form-data",
        "application/json",
    }


def test_runs_are_routed_to_their_spec_queue(session: Session) -> None:
    ds = make_dataset(session)
    enqueue = FakeEnqueue()
    with api_client(session, enqueue=enqueue) as client:
        gpu = client.post("/v1/runs", json={**dpo_spec(ds.id), "queue": "gpu"})
        default = client.post("/v1/runs", json=dpo_spec(ds.id))
        bad = client.post("/v1/runs", json={**dpo_spec(ds.id), "queue": "no spaces"})
    assert gpu.status_code == default.status_code == 201
    assert enqueue.queues == ["gpu", None]  # None: the server's RLRUN_QUEUE
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "queue"
