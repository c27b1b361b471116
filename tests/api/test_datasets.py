"""Dataset upload: formats, atomicity, error shape, limits, listing — on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Dataset, DatasetRow
from api.settings import Settings
from tests.factories import api_client, jsonl, pair_rows


def count_datasets(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Dataset)) or 0)


def upload(client, data: bytes, name: str = "d.jsonl", kind: str = "preference"):  # type: ignore[no-untyped-def]
    return client.post("/v1/datasets", files={"file": (name, data)}, data={"kind": kind})


def test_upload_plain_pairs_stores_rows_and_stats(session: Session) -> None:
    rows = pair_rows(5) + [pair_rows(1)[0]]  # one exact duplicate
    rows.append({"prompt": "p", "chosen": "same", "rejected": "same"})
    rows.append({"prompt": "p", "chosen": "  ", "rejected": "x"})
    with api_client(session) as client:
        resp = upload(client, jsonl(rows))
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["row_count"] == 8 and body["kind"] == "preference"
    stats = body["stats"]
    assert stats["exact_duplicates"] == 1
    assert stats["identical_pairs"] == 1
    assert stats["empty_pairs"] == 1
    assert stats["source_formats"] == {"plain": 8}
    # chosen lengths: "0","2","4","6","8","0","same","  " -> chars 1,1,1,1,1,1,4,2
    assert stats["chosen_chars"] == {"mean": pytest.approx(12 / 8), "max": 4}
    stored = session.scalars(
        select(DatasetRow).where(DatasetRow.dataset_id == uuid.UUID(body["id"])).order_by(DatasetRow.index)
    ).all()
    assert [r.data for r in stored] == rows


def test_every_accepted_format_normalises_to_one_form(session: Session) -> None:
    lines = [
        {"prompt": "Q?", "chosen": "A", "rejected": "B"},
        {
            "input": {"messages": [{"role": "user", "content": "Q?"}]},
            "preferred_output": [{"role": "assistant", "content": "A"}],
            "non_preferred_output": [{"role": "assistant", "content": "B"}],
        },
        {
            "chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}],
            "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "B"}],
        },
        {"chosen": "\n\nHuman: Q?\n\nAssistant: A", "rejected": "\n\nHuman: Q?\n\nAssistant: B"},
    ]
    with api_client(session) as client:
        resp = upload(client, jsonl(lines))
        assert resp.status_code == 201, resp.text
        ds = resp.json()
        got = client.get(f"/v1/datasets/{ds['id']}/rows").json()["data"]
    assert ds["stats"]["source_formats"] == {"chat": 1, "hh": 1, "openai": 1, "plain": 1}
    chat_prompt = [{"role": "user", "content": "Q?"}]
    assert [r["data"] for r in got] == [
        {"prompt": "Q?", "chosen": "A", "rejected": "B"},
        {"prompt": chat_prompt, "chosen": "A", "rejected": "B"},
        {"prompt": chat_prompt, "chosen": "A", "rejected": "B"},
        {"prompt": "\n\nHuman: Q?\n\nAssistant:", "chosen": " A", "rejected": " B"},
    ]


def test_hh_prompt_is_prefix_up_to_last_assistant_turn(session: Session) -> None:
    convo = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant:"
    with api_client(session) as client:
        resp = upload(client, jsonl([{"chosen": convo + " 4", "rejected": convo + " 5"}]))
        rows = client.get(f"/v1/datasets/{resp.json()['id']}/rows").json()["data"]
    assert rows[0]["data"] == {"prompt": convo, "chosen": " 4", "rejected": " 5"}


BAD_CASES = [
    (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n',
        2,
        None,
        "invalid JSON",
    ),
    (b'{"prompt": "a", "chosen": "b"}\n', 1, "rejected", "missing field 'rejected'"),
    (b'{"prompt": "a", "chosen": 3, "rejected": "c"}\n', 1, "chosen", "must be a string"),
    (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
        b'{"prompt": "\xff\xfe", "chosen": "b", "rejected": "c"}\n',
        2,
        None,
        "not valid UTF-8",
    ),
    (b"[1, 2]\n", 1, None, "expected a JSON object"),
    (
        b'{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
        b'"rejected": [{"role": "user", "content": "q"}, {"role": "bot", "content": "b"}]}\n',
        1,
        "rejected[1].role",
        "must be one of",
    ),
]


@pytest.mark.parametrize(("data", "line", "field", "message"), BAD_CASES)
def test_bad_line_is_refused_with_line_and_field_and_stores_nothing(
    session: Session, data: bytes, line: int, field: str | None, message: str
) -> None:
    before = count_datasets(session)
    rows_before = session.scalar(select(func.count()).select_from(DatasetRow))
    with api_client(session) as client:
        resp = upload(client, data)
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert err["code"] == "dataset_invalid"
    detail = err["details"][0]
    assert detail["line"] == line
    assert detail.get("field") == field
    assert message in detail["message"]
    assert count_datasets(session) == before
    assert session.scalar(select(func.count()).select_from(DatasetRow)) == rows_before


def test_errors_are_capped_at_20_and_counted(session: Session) -> None:
    data = jsonl(pair_rows(3)) + b"not json\n" * 30
    with api_client(session) as client:
        resp = upload(client, data)
    err = resp.json()["error"]
    assert resp.status_code == 422
    assert len(err["details"]) == 20
    assert [d["line"] for d in err["details"]] == list(range(4, 24))
    assert err["message"].startswith("30 invalid line(s); first at line 4")


def test_empty_file_is_refused(session: Session) -> None:
    before = count_datasets(session)
    with api_client(session) as client:
        resp = upload(client, b"\n\n")
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "file"
    assert count_datasets(session) == before


def test_upload_over_the_size_limit_is_413_and_stores_nothing(session: Session, tmp_path) -> None:  # type: ignore[no-untyped-def]
    before = count_datasets(session)
    data = jsonl(pair_rows(400))
    settings = Settings(home=tmp_path, max_upload_bytes=len(data) // 2)
    with api_client(session, settings=settings) as client:
        resp = upload(client, data)  # declared length within the multipart slack? no: body is 2x the limit
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "payload_too_large"
    assert count_datasets(session) == before


def test_size_limit_is_enforced_while_reading_not_only_from_the_header(session: Session, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = jsonl(pair_rows(400))
    settings = Settings(home=tmp_path, max_upload_bytes=len(data) - 10)  # within header slack
    before = count_datasets(session)
    with api_client(session, settings=settings) as client:
        resp = upload(client, data)
    assert resp.status_code == 413
    assert count_datasets(session) == before


def test_json_body_upload_and_unknown_kind(session: Session) -> None:
    with api_client(session) as client:
        ok = client.post("/v1/datasets", json={"name": "small", "rows": pair_rows(2)})
        bad_kind = client.post("/v1/datasets", json={"name": "small", "kind": "weird", "rows": pair_rows(2)})
        bad_multipart_kind = upload(client, jsonl(pair_rows(2)), kind="weird")
        wrong_type = client.post("/v1/datasets", content=b"x", headers={"content-type": "text/plain"})
    assert ok.status_code == 201 and ok.json()["row_count"] == 2 and ok.json()["name"] == "small"
    assert bad_kind.status_code == 422 and bad_kind.json()["error"]["field"] == "kind"
    assert bad_multipart_kind.status_code == 422 and bad_multipart_kind.json()["error"]["field"] == "kind"
    assert wrong_type.status_code == 415


def test_list_and_read_and_paginate(session: Session) -> None:
    with api_client(session) as client:
        ids = [upload(client, jsonl(pair_rows(3)), name=f"d{i}").json()["id"] for i in range(3)]
        first = client.get("/v1/datasets", params={"limit": 2}).json()
        second = client.get("/v1/datasets", params={"limit": 2, "after": first["next_cursor"]}).json()
        one = client.get(f"/v1/datasets/{ids[0]}")
        missing = client.get(f"/v1/datasets/{uuid.uuid4()}")
        rows_p1 = client.get(f"/v1/datasets/{ids[0]}/rows", params={"limit": 2}).json()
        rows_p2 = client.get(f"/v1/datasets/{ids[0]}/rows", params={"after": rows_p1["next_cursor"]}).json()
        bad_cursor = client.get("/v1/datasets", params={"after": "garbage!"})
    listed = [d["id"] for d in first["data"]] + [d["id"] for d in second["data"]]
    assert first["has_more"] is True
    assert listed[:3] == ids[::-1]  # newest first, no repeats across pages
    assert one.status_code == 200 and one.json()["row_count"] == 3
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "dataset_not_found"
    assert [r["index"] for r in rows_p1["data"]] == [0, 1] and rows_p1["has_more"]
    assert [r["index"] for r in rows_p2["data"]] == [2] and not rows_p2["has_more"]
    assert bad_cursor.status_code == 422 and bad_cursor.json()["error"]["field"] == "after"


def test_large_upload_is_read_in_batches(session: Session) -> None:
    rows = [{"prompt": f"p{i}", "chosen": "c" * 50, "rejected": "r" * 40} for i in range(1200)]
    with api_client(session) as client:
        resp = upload(client, "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert resp.status_code == 201
    assert resp.json()["stats"]["rejected_chars"] == {"mean": 40.0, "max": 40}
    assert (
        session.scalar(
            select(func.count())
            .select_from(DatasetRow)
            .where(DatasetRow.dataset_id == uuid.UUID(resp.json()["id"]))
        )
        == 1200
    )
