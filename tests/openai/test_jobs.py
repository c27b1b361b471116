"""/v1/fine_tuning/jobs in process, on SQLite and PostgreSQL: create (mapping onto a run), list, read,
cancel/pause/resume, events, checkpoints, errors and project scoping."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from openai.types.fine_tuning import FineTuningJob as SdkJob
from openai.types.fine_tuning import FineTuningJobEvent as SdkEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint as SdkCheckpoint
from sqlalchemy.orm import Session

from api.models import Checkpoint, Event, Run, utcnow
from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import FakeEnqueue, api_client, jsonl, make_dataset, make_run
from tests.openai.helpers import chat_lines, dpo_lines, openai_error, upload_file


def dpo_job(file: str, **over: Any) -> dict[str, Any]:
    hp = {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 2.0, "beta": 0.2}
    return {
        "model": "tiny:llama-0.4m",
        "training_file": file,
        "method": {"type": "dpo", "dpo": {"hyperparameters": hp}},
        **over,
    }


def run_of(session: Session, job: dict[str, Any]) -> Run:
    run = session.get(Run, uuid.UUID(hex=job["id"].removeprefix("ftjob-")))
    assert run is not None
    return run


def test_create_maps_a_dpo_job_onto_a_queued_run(session: Session) -> None:
    ds = make_dataset(session, kind="preference")  # 10 rows
    enqueue = FakeEnqueue()
    body = dpo_job(f"file-{ds.id.hex}", suffix="adder", seed=42, metadata={"team": "evals"})
    with api_client(session, enqueue=enqueue) as client:
        resp = client.post("/v1/fine_tuning/jobs", json=body)
        again = client.get(f"/v1/fine_tuning/jobs/{resp.json()['id']}")
    assert resp.status_code == 200, resp.text
    job = resp.json()
    SdkJob.model_validate(job)
    assert again.json() == job
    run = run_of(session, job)
    hp = run.spec["hyperparameters"]
    # ceil(3 epochs * 10 rows / batch 4) = ceil(7.5) = 8 steps; 2 x DPO's default for a tiny preset, 1e-3
    assert (run.algorithm, hp["max_steps"], hp["batch_size"], hp["beta"], hp["seed"]) == (
        "dpo",
        8,
        4,
        0.2,
        42,
    )
    assert hp["learning_rate"] == 2e-3 and run.total_steps == 8
    assert run.spec["name"] == "adder" and run.user_metadata == {"team": "evals"}
    assert enqueue.sent == [run.id]
    assert job["status"] == "queued" and job["model"] == "tiny:llama-0.4m" and job["seed"] == 42
    assert job["training_file"] == f"file-{ds.id.hex}" and job["validation_file"] is None
    assert job["fine_tuned_model"] is None and job["finished_at"] is None
    assert job["user_provided_suffix"] == "adder" and job["metadata"] == {"team": "evals"}
    assert job["organization_id"] == str(run.project_id)
    assert job["hyperparameters"] == {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 2.0}
    assert job["method"]["type"] == "dpo"
    assert job["method"]["dpo"]["hyperparameters"] == body["method"]["dpo"]["hyperparameters"]


def test_a_supervised_job_with_auto_values_and_a_random_seed(session: Session) -> None:
    train = make_dataset(session, [{"prompt": "q", "completion": "a"}] * 12, kind="sft")
    val = make_dataset(session, kind="sft")
    auto = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
    with api_client(session) as client:
        resp = client.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "tiny:llama-0.4m",
                "training_file": f"file-{train.id.hex}",
                "validation_file": f"file-{val.id.hex}",
                "hyperparameters": auto,  # the deprecated top-level form: supervised
            },
        )
    assert resp.status_code == 200, resp.text
    job, run = resp.json(), run_of(session, resp.json())
    # auto: 3 epochs, batch min(8, 12 rows) = 8 -> ceil(36 / 8) = 5 steps at a tiny preset's SFT 1e-3
    assert run.algorithm == "sft" and run.spec["hyperparameters"]["max_steps"] == 5
    assert run.spec["hyperparameters"]["learning_rate"] == 1e-3
    assert run.spec["validation_dataset_id"] == str(val.id) and job["validation_file"] == f"file-{val.id.hex}"
    assert job["hyperparameters"] == {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0}
    assert job["method"]["type"] == "supervised" and job["seed"] == run.spec["hyperparameters"]["seed"]


def test_files_uploaded_here_train_jobs_here(session: Session) -> None:
    with api_client(session) as client:
        pref = upload_file(client, jsonl(dpo_lines(6))).json()["id"]
        chat = upload_file(client, jsonl(chat_lines(6))).json()["id"]
        dpo = client.post("/v1/fine_tuning/jobs", json=dpo_job(pref))
        sft = client.post("/v1/fine_tuning/jobs", json={"model": "tiny:llama-0.4m", "training_file": chat})
        dpo_on_sft = client.post("/v1/fine_tuning/jobs", json=dpo_job(chat))
    assert dpo.status_code == sft.status_code == 200
    error = openai_error(dpo_on_sft)
    assert dpo_on_sft.status_code == 400 and error["param"] == "training_file"
    assert "method.type 'dpo' needs preference lines" in error["message"]


def test_refused_requests_answer_in_openai_shape_and_store_nothing(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    file = f"file-{ds.id.hex}"
    running = make_run(session, ds, status="running")
    cases: dict[str, tuple[int, dict[str, Any]]] = {
        "training_file": (404, dpo_job(f"file-{uuid.uuid4().hex}")),
        "validation_file": (404, dpo_job(file, validation_file="file-nope")),
        "method.type": (400, {"model": "m", "training_file": file, "method": {"type": "unsupervised"}}),
        "method.reinforcement": (
            400,
            {"model": "m", "training_file": file, "method": {"type": "reinforcement"}},
        ),
        "model": (400, {"training_file": file}),
        "method.dpo.hyperparameters.n_epochs": (
            400,
            dpo_job(file) | {"method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": "x"}}}},
        ),
        "suffix": (400, dpo_job(file, suffix="")),
    }
    with api_client(session) as client:
        before = client.get("/v1/fine_tuning/jobs").json()["data"]
        for param, (status, body) in cases.items():
            resp = client.post("/v1/fine_tuning/jobs", json=body)
            error = openai_error(resp)
            assert (resp.status_code, error["param"]) == (status, param), (param, resp.text)
            assert error["type"] == "invalid_request_error" and resp.headers["x-should-retry"] == "false"
        unfinished = client.post("/v1/fine_tuning/jobs", json=dpo_job(file, model=f"run:{running.id}"))
        after = client.get("/v1/fine_tuning/jobs").json()["data"]
    assert unfinished.status_code == 409 and openai_error(unfinished)["param"] == "model"
    assert "running" in openai_error(unfinished)["message"]
    assert [j["id"] for j in after] == [j["id"] for j in before]


def test_list_pages_newest_first_and_shows_only_sft_and_dpo_runs(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    base = utcnow() + timedelta(days=1)  # newer than anything else in the shared database
    made = [make_run(session, ds, created_at=base + timedelta(seconds=i)) for i in range(3)]
    grpo_spec = {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(ds.id),
        "hyperparameters": {"max_steps": 1},
    }
    native_grpo = make_run(  # a grpo run not made as a reinforcement job is no job
        session,
        ds,
        algorithm="grpo",
        spec=grpo_spec,
        created_at=base + timedelta(seconds=9),
    )
    ids = [f"ftjob-{r.id.hex}" for r in made]
    with api_client(session) as client:
        assert client.get(f"/v1/fine_tuning/jobs/ftjob-{native_grpo.id.hex}").status_code == 404
        p1 = client.get("/v1/fine_tuning/jobs", params={"limit": 2}).json()
        p2 = client.get("/v1/fine_tuning/jobs", params={"limit": 2, "after": p1["data"][-1]["id"]}).json()
        unknown_after = client.get("/v1/fine_tuning/jobs", params={"after": f"ftjob-{uuid.uuid4().hex}"})
        by_metadata = client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "evals"})
    assert p1["object"] == "list" and [j["id"] for j in p1["data"]] == ids[::-1][:2] and p1["has_more"]
    assert [j["id"] for j in p2["data"]][:1] == [ids[0]]
    for job in p1["data"]:
        SdkJob.model_validate(job)
        assert job["hyperparameters"]["n_epochs"] == "auto"  # submitted through /v1/runs: budgeted in steps
    assert unknown_after.status_code == 404 and openai_error(unknown_after)["param"] == "after"
    assert by_metadata.status_code == 400 and openai_error(by_metadata)["param"] == "metadata"


def test_cancel_pause_and_resume_use_openai_status_names(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    queued, running, done = (
        make_run(session, ds),
        make_run(session, ds, status="running"),
        make_run(session, ds, status="succeeded", finished_at=utcnow()),
    )
    enqueue = FakeEnqueue()
    url = "/v1/fine_tuning/jobs/ftjob-{}/{}".format
    with api_client(session, enqueue=enqueue) as client:
        paused = client.post(url(queued.id.hex, "pause")).json()
        resumed = client.post(url(queued.id.hex, "resume")).json()
        pausing = client.post(url(running.id.hex, "pause")).json()
        cancelled = client.post(url(queued.id.hex, "cancel")).json()
        twice = client.post(url(queued.id.hex, "cancel"))
        resume_queued = client.post(url(running.id.hex, "resume"))
        finished = client.get(f"/v1/fine_tuning/jobs/ftjob-{done.id.hex}").json()
    assert (paused["status"], resumed["status"], pausing["status"], cancelled["status"]) == (
        "paused",
        "queued",
        "pausing",
        "cancelled",
    )
    assert enqueue.sent == [queued.id] and isinstance(cancelled["finished_at"], int)
    # OpenAI's API has `pausing` and `paused`; the SDK's status Literal lags, but its client keeps them
    assert SdkJob.construct(**paused).status == "paused" and SdkJob.construct(**pausing).status == "pausing"
    for resp in (twice, resume_queued):
        error = openai_error(resp)
        assert resp.status_code == 409 and error["param"] == "fine_tuning_job_id"
        assert resp.headers["x-should-retry"] == "false"
    assert "cancelled" in openai_error(twice)["message"]
    assert finished["status"] == "succeeded" and finished["fine_tuned_model"] == f"run:{done.id}"


def test_events_newest_first_with_levels_and_paging(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    with api_client(session) as client:
        job = client.post("/v1/fine_tuning/jobs", json=dpo_job(f"file-{ds.id.hex}")).json()
        run = run_of(session, job)
        for kind, message, data in [
            ("status", "running", {"attempt": 1}),
            ("warning", "slow step", None),
            ("status", "failed", {"error": "non-finite loss at step 2"}),
        ]:
            session.add(Event(run_id=run.id, kind=kind, message=message, data=data))
        run.status, run.error = "failed", "non-finite loss at step 2"
        session.flush()
        url = f"/v1/fine_tuning/jobs/{job['id']}/events"
        everything = client.get(url).json()
        p1 = client.get(url, params={"limit": 2}).json()
        p2 = client.get(url, params={"after": p1["data"][-1]["id"], "limit": 10}).json()
        bad = client.get(url, params={"after": "nope"})
        failed = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    for event in everything["data"]:
        SdkEvent.model_validate(event)
    pairs = [(e["level"], e["message"]) for e in everything["data"]]
    assert pairs == [
        ("error", "The job failed: non-finite loss at step 2"),
        ("warn", "slow step"),
        ("info", "Job started (attempt 1)"),
        ("info", f"Created fine-tuning job: {job['id']}"),
        ("info", "Job queued"),
    ]
    assert p1["has_more"] and not p2["has_more"]
    assert [e["id"] for e in p1["data"] + p2["data"]] == [e["id"] for e in everything["data"]]
    assert bad.status_code == 400 and openai_error(bad)["param"] == "after"
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "run_failed", "message": "non-finite loss at step 2", "param": None}


def test_checkpoints_newest_first_with_model_refs_metrics_and_paging(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    run = make_run(session, ds, status="succeeded")
    for step, metrics in [
        (4, {"loss": 0.5, "eval/loss": 0.75}),
        (8, {"loss": 0.25}),
        (12, {"final/loss": 0.125}),
    ]:
        session.add(Checkpoint(run_id=run.id, step=step, path="/x", size_bytes=1, metrics=metrics))
    session.flush()
    url = f"/v1/fine_tuning/jobs/ftjob-{run.id.hex}/checkpoints"
    with api_client(session) as client:
        p1 = client.get(url, params={"limit": 2}).json()
        p2 = client.get(url, params={"after": p1["last_id"]}).json()
    for ckpt in p1["data"]:
        SdkCheckpoint.model_validate(ckpt)
    assert [c["step_number"] for c in p1["data"]] == [12, 8] and p1["has_more"]
    assert p1["first_id"] == f"ftckpt-{run.id.hex}-12" and p1["last_id"] == f"ftckpt-{run.id.hex}-8"
    final = p1["data"][0]
    assert final["fine_tuned_model_checkpoint"] == f"run:{run.id}@12"
    assert (
        final["fine_tuning_job_id"] == f"ftjob-{run.id.hex}"
        and final["object"] == "fine_tuning.job.checkpoint"
    )
    assert final["metrics"] == {
        "step": 12.0,
        "train_loss": 0.125,
        "train_mean_token_accuracy": None,
        "valid_loss": None,
        "valid_mean_token_accuracy": None,
        "full_valid_loss": None,
        "full_valid_mean_token_accuracy": None,
    }
    assert [c["step_number"] for c in p2["data"]] == [4] and not p2["has_more"]
    assert p2["data"][0]["metrics"]["valid_loss"] == 0.75


def test_a_key_sees_only_its_projects_files_and_jobs(session: Session, tmp_path: Path) -> None:
    key_a, _ = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    a, b = {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}
    with api_client(session, settings=Settings(home=tmp_path, auth=True)) as client:
        nobody = client.get("/v1/fine_tuning/jobs")
        file_a = upload_file(client, jsonl(dpo_lines(4)), headers=a).json()["id"]
        job_a = client.post("/v1/fine_tuning/jobs", json=dpo_job(file_a), headers=a).json()["id"]
        hidden = [
            client.get(f"/v1/files/{file_a}", headers=b),
            client.delete(f"/v1/files/{file_a}", headers=b),
            client.post("/v1/fine_tuning/jobs", json=dpo_job(file_a), headers=b),
            client.get(f"/v1/fine_tuning/jobs/{job_a}", headers=b),
            client.post(f"/v1/fine_tuning/jobs/{job_a}/cancel", headers=b),
            client.get(f"/v1/fine_tuning/jobs/{job_a}/events", headers=b),
            client.get(f"/v1/fine_tuning/jobs/{job_a}/checkpoints", headers=b),
        ]
        listed_b = (
            client.get("/v1/files", headers=b).json(),
            client.get("/v1/fine_tuning/jobs", headers=b).json(),
        )
        listed_a = client.get("/v1/fine_tuning/jobs", headers=a).json()
    assert nobody.status_code == 401 and openai_error(nobody)["code"] == "unauthorized"
    assert [r.status_code for r in hidden] == [404] * len(hidden)
    assert all(openai_error(r)["type"] == "invalid_request_error" for r in hidden)
    assert listed_b[0]["data"] == [] and listed_b[1]["data"] == []
    assert [j["id"] for j in listed_a["data"]] == [job_a]


def test_the_openapi_document_describes_the_openai_surface(session: Session) -> None:
    with api_client(session) as client:
        doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    assert {
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints",
    } <= set(paths)
    job_ref = paths["/v1/fine_tuning/jobs"]["post"]["responses"]["200"]["content"]["application/json"][
        "schema"
    ]
    assert job_ref["$ref"].endswith("/FineTuningJob")
    assert paths["/v1/files/{file_id}"]["get"]["responses"]["404"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("/OpenAIErrorBody")
