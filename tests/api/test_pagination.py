"""The one keyset-pagination helper (api/pagination.py): pages visit every row once, in order, ties
included; cursors it did not make are 422s naming ``after`` on every list (never a 500)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Run, utcnow
from api.pagination import Keyset, encode_cursor, paginate
from api.settings import Settings
from tests.factories import api_client, make_dataset, make_run


@pytest.mark.parametrize("desc", [False, True], ids=["ascending", "descending"])
def test_pages_visit_every_row_once_in_order_even_with_tied_first_keys(session: Session, desc: bool) -> None:
    ds = make_dataset(session)
    at = [utcnow()] * 3 + [utcnow()] * 2  # two groups of runs created at the same instant
    ids = {make_run(session, ds, created_at=t).id for t in at}
    order = Keyset(Run.created_at, Run.id, desc=desc)
    stmt = select(Run).where(Run.id.in_(ids))
    seen: list[Run] = []
    cursor = None
    while True:
        found = paginate(session, stmt, order, limit=2, cursor=cursor)
        seen += found.rows
        assert found.has_more == (found.next_cursor is not None)
        if not found.has_more:
            break
        cursor = found.next_cursor
    keys = [(r.created_at, r.id) for r in seen]
    assert keys == sorted(keys, reverse=desc) and {r.id for r in seen} == ids


def forged(*key: Any) -> str:
    return encode_cursor(*key)


def test_cursors_of_the_wrong_shape_are_refused_on_every_list(session: Session, tmp_path: Path) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds)
    naive = utcnow().replace(tzinfo=None).isoformat()
    with api_client(session, settings=Settings(home=tmp_path, webhook_allow_loopback=True)) as client:
        hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"}).json()
        lists = {
            "/v1/runs": [
                forged(5, str(run.id)),
                forged(naive, str(run.id)),
                forged(utcnow().isoformat(), "x"),
            ],
            "/v1/datasets": [forged(True, str(ds.id)), forged(naive, str(ds.id))],
            f"/v1/datasets/{ds.id}/rows": [forged("3"), forged(True)],
            f"/v1/datasets/{ds.id}/skipped": [forged("3")],
            f"/v1/runs/{run.id}/metrics": [forged("1", "loss"), forged(1, 2)],
            f"/v1/runs/{run.id}/events": [forged("1"), forged(1, 2)],
            f"/v1/runs/{run.id}/samples": [forged(1.5)],
            f"/v1/webhooks/{hook['id']}/deliveries": [forged(7, str(uuid.uuid4())), forged(naive, "x")],
        }
        for url, cursors in lists.items():
            for cursor in cursors:
                resp = client.get(url, params={"after": cursor})
                assert resp.status_code == 422, (url, cursor, resp.text)
                assert resp.json()["error"]["field"] == "after", (url, resp.json())
