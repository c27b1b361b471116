"""API keys and projects: every endpoint needs a key when auth is on, and a key sees only its project."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.models import Checkpoint
from api.services.auth import create_api_key, revoke_api_key
from api.settings import Settings
from tests.factories import api_client, dpo_spec, jsonl, pair_rows


@pytest.fixture
def client(session: Session, tmp_path: Path) -> Iterator[TestClient]:
    with api_client(session, settings=Settings(home=tmp_path, auth=True, max_runs_in_flight=3)) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(client: TestClient, key: str) -> str:
    resp = client.post(
        "/v1/datasets",
        files={"file": ("d.jsonl", jsonl(pair_rows(4)))},
        data={"kind": "preference"},
        headers=bearer(key),
    )
    assert resp.status_code == 201, resp.text
    dataset_id: str = resp.json()["id"]
    return dataset_id


def test_no_key_bad_key_and_revoked_key_get_401(client: TestClient, session: Session) -> None:
    key, row = create_api_key(session=session, project_name=f"p-{uuid.uuid4().hex[:6]}")
    assert client.get("/v1/runs", headers=bearer(key)).status_code == 200
    for headers in (
        {},
        bearer("rlrun_nope_nope"),
        bearer(key[:-2] + "xx"),
        {"Authorization": f"Basic {key}"},
    ):
        resp = client.get("/v1/runs", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized", headers
    assert revoke_api_key(session=session, prefix=row.prefix)
    assert client.get("/v1/runs", headers=bearer(key)).status_code == 401


def test_a_key_sees_only_its_projects_rows(client: TestClient, session: Session) -> None:
    key_a, _ = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    ds_a = upload(client, key_a)
    run_a = client.post("/v1/runs", json=dpo_spec(uuid.UUID(ds_a)), headers=bearer(key_a)).json()["id"]
    session.add(Checkpoint(run_id=uuid.UUID(run_a), step=1, path="/nowhere", size_bytes=1, metrics={}))
    session.flush()
    b = bearer(key_b)
    hidden: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/v1/runs/{run_a}", None),
        ("GET", f"/v1/runs/{run_a}/metrics", None),
        ("GET", f"/v1/runs/{run_a}/events", None),
        ("GET", f"/v1/runs/{run_a}/checkpoints", None),
        ("GET", f"/v1/runs/{run_a}/samples", None),
        ("GET", f"/v1/runs/{run_a}/stream", None),
        ("POST", f"/v1/runs/{run_a}/cancel", None),
        ("POST", f"/v1/runs/{run_a}/pause", None),
        ("GET", f"/v1/datasets/{ds_a}", None),
        ("GET", f"/v1/datasets/{ds_a}/rows", None),
        ("POST", "/v1/runs", dpo_spec(uuid.UUID(ds_a))),
    ]
    for method, path, body in hidden:
        resp = client.request(method, path, headers=b, json=body)
        assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
    steal = client.post(
        "/v1/runs", json={**dpo_spec(uuid.UUID(upload(client, key_b))), "model": f"run:{run_a}@1"}, headers=b
    )
    assert steal.status_code == 409 and "does not exist" in steal.json()["error"]["message"]
    assert client.get("/v1/runs", headers=b).json()["data"] == []
    assert [d["id"] for d in client.get("/v1/datasets", headers=b).json()["data"]] != [ds_a]
    assert [r["id"] for r in client.get("/v1/runs", headers=bearer(key_a)).json()["data"]] == [run_a]


def test_idempotency_keys_are_per_project(client: TestClient, session: Session) -> None:
    key_a, _ = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    ds_a, ds_b = upload(client, key_a), upload(client, key_b)
    same = {"Idempotency-Key": "retry-1"}
    a = client.post("/v1/runs", json=dpo_spec(uuid.UUID(ds_a)), headers=bearer(key_a) | same)
    b = client.post("/v1/runs", json=dpo_spec(uuid.UUID(ds_b)), headers=bearer(key_b) | same)
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]


def test_runs_in_flight_per_project_are_limited_with_429(client: TestClient, session: Session) -> None:
    key, _ = create_api_key(session=session, project_name=f"l-{uuid.uuid4().hex[:6]}")
    ds = upload(client, key)
    codes = [
        client.post("/v1/runs", json=dpo_spec(uuid.UUID(ds)), headers=bearer(key)).status_code
        for _ in range(4)
    ]
    assert codes == [201, 201, 201, 429]
    other, _ = create_api_key(session=session, project_name=f"o-{uuid.uuid4().hex[:6]}")
    assert (
        client.post(
            "/v1/runs", json=dpo_spec(uuid.UUID(upload(client, other))), headers=bearer(other)
        ).status_code
        == 201
    )  # the limit is per project
