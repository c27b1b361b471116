"""/v1/environments: store environment code (``reset``/``step``) once, name it by id in run specs."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response

from api.deps import ProjectDep, SessionDep
from api.models import Environment
from api.pagination import AfterCursor
from api.schemas import EnvironmentCreate
from api.services import environments as service
from rlrun.schemas import EnvironmentRead, ErrorBody, Page

router = APIRouter(prefix="/v1/environments", tags=["environments"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 422)}
EnvironmentId = Annotated[uuid.UUID, Path()]


def _load(session: SessionDep, project_id: ProjectDep, environment_id: EnvironmentId) -> Environment:
    return service.get_environment(session=session, environment_id=environment_id, project_id=project_id)


@router.post("", status_code=201, response_model=EnvironmentRead, responses=_ERRORS)
def create_environment(
    body: EnvironmentCreate, session: SessionDep, project_id: ProjectDep
) -> EnvironmentRead:
    """Store environment code: Python defining `reset(row)` (an episode's opening messages) and
    `step(messages, row)` (`{"messages", "reward", "done"}` after each policy turn), run in the python
    graders' sandbox. A run names it as `"environment": {"id": ...}`. Refused (422, the line named) where
    it does not compile or lacks either function."""
    environment = service.create_environment(
        session=session, project_id=project_id, name=body.name, source=body.source
    )
    read = EnvironmentRead.model_validate(environment)
    session.commit()
    return read


@router.get("", response_model=Page[EnvironmentRead])
def list_environments(
    session: SessionDep,
    project_id: ProjectDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> Page[EnvironmentRead]:
    """This project's environments, newest first."""
    found = service.list_environments(session=session, project_id=project_id, after=after, limit=limit)
    return found.as_page(EnvironmentRead.model_validate)


@router.get("/{environment_id}", response_model=EnvironmentRead, responses=_ERRORS)
def get_environment(
    session: SessionDep, project_id: ProjectDep, environment_id: EnvironmentId
) -> EnvironmentRead:
    return EnvironmentRead.model_validate(_load(session, project_id, environment_id))


@router.delete("/{environment_id}", status_code=204, responses=_ERRORS)
def delete_environment(
    session: SessionDep, project_id: ProjectDep, environment_id: EnvironmentId
) -> Response:
    """Remove an environment; runs that used it keep its code in their specs."""
    service.delete_environment(session=session, environment=_load(session, project_id, environment_id))
    session.commit()
    return Response(status_code=204)
