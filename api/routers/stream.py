"""GET /v1/runs/{id}/stream: Server-Sent Events of a run's new metrics, events and status changes.

The one async route. Its first read is a one-off query (a missing run answers 404 before streaming);
after that it follows the run's feed (api/stream_hub.py): one poller per run in this process, whatever
the number of streams, so open streams do not hold or take a database connection each. It ends after the
run has ended and everything has been sent. Each message's ``id`` is a cursor; a client that reconnects
with ``Last-Event-ID`` gets only what it has not seen (metrics are ordered by the time they were logged,
so a value rewritten by a resumed attempt is sent again: clients key points by step).

A client (an API key; a client address when auth is off) may hold ``max_streams_per_client`` streams
open at once; one more is answered 429 ``too_many_streams``, and a closed stream frees its place.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.deps import BriefProjectDep, SessionFactoryDep, SettingsDep
from api.stream_hub import Cursor, StreamHub, end_message, sse
from rlrun.schemas import ErrorBody

router = APIRouter(prefix="/v1/runs", tags=["runs"])


async def get_stream_hub(request: Request) -> StreamHub:
    """The app's hub, made on first use (async: made on the event loop, so never twice)."""
    hub: StreamHub | None = getattr(request.app.state, "stream_hub", None)
    if hub is None:
        hub = request.app.state.stream_hub = StreamHub()
    return hub


def client_of(request: Request, auth: bool, authorization: str | None) -> str:
    """Whom a stream counts against: the API key (its public prefix; the key was checked already), or
    the client address when auth is off."""
    if auth:
        return "key:" + (authorization or "").partition(" ")[2].strip().split("_", 2)[1]
    return "addr:" + (request.client.host if request.client else "unknown")


@router.get(
    "/{run_id}/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "SSE: `metrics`, `event`, `status` messages, then `end`",
        },
        404: {"model": ErrorBody, "description": "No such run in this project"},
        429: {"model": ErrorBody, "description": "Too many streams open for this API key or address"},
    },
)
async def stream_run(
    run_id: Annotated[uuid.UUID, Path()],
    request: Request,
    factory: SessionFactoryDep,
    settings: SettingsDep,
    hub: Annotated[StreamHub, Depends(get_stream_hub)],
    project_id: BriefProjectDep,
    last_event_id: Annotated[str | None, Header(description="Resume after this message id")] = None,
    authorization: Annotated[str | None, Header()] = None,
    poll_seconds: Annotated[float, Query(ge=0.05, le=10)] = 0.5,
) -> StreamingResponse:
    """Live metrics, events and status of a run as Server-Sent Events, until the run ends."""
    cursor = Cursor.decode(last_event_id)
    slot = hub.acquire(client_of(request, settings.auth, authorization), settings.max_streams_per_client)

    try:  # a missing run answers 404 before streaming
        first, cursor, done = await hub.first_read(factory, run_id, cursor, project_id)
    except BaseException:
        slot.release()
        raise
    sub = None if done else hub.join(run_id, factory, cursor, poll_seconds)

    async def body() -> AsyncGenerator[str | bytes, None]:
        if first:
            yield first
        if sub is None:
            yield sse(*end_message(cursor))
            return
        async for text in sub.follow(factory, cursor):
            yield text

    def close() -> None:
        if sub is not None:
            sub.close()
        slot.release()

    return EventStream(body(), on_close=close)


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends: sent to the end, failed, or cancelled by
    a client that went away (the body generator is then left suspended; its ``finally`` would run only
    when it is garbage-collected, holding the stream's place until then)."""

    def __init__(self, content: AsyncGenerator[str | bytes, None], *, on_close: Callable[[], None]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close
        weakref.finalize(self, on_close)  # a response dropped before it was ever sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
