"""Environments: a project's ``reset``/``step`` code for multi-turn RL runs (trainer/rollout/env_episodes.py),
stored once and named by id in run specs. Immutable: a run stores the source in its own spec at submit
(``with_environment_source``), so an environment can be deleted at any time without touching a run.
Never commits."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import InvalidRequest, NotFound
from api.models import Environment
from api.pagination import Keyset, Slice, paginate
from trainer.specs import AnyRunSpec, EnvironmentSpec

ENVIRONMENTS_ORDER = Keyset(Environment.created_at, Environment.id, desc=True)  # newest first


class EnvironmentNotFound(NotFound):
    code = "environment_not_found"


def create_environment(*, session: Session, project_id: uuid.UUID, name: str, source: str) -> Environment:
    """Store an environment after the checks a run spec's ``environment.source`` gets (Python that
    defines ``reset(row)`` and ``step(messages, row)``, no NUL, a sandbox on this server)."""
    try:
        EnvironmentSpec.check_source(source)
    except ValueError as exc:
        raise InvalidRequest(f"source: {exc}", field="source") from None
    environment = Environment(id=uuid.uuid4(), project_id=project_id, name=name, source=source)
    session.add(environment)
    session.flush()
    return environment


def get_environment(
    *, session: Session, environment_id: uuid.UUID, project_id: uuid.UUID | None
) -> Environment:
    """The project's environment; another project's answers as an unknown id does."""
    environment = session.get(Environment, environment_id)
    if environment is None or (project_id is not None and environment.project_id != project_id):
        raise EnvironmentNotFound(f"environment {environment_id} does not exist", field="environment_id")
    return environment


def list_environments(
    *, session: Session, project_id: uuid.UUID, after: str | None, limit: int
) -> Slice[Environment]:
    stmt = select(Environment).where(Environment.project_id == project_id)
    return paginate(session, stmt, ENVIRONMENTS_ORDER, limit=limit, cursor=after)


def delete_environment(*, session: Session, environment: Environment) -> None:
    """Remove it; runs that used it keep its source in their specs."""
    session.delete(environment)


def with_environment_source(
    session: Session, spec: AnyRunSpec, project_id: uuid.UUID | None, prefix: str = ""
) -> AnyRunSpec:
    """``spec`` with a stored environment's source in ``environment.source`` (replacing any given), so the
    run keeps the code it runs with; any other spec as it is. An ``id`` no longer stored with a ``source``
    given (a run's stored spec cloned, a pipeline's later stage) keeps that source: the id is then only
    where the code came from.

    Raises:
        EnvironmentNotFound: no such environment in the project and no source (the field named, as for
            datasets).
    """
    env = getattr(spec, "environment", None)
    if env is None or env.id is None:
        return spec
    field = f"{prefix}environment.id"
    try:
        stored = get_environment(session=session, environment_id=env.id, project_id=project_id)
    except EnvironmentNotFound:
        if env.source is not None:
            return spec
        raise EnvironmentNotFound(f"{field}: environment {env.id} does not exist", field=field) from None
    return spec.model_copy(update={"environment": env.model_copy(update={"source": stored.source})})
