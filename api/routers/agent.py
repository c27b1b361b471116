"""/v1/runs/{id}/agent: where an agent program plays an agent run's episodes (docs/runs.md, "Bring your own
agent"). The API proxies each call to the gateway of the worker that holds the run
(trainer/rollout/agent_gateway.py), so an agent needs only the service's address and its API key:

1. ``GET .../agent/episodes/next``: an episode (its dataset row), with the ``base_url`` to give the
   ``openai`` client and the ``reward_url`` to post its reward to; 204 when none is on offer within ``wait``
   seconds (the run is training between rollouts), 410 once the run is over;
2. ``POST .../agent/episodes/{episode}/v1/chat/completions``: OpenAI's chat completions, answered by the
   run's current policy, with the token ids it generated from and returned;
3. ``POST .../agent/episodes/{episode}/reward``: the episode's reward; it ends the episode.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.deps import BriefProjectDep, SessionFactoryDep
from api.errors import ApiError
from api.schemas import AgentReward
from api.services.agent_gateway import Gateway, gateway_of
from rlrun.schemas import AgentEpisode, AgentRewarded, ErrorBody
from trainer.gateway_server import TOKEN_HEADER

router = APIRouter(prefix="/v1/runs/{run_id}/agent", tags=["agent"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 404, 409, 410, 413, 503)
}
EpisodeId = Annotated[str, Path(pattern="^[0-9a-f]{32}$", description="The episode's id, from `next`.")]


class GatewayUnreachable(ApiError):
    status = 503
    code = "agent_gateway_unreachable"


class GatewayLost(ApiError):
    status = 502
    code = "agent_gateway_lost"


async def _gateway(
    run_id: Annotated[uuid.UUID, Path()], factory: SessionFactoryDep, project_id: BriefProjectDep
) -> Gateway:
    """The run's gateway, looked up in a session that ends at once (the proxied call may wait long)."""

    def lookup() -> Gateway:
        with factory() as session:
            return gateway_of(session=session, run_id=run_id, project_id=project_id)

    return await run_in_threadpool(lookup)


GatewayDep = Annotated[Gateway, Depends(_gateway)]


async def _forward(gateway: Gateway, method: str, path: str, timeout: float, **kwargs: Any) -> httpx.Response:
    """The gateway's answer; a call it may have served before the connection broke is a 502 (send it
    again: the same call gets the same answer), one that never reached it, or a ``next``, a 503."""
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0)) as client:
            return await client.request(
                method, gateway.url + path, headers={TOKEN_HEADER: gateway.token}, **kwargs
            )
    except httpx.ConnectError as exc:  # nothing reached the worker: a retry is safe
        raise GatewayUnreachable(
            f"the run's worker did not answer ({type(exc).__name__}); if the run is still running, try again"
        ) from None
    except httpx.HTTPError as exc:  # it may have been served: the same call again gets its answer
        if method == "GET":  # an episode offer lost on the way: it times out; ask for another
            raise GatewayUnreachable(
                f"the run's worker stopped answering ({type(exc).__name__}); if the run is still running, "
                "try again"
            ) from None
        raise GatewayLost(
            f"the run's worker stopped answering mid-call ({type(exc).__name__}); send the call again"
        ) from None


def _passed_on(answer: httpx.Response) -> Response:
    """The gateway's answer as it is; a 4xx tells the ``openai`` client not to retry it."""
    if answer.status_code == 204:
        return Response(status_code=204)
    headers = {"x-should-retry": "false"} if 400 <= answer.status_code < 500 else {}
    return JSONResponse(status_code=answer.status_code, content=answer.json(), headers=headers)


@router.get(
    "/episodes/next",
    response_model=AgentEpisode,
    responses={204: {"description": "No episode on offer within `wait` seconds."}, **_ERRORS},
)
async def next_episode(
    request: Request,
    run_id: Annotated[uuid.UUID, Path()],
    gateway: GatewayDep,
    wait: Annotated[float, Query(ge=0, le=60, description="Seconds to wait for an episode.")] = 20.0,
) -> Response:
    """Take an episode to play: its dataset row (`prompt`, `answer`, `meta`), the `base_url` to give the
    `openai` client (`OpenAI(base_url=..., api_key=<your rlrun key>)`) and the `reward_url` to post its
    reward to. 204: none on offer within `wait` seconds (the run trains between its rollouts); 409 with
    code `agent_not_ready`: the run has not started yet; 410: the run is over."""
    answer = await _forward(gateway, "GET", "/episodes/next", wait + 30, params={"wait": wait})
    if answer.status_code != 200:
        return _passed_on(answer)
    offer = answer.json()
    here = f"{str(request.base_url).rstrip('/')}/v1/runs/{run_id}/agent/episodes/{offer['id']}"
    episode = AgentEpisode(**offer, base_url=f"{here}/v1", reward_url=f"{here}/reward")
    return JSONResponse(episode.model_dump(mode="json"))


@router.post(
    "/episodes/{episode_id}/v1/chat/completions",
    responses={
        200: {
            "description": "OpenAI's chat completion object, with `prompt_token_ids` and "
            "`choices[0].token_ids`."
        },
        **_ERRORS,
    },
)
async def agent_chat_completion(
    episode_id: EpisodeId,
    gateway: GatewayDep,
    body: Annotated[
        dict[str, Any],
        Body(description="OpenAI's chat completion request (`messages`, `tools`, `max_tokens`, `logprobs`)."),
    ],
) -> Response:
    """One turn of the episode, answered by the run's current policy at the run's sampling settings
    (`temperature`, `top_p` and `top_k` of its hyperparameters; `max_tokens` may only lower its
    `max_new_tokens`). Send the whole conversation each time, the earlier replies as returned: the
    episode's calls become one training sample. Tool calls in the reply (`finish_reason: tool_calls`)
    are read from the model's text when the request gives `tools`. The answer adds `prompt_token_ids`
    and `choices[0].token_ids`, what the policy generated from and returned."""
    answer = await _forward(gateway, "POST", f"/episodes/{episode_id}/chat/completions", 3600, json=body)
    return _passed_on(answer)


@router.post("/episodes/{episode_id}/reward", response_model=AgentRewarded, responses=_ERRORS)
async def post_agent_reward(episode_id: EpisodeId, gateway: GatewayDep, body: AgentReward) -> Response:
    """The episode's reward, once its calls are done; it ends the episode (later calls are refused)."""
    answer = await _forward(gateway, "POST", f"/episodes/{episode_id}/reward", 60, json=body.model_dump())
    return _passed_on(answer)
