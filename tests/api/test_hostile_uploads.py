"""Hostile uploads: each is refused with a clear error (or stored correctly) and nothing half-stored."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Dataset
from api.settings import Settings
from tests.factories import api_client, jsonl, pair_rows


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Dataset)) or 0)


def post(client, data: bytes, name: str = "x.jsonl"):  # type: ignore[no-untyped-def]
    return client.post("/v1/datasets", files={"file": (name, data)}, data={"kind": "preference"})


GOOD = jsonl(pair_rows(2))


# Named by their labels: the bytes would make ids of megabytes, and a gzip header's mtime made them differ
# between xdist workers (mtime=0 keeps the bomb's bytes the same on every run too).
HOSTILE = [
    ("deeply nested JSON", b"[" * 20_000 + b"]" * 20_000 + b"\n", "nested too deeply"),
    ("raw NUL byte", GOOD + b'{"prompt": "a\x00", "chosen": "b", "rejected": "c"}\n', "NUL"),
    ("escaped NUL", GOOD + b'{"prompt": "a\\u0000", "chosen": "b", "rejected": "c"}\n', "NUL"),
    ("invalid UTF-8", GOOD + b'{"prompt": "\xc3\x28", "chosen": "b", "rejected": "c"}\n', "UTF-8"),
    ("gzip bomb named .jsonl", gzip.compress(b"0" * 5_000_000, mtime=0), "line"),
    (
        "a line over the line limit",
        GOOD + b'{"prompt": "' + b"x" * 300_000 + b'"}\n' + GOOD,
        "longer than",
    ),
]


@pytest.mark.parametrize(("label", "data", "message"), HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_upload_is_refused_and_stores_nothing(
    session: Session,
    tmp_path,
    label: str,
    data: bytes,  # type: ignore[no-untyped-def]
    message: str,
) -> None:
    before = count(session)
    settings = Settings(home=tmp_path, max_line_bytes=100_000)
    with api_client(session, settings=settings) as client:
        resp = post(client, data)
    assert resp.status_code in (413, 422), (label, resp.status_code, resp.text[:300])
    assert message in json.dumps(resp.json()), (label, resp.json())
    assert count(session) == before


def test_a_million_tiny_bad_lines_are_answered_quickly_with_20_errors(session: Session) -> None:
    data = b"{}\n" * 1_000_000
    with api_client(session) as client:
        resp = post(client, data)
    err = resp.json()["error"]
    assert resp.status_code == 422 and len(err["details"]) == 20
    assert err["message"].startswith("1000000 invalid line(s)")


def test_row_limit_answers_413(session: Session, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with api_client(session, settings=Settings(home=tmp_path, max_dataset_rows=5)) as client:
        resp = post(client, jsonl(pair_rows(6)))
        ok = post(client, jsonl(pair_rows(5)))
    assert resp.status_code == 413 and "more than 5 rows" in resp.json()["error"]["message"]
    assert ok.status_code == 201


def test_ingest_memory_does_not_grow_with_the_file(session: Session) -> None:
    """Peak Python allocations while ingesting 40k rows stay far below the upload's size (the rows are
    read line by line from the spooled file and inserted in batches)."""
    rows = [{"prompt": f"p{i}", "chosen": "c" * 200, "rejected": "r" * 200} for i in range(40_000)]
    data = jsonl(rows)
    from api.services.datasets import ingest_dataset

    lines = data.splitlines(keepends=True)  # the caller's buffer, allocated before measuring
    tracemalloc.start()
    ingest_dataset(session=session, name="big", kind="preference", lines=iter(lines), max_bytes=len(data) + 1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # What ingest itself holds: one insert batch of rows plus 16 bytes of hash per row seen (duplicates).
    assert peak < len(data) * 0.4, (peak, len(data))
