"""One database poller per run, fanned out to every SSE subscriber of that run in this process.

A stream used to poll the database itself every ``poll_seconds``: 200 open streams were 400 short
transactions a second (on SQLite each takes the write lock, api/db.py), which starved the API's pool and
the worker's own writes. Now:

- ``RunFeed`` polls one run from its own cursor while the run has subscribers, at the shortest interval
  they asked for. What it reads goes into a bounded buffer (the last ``KEEP_EVENTS`` events and
  ``KEEP_POINTS`` metric points) and wakes the subscribers. It stops with its last subscriber.
- Each subscriber keeps its own ``Cursor`` (so ``Last-Event-ID`` works as before) and takes from the
  buffer what lies after it, at its own pace. A subscriber behind the buffer's start (a resume from long
  ago, a slow reader) catches up with one-off queries of its own, then reads the buffer again.
- Messages, ids and their order are those of ``poll``, the one-off query: events, then metric points,
  then a status change. A status comes from a feed poll that started after the subscriber last read the
  database itself, so a subscriber never goes back to an older status.
- Subscribers in step (the same cursor) share one encoding of each poll's news. One-off reads (a stream's
  first read, catch-ups) run at most ``ONE_OFF_READS`` at a time. Streams that open at once from the same
  cursor share their first read too (one query, one encoding, made in the thread pool): 200 dashboards
  opening a run's history together cost one read of it, not 200 encodings on the event loop.
- ``StreamHub`` also counts open streams per client (API key, or address when auth is off) and answers
  429 ``too_many_streams`` above the cap.

All state lives on the event loop (no locks); only the queries run in the thread pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from bisect import bisect_right
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import InvalidRequest, TooManyStreams
from api.models import FINISHED_STATUSES, Event, Metric
from api.pagination import decode_cursor, encode_cursor
from api.services.runs import get_run
from rlrun.schemas import EventRead

log = logging.getLogger("rlrun.api.stream")
BATCH = 2000  # rows of each kind per query (and metric points per message)
KEEP_EVENTS = 1000
KEEP_POINTS = 20_000
# Between two polls of a feed that is behind. Back-to-back reads would hold the database for the whole
# catch-up: on SQLite every transaction takes the write lock (api/db.py) and a waiting request sleeps in
# SQLite's busy handler (up to 100 ms a try), so it kept missing the moments the lock was free.
CATCH_UP_PAUSE = 0.05
ONE_OFF_READS = 4  # first reads and catch-ups at once per process: 200 clients connecting at once would
# otherwise take every worker thread of the pool (the API's sync routes wait for one) and queue on the
# database (on SQLite each read holds the write lock, so the trainer's writes queue behind them)
SessionFactory = Callable[[], AbstractContextManager[Session]]
MetricPos = tuple[datetime, str, int]  # (logged_at, key, step): the order metrics are sent in
Message = tuple[str, Any, str]  # (event type, data, id = the cursor just after this message)
T = TypeVar("T")


@dataclass
class Cursor:
    event_id: int = 0
    logged_at: str = ""  # ISO time of the last metric sent ("" = none yet)
    key: str = ""
    step: int = -1
    status: str = ""

    def encode(self) -> str:
        return encode_cursor(self.event_id, self.logged_at, self.key, self.step, self.status)

    @classmethod
    def decode(cls, raw: str | None) -> Cursor:
        if not raw:
            return cls()
        bad = InvalidRequest("Last-Event-ID: not an id sent by this stream", field="Last-Event-ID")
        try:
            event_id, logged_at, key, step, status = decode_cursor(raw, 5)
        except InvalidRequest:
            raise bad from None
        if not isinstance(event_id, int) or not isinstance(step, int):
            raise bad
        cur = cls(event_id, str(logged_at), str(key), step, str(status))
        try:
            pos = cur.metric_pos()
        except ValueError:
            raise bad from None
        if pos is not None and pos[0].tzinfo is None:  # ours are UTC; a naive time would not compare
            raise bad
        return cur

    def metric_pos(self) -> MetricPos | None:
        return (datetime.fromisoformat(self.logged_at), self.key, self.step) if self.logged_at else None


def _at_or_after(pos: MetricPos | None, floor: MetricPos | None) -> bool:
    return floor is None or (pos is not None and pos >= floor)


@dataclass
class Batch:
    """What one query found after a cursor (the cursor itself is not moved)."""

    events: list[tuple[int, dict[str, Any]]]
    points: list[tuple[MetricPos, dict[str, Any]]]
    status: str
    status_data: dict[str, Any]
    drained: bool  # fewer than BATCH rows of each kind: nothing newer was left behind


def read_since(session: Session, run_id: uuid.UUID, cur: Cursor, project_id: uuid.UUID | None) -> Batch:
    """Events and metric points after ``cur`` and the run's status; RunNotFound outside ``project_id``."""
    run = get_run(session=session, run_id=run_id, project_id=project_id)
    events = session.scalars(
        select(Event).where(Event.run_id == run_id, Event.id > cur.event_id).order_by(Event.id).limit(BATCH)
    ).all()
    # Columns, not ORM objects: a stream's first read may be 2,000 rows, times every client that connects.
    stmt = select(Metric.logged_at, Metric.key, Metric.step, Metric.value).where(Metric.run_id == run_id)
    if (pos := cur.metric_pos()) is not None:  # a row-value comparison: an index on these columns serves it
        stmt = stmt.where(tuple_(Metric.logged_at, Metric.key, Metric.step) > tuple_(*pos))
    metrics = session.execute(stmt.order_by(Metric.logged_at, Metric.key, Metric.step).limit(BATCH)).all()
    return Batch(
        events=[(e.id, EventRead.model_validate(e).model_dump(mode="json")) for e in events],
        points=[
            ((at, key, step), {"key": key, "step": step, "value": value, "time": at.timestamp()})
            for at, key, step, value in metrics
        ],
        status=run.status,
        status_data={
            "status": run.status,
            "step": run.step,
            "total_steps": run.total_steps,
            "error": run.error,
        },
        drained=len(events) < BATCH and len(metrics) < BATCH,
    )


def _event(cur: Cursor, event_id: int, data: dict[str, Any]) -> Message:
    cur.event_id = event_id
    return ("event", data, cur.encode())


def _metrics(cur: Cursor, points: list[tuple[MetricPos, dict[str, Any]]]) -> Message:
    at, cur.key, cur.step = points[-1][0]
    cur.logged_at = at.isoformat()
    return ("metrics", [p for _, p in points], cur.encode())


def _status(cur: Cursor, data: dict[str, Any]) -> Message:
    cur.status = data["status"]
    return ("status", data, cur.encode())


def end_message(cur: Cursor) -> Message:
    return ("end", {"status": cur.status}, cur.encode())


def sse(kind: str, data: Any, message_id: str) -> str:
    return f"id: {message_id}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"


KEEP_ALIVE = ": keep-alive\n\n"


def poll(
    session: Session, run_id: uuid.UUID, cur: Cursor, project_id: uuid.UUID | None = None
) -> tuple[list[Message], bool]:
    """One-off query: new messages since ``cur`` (advancing it) and whether the run has ended with nothing
    left. A stream's first read, and a subscriber's catch-up when it is behind its feed's buffer."""
    batch = read_since(session, run_id, cur, project_id)
    messages = [_event(cur, event_id, data) for event_id, data in batch.events]
    if batch.points:
        messages.append(_metrics(cur, batch.points))
    if batch.status != cur.status:
        messages.append(_status(cur, batch.status_data))
    return messages, batch.status in FINISHED_STATUSES and batch.drained


@dataclass(eq=False)  # identity: kept in a set
class Subscriber:
    interval: float
    status_after: int  # trust the feed's status only from polls numbered above this


@dataclass
class RunFeed:
    """The one poller of a run in this process, and the bounded buffer of what it read."""

    run_id: uuid.UUID
    factory: SessionFactory
    cursor: Cursor  # where the next poll reads from
    event_floor: int = 0  # every event after this id (up to the cursor) is in the buffer
    metric_floor: MetricPos | None = None  # likewise for metric points
    event_ids: list[int] = field(default_factory=list)
    event_data: list[dict[str, Any]] = field(default_factory=list)
    point_pos: list[MetricPos] = field(default_factory=list)
    point_data: list[dict[str, Any]] = field(default_factory=list)
    status_data: dict[str, Any] | None = None
    polls: int = 0  # polls started
    status_poll: int = 0  # the poll that read status_data
    done_poll: int = 0  # the last poll, if it found the run ended and everything read
    subscribers: set[Subscriber] = field(default_factory=set)
    encoded: dict[tuple[Any, ...], tuple[bytes, Cursor]] = field(default_factory=dict)  # this poll's takes
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    @classmethod
    def starting_at(cls, run_id: uuid.UUID, factory: SessionFactory, cur: Cursor) -> RunFeed:
        return cls(run_id, factory, replace(cur), event_floor=cur.event_id, metric_floor=cur.metric_pos())

    def covers(self, cur: Cursor) -> bool:
        """Whether the buffer holds everything after ``cur`` that this feed has read."""
        return cur.event_id >= self.event_floor and _at_or_after(cur.metric_pos(), self.metric_floor)

    def take(self, cur: Cursor, sub: Subscriber) -> bytes:
        """SSE bytes of what the buffer holds after ``cur`` (which ``covers``), advancing it. Subscribers
        in step (the same cursor) share one encoding per poll, to bytes (a str chunk would be encoded again
        for each response): 200 streams of a busy run cost one."""
        fresh = self.status_data is not None and self.status_poll > sub.status_after
        key = (cur.event_id, cur.logged_at, cur.key, cur.step, cur.status, fresh)
        shared = self.encoded.get(key)
        if shared is None:
            after = replace(cur)
            text = "".join(sse(*m) for m in self._messages(after, fresh)).encode()
            shared = self.encoded[key] = (text, after)
        text, after = shared
        cur.event_id, cur.logged_at, cur.key, cur.step, cur.status = (
            after.event_id,
            after.logged_at,
            after.key,
            after.step,
            after.status,
        )
        return text

    def _messages(self, cur: Cursor, fresh_status: bool) -> list[Message]:
        first = bisect_right(self.event_ids, cur.event_id)
        messages = [
            _event(cur, i, d) for i, d in zip(self.event_ids[first:], self.event_data[first:], strict=True)
        ]
        pos = cur.metric_pos()
        first = 0 if pos is None else bisect_right(self.point_pos, pos)
        for start in range(first, len(self.point_pos), BATCH):
            end = start + BATCH
            messages.append(
                _metrics(cur, list(zip(self.point_pos[start:end], self.point_data[start:end], strict=True)))
            )
        if fresh_status and self.status_data is not None and self.status_data["status"] != cur.status:
            messages.append(_status(cur, self.status_data))
        return messages

    def ensure_running(self) -> None:
        """Start the poller (again): it stops when the run has ended for everyone subscribed then."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())

    def ended_for(self, sub: Subscriber) -> bool:
        return self.done_poll > sub.status_after

    def _keep(self, batch: Batch, number: int) -> None:
        self.encoded.clear()
        for event_id, data in batch.events:
            self.event_ids.append(event_id)
            self.event_data.append(data)
        for pos, point in batch.points:
            self.point_pos.append(pos)
            self.point_data.append(point)
        if batch.events:
            self.cursor.event_id = batch.events[-1][0]
        if batch.points:
            at, self.cursor.key, self.cursor.step = batch.points[-1][0]
            self.cursor.logged_at = at.isoformat()
        if len(self.event_ids) > 2 * KEEP_EVENTS:  # trim in halves: amortised O(1) per row
            cut = len(self.event_ids) - KEEP_EVENTS
            self.event_floor = self.event_ids[cut - 1]
            del self.event_ids[:cut], self.event_data[:cut]
        if len(self.point_pos) > 2 * KEEP_POINTS:
            cut = len(self.point_pos) - KEEP_POINTS
            self.metric_floor = self.point_pos[cut - 1]
            del self.point_pos[:cut], self.point_data[:cut]
        self.status_data, self.status_poll = batch.status_data, number
        self.done_poll = number if batch.status in FINISHED_STATUSES and batch.drained else 0

    def _read(self) -> Batch:
        with self.factory() as session:
            return read_since(session, self.run_id, self.cursor, None)

    async def run(self) -> None:
        """Poll while anyone listens; stop once every subscriber can see the run's end."""
        while self.subscribers:
            self.polls += 1
            number, drained = self.polls, True
            try:
                batch = await run_in_threadpool(self._read)
                self._keep(batch, number)
                drained = batch.drained
            except Exception:  # noqa: BLE001 - a busy or restarting database: the next poll tries again
                log.warning("stream of run %s: poll failed", self.run_id, exc_info=True)
            self.wake.set()
            self.wake = asyncio.Event()
            if self.done_poll and all(s.status_after < self.done_poll for s in self.subscribers):
                break
            if drained:
                await asyncio.sleep(min(s.interval for s in self.subscribers) if self.subscribers else 0)
            else:  # behind (a burst over BATCH rows, a history replayed): read on after a breath
                await asyncio.sleep(CATCH_UP_PAUSE)
        self.task = None


class StreamSlot:
    """One open stream counted against its client; ``release`` is idempotent."""

    def __init__(self, counts: Counter[str], client: str):
        self.counts, self.client, self.released = counts, client, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.counts[self.client] -= 1
            if self.counts[self.client] <= 0:
                del self.counts[self.client]


class StreamHub:
    """The process's run feeds and open-stream counts (one per app, on ``app.state``)."""

    def __init__(self) -> None:
        self.feeds: dict[uuid.UUID, RunFeed] = {}
        self.open: Counter[str] = Counter()
        self._reads: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._first: dict[tuple[uuid.UUID, str, uuid.UUID | None], asyncio.Task[FirstRead]] = {}

    async def first_read(
        self, factory: SessionFactory, run_id: uuid.UUID, cur: Cursor, project_id: uuid.UUID | None
    ) -> FirstRead:
        """A stream's first read: the SSE bytes of what lies after ``cur``, the cursor after it, and whether
        the run has ended with nothing left (RunNotFound outside ``project_id``). Streams opening from the
        same cursor while a read is under way wait for that one (a task of its own: a client that goes
        away does not cancel it for the others)."""
        key = (run_id, cur.encode(), project_id)
        loop = asyncio.get_running_loop()
        task = self._first.get(key)
        if task is None or task.get_loop() is not loop:
            task = loop.create_task(self.one_off(_first_read, factory, run_id, replace(cur), project_id))
            self._first[key] = task

            def forget(done: asyncio.Task[FirstRead]) -> None:
                if self._first.get(key) is done:
                    del self._first[key]
                if not done.cancelled():
                    done.exception()  # retrieved: every waiter may have gone (its error is theirs, a 404)

            task.add_done_callback(forget)
        data, after, done = await asyncio.shield(task)
        return data, replace(after), done

    async def one_off(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread pool, at most ``ONE_OFF_READS`` at once (a stream's first read,
        a catch-up); the feeds' polls do not wait here."""
        loop = asyncio.get_running_loop()
        if self._reads is None or self._reads[0] is not loop:
            self._reads = (loop, asyncio.Semaphore(ONE_OFF_READS))
        async with self._reads[1]:
            return await run_in_threadpool(fn, *args)

    def acquire(self, client: str, limit: int) -> StreamSlot:
        """Count one more stream for ``client``, or raise TooManyStreams (429) at ``limit``."""
        if self.open[client] >= limit:
            raise TooManyStreams(
                f"at most {limit} event streams may be open at once per API key (per client address "
                "when auth is off); close one first"
            )
        self.open[client] += 1
        return StreamSlot(self.open, client)

    def join(self, run_id: uuid.UUID, factory: SessionFactory, cur: Cursor, interval: float) -> Subscription:
        """Subscribe to the run's feed (made, starting at ``cur``, if this is its first subscriber)."""
        feed = self.feeds.get(run_id)
        if feed is None or feed.loop is not asyncio.get_running_loop():  # (tests run one app in many loops)
            feed = self.feeds[run_id] = RunFeed.starting_at(run_id, factory, cur)
        sub = Subscriber(interval=interval, status_after=feed.polls)
        feed.subscribers.add(sub)
        return Subscription(self, feed, sub)

    def leave(self, feed: RunFeed, sub: Subscriber) -> None:
        feed.subscribers.discard(sub)
        if feed.subscribers:
            return
        if self.feeds.get(feed.run_id) is feed:
            del self.feeds[feed.run_id]
        if feed.task is not None:
            feed.task.cancel()
            feed.task = None


class Subscription:
    """One stream's place in its run's feed. ``close`` (idempotent, synchronous) leaves the feed: the
    response calls it however it ends, since a disconnect cancels the response while the message generator
    may sit suspended, and that generator's ``finally`` would only run when it is garbage-collected."""

    def __init__(self, hub: StreamHub, feed: RunFeed, sub: Subscriber):
        self.hub, self.feed, self.sub, self.closed = hub, feed, sub, False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hub.leave(self.feed, self.sub)

    async def follow(self, factory: SessionFactory, cur: Cursor) -> AsyncGenerator[str | bytes, None]:
        """SSE text of the feed after ``cur`` (advancing it) once per poll, a keep-alive comment when
        nothing was new, until the run has ended and everything was sent (then an ``end``). A client
        that goes away cancels the response (Starlette listens for the disconnect), which ``close``s."""
        feed, sub, loop = self.feed, self.sub, asyncio.get_running_loop()
        wake, behind, sent_at = feed.wake, False, loop.time()
        try:
            while True:
                if not behind:
                    feed.ensure_running()
                    await wake.wait()  # at once if the feed polled since `wake` was taken
                    early = sent_at + sub.interval - loop.time()
                    if early > sub.interval / 2:  # woken for a faster subscriber: keep this one's pace
                        await asyncio.sleep(early)
                wake = feed.wake
                text: str | bytes
                if feed.covers(cur):
                    text, done, behind = feed.take(cur, sub), feed.ended_for(sub), False
                else:  # behind the buffer's start: a one-off query of its own, then look again
                    messages, done = await self.hub.one_off(_catch_up, factory, feed.run_id, cur)
                    sub.status_after, behind = feed.polls, bool(messages)
                    text = "".join(sse(*m) for m in messages)
                if text or not done:
                    yield text or KEEP_ALIVE
                    sent_at = loop.time()
                if done:
                    yield sse(*end_message(cur))
                    return
        finally:
            self.close()


FirstRead = tuple[bytes, Cursor, bool]  # SSE bytes, the cursor after it, whether the stream is done


def _first_read(
    factory: SessionFactory, run_id: uuid.UUID, cur: Cursor, project_id: uuid.UUID | None
) -> FirstRead:
    with factory() as session:
        messages, done = poll(session, run_id, cur, project_id)
    return "".join(sse(*m) for m in messages).encode(), cur, done


def _catch_up(factory: SessionFactory, run_id: uuid.UUID, cur: Cursor) -> tuple[list[Message], bool]:
    with factory() as session:
        return poll(session, run_id, cur)
