"""Pipelines and checkpoints over the API, with the worker's part played by direct DB updates."""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Checkpoint, Pipeline, Run, utcnow
from api.services.pipelines import advance
from tests.factories import FakeEnqueue, api_client, make_dataset, make_run


def spec(
    algorithm: str, dataset_id: uuid.UUID, model: str = "tiny:llama-0.4m", **extra: Any
) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "model": model,
        "dataset_id": str(dataset_id),
        "hyperparameters": {"max_steps": 2},
        **extra,
    }


def finish(session: Session, run_id: str | uuid.UUID, status: str) -> None:
    run = session.get(Run, uuid.UUID(str(run_id)))
    assert run is not None
    run.status, run.finished_at = status, utcnow()
    if status == "succeeded":
        run.output_path = f"/tmp/{run.id}"
    session.flush()


def test_wrong_dataset_kind_and_validation_kind_are_refused(session: Session) -> None:
    prefs = make_dataset(session)
    sft = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    with api_client(session) as client:
        wrong = client.post("/v1/runs", json=spec("sft", prefs.id))
        wrong_val = client.post("/v1/runs", json=spec("dpo", prefs.id, validation_dataset_id=str(sft.id)))
        both = client.post(
            "/v1/runs",
            json=spec("dpo", prefs.id, validation_dataset_id=str(prefs.id), validation_fraction=0.1),
        )
        stage_ref = client.post("/v1/runs", json=spec("dpo", prefs.id, model="stage:sft"))
        rm_ok = client.post("/v1/runs", json=spec("reward_model", prefs.id))
    assert wrong.status_code == 409 and wrong.json()["error"]["field"] == "dataset_id"
    assert "kind 'preference'; sft needs 'sft'" in wrong.json()["error"]["message"]
    assert wrong_val.status_code == 409 and wrong_val.json()["error"]["field"] == "validation_dataset_id"
    assert both.status_code == 422
    assert stage_ref.status_code == 409 and stage_ref.json()["error"]["field"] == "model"
    assert rm_ok.status_code == 201


def test_run_refs_to_failed_runs_and_missing_checkpoints_are_refused(session: Session) -> None:
    ds = make_dataset(session)
    failed = make_run(session, ds, status="failed")
    done = make_run(session, ds, status="succeeded", output_path="/tmp/x")
    session.add(Checkpoint(run_id=done.id, step=5, path="/tmp/x/step-5", size_bytes=1, metrics={}))
    session.flush()
    before = session.scalar(select(func.count()).select_from(Run))
    with api_client(session) as client:
        to_failed = client.post("/v1/runs", json=spec("dpo", ds.id, model=f"run:{failed.id}"))
        no_ckpt = client.post("/v1/runs", json=spec("dpo", ds.id, model=f"run:{done.id}@7"))
        malformed = client.post("/v1/runs", json=spec("dpo", ds.id, model="run:xyz"))
        assert session.scalar(select(func.count()).select_from(Run)) == before
        ok_final = client.post("/v1/runs", json=spec("dpo", ds.id, model=f"run:{done.id}"))
        ok_ckpt = client.post("/v1/runs", json=spec("dpo", ds.id, model=f"run:{done.id}@5"))
    assert to_failed.status_code == 409 and to_failed.json()["error"]["field"] == "model"
    assert "failed" in to_failed.json()["error"]["message"]
    assert no_ckpt.status_code == 409 and "no checkpoint at step 7" in no_ckpt.json()["error"]["message"]
    assert malformed.status_code == 422 and malformed.json()["error"]["field"] == "model"
    assert ok_final.status_code == 201 and ok_ckpt.status_code == 201


def test_pipeline_starts_stages_as_inputs_succeed(session: Session) -> None:
    sft_ds = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    prefs = make_dataset(session)
    enqueue = FakeEnqueue()
    body = {
        "name": "classic",
        "stages": [
            {"name": "sft", "spec": spec("sft", sft_ds.id)},
            {"name": "rm", "spec": spec("reward_model", prefs.id, model="stage:sft")},
            {"name": "dpo", "spec": spec("dpo", prefs.id, model="stage:sft", reference_model="stage:sft")},
        ],
    }
    with api_client(session, enqueue=enqueue) as client:
        created = client.post("/v1/pipelines", json=body)
        assert created.status_code == 201, created.text
        p = created.json()
        assert [(s["name"], s["status"]) for s in p["stages"]] == [
            ("sft", "queued"),
            ("rm", "waiting"),
            ("dpo", "waiting"),
        ]
        sft_run = p["stages"][0]["run_id"]
        assert enqueue.sent == [uuid.UUID(sft_run)]
        finish(session, sft_run, "succeeded")
        assert len(advance(session=session, pipeline_id=uuid.UUID(p["id"]))) == 2
        p = client.get(f"/v1/pipelines/{p['id']}").json()
        dpo_run = client.get(f"/v1/runs/{p['stages'][2]['run_id']}").json()
        assert dpo_run["spec"]["model"] == dpo_run["spec"]["reference_model"] == f"run:{sft_run}"
        assert dpo_run["pipeline_id"] == p["id"] and dpo_run["stage"] == "dpo"
        finish(session, p["stages"][1]["run_id"], "succeeded")
        finish(session, p["stages"][2]["run_id"], "succeeded")
        advance(session=session, pipeline_id=uuid.UUID(p["id"]))
        final = client.get(f"/v1/pipelines/{p['id']}").json()
    assert final["status"] == "succeeded" and final["finished_at"] is not None


def test_a_failed_stage_cancels_the_rest_with_a_reason(session: Session) -> None:
    sft_ds = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    prefs = make_dataset(session)
    body = {
        "stages": [
            {"name": "sft", "spec": spec("sft", sft_ds.id)},
            {"name": "dpo", "spec": spec("dpo", prefs.id, model="stage:sft")},
        ]
    }
    with api_client(session) as client:
        p = client.post("/v1/pipelines", json=body).json()
        finish(session, p["stages"][0]["run_id"], "failed")
        advance(session=session, pipeline_id=uuid.UUID(p["id"]))
        p = client.get(f"/v1/pipelines/{p['id']}").json()
        events = client.get(f"/v1/runs/{p['stages'][1]['run_id']}/events").json()["data"]
    assert p["status"] == "failed" and p["reason"] == "stage 'sft' failed"
    assert p["stages"][1]["status"] == "cancelled"
    assert events[-1]["data"] == {"reason": "pipeline: stage 'sft' failed"}


def test_cancel_pipeline_cancels_the_running_stage_and_the_rest(session: Session) -> None:
    sft_ds = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    prefs = make_dataset(session)
    body = {
        "stages": [
            {"name": "sft", "spec": spec("sft", sft_ds.id)},
            {"name": "dpo", "spec": spec("dpo", prefs.id, model="stage:sft")},
        ]
    }
    with api_client(session) as client:
        p = client.post("/v1/pipelines", json=body).json()
        session.get(Run, uuid.UUID(p["stages"][0]["run_id"])).status = "running"  # type: ignore[union-attr]
        session.flush()
        cancelled = client.post(f"/v1/pipelines/{p['id']}/cancel")
        again = client.post(f"/v1/pipelines/{p['id']}/cancel")
        sft_run = client.get(f"/v1/runs/{p['stages'][0]['run_id']}").json()
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert [s["status"] for s in cancelled.json()["stages"]] == ["running", "cancelled"]
    assert sft_run["cancel_requested"] is True
    assert again.status_code == 409


def test_bad_pipelines_are_refused_with_the_field_and_store_nothing(session: Session) -> None:
    prefs = make_dataset(session)
    before = session.scalar(select(func.count()).select_from(Pipeline))
    cases = {
        "stages.1.name": [
            {"name": "a", "spec": spec("dpo", prefs.id)},
            {"name": "bad name!", "spec": spec("dpo", prefs.id)},
        ],
        "stages[1].name": [
            {"name": "a", "spec": spec("dpo", prefs.id)},
            {"name": "a", "spec": spec("dpo", prefs.id)},
        ],
        "stages[0].spec.model": [
            {"name": "a", "spec": spec("dpo", prefs.id, model="stage:b")},
            {"name": "b", "spec": spec("dpo", prefs.id)},
        ],
        "stages[0].spec.dataset_id": [{"name": "a", "spec": spec("sft", prefs.id)}],
    }
    with api_client(session) as client:
        for field, stages in cases.items():
            resp = client.post("/v1/pipelines", json={"stages": stages})
            assert resp.status_code in (409, 422), resp.text
            assert resp.json()["error"]["field"] == field, (field, resp.json())
        missing = client.get(f"/v1/pipelines/{uuid.uuid4()}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "pipeline_not_found"
    assert session.scalar(select(func.count()).select_from(Pipeline)) == before


def test_checkpoints_list_and_download_as_tar(session: Session, tmp_path: Path) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds, status="succeeded")
    folder = tmp_path / "step-00000004"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 5000)  # not a multiple of 512
    session.add(
        Checkpoint(run_id=run.id, step=4, path=str(folder), size_bytes=1_280_008, metrics={"loss": 0.5})
    )
    session.flush()
    with api_client(session) as client:
        listed = client.get(f"/v1/runs/{run.id}/checkpoints").json()
        # a browser asks for gzip: the tar still comes whole, with its length (progress, cut downloads)
        tar_resp = client.get(
            f"/v1/runs/{run.id}/checkpoints/4/download", headers={"Accept-Encoding": "gzip"}
        )
        missing = client.get(f"/v1/runs/{run.id}/checkpoints/9/download")
    assert listed == [
        {
            "step": 4,
            "size_bytes": 1_280_008,
            "metrics": {"loss": 0.5},
            "created_at": listed[0]["created_at"],
            "model_ref": f"run:{run.id}@4",
        }
    ]
    assert tar_resp.status_code == 200 and tar_resp.headers["content-type"] == "application/x-tar"
    assert int(tar_resp.headers["content-length"]) == len(tar_resp.content)
    assert "content-encoding" not in tar_resp.headers
    with tarfile.open(fileobj=io.BytesIO(tar_resp.content)) as tar:
        names = sorted(tar.getnames())
        weights = tar.extractfile(f"{run.id}-step-4/sub/weights.bin").read()  # type: ignore[union-attr]
    assert names == [f"{run.id}-step-4/config.json", f"{run.id}-step-4/sub/weights.bin"]
    assert weights == bytes(range(256)) * 5000
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
