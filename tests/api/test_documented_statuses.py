"""Statuses a 300 s schemathesis run found answered but not documented (issue 41 item 5): each answer here
is one the operation's OpenAPI lists, with the field named, and a refused upload stores nothing."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Dataset
from tests.factories import api_client

PAIR = b'{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'


def documented(client: object, method: str, path: str) -> set[str]:
    spec = client.get("/openapi.json").json()  # type: ignore[attr-defined]
    return set(spec["paths"][path][method]["responses"])


def datasets(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Dataset)) or 0)


def test_a_malformed_json_body_is_a_documented_422_naming_the_body(session: Session) -> None:
    with api_client(session) as client:
        answers = {
            ("patch", "/v1/runs/{run_id}"): client.patch(
                f"/v1/runs/{uuid.uuid4()}", content=b"{bad", headers={"content-type": "application/json"}
            ),
            ("post", "/v1/webhooks"): client.post(
                "/v1/webhooks", content=b'{"url": ', headers={"content-type": "application/json"}
            ),
        }
        # bytes that are not UTF-8 at all (FastAPI's own answer was an undocumented 400)
        not_utf8 = {
            ("patch", "/v1/runs/{run_id}"): client.patch(
                f"/v1/runs/{uuid.uuid4()}",
                content=b"\xff\xfeDq\n",
                headers={"content-type": "application/json"},
            ),
            ("post", "/v1/webhooks"): client.post(
                "/v1/webhooks", content=b"\xff\xc9\xa9\x80", headers={"content-type": "application/json"}
            ),
        }
        listed = {key: documented(client, *key) for key in answers}
    for key, answer in answers.items():
        assert answer.status_code == 422 and "422" in listed[key], (key, answer.text)
        error = answer.json()["error"]
        assert error["field"] == "body" and "not valid JSON" in error["message"], error
        assert "at character" in error["message"]
    for key, answer in not_utf8.items():
        assert answer.status_code == 422 and "422" in listed[key], (key, answer.text)
        error = answer.json()["error"]
        assert error["field"] == "body" and "not valid JSON (not UTF-8)" in error["message"], error


def test_a_multipart_over_its_field_limit_is_a_documented_422_and_stores_nothing(session: Session) -> None:
    before = datasets(session)
    with api_client(session) as client:
        extra = {f"extra{i}": (None, "x") for i in range(11)}
        answer = client.post("/v1/datasets", files={"file": ("pairs.jsonl", PAIR), **extra})
        listed = documented(client, "post", "/v1/datasets")
    assert answer.status_code == 422 and "422" in listed, answer.text
    assert (
        answer.json()["error"]["field"] == "body" and "Too many fields" in answer.json()["error"]["message"]
    )
    assert datasets(session) == before


def test_a_text_field_that_is_not_utf8_is_refused_naming_it_not_stored_as_mojibake(session: Session) -> None:
    before = datasets(session)
    with api_client(session) as client:
        bad = client.post(
            "/v1/datasets", files={"file": ("pairs.jsonl", PAIR), "name": (None, b"caf\xe9 \xff\xfe")}
        )
        bad_file = client.post("/v1/files", files={"file": ("p.jsonl", PAIR), "purpose": (None, b"\xfffine")})
        good = client.post(
            "/v1/datasets", files={"file": ("pairs.jsonl", PAIR), "name": (None, "café 名".encode())}
        )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "name", bad.text
    assert "not valid UTF-8" in bad.json()["error"]["message"]
    # the OpenAI route keeps OpenAI's shape: 400 naming the parameter
    assert bad_file.status_code == 400 and bad_file.json()["error"]["param"] == "purpose", bad_file.text
    assert good.status_code == 201 and good.json()["name"] == "café 名"  # real UTF-8 is kept as sent
    assert datasets(session) == before + 1


def test_a_bad_models_query_and_an_unknown_runs_stream_answer_documented_statuses(session: Session) -> None:
    with api_client(session) as client:
        models = client.get("/v1/models", params={"runs": -1})
        stream = client.get(f"/v1/runs/{uuid.uuid4()}/stream")
        listed_models = documented(client, "get", "/v1/models")
        listed_stream = documented(client, "get", "/v1/runs/{run_id}/stream")
    assert models.status_code == 400 and "400" in listed_models
    assert models.json()["error"]["param"] == "runs"
    assert stream.status_code == 404 and "404" in listed_stream
    assert stream.json()["error"]["field"] == "run_id"
