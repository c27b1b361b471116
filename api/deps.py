"""FastAPI dependencies, as typed ``Annotated`` aliases."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Annotated

from fastapi import Depends, Header, Path, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.models import DEFAULT_PROJECT_ID, Dataset, Run
from api.queue import Enqueue
from api.services.auth import project_of_key
from api.services.datasets import get_dataset
from api.services.runs import get_run
from api.settings import Settings

# The dependencies that only read app.state are coroutines: FastAPI runs a plain function dependency in a
# worker thread, a hand-off per dependency per request. Those that touch the database stay plain functions.


async def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


async def get_session_factory(request: Request) -> Callable[[], AbstractContextManager[Session]]:
    """For the one route that opens a short session per poll (the SSE stream)."""
    factory: Callable[[], AbstractContextManager[Session]] = request.app.state.session_factory
    return factory


async def get_enqueue(request: Request) -> Enqueue:
    enqueue: Enqueue = request.app.state.enqueue
    return enqueue


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
EnqueueDep = Annotated[Enqueue, Depends(get_enqueue)]
SessionFactoryDep = Annotated[Callable[[], AbstractContextManager[Session]], Depends(get_session_factory)]


def get_project_id(
    session: SessionDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> uuid.UUID:
    """The caller's project: from its API key, or the default project when auth is off (loopback only)."""
    if not settings.auth:
        return DEFAULT_PROJECT_ID
    return project_of_key(session=session, authorization=authorization)


ProjectDep = Annotated[uuid.UUID, Depends(get_project_id)]


async def get_project_id_briefly(
    factory: SessionFactoryDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> uuid.UUID:
    """``ProjectDep`` for long responses (the SSE stream): the key is looked up in a session that ends at
    once. A request session would stay open as long as the response, and on SQLite, where every
    transaction takes the write lock (api/db.py), it would block every other writer meanwhile. A coroutine:
    with auth off it answers on the event loop, so 200 streams opening at once take no worker threads from
    the API's other requests; a key is looked up in the thread pool."""
    if not settings.auth:
        return DEFAULT_PROJECT_ID

    def lookup() -> uuid.UUID:
        with factory() as session:
            return project_of_key(session=session, authorization=authorization)

    return await run_in_threadpool(lookup)


BriefProjectDep = Annotated[uuid.UUID, Depends(get_project_id_briefly)]


def load_run(run_id: Annotated[uuid.UUID, Path()], session: SessionDep, project_id: ProjectDep) -> Run:
    return get_run(session=session, run_id=run_id, project_id=project_id)


def load_dataset(
    dataset_id: Annotated[uuid.UUID, Path()], session: SessionDep, project_id: ProjectDep
) -> Dataset:
    return get_dataset(session=session, dataset_id=dataset_id, project_id=project_id)


RunDep = Annotated[Run, Depends(load_run)]
DatasetDep = Annotated[Dataset, Depends(load_dataset)]
