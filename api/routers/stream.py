"""GET /v1/runs/{id}/stream: Server-Sent Events of a run's new metrics, events and status changes.

The one async route: it polls the database (in the thread pool, one short session per poll) and ends
after the run has ended and everything has been sent. Each message's ``id`` is a cursor; a client that
reconnects with ``Last-Event-ID`` gets only what it has not seen (metrics are ordered by the time they
were logged, so a value rewritten by a resumed attempt is sent again: clients key points by step).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import BriefProjectDep, SessionFactoryDep
from api.errors import InvalidRequest
from api.models import FINISHED_STATUSES, Event, Metric
from api.pagination import decode_cursor, encode_cursor
from api.schemas import EventRead
from api.services.runs import get_run

router = APIRouter(prefix="/v1/runs", tags=["runs"])
BATCH = 2000


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
        try:
            event_id, logged_at, key, step, status = decode_cursor(raw, 5)
        except InvalidRequest:
            raise InvalidRequest(
                "Last-Event-ID: not an id sent by this stream", field="Last-Event-ID"
            ) from None
        if not isinstance(event_id, int) or not isinstance(step, int):
            raise InvalidRequest("Last-Event-ID: not an id sent by this stream", field="Last-Event-ID")
        return cls(event_id, str(logged_at), str(key), step, str(status))


Message = tuple[str, Any, str]  # (event type, data, id = the cursor just after this message)


def poll(
    session: Session, run_id: uuid.UUID, cur: Cursor, project_id: uuid.UUID | None = None
) -> tuple[list[Message], bool]:
    """New messages since ``cur`` (advancing it) and whether the run has ended with nothing left."""
    messages: list[Message] = []
    run = get_run(session=session, run_id=run_id, project_id=project_id)
    events = session.scalars(
        select(Event).where(Event.run_id == run_id, Event.id > cur.event_id).order_by(Event.id).limit(BATCH)
    ).all()
    for e in events:
        cur.event_id = e.id
        messages.append(("event", EventRead.model_validate(e).model_dump(mode="json"), cur.encode()))
    stmt = select(Metric).where(Metric.run_id == run_id)
    if cur.logged_at:
        at = datetime.fromisoformat(cur.logged_at)
        stmt = stmt.where(
            or_(
                Metric.logged_at > at,
                and_(
                    Metric.logged_at == at,
                    or_(Metric.key > cur.key, and_(Metric.key == cur.key, Metric.step > cur.step)),
                ),
            )
        )
    metrics = session.scalars(stmt.order_by(Metric.logged_at, Metric.key, Metric.step).limit(BATCH)).all()
    if metrics:
        last = metrics[-1]
        cur.logged_at, cur.key, cur.step = last.logged_at.isoformat(), last.key, last.step
        points = [{"key": m.key, "step": m.step, "value": m.value} for m in metrics]
        messages.append(("metrics", points, cur.encode()))
    if run.status != cur.status:
        cur.status = run.status
        status = {"status": run.status, "step": run.step, "total_steps": run.total_steps, "error": run.error}
        messages.append(("status", status, cur.encode()))
    drained = len(events) < BATCH and len(metrics) < BATCH
    return messages, run.status in FINISHED_STATUSES and drained


def sse(kind: str, data: Any, message_id: str) -> str:
    return f"id: {message_id}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"


@router.get(
    "/{run_id}/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "SSE: `metrics`, `event`, `status` messages, then `end`",
        }
    },
)
async def stream_run(
    run_id: Annotated[uuid.UUID, Path()],
    request: Request,
    factory: SessionFactoryDep,
    project_id: BriefProjectDep,
    last_event_id: Annotated[str | None, Header(description="Resume after this message id")] = None,
    poll_seconds: Annotated[float, Query(ge=0.05, le=10)] = 0.5,
) -> StreamingResponse:
    """Live metrics, events and status of a run as Server-Sent Events, until the run ends."""
    cursor = Cursor.decode(last_event_id)

    def poll_once(cur: Cursor) -> tuple[list[Message], bool]:
        with factory() as session:
            return poll(session, run_id, cur, project_id)

    first = await run_in_threadpool(poll_once, cursor)  # a missing run answers 404 before streaming

    async def body() -> AsyncIterator[str]:
        messages, done = first
        while True:
            for kind, data, message_id in messages:
                yield sse(kind, data, message_id)
            if done:
                yield sse("end", {"status": cursor.status}, cursor.encode())
                return
            if await request.is_disconnected():
                return
            await asyncio.sleep(poll_seconds)
            messages, done = await run_in_threadpool(poll_once, cursor)
            if not messages:
                yield ": keep-alive\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
