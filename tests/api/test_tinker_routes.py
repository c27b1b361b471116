"""The Tinker protocol's routes (issue 40) at the API, without a worker: the key as the SDK sends it, the
answers the SDK needs to start, refusals as 4xx with a body naming the field (never a status it retries),
and a model of another project answering as an unknown one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import api_client, make_dataset, make_run


@pytest.fixture
def client(session: Session, tmp_path: Path) -> Iterator[TestClient]:
    with api_client(session, settings=Settings(home=tmp_path, auth=True)) as c:
        yield c


def tml(session: Session) -> tuple[dict[str, str], uuid.UUID]:
    key, row = create_api_key(session=session, project_name=f"t-{uuid.uuid4().hex[:6]}")
    return {"X-API-Key": f"tml-{key}"}, row.project_id


def test_the_sdks_start_up_calls_and_its_key(session: Session, client: TestClient, tmp_path: Path) -> None:
    headers, _ = tml(session)
    assert (
        client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).json()["parallel_fwdbwd_chunks"]
        is False
    )
    assert (
        client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    )
    created = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
    assert created.status_code == 200 and len(created.json()["session_id"]) == 32
    assert client.post("/api/v1/telemetry", json={}).json() == {"status": "accepted"}
    imported = tmp_path / "models" / "org" / "imported-model"  # a folder under the server's model roots
    imported.mkdir(parents=True)
    (imported / "config.json").write_text("{}")
    models = client.get("/api/v1/get_server_capabilities", headers=headers).json()["supported_models"]
    assert {"model_name": "tiny:llama-0.4m"} in models and {"model_name": "org/imported-model"} in models
    assert "/api/v1/create_model" not in client.get("/openapi.json").json()["paths"]  # the SDK's, not ours


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (
            "create_model",
            {"session_id": "nope", "model_seq_id": 0, "base_model": "tiny:llama-0.4m"},
            400,
            "session_id",
        ),
        (
            "create_model",
            {"session_id": "a" * 32, "model_seq_id": -1, "base_model": "tiny:llama-0.4m"},
            400,
            "model_seq_id",
        ),
        (
            "create_model",
            {"session_id": "a" * 32, "model_seq_id": 0, "base_model": "org/none"},
            422,
            "base_model",
        ),
        ("get_info", {"model_id": f"{'a' * 32}:train:0"}, 404, "model_id"),
        ("optim_step", {"model_id": "x", "adam_params": {"learning_rate": 1e-3}}, 404, "model_id"),
        ("retrieve_future", {"request_id": "cmd.not-a-run.1"}, 404, "request_id"),
        ("create_sampling_session", {"base_model": "tiny:llama-0.4m"}, 400, "model_path"),
        ("asample", {"sampling_session_id": "sampler.x.y", "num_samples": 1}, 404, "sampling_session_id"),
        ("save_weights_for_sampler", {"model_id": f"{'a' * 32}:train:0", "path": "s"}, 404, "model_id"),
        ("retrieve_future", {"request_id": f"create.{uuid.uuid4()}"}, 404, "request_id"),
    ],
)
def test_refusals_are_4xx_with_the_field_named(
    session: Session, client: TestClient, path: str, body: dict, status: int, field: str
) -> None:
    headers, _ = tml(session)
    resp = client.post(f"/api/v1/{path}", json=body, headers=headers)
    assert resp.status_code == status, resp.text
    assert resp.json()["field"] == field and resp.json()["detail"]


def test_loading_into_an_existing_client_says_so_and_bad_bodies_are_refused(
    session: Session, client: TestClient
) -> None:
    headers, _ = tml(session)
    legacy = client.post(
        "/api/v1/load_weights", json={"model_id": "m", "path": "p", "seq_id": 2}, headers=headers
    )
    assert legacy.status_code == 400 and "not supported yet" in legacy.json()["detail"]
    unknown = {"session_id": "a" * 32, "model_seq_id": 1, "path": f"tinker://{'b' * 32}:train:0/weights/x"}
    assert client.post("/api/v1/load_weights", json=unknown, headers=headers).status_code == 404
    garbage = client.post(
        "/api/v1/forward_backward",
        content=b"\xff\xfe",
        headers=headers | {"Content-Type": "application/x-protobuf"},
    )
    assert garbage.status_code == 400 and garbage.json()["field"] == "body"


def test_another_projects_model_is_unknown_and_a_finished_one_is_over(
    session: Session, client: TestClient
) -> None:
    mine, project = tml(session)
    theirs, _ = tml(session)
    name = f"{uuid.uuid4().hex}:train:0"
    spec = {"algorithm": "training_session", "model": "tiny:llama-0.4m", "name": name, "hyperparameters": {}}
    dataset = make_dataset(session)
    make_run(
        session,
        dataset,
        spec=spec | {"hyperparameters": {"max_steps": 1}},
        algorithm="training_session",
        name=name,
        project_id=project,
        status="succeeded",
        dataset_id=None,
    )
    assert client.post("/api/v1/get_info", json={"model_id": name}, headers=theirs).status_code == 404
    info = client.post("/api/v1/get_info", json={"model_id": name}, headers=mine)
    assert info.status_code == 400 and "is over" in info.json()["detail"]
