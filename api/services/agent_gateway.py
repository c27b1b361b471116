"""Where an agent run's gateway is, for the API's proxy (api/routers/agent.py): the worker that holds the
run writes the address on the run's row when the gateway opens (trainer/rollout/agent_gateway.py) and
clears it when the run ends. Torch-free; never commits."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.errors import ApiError
from api.models import FINISHED_STATUSES
from api.services.runs import get_run


class NotAnAgentRun(ApiError):
    status = 400
    code = "not_an_agent_run"


class AgentNotReady(ApiError):
    """The run has not opened its gateway yet (queued, starting, paused): try again."""

    status = 409
    code = "agent_not_ready"


class AgentRunOver(ApiError):
    status = 410
    code = "run_over"


@dataclass(frozen=True)
class Gateway:
    url: str
    token: str


def gateway_of(*, session: Session, run_id: uuid.UUID, project_id: uuid.UUID) -> Gateway:
    """The gateway of ``run_id`` (in ``project_id``).

    Raises:
        RunNotFound: no such run in the project.
        NotAnAgentRun: its spec has no ``agent``.
        AgentRunOver: it has finished.
        AgentNotReady: it is not running with its gateway open yet.
    """
    run = get_run(session=session, run_id=run_id, project_id=project_id)
    if not isinstance(run.spec, dict) or not run.spec.get("agent"):
        raise NotAnAgentRun(f"run {run_id} has no `agent` in its spec; agents play only agent runs")
    if run.status in FINISHED_STATUSES:
        raise AgentRunOver(f"run {run_id} is {run.status}; it offers no more episodes")
    address = run.agent_gateway
    if run.status != "running" or not address:
        raise AgentNotReady(
            f"run {run_id} is {run.status}; its agent endpoint opens once a worker has loaded the model "
            "(try again in a few seconds)"
        )
    return Gateway(url=str(address["url"]), token=str(address["token"]))
