"""/v1/files in process, on SQLite and PostgreSQL: upload (kind detection, atomicity), list, read,
delete, and OpenAI's error shape."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

from openai.types import FileObject as SdkFileObject
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Dataset, DatasetRow, utcnow
from tests.factories import api_client, jsonl, make_dataset, make_run
from tests.openai.helpers import chat_lines, dpo_line, dpo_lines, openai_error, upload_file


def count(session: Session, table: type) -> int:
    return int(session.scalar(select(func.count()).select_from(table)) or 0)


def test_an_openai_dpo_file_becomes_a_preference_dataset(session: Session) -> None:
    data = jsonl(dpo_lines(5))
    with api_client(session) as client:
        resp = upload_file(client, data)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    SdkFileObject.model_validate(body)
    assert body["object"] == "file" and body["purpose"] == "fine-tune" and body["status"] == "processed"
    assert body["bytes"] == len(data) and body["filename"] == "train.jsonl"
    assert isinstance(body["created_at"], int)
    dataset = session.get(Dataset, uuid.UUID(hex=body["id"].removeprefix("file-")))
    assert dataset is not None and dataset.kind == "preference" and dataset.row_count == 5
    row = session.get(DatasetRow, (dataset.id, 0))
    assert row is not None and row.data == {
        "prompt": [{"role": "user", "content": "0+0="}],
        "chosen": "0",
        "rejected": "1",
    }


def test_a_chat_file_becomes_an_sft_dataset(session: Session) -> None:
    with api_client(session) as client:
        body = upload_file(client, b"\n" + jsonl(chat_lines(3))).json()  # a blank first line is skipped
    dataset = session.get(Dataset, uuid.UUID(hex=body["id"].removeprefix("file-")))
    assert dataset is not None and dataset.kind == "sft" and dataset.row_count == 3


def test_another_purpose_is_refused_and_nothing_is_stored(session: Session) -> None:
    before = count(session, Dataset)
    with api_client(session) as client:
        resp = upload_file(client, jsonl(chat_lines(2)), purpose="assistants")
        missing = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"other": ("x", b"{}")})
    error = openai_error(resp)
    assert resp.status_code == 400 and resp.headers["x-should-retry"] == "false"
    assert error["param"] == "purpose" and error["type"] == "invalid_request_error"
    assert "fine-tune" in error["message"] and "assistants" in error["message"]
    assert missing.status_code == 400 and openai_error(missing)["param"] == "file"
    assert count(session, Dataset) == before


def test_a_malformed_file_names_the_line_and_stores_no_dataset(session: Session) -> None:
    lines = dpo_lines(4)
    lines[2] = dpo_line("q", "a", "b") | {"preferred_output": "a"}  # line 3: not a message list
    before_sets, before_rows = count(session, Dataset), count(session, DatasetRow)
    with api_client(session) as client:
        resp = upload_file(client, jsonl(lines))
        mixed = upload_file(client, jsonl(dpo_lines(2) + chat_lines(1)))  # kind comes from line 1
    error = openai_error(resp)
    assert resp.status_code == 400 and error["param"] == "file" and error["code"] == "dataset_invalid"
    assert "line 3" in error["message"] and "preferred_output" in error["message"]
    assert mixed.status_code == 400 and "line 3" in openai_error(mixed)["message"]
    assert (count(session, Dataset), count(session, DatasetRow)) == (before_sets, before_rows)


def test_list_pages_newest_first_with_after_and_limit(session: Session) -> None:
    base = utcnow() + timedelta(days=1)  # newer than anything else in the shared database
    made = [make_dataset(session, kind="sft", created_at=base + timedelta(seconds=i)) for i in range(3)]
    ranking = make_dataset(session, kind="ranking", created_at=base + timedelta(seconds=9))
    ids = [f"file-{d.id.hex}" for d in made]
    with api_client(session) as client:
        p1 = client.get("/v1/files", params={"limit": 2}).json()
        p2 = client.get("/v1/files", params={"limit": 1, "after": p1["last_id"]}).json()
        oldest_first = client.get("/v1/files", params={"order": "asc", "after": ids[0], "limit": 1}).json()
        other = client.get("/v1/files", params={"purpose": "batch"}).json()
        bad_after = client.get("/v1/files", params={"after": "file-nope"})
    assert p1["object"] == "list" and [f["id"] for f in p1["data"]] == ids[::-1][:2] and p1["has_more"]
    assert (p1["first_id"], p1["last_id"]) == (ids[2], ids[1])
    assert [f["id"] for f in p2["data"]] == [ids[0]]
    assert [f["id"] for f in oldest_first["data"]] == [ids[1]]
    assert f"file-{ranking.id.hex}" not in [f["id"] for f in p1["data"]]  # not a fine-tuning file
    assert other["data"] == [] and not other["has_more"]
    assert bad_after.status_code == 404 and openai_error(bad_after)["param"] == "after"


def test_retrieve_and_unknown_ids_answer_404_in_openai_shape(session: Session) -> None:
    ds = make_dataset(session, kind="preference")
    with api_client(session) as client:
        one = client.get(f"/v1/files/file-{ds.id.hex}")
        unknown = client.get(f"/v1/files/file-{uuid.uuid4().hex}")
        malformed = client.get("/v1/files/not-a-file-id")
        no_route = client.get("/v1/files/x/y/z")
        elsewhere = client.get(f"/v1/datasets/{uuid.uuid4()}")
    assert one.status_code == 200 and one.json()["id"] == f"file-{ds.id.hex}"
    for resp in (unknown, malformed):
        error = openai_error(resp)
        assert resp.status_code == 404 and error["param"] == "file_id" and error["code"] == "file_not_found"
        assert error["message"].startswith("No such File object")
    assert no_route.status_code == 404 and openai_error(no_route)["code"] == "not_found"
    # every other path keeps rlrun's shape
    assert elsewhere.status_code == 404 and elsewhere.json()["error"]["code"] == "dataset_not_found"
    assert "type" not in elsewhere.json()["error"]


def test_delete_removes_an_unused_file_and_refuses_a_used_one(session: Session) -> None:
    unused, used = make_dataset(session, kind="sft"), make_dataset(session, kind="preference")
    users = [make_run(session, used) for _ in range(2)]
    with api_client(session) as client:
        gone = client.delete(f"/v1/files/file-{unused.id.hex}")
        again = client.get(f"/v1/files/file-{unused.id.hex}")
        kept = client.delete(f"/v1/files/file-{used.id.hex}")
    assert gone.status_code == 200 and gone.json() == {
        "id": f"file-{unused.id.hex}",
        "object": "file",
        "deleted": True,
    }
    assert again.status_code == 404
    assert session.scalar(select(func.count()).where(DatasetRow.dataset_id == unused.id)) == 0
    error = openai_error(kept)
    assert kept.status_code == 409 and error["code"] == "file_in_use" and "ftjob-" in error["message"]
    assert all(str(run.id) in error["message"] for run in users)  # every run that keeps it is named
    assert kept.headers["x-should-retry"] == "false"  # the SDK would otherwise retry a 409
    assert session.get(Dataset, used.id) is not None


def test_delete_refuses_a_file_used_only_as_validation_data(session: Session) -> None:
    train, val = make_dataset(session), make_dataset(session)
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(train.id),
        "validation_dataset_id": str(val.id),
        "hyperparameters": {"max_steps": 3},
    }
    make_run(session, train, spec=spec)
    with api_client(session) as client:
        resp = client.delete(f"/v1/files/file-{val.id.hex}")
    assert resp.status_code == 409 and openai_error(resp)["code"] == "file_in_use"


def test_content_gives_the_bytes_uploaded_in_every_format(session: Session) -> None:
    """SFT, DPO and reinforcement files, as written by hand (spacing, key order, a blank line, CRLF, a
    non-ASCII answer): `files.content` answers exactly the bytes sent, as OpenAI does (issue 41 item 3);
    the normalised rows stay on the datasets API."""
    rft = {"messages": [{"role": "user", "content": "2+2="}], "answer": "4", "level": 1}
    uploads = {
        "sft": b'{"messages": [{"role": "user", "content": "hi"},'
        b' {"role": "assistant", "content": "h\u00e9"}]}\r\n'
        + b"\n"
        + jsonl(chat_lines(3)),
        "preference": jsonl(dpo_lines(4)) + b'{ "input":{"messages":[{"role":"user","content":"q"}]},'
        b' "preferred_output":[{"role":"assistant","content":"a"}],'
        b' "non_preferred_output":[{"role":"assistant","content":"b"}] }',
        "prompts": json.dumps(rft, indent=None, separators=(", ", ":")).encode() + b"\n",
    }
    with api_client(session) as client:
        for kind, data in uploads.items():
            body = upload_file(client, data).json()
            dataset = session.get(Dataset, uuid.UUID(hex=body["id"].removeprefix("file-")))
            assert dataset is not None and dataset.kind == kind, (kind, body)
            got = client.get(f"/v1/files/{body['id']}/content")
            assert got.status_code == 200 and got.content == data, kind
        rows = client.get(f"/v1/datasets/{dataset.id}/rows").json()["data"]
    assert rows[0]["data"]["answer"] == "4"  # the normalised rows, still there


def test_content_of_a_large_upload_streams_back_every_byte(session: Session) -> None:
    lines = chat_lines(20_000)  # over a MiB: several read blocks
    data = jsonl(lines)
    with api_client(session) as client:
        body = upload_file(client, data).json()
        resp = client.get(f"/v1/files/{body['id']}/content")
        missing = client.get(f"/v1/files/file-{uuid.uuid4().hex}/content")
        no_results = client.get(f"/v1/files/file-results-{uuid.uuid4().hex}/content")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/jsonl")
    assert len(data) > 1 << 20 and resp.content == data
    assert missing.status_code == no_results.status_code == 404
    assert openai_error(missing)["code"] and openai_error(no_results)["param"] == "file_id"


def test_content_of_a_dataset_uploaded_elsewhere_gives_its_rows_in_order_across_pages(
    session: Session,
) -> None:
    """A dataset made through /v1/datasets keeps no copy of its bytes: its rows as stored, every page."""
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(2_345)]
    dataset = make_dataset(session, rows=rows, kind="sft")
    with api_client(session) as client:
        resp = client.get(f"/v1/files/file-{dataset.id.hex}/content")
    assert resp.status_code == 200
    assert [json.loads(line) for line in resp.text.splitlines()] == rows
