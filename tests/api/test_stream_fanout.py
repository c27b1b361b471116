"""The SSE stream's fan-out: one poller per run whatever the number of subscribers, each subscriber with
its own cursor (resume and catch-up behind the shared buffer), and the per-client cap on open streams.

These tests use a real app on a committing session factory (the streams read from other threads while the
test writes), on SQLite and PostgreSQL; rows use fresh ids.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, update
from sqlalchemy.orm import Session, sessionmaker

import api.stream_hub as stream_hub
from api.main import create_app
from api.models import Event, Metric, Run, utcnow
from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import FakeEnqueue, make_dataset, make_run

POLL = 0.1


@contextmanager
def app_client(factory: sessionmaker[Session], settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, session_factory=factory, enqueue=FakeEnqueue())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def new_run(factory: sessionmaker[Session], **over: Any) -> uuid.UUID:
    with factory.begin() as s:
        project = over.pop("project_id", None)
        ds = make_dataset(s, **({"project_id": project} if project else {}))
        return make_run(s, ds, status="running", **({"project_id": project} if project else {}), **over).id


def write_metrics(factory: sessionmaker[Session], run_id: uuid.UUID, steps: range) -> None:
    now = utcnow()
    with factory.begin() as s:
        for step in steps:
            at = now + timedelta(microseconds=step)
            s.add(Metric(run_id=run_id, key="loss", step=step, value=1.0 / step, logged_at=at))


def write_event(factory: sessionmaker[Session], run_id: uuid.UUID, message: str) -> None:
    with factory.begin() as s:
        s.add(Event(run_id=run_id, kind="log", message=message))


def finish(factory: sessionmaker[Session], run_id: uuid.UUID) -> None:
    with factory.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status="succeeded"))
        s.add(Event(run_id=run_id, kind="status", message="succeeded"))


class Reader(threading.Thread):
    """Reads one stream to its end in the background, parsing each message."""

    def __init__(
        self, client: TestClient, run_id: uuid.UUID, last_event_id: str | None = None, poll: float = POLL
    ):
        super().__init__(daemon=True)
        self.client, self.run_id, self.last_event_id, self.poll = client, run_id, last_event_id, poll
        self.messages: list[dict[str, Any]] = []
        self.keep_alives = 0
        self.connected = threading.Event()
        self.status_code = 0

    def run(self) -> None:
        headers = {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}
        url = f"/v1/runs/{self.run_id}/stream"
        with self.client.stream("GET", url, params={"poll_seconds": self.poll}, headers=headers) as resp:
            self.status_code = resp.status_code
            self.connected.set()
            fields: dict[str, str] = {}
            for line in resp.iter_lines():
                if line.startswith(":"):
                    self.keep_alives += 1
                    continue
                if line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                if fields:
                    data = json.loads(fields["data"])
                    self.messages.append({"id": fields["id"], "event": fields["event"], "data": data})
                    fields = {}

    def points(self) -> list[int]:
        return [p["step"] for m in self.messages if m["event"] == "metrics" for p in m["data"]]

    def events(self) -> list[str]:
        return [m["data"]["message"] for m in self.messages if m["event"] == "event"]

    def kinds(self) -> list[str]:
        return [m["event"] for m in self.messages]


@contextmanager
def counting_event_reads(engine: Engine) -> Iterator[list[float]]:
    """Times of every SELECT on the events table (one per poll: the stream's first read, its feed's
    polls, a catch-up)."""
    seen: list[float] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM events" in statement:
            seen.append(time.monotonic())

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_many_subscribers_of_a_run_share_one_poller(
    engine: Engine, committing_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    n = 6
    run_id = new_run(committing_factory)
    with app_client(committing_factory, Settings(home=tmp_path)) as client:
        readers = [Reader(client, run_id) for _ in range(n)]
        for r in readers:
            r.start()
        assert all(r.connected.wait(10) for r in readers)  # each has made its own first read
        with counting_event_reads(engine) as reads:
            start = time.monotonic()
            for rnd in range(4):
                write_metrics(committing_factory, run_id, range(5 * rnd + 1, 5 * rnd + 6))
                time.sleep(0.15)
            write_event(committing_factory, run_id, "halfway")
            finish(committing_factory, run_id)
            for r in readers:
                r.join(10)
            elapsed = time.monotonic() - start
        hub = client.app.state.stream_hub  # type: ignore[attr-defined]
        wait_until(lambda: not hub.feeds and not hub.open)  # the last subscriber stopped the poller
        # A reconnect from the middle of a live stream gets exactly the rest of it (batched differently).
        cut = readers[0].kinds().index("metrics")
        resumed = Reader(client, run_id, last_event_id=readers[0].messages[cut]["id"])
        resumed.run()
    # One poller: about one read per interval, not one per subscriber per interval (n times as many).
    assert len(reads) <= elapsed / POLL + 3, (len(reads), elapsed)
    for r in readers:
        assert not r.is_alive() and r.status_code == 200
        assert r.points() == list(range(1, 21)), r.points()
        assert r.events() == ["halfway", "succeeded"]
        status = [m["data"]["status"] for m in r.messages if m["event"] == "status"]
        assert status == ["running", "succeeded"] and r.kinds()[-1] == "end"
    seen = readers[0].messages[cut]["data"][-1]["step"]
    assert resumed.points() == list(range(seen + 1, 21)) and resumed.events() == ["halfway", "succeeded"]
    assert resumed.messages[-1] == readers[0].messages[-1]  # the same `end`, with the same id


def test_a_subscriber_behind_the_shared_buffer_catches_up_on_its_own(
    committing_factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny query batches and buffer: a resume from the start is far behind what the poller keeps."""
    monkeypatch.setattr(stream_hub, "BATCH", 3)
    monkeypatch.setattr(stream_hub, "KEEP_POINTS", 2)
    monkeypatch.setattr(stream_hub, "KEEP_EVENTS", 2)
    run_id = new_run(committing_factory)
    with app_client(committing_factory, Settings(home=tmp_path)) as client:
        live = Reader(client, run_id)
        live.start()
        assert live.connected.wait(10)
        for rnd in range(3):
            write_metrics(committing_factory, run_id, range(10 * rnd + 1, 10 * rnd + 11))
            write_event(committing_factory, run_id, f"e{rnd}")
        wait_until(lambda: len(live.points()) == 30)
        feed = client.app.state.stream_hub.feeds[run_id]  # type: ignore[attr-defined]
        assert feed.metric_floor is not None  # the buffer no longer starts at the beginning
        late = Reader(client, run_id, last_event_id=live.messages[0]["id"])
        late.start()
        assert late.connected.wait(10)
        write_metrics(committing_factory, run_id, range(31, 36))
        finish(committing_factory, run_id)
        live.join(10)
        late.join(10)
    assert live.points() == list(range(1, 36)) and late.points() == list(range(1, 36))
    assert live.events() == late.events() == ["e0", "e1", "e2", "succeeded"]
    assert live.kinds()[-1] == late.kinds()[-1] == "end"


@pytest.fixture
def sqlite_factory(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    from api.db import make_engine, make_session_factory

    engine = make_engine(sqlite_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_a_slow_subscriber_keeps_its_own_pace_beside_a_fast_one(
    sqlite_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """The shared poller runs at the fastest subscriber's interval; the others are not woken that often."""
    run_id = new_run(sqlite_factory)
    with app_client(sqlite_factory, Settings(home=tmp_path)) as client:
        fast, slow = Reader(client, run_id, poll=0.05), Reader(client, run_id, poll=0.5)
        for r in (fast, slow):
            r.start()
            assert r.connected.wait(10)
        time.sleep(1.2)
        finish(sqlite_factory, run_id)
        fast.join(10)
        slow.join(10)
    assert fast.keep_alives >= 10, fast.keep_alives
    assert slow.keep_alives <= 4, slow.keep_alives
    assert fast.events() == slow.events() == ["succeeded"]


def open_stream(stack: ExitStack, client: TestClient, run_id: uuid.UUID, **headers: str) -> int:
    resp = stack.enter_context(client.stream("GET", f"/v1/runs/{run_id}/stream", headers=headers))
    if resp.status_code != 200:
        resp.read()
    return resp.status_code


def test_streams_over_the_cap_get_429_and_a_closed_stream_frees_its_place(
    sqlite_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    run_id = new_run(sqlite_factory)
    url = f"/v1/runs/{run_id}/stream"
    with app_client(sqlite_factory, Settings(home=tmp_path, max_streams_per_client=2)) as client:
        first, second = ExitStack(), ExitStack()
        assert open_stream(first, client, run_id) == 200
        assert open_stream(second, client, run_id) == 200
        over = client.get(url)
        assert over.status_code == 429
        error = over.json()["error"]
        assert error["code"] == "too_many_streams" and "at most 2" in error["message"]
        first.close()
        again = ExitStack()
        assert open_stream(again, client, run_id) == 200
        assert client.get(url).status_code == 429
        second.close()
        again.close()
        # a refused or failed request holds no place: 404s and 422s leave the count at zero
        assert client.get(f"/v1/runs/{uuid.uuid4()}/stream").status_code == 404
        assert client.get(url, headers={"Last-Event-ID": "nonsense"}).status_code == 422
        assert client.app.state.stream_hub.open == {}  # type: ignore[attr-defined]


def test_with_auth_on_the_cap_counts_per_api_key(
    sqlite_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    with sqlite_factory.begin() as s:
        key_a, row_a = create_api_key(session=s, project_name=f"a-{uuid.uuid4().hex[:6]}")
        key_b, row_b = create_api_key(session=s, project_name=f"b-{uuid.uuid4().hex[:6]}")
    run_a = new_run(sqlite_factory, project_id=row_a.project_id)
    run_b = new_run(sqlite_factory, project_id=row_b.project_id)
    settings = Settings(home=tmp_path, auth=True, max_streams_per_client=1)
    with app_client(sqlite_factory, settings) as client, ExitStack() as stack:
        assert open_stream(stack, client, run_a, Authorization=f"Bearer {key_a}") == 200
        assert open_stream(stack, client, run_a, Authorization=f"Bearer {key_a}") == 429
        assert open_stream(stack, client, run_b, Authorization=f"Bearer {key_b}") == 200


def test_streams_opening_at_once_from_one_cursor_share_their_first_read(
    committing_factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = new_run(committing_factory)
    write_metrics(committing_factory, run_id, range(1, 31))
    finish(committing_factory, run_id)
    first_reads: list[str] = []
    real_poll = stream_hub.poll

    def slow_poll(session: Session, rid: uuid.UUID, cur: Any, project_id: Any = None) -> Any:
        first_reads.append(cur.encode())  # a first read (the run has ended: no feed, no catch-up)
        time.sleep(0.5)  # long enough for every stream below to arrive while it runs
        return real_poll(session, rid, cur, project_id)

    monkeypatch.setattr(stream_hub, "poll", slow_poll)
    with app_client(committing_factory, Settings(home=tmp_path)) as client:
        at_once = [Reader(client, run_id) for _ in range(5)]
        for r in at_once:
            r.start()
        for r in at_once:
            r.join(20)
        assert len(first_reads) == 1  # five streams, one query
        cut = at_once[0].messages[0]  # the run's one event ("succeeded"); its points come after it
        assert cut["event"] == "event"
        resumed = Reader(client, run_id, last_event_id=cut["id"])
        resumed.run()  # another cursor: a read of its own
    assert len(first_reads) == 2 and first_reads[1] != first_reads[0]
    for r in at_once:
        assert r.status_code == 200 and r.points() == list(range(1, 31)) and r.kinds()[-1] == "end"
    assert [m["id"] for m in at_once[1].messages] == [m["id"] for m in at_once[0].messages]
    assert resumed.points() == list(range(1, 31)) and resumed.events() == []
