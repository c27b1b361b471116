"""Dataset upload: formats, atomicity, error shape, limits, listing — on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

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
    assert stats["flags"] == {"identical_pairs": 1, "empty_pairs": 1, "with_margin": 0}
    assert stats["source_formats"] == {"plain": 8}
    # chosen lengths: "0","2","4","6","8","0","same","  " -> chars 1,1,1,1,1,1,4,2
    assert stats["lengths"]["chosen"] == {"mean": pytest.approx(12 / 8), "max": 4}
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
    assert resp.json()["stats"]["lengths"]["rejected"] == {"mean": 40.0, "max": 40}
    assert (
        session.scalar(
            select(func.count())
            .select_from(DatasetRow)
            .where(DatasetRow.dataset_id == uuid.UUID(resp.json()["id"]))
        )
        == 1200
    )


def rows_of(client, dataset_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [r["data"] for r in client.get(f"/v1/datasets/{dataset_id}/rows").json()["data"]]


def test_sft_kind_formats_and_stats(session: Session) -> None:
    lines = [
        {"prompt": "Q", "completion": "A"},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A2"},
            ]
        },
        {"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": " "}]},
    ]
    with api_client(session) as client:
        resp = upload(client, jsonl(lines), kind="sft")
        assert resp.status_code == 201, resp.text
        got = rows_of(client, resp.json()["id"])
    assert got == [
        {"prompt": "Q", "completion": "A"},
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q"}],
            "completion": "A2",
        },
        {"prompt": [{"role": "user", "content": "Q"}], "completion": " "},
    ]
    stats = resp.json()["stats"]
    assert stats["source_formats"] == {"chat": 1, "conversational": 1, "plain": 1}
    assert stats["flags"] == {"empty_completions": 1}
    assert stats["lengths"]["completion"] == {"mean": pytest.approx(4 / 3), "max": 2}


def test_ranking_kind_and_its_errors(session: Session) -> None:
    good = [{"prompt": "Q", "responses": ["best", "mid", "worst"]}, {"prompt": "Q2", "responses": ["a", "a"]}]
    with api_client(session) as client:
        ok = upload(client, jsonl(good), kind="ranking")
        one = upload(client, jsonl([{"prompt": "Q", "responses": ["only"]}]), kind="ranking")
        typed = upload(client, jsonl([{"prompt": "Q", "responses": ["a", 3]}]), kind="ranking")
    assert ok.status_code == 201
    assert ok.json()["stats"]["lengths"]["candidates"] == {"mean": 2.5, "max": 3}
    assert ok.json()["stats"]["flags"]["duplicate_responses"] == 1
    assert one.status_code == 422 and one.json()["error"]["details"][0]["field"] == "responses"
    assert typed.status_code == 422 and typed.json()["error"]["details"][0]["field"] == "responses[1]"


def test_preference_margin_is_kept_and_validated(session: Session) -> None:
    with api_client(session) as client:
        ok = upload(client, jsonl([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 2}]))
        bad = upload(client, jsonl([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}]))
        assert rows_of(client, ok.json()["id"]) == [
            {"prompt": "p", "chosen": "a", "rejected": "b", "margin": 2.0}
        ]
    assert ok.json()["stats"]["flags"]["with_margin"] == 1
    assert bad.status_code == 422 and bad.json()["error"]["details"][0]["field"] == "margin"


GSM8K = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"  # copied from shared/data


def test_real_gsm8k_uploads_as_prompts(session: Session) -> None:
    with api_client(session) as client:
        resp = upload(client, GSM8K.read_bytes(), name="gsm8k.jsonl", kind="prompts")
        assert resp.status_code == 201, resp.text
        first = rows_of(client, resp.json()["id"])[0]
    source = json.loads(GSM8K.read_text().splitlines()[0])
    assert resp.json()["row_count"] == 1319
    assert resp.json()["stats"]["source_formats"] == {"question": 1319}
    assert resp.json()["stats"]["flags"] == {"with_answer": 1319}
    assert first == {"prompt": source["question"], "answer": source["answer"], "meta": {}}
    assert first["answer"].rsplit("####", 1)[1].strip().isdigit()


def test_prompts_kind_keeps_extra_fields_as_meta(session: Session) -> None:
    with api_client(session) as client:
        resp = upload(
            client,
            jsonl([{"prompt": "2+2?", "answer": 4, "level": "easy"}, {"prompt": "hi"}]),
            kind="prompts",
        )
        got = rows_of(client, resp.json()["id"])
    assert got == [
        {"prompt": "2+2?", "answer": "4", "meta": {"level": "easy"}},
        {"prompt": "hi", "answer": None, "meta": {}},
    ]


def test_openai_reinforcement_lines_upload_as_prompts_detected_or_named(session: Session) -> None:
    lines = [
        {
            "messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2?"}],
            "answer": 4,
        },
        {"messages": [{"role": "user", "content": "capital?"}], "answer": {"city": "Oslo"}, "tags": ["geo"]},
    ]
    with api_client(session) as client:
        # no kind given: the messages end in a user turn
        detected = client.post("/v1/datasets", files={"file": ("rft.jsonl", jsonl(lines))})
        named = upload(client, jsonl(lines), kind="prompts")
        as_sft = upload(client, jsonl(lines), kind="sft")
        ends_with_assistant = upload(
            client,
            jsonl([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]),
            kind="prompts",
        )
        assert detected.status_code == named.status_code == 201, detected.text
        assert detected.json()["kind"] == "prompts" and detected.json()["stats"]["source_formats"] == {
            "rft": 2
        }
        got = rows_of(client, detected.json()["id"])
    assert got == [
        {"prompt": lines[0]["messages"], "answer": "4", "meta": {}},
        # an answer that is no string or number stays a field for graders (item.answer)
        {
            "prompt": lines[1]["messages"],
            "answer": None,
            "meta": {"answer": {"city": "Oslo"}, "tags": ["geo"]},
        },
    ]
    assert as_sft.status_code == 422 and "assistant message" in as_sft.text
    assert ends_with_assistant.status_code == 422 and "missing field 'prompt'" in ends_with_assistant.text


def test_unpaired_answers_upload_with_their_labels_counted(session: Session) -> None:
    lines = [
        {"prompt": "2+2=", "completion": "4", "label": True},
        {
            "prompt": [{"role": "user", "content": "2+3="}],
            "completion": [{"role": "assistant", "content": "6"}],
            "label": False,
        },
        {"prompt": "2+4=", "completion": "6", "label": True},
    ]
    with api_client(session) as client:
        detected = client.post("/v1/datasets", files={"file": ("kto.jsonl", jsonl(lines))})
        assert detected.status_code == 201, detected.text
        body = detected.json()
        got = rows_of(client, body["id"])
        not_bool = upload(
            client, jsonl([{"prompt": "p", "completion": "c", "label": "yes"}]), kind="unpaired"
        )
        no_label = upload(client, jsonl([{"prompt": "p", "completion": "c"}]), kind="unpaired")
    assert body["kind"] == "unpaired" and body["stats"]["source_formats"] == {"plain": 2, "conversational": 1}
    assert body["stats"]["flags"]["desirable"] == 2 and body["stats"]["flags"]["undesirable"] == 1
    assert got[1] == {"prompt": lines[1]["prompt"], "completion": "6", "label": False}
    assert not_bool.status_code == 422 and not_bool.json()["error"]["details"][0]["field"] == "label"
    assert no_label.status_code == 422 and "label" in no_label.text


def test_dataset_kind_names_agree_between_api_and_db() -> None:
    from typing import get_args

    from api.models import DATASET_KINDS
    from rlrun.formats import NORMALIZERS
    from rlrun.schemas import DatasetKind

    assert set(get_args(DatasetKind)) == set(DATASET_KINDS) == set(NORMALIZERS)
