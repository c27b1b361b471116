"""Chart-sized metrics (min-max downsampling) and the SSE stream."""

from __future__ import annotations

import json
import random
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.downsample import minmax_downsample
from api.metric_store import write_points
from api.models import Event, Metric, utcnow
from tests.factories import api_client, make_dataset, make_run


def test_minmax_downsample_keeps_first_last_and_bucket_extremes() -> None:
    rng = random.Random(0)
    values = [rng.random() for _ in range(1000)]
    values[500] = 10.0  # a spike
    values[777] = -10.0  # a dip
    steps = list(range(1000))
    kept = minmax_downsample(steps, values, 100)
    assert len(kept) <= 100 and kept == sorted(kept)
    assert {0, 999, 500, 777} <= set(kept)
    # brute force: every bucket's min and max index is kept
    n_buckets, inner = 49, list(range(1, 999))
    for b in range(n_buckets):
        bucket = inner[len(inner) * b // n_buckets : len(inner) * (b + 1) // n_buckets]
        assert min(bucket, key=values.__getitem__) in kept
        assert max(bucket, key=values.__getitem__) in kept
    assert minmax_downsample(steps[:50], values[:50], 100) == steps[:50]


def add_metrics(session: Session, run_id: uuid.UUID, key: str, n: int, start: int = 1) -> None:
    now = utcnow()
    rows = [
        {
            "run_id": run_id,
            "key": key,
            "step": s,
            "value": float(s % 7),
            "logged_at": now + timedelta(microseconds=s),
        }
        for s in range(start, start + n)
    ]
    write_points(session, rows)


def test_metrics_max_points_downsamples_each_key(session: Session) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds)
    add_metrics(session, run.id, "loss", 500)
    add_metrics(session, run.id, "lr", 3)
    with api_client(session) as client:
        both = client.get(f"/v1/runs/{run.id}/metrics", params={"max_points": 40}).json()
        one = client.get(
            f"/v1/runs/{run.id}/metrics", params={"max_points": 40, "key": "loss", "min_step": 100}
        )
        keys = client.get(f"/v1/runs/{run.id}/metric-keys").json()
        bad = client.get(f"/v1/runs/{run.id}/metrics", params={"max_points": 2})
    loss = [m for m in both["data"] if m["key"] == "loss"]
    assert len(loss) <= 40 and loss[0]["step"] == 1 and loss[-1]["step"] == 500
    assert {m["value"] for m in loss} >= {0.0, 6.0}  # the extremes survive
    assert [m["step"] for m in both["data"] if m["key"] == "lr"] == [1, 2, 3]
    assert both["has_more"] is False
    assert one.json()["data"][0]["step"] == 100
    assert keys == ["loss", "lr"]
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "max_points"


def read_sse(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if fields:
            out.append({"id": fields["id"], "event": fields["event"], "data": json.loads(fields["data"])})
    return out


def test_stream_sends_events_metrics_status_then_ends_and_resumes(session: Session) -> None:
    ds = make_dataset(session)
    run = make_run(session, ds, status="succeeded")
    session.add(Event(run_id=run.id, kind="status", message="running"))
    session.add(Event(run_id=run.id, kind="status", message="succeeded"))
    add_metrics(session, run.id, "loss", 3)
    with api_client(session) as client:
        first = read_sse(client.get(f"/v1/runs/{run.id}/stream").text)
        # A reconnect after the 'event' messages gets only what came after them.
        after_events = first[1]["id"]
        resumed = read_sse(
            client.get(f"/v1/runs/{run.id}/stream", headers={"Last-Event-ID": after_events}).text
        )
        missing = client.get(f"/v1/runs/{uuid.uuid4()}/stream")
        bad = client.get(f"/v1/runs/{run.id}/stream", headers={"Last-Event-ID": "nonsense"})
    kinds = [m["event"] for m in first]
    assert kinds == ["event", "event", "metrics", "status", "end"]
    assert [m["data"]["message"] for m in first[:2]] == ["running", "succeeded"]
    assert [(p["key"], p["step"]) for p in first[2]["data"]] == [("loss", 1), ("loss", 2), ("loss", 3)]
    logged = dict(session.execute(select(Metric.step, Metric.logged_at).where(Metric.run_id == run.id)).all())
    assert [p["time"] for p in first[2]["data"]] == [logged[s].timestamp() for s in (1, 2, 3)]
    assert first[3]["data"]["status"] == "succeeded"
    assert [m["event"] for m in resumed] == ["metrics", "status", "end"]
    assert missing.status_code == 404
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "Last-Event-ID"
