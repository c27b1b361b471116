"""OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` on the project's models.

The API checks the request (the bodies in trainer/inference/schemas.py) and the caller's project,
resolves the model name to its files (api/services/inference.py) and forwards the request to the
inference process (``RLRUN_INFERENCE_URL``, started by ``rlrun serve`` or run alone as ``rlrun
inference``), streaming its answer back unchanged: the API never imports torch. Sessions are brief: a
stream can last minutes and must not hold the database (SQLite's write lock) meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from api.deps import BriefProjectDep, SessionFactoryDep, SettingsDep
from api.errors import InferenceUnavailable, OpenAIErrorBody
from api.services.inference import resolve_served_model
from trainer.inference.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["inference"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody} for code in (400, 401, 404, 503)}
MODEL_SOURCE_HEADER = "x-rlrun-model-source"  # trainer/inference/server.py reads it
_STARTING_SECONDS = 20.0  # how long a request waits for an inference process that is still starting
_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=600.0)


def _client(request: Request, base_url: str) -> httpx.AsyncClient:
    client: httpx.AsyncClient | None = getattr(request.app.state, "inference_client", None)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT)
        request.app.state.inference_client = client
    return client


async def _forward(
    request: Request,
    path: str,
    body: ChatCompletionRequest | CompletionRequest,
    factory: SessionFactoryDep,
    project_id: Any,
    settings: Any,
) -> Response:
    def resolve() -> Any:
        with factory() as session:
            return resolve_served_model(session, project_id, body.model, settings)

    served = await run_in_threadpool(resolve)
    if not settings.inference_url:
        raise InferenceUnavailable(
            "no inference process is configured (RLRUN_INFERENCE_URL): `rlrun serve` starts one, or run "
            "`rlrun inference` and point RLRUN_INFERENCE_URL at it"
        )
    client = _client(request, settings.inference_url)
    upstream = client.build_request(
        "POST",
        path,
        json=body.model_dump(mode="json", exclude_unset=True),
        headers={MODEL_SOURCE_HEADER: served.source},
    )
    deadline = time.monotonic() + _STARTING_SECONDS
    while True:
        try:
            answer = await client.send(upstream, stream=True)
            break
        except httpx.ConnectError:  # not listening (yet): `rlrun serve` starts it beside the API
            if time.monotonic() >= deadline:
                raise InferenceUnavailable(
                    f"the inference process at {settings.inference_url} is not answering (nothing listens "
                    "there): start it with `rlrun inference` or `rlrun serve`"
                ) from None
            await asyncio.sleep(0.5)
        except httpx.TransportError as exc:
            raise InferenceUnavailable(
                f"the inference process at {settings.inference_url} is not answering ({type(exc).__name__})"
            ) from None
    media_type = answer.headers.get("content-type", "application/json")
    if body.stream and answer.status_code == 200:
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=200,
            media_type=media_type,
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(answer.aclose),
        )
    content = await answer.aread()
    await answer.aclose()
    return Response(content=content, status_code=answer.status_code, media_type=media_type)


@router.post(
    "/v1/chat/completions",
    responses=_ERRORS,
    summary="Chat with a model (OpenAI's chat completions; `stream: true` for server-sent chunks)",
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    factory: SessionFactoryDep,
    project_id: BriefProjectDep,
    settings: SettingsDep,
) -> Response:
    """The model's answer to `messages`, rendered with the model's chat template (or `role: content`
    lines where its tokenizer has none). Answers OpenAI's `chat.completion` object, or with `stream:
    true` `chat.completion.chunk` events ending in `data: [DONE]`."""
    return await _forward(request, "/v1/chat/completions", body, factory, project_id, settings)


@router.post(
    "/v1/completions",
    responses=_ERRORS,
    summary="Continue a prompt (OpenAI's legacy completions; `stream: true` for server-sent chunks)",
)
async def completions(
    body: CompletionRequest,
    request: Request,
    factory: SessionFactoryDep,
    project_id: BriefProjectDep,
    settings: SettingsDep,
) -> Response:
    """The model's continuation of `prompt` (no chat template). Answers OpenAI's `text_completion`."""
    return await _forward(request, "/v1/completions", body, factory, project_id, settings)
