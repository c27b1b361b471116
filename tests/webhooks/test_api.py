"""/v1/webhooks: registration behind the allow-list, secrets shown once, project scoping, the log."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Webhook
from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import api_client


@pytest.fixture
def client(session: Session, tmp_path: Path) -> Iterator[TestClient]:
    with api_client(session, settings=Settings(home=tmp_path, webhook_allow_loopback=True)) as c:
        yield c


def count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Webhook)) or 0


def test_register_list_get_delete(client: TestClient) -> None:
    resp = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/h", "description": "ci"})
    assert resp.status_code == 201, resp.text
    created = resp.json()
    assert created["secret"].startswith("whsec_")
    assert created["event_types"] == ["run.succeeded", "run.failed", "run.cancelled"]
    listed = client.get("/v1/webhooks").json()
    mine = [w for w in listed if w["id"] == created["id"]]
    assert len(mine) == 1 and "secret" not in mine[0] and mine[0]["description"] == "ci"
    got = client.get(f"/v1/webhooks/{created['id']}").json()
    assert got["url"] == "http://127.0.0.1:9/h" and "secret" not in got
    assert client.get(f"/v1/webhooks/{created['id']}/deliveries").json() == {
        "data": [],
        "has_more": False,
        "next_cursor": None,
    }
    assert client.delete(f"/v1/webhooks/{created['id']}").status_code == 204
    assert client.get(f"/v1/webhooks/{created['id']}").status_code == 404


def test_loopback_is_refused_unless_configured_and_nothing_is_stored(
    session: Session, tmp_path: Path
) -> None:
    before = count(session)
    with api_client(session, settings=Settings(home=tmp_path)) as strict:
        for url in ("http://127.0.0.1:8000/v1/runs", "http://localhost/", "http://169.254.169.254/latest"):
            resp = strict.post("/v1/webhooks", json={"url": url})
            assert resp.status_code == 422, resp.text
            error = resp.json()["error"]
            assert error["field"] == "url" and error["code"] == "webhook_url_refused", error
    assert count(session) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://x/"}, "url"),
        ({"url": ""}, "url"),
        ({"url": "http://127.0.0.1/", "event_types": ["run.started"]}, "event_types.0"),
        ({"url": "http://127.0.0.1/", "event_types": []}, "event_types"),
        ({"url": "http://127.0.0.1/", "secret": "mine"}, "secret"),
    ],
)
def test_bad_bodies_name_the_field(
    client: TestClient, session: Session, body: dict[str, object], field: str
) -> None:
    before = count(session)
    resp = client.post("/v1/webhooks", json=body)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
    assert count(session) == before


def test_event_type_subset_is_kept(client: TestClient) -> None:
    resp = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/", "event_types": ["run.failed"]})
    assert resp.status_code == 201 and resp.json()["event_types"] == ["run.failed"]


def test_unknown_ids_and_bad_cursors(client: TestClient) -> None:
    assert client.get(f"/v1/webhooks/{uuid.uuid4()}").json()["error"]["code"] == "webhook_not_found"
    assert client.delete(f"/v1/webhooks/{uuid.uuid4()}").status_code == 404
    hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"}).json()
    resp = client.get(f"/v1/webhooks/{hook['id']}/deliveries", params={"after": "garbage"})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "after"


def test_webhooks_are_per_project(session: Session, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, auth=True, webhook_allow_loopback=True)
    key_a, _ = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    with api_client(session, settings=settings) as client:
        a = {"Authorization": f"Bearer {key_a}"}
        b = {"Authorization": f"Bearer {key_b}"}
        assert client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"}).status_code == 401
        hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"}, headers=a).json()
        assert client.get("/v1/webhooks", headers=b).json() == []
        assert client.get(f"/v1/webhooks/{hook['id']}", headers=b).status_code == 404
        assert client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=b).status_code == 404
        assert client.delete(f"/v1/webhooks/{hook['id']}", headers=b).status_code == 404
        assert [w["id"] for w in client.get("/v1/webhooks", headers=a).json()] == [hook["id"]]
