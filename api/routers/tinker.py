"""/api/v1: the Tinker protocol (issue 40), so the official `tinker` SDK drives rlrun: set
``TINKER_BASE_URL`` to the server and ``TINKER_API_KEY`` to ``tml-<rlrun API key>`` (any ``tml-...`` with
auth off), then ``tinker.ServiceClient()`` as its docs show (docs/tinker.md).

A training client is a ``training_session`` run (api/services/tinker.py): ``create_model`` submits it,
its future resolves once a worker has loaded the model, and each ``forward_backward`` / ``optim_step`` is
queued at that worker's session gateway (trainer/primitives/commands.py) and its result polled through
``retrieve_future``, held open up to 25 s (the SDK waits 45). What the SDK would retry for minutes is
never answered with it: refusals are 4xx with a body naming the field, failures inside a call are
``{"error", "category": "user"}`` results.

These routes are the SDK's protocol, not rlrun's REST API: they stay out of the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import httpx
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from api import lifecycle
from api.deps import EnqueueDep, SessionFactoryDep, SettingsDep
from api.errors import ApiError
from api.models import DEFAULT_PROJECT_ID, FINISHED_STATUSES
from api.services import runs as run_service
from api.services.auth import project_of_key
from api.services.tinker import (
    FUTURE_ID,
    SAMPLER_ID,
    SAMPLER_PATH,
    STATE_PATH,
    Held,
    TinkerError,
    held,
    saved_states,
    session_model,
    session_run,
    session_runs,
    session_runs_page,
    training_run,
)
from trainer.gateway_server import COMMAND_HEADER, TOKEN_HEADER
from trainer.model_refs import models_in_roots
from trainer.primitives.schema import message_class
from trainer.specs import TINY_PRESETS, TrainingSessionSpec
from trainer.specs.session import TRAINABLE_FILE

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)
SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
POLL_SECONDS = 25.0  # a retrieve_future is held this long at most (the SDK's timeout is 45 s)
T = TypeVar("T")


def tinker_error_response(request: Request, exc: Exception) -> JSONResponse:  # noqa: ARG001 - handler shape
    assert isinstance(exc, TinkerError)
    return JSONResponse(status_code=exc.status, content=exc.body())


async def _db(factory: Callable[[], Any], work: Callable[[Any], T]) -> T:
    """``work`` in a short session of its own, in the thread pool (the routes here may wait long)."""

    def run() -> T:
        with factory() as session:
            return work(session)

    return await run_in_threadpool(run)


async def tinker_project(
    factory: SessionFactoryDep, settings: SettingsDep, x_api_key: Annotated[str | None, Header()] = None
) -> uuid.UUID:
    """The caller's project from ``X-API-Key: tml-<rlrun key>`` (the SDK accepts only keys with that
    prefix); the default project with auth off."""
    if not settings.auth:
        return DEFAULT_PROJECT_ID
    key = (x_api_key or "").removeprefix("tml-")
    return await _db(factory, lambda s: project_of_key(session=s, authorization=f"Bearer {key}"))


ProjectDep = Annotated[uuid.UUID, Depends(tinker_project)]


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise TinkerError(400, "the body is not JSON", "body") from None
    if not isinstance(body, dict):
        raise TinkerError(400, "the body must be a JSON object", "body")
    return body


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    # plain httpx, and forward_backward chunks sent one after another (so they arrive in seq_id order)
    return {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False, "pjwt_auth_enabled": False}


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.post("/create_session")
async def create_session(project_id: ProjectDep) -> dict[str, Any]:  # noqa: ARG001 - checks the key
    return {"session_id": uuid.uuid4().hex, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(project_id: ProjectDep) -> dict[str, Any]:  # noqa: ARG001 - checks the key
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(
    project_id: ProjectDep,  # noqa: ARG001 - checks the key
    settings: SettingsDep,
) -> dict[str, Any]:
    """The base models this server can train: the tiny presets and the model folders under its model
    roots (imported models among them), by the name a run spec gives them (``run:<id>`` works too)."""
    names = [f"tiny:{p}" for p in TINY_PRESETS] + models_in_roots(settings.resolved_model_roots)
    return {"supported_models": [{"model_name": n} for n in names]}


def _model_name(body: dict[str, Any]) -> str:
    """The id of the model a session creates, ``{session_id}:train:{model_seq_id}`` (as the SDK derives it).

    Raises:
        TinkerError: 400, not a session this server made, or a bad sequence number.
    """
    session_id, seq = body.get("session_id"), body.get("model_seq_id")
    if not isinstance(session_id, str) or not SESSION_ID.match(session_id):
        raise TinkerError(400, "unknown session (create one with create_session)", "session_id")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise TinkerError(400, "model_seq_id must be an integer >= 0", "model_seq_id")
    return f"{session_id}:train:{seq}"


@router.post("/create_model")
async def create_model(
    request: Request,
    project_id: ProjectDep,
    factory: SessionFactoryDep,
    settings: SettingsDep,
    enqueue: EnqueueDep,
) -> dict[str, Any]:
    """A LoRA training client: a ``training_session`` run, queued; its future resolves once a worker
    holds the model."""
    body = await _body(request)
    name = _model_name(body)
    lora = body.get("lora_config") or {}
    try:
        spec = TrainingSessionSpec.model_validate(
            {
                "algorithm": "training_session",
                "model": body.get("base_model"),
                "name": name,
                "hyperparameters": {"lora_rank": lora.get("rank", 32), "seed": lora.get("seed") or 0},
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]).replace("model", "base_model", 1)
        raise TinkerError(
            400, f"{first['msg']}", where.replace("hyperparameters.lora_rank", "lora_config.rank")
        ) from None

    run_id = await _submit_session(spec, project_id, factory, settings, enqueue)
    return {"request_id": f"create.{run_id}", "model_id": name}


async def _submit_session(
    spec: TrainingSessionSpec, project_id: uuid.UUID, factory: Callable[[], Any], settings: Any, enqueue: Any
) -> uuid.UUID:
    """Store and queue a session's run, as POST /v1/runs would."""

    def submit(session: Any) -> uuid.UUID:
        run = run_service.submit_run(
            session=session,
            spec=spec,
            roots=settings.resolved_model_roots,
            allow_hub=settings.allow_hub,
            project_id=project_id,
            max_in_flight=settings.max_runs_in_flight,
            worker_devices=settings.worker_devices,
            worker_hosts=settings.worker_hosts,
        )
        session.commit()
        lifecycle.send_committed(session=session, enqueue=enqueue, runs=[run])
        return run.id

    try:
        return await _db(factory, submit)
    except ApiError as exc:
        raise TinkerError(exc.status if exc.status < 500 else 400, exc.message, "base_model") from None


@router.post("/get_info")
async def get_info(request: Request, project_id: ProjectDep, factory: SessionFactoryDep) -> dict[str, Any]:
    body = await _body(request)
    model_id = str(body.get("model_id", ""))

    def info(session: Any) -> dict[str, Any]:
        run = session_model(session, project_id, model_id)
        at = held(run)
        spec = TrainingSessionSpec.model_validate(run.spec)
        data: dict[str, Any] = {"model_name": spec.model, "arch": "causal_lm"}
        if at is not None and at.model_path:
            data["tokenizer_id"] = at.model_path  # a local folder: the SDK's get_tokenizer loads it
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": data,
            "is_lora": True,
            "lora_rank": spec.hyperparameters.lora_rank,
            "model_name": spec.model,
        }

    return await _db(factory, info)


async def _held(factory: Callable[[], Any], project_id: uuid.UUID, model_id: str) -> Held:
    def find(session: Any) -> Held:
        at = held(session_model(session, project_id, model_id))
        if at is None:
            raise TinkerError(
                400, f"the session of {model_id} is not ready: wait for create_model's result", "model_id"
            )
        return at

    return await _db(factory, find)


async def _submit(at: Held, kind: str, raw: bytes, content_type: str) -> dict[str, Any]:
    """Queue a call at the session's worker; its future."""
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
            answer = await client.post(
                f"{at.url}/commands",
                content=raw,
                headers={TOKEN_HEADER: at.token, COMMAND_HEADER: kind, "Content-Type": content_type},
            )
    except httpx.HTTPError as exc:
        raise TinkerError(
            400, f"the session's worker did not answer ({type(exc).__name__})", "model_id"
        ) from None
    if answer.status_code != 200:
        body = answer.json()
        raise TinkerError(
            400 if answer.status_code >= 500 else answer.status_code,
            body.get("detail", ""),
            body.get("field"),
        )
    return {"request_id": f"cmd.{at.run_id}.{answer.json()['request_id']}"}


@router.post("/forward_backward")
async def forward_backward(
    request: Request, project_id: ProjectDep, factory: SessionFactoryDep
) -> dict[str, Any]:
    """``forward_backward`` and ``forward``: the protobuf body goes to the session's worker as it is."""
    raw = await request.body()
    if request.headers.get("content-encoding"):
        raise TinkerError(400, "compressed bodies are not supported (this server asks for none)", "body")
    msg = message_class("ForwardBackwardRequest")()
    try:
        msg.ParseFromString(raw)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise TinkerError(400, "not a ForwardBackwardRequest", "body") from None
    at = await _held(factory, project_id, msg.model_id)
    return await _submit(at, "forward_backward", raw, "application/x-protobuf") | {"model_id": msg.model_id}


@router.post("/optim_step")
async def optim_step(request: Request, project_id: ProjectDep, factory: SessionFactoryDep) -> dict[str, Any]:
    raw = await request.body()
    body = await _body(request)
    model_id = str(body.get("model_id", ""))
    at = await _held(factory, project_id, model_id)
    return await _submit(at, "optim_step", raw, "application/json") | {"model_id": model_id}


@router.post("/retrieve_future")
async def retrieve_future(request: Request, project_id: ProjectDep, factory: SessionFactoryDep) -> Response:
    """A call's result once it is ready, waiting up to 25 s; else ``try_again``."""
    body = await _body(request)
    request_id = str(body.get("request_id", ""))
    found = FUTURE_ID.match(request_id)
    if found is None:
        raise TinkerError(404, f"no request {request_id!r}", "request_id")
    run_id = uuid.UUID(found["run"])
    if found["kind"] in ("create", "load"):
        return JSONResponse(await _created(factory, project_id, run_id, request_id, found["kind"]))

    def where(session: Any) -> Held | dict[str, Any]:
        run = session_run(session, project_id, run_id, request_id)
        if run.status in FINISHED_STATUSES:
            return {"error": f"the session is over (its run {run.status})", "category": "user"}
        at = held(run)
        if at is None:
            return {"error": "the session's worker is gone", "category": "user"}
        return at

    at = await _db(factory, where)
    if isinstance(at, dict):
        return JSONResponse(at)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(POLL_SECONDS + 10, connect=5.0)) as client:
            answer = await client.get(
                f"{at.url}/futures/{found['n']}",
                params={"wait": POLL_SECONDS},
                headers={TOKEN_HEADER: at.token},
            )
    except httpx.HTTPError:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if answer.status_code == 404:
        raise TinkerError(404, f"no request {request_id!r} (its result is gone)", "request_id")
    content_type = answer.headers.get("content-type", "application/json")
    if content_type.startswith("application/json"):
        result = answer.json()
        if result.get("type") == "try_again":
            result["request_id"] = request_id
        return JSONResponse(result)
    return Response(content=answer.content, media_type=content_type)


async def _created(
    factory: Callable[[], Any], project_id: uuid.UUID, run_id: uuid.UUID, request_id: str, kind: str
) -> dict[str, Any]:
    """``create_model``'s (or a create-from-state ``load_weights``') result: the model id once a worker
    holds the model (polled up to 25 s)."""
    deadline = time.monotonic() + POLL_SECONDS
    while True:

        def state(session: Any) -> tuple[str, str, str | None, bool]:
            run = session_run(session, project_id, run_id, request_id)
            return run.status, run.name, run.error, bool(run.agent_gateway)

        status, name, error, ready = await _db(factory, state)
        if status in FINISHED_STATUSES:
            return {
                "error": f"the model could not be created: run {run_id} {status}: {error or ''}",
                "category": "user",
            }
        if status == "running" and ready:
            return {"model_id": name, "type": "create_model" if kind == "create" else "load_weights"}
        if time.monotonic() >= deadline:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        await asyncio.sleep(0.25)


@router.get("/training_runs")
async def list_training_runs(
    project_id: ProjectDep,
    factory: SessionFactoryDep,
    settings: SettingsDep,
    limit: int = 20,
    offset: int = 0,
) -> dict[str, Any]:
    """The project's training sessions (the SDK's ``RestClient.list_training_runs``), newest first."""
    limit, offset = min(max(limit, 1), 200), max(offset, 0)
    artifacts = settings.resolved_artifacts_dir

    def page(session: Any) -> dict[str, Any]:
        runs, total = session_runs_page(session, project_id, limit, offset)
        return {
            "training_runs": [training_run(r, artifacts) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    return await _db(factory, page)


@router.get("/training_runs/{model_id}")
async def get_training_run(
    model_id: str, project_id: ProjectDep, factory: SessionFactoryDep, settings: SettingsDep
) -> dict[str, Any]:
    artifacts = settings.resolved_artifacts_dir
    return await _db(factory, lambda s: training_run(session_model(s, project_id, model_id), artifacts))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(
    model_id: str, project_id: ProjectDep, factory: SessionFactoryDep, settings: SettingsDep
) -> dict[str, Any]:
    """The states a session saved (``RestClient.list_checkpoints``), newest first."""
    artifacts = settings.resolved_artifacts_dir
    states = await _db(factory, lambda s: saved_states(artifacts, session_model(s, project_id, model_id)))
    return {"checkpoints": states, "cursor": None}


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, project_id: ProjectDep, factory: SessionFactoryDep
) -> dict[str, Any]:
    """End the session: each of its models' workers saves the adapter as its run's model and stops; a
    model no worker holds yet is cancelled (it would otherwise hold a worker until its idle timeout)."""
    if not SESSION_ID.match(session_id):
        raise TinkerError(404, f"no session {session_id!r}", "session_id")

    def ending(session: Any) -> list[Held]:
        out = []
        for run in session_runs(session, project_id, session_id):
            at = held(run)
            if at is not None:
                out.append(at)
            else:
                lifecycle.cancel_run(session=session, run=run)
        session.commit()
        return out

    for at in await _db(factory, ending):
        try:
            await _submit(at, "finish", b"", "application/json")
        except TinkerError:
            pass  # a worker already gone: its lease ends the run
    return {}


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, project_id: ProjectDep, factory: SessionFactoryDep
) -> dict[str, Any]:
    """Snapshot the adapter for sampling: named (``path``), its result the ``tinker://`` path; unnamed
    (``save_weights_and_get_sampling_client``), its result a sampling session on it."""
    body = await _body(request)
    model_id = str(body.get("model_id", ""))
    at = await _held(factory, project_id, model_id)
    name = body.get("path")
    if name is None:
        seq = body.get("sampling_session_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise TinkerError(
                400, "sampling_session_seq_id must be an integer >= 0", "sampling_session_seq_id"
            )
        name = f"ephemeral-{seq}"
        reply: dict[str, Any] = {"sampling_session_id": f"sampler.{at.run_id}.{name}"}
    else:
        reply = {"path": f"tinker://{model_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
    raw = json.dumps({"name": name, "reply": reply}).encode()
    return await _submit(at, "save_sampler", raw, "application/json") | {"model_id": model_id}


@router.post("/create_sampling_session")
async def create_sampling_session(
    request: Request, project_id: ProjectDep, factory: SessionFactoryDep
) -> dict[str, Any]:
    """A sampler on weights saved with ``save_weights_for_sampler`` (``model_path``)."""
    body = await _body(request)
    path = body.get("model_path")
    found = SAMPLER_PATH.match(path) if isinstance(path, str) else None
    if found is None:
        raise TinkerError(
            400,
            "give model_path, a tinker://<model>/sampler_weights/<name> path from save_weights_for_sampler "
            "(sampling a bare base model is not supported yet)",
            "model_path",
        )
    run_id = await _db(factory, lambda s: session_model(s, project_id, found["model"]).id)
    return {"sampling_session_id": f"sampler.{run_id}.{found['name']}", "type": "create_sampling_session"}


async def _sampler(factory: Callable[[], Any], project_id: uuid.UUID, sampler_id: str) -> tuple[Any, str]:
    """(the session run, the snapshot name) of a sampling session id."""
    found = SAMPLER_ID.match(sampler_id or "")
    if found is None:
        raise TinkerError(404, f"no sampling session {sampler_id!r}", "sampling_session_id")
    run = await _db(factory, lambda s: session_run(s, project_id, uuid.UUID(found["run"]), sampler_id))
    return run, found["name"]


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, project_id: ProjectDep, factory: SessionFactoryDep) -> dict[str, Any]:
    run, name = await _sampler(factory, project_id, sampler_id)
    model = TrainingSessionSpec.model_validate(run.spec).model
    return {
        "sampler_id": sampler_id,
        "base_model": model,
        "model_path": f"tinker://{run.name}/sampler_weights/{name}",
    }


@router.post("/asample")
async def asample(request: Request, project_id: ProjectDep, factory: SessionFactoryDep) -> dict[str, Any]:
    """Samples from a snapshot, generated by the worker holding its session between training calls."""
    body = await _body(request)
    run, name = await _sampler(factory, project_id, str(body.get("sampling_session_id", "")))
    at = await _held(factory, project_id, run.name)
    raw = json.dumps(body | {"snapshot": name}).encode()
    future = await _submit(at, "sample", raw, "application/json")
    n = body.get("num_samples", 1)
    count = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 64 else 1
    return future | {"sample_sequence_ids": [f"{future['request_id']}:{i}" for i in range(count)]}


@router.post("/save_weights")
async def save_weights(
    request: Request, project_id: ProjectDep, factory: SessionFactoryDep
) -> dict[str, Any]:
    """``save_state``: the adapter and the optimizer's state, under the run's checkpoints; its result the
    ``tinker://<model>/weights/<name>`` path a new training client starts from."""
    body = await _body(request)
    model_id = str(body.get("model_id", ""))
    at = await _held(factory, project_id, model_id)
    name = body.get("path")
    reply = {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}
    raw = json.dumps({"name": name, "reply": reply, "overwrite": bool(body.get("overwrite"))}).encode()
    return await _submit(at, "save_state", raw, "application/json") | {"model_id": model_id}


@router.post("/load_weights")
async def load_weights(
    request: Request,
    project_id: ProjectDep,
    factory: SessionFactoryDep,
    settings: SettingsDep,
    enqueue: EnqueueDep,
) -> dict[str, Any]:
    """``create_training_client_from_state[_with_optimizer]``: a new session run (the model id the SDK
    derives) on the saved state's base model and rank, started from its adapter (and Adam state)."""
    body = await _body(request)
    if not isinstance(body.get("session_id"), str):
        raise TinkerError(
            400,
            "loading a state into an existing training client (load_state) is not supported yet: create one "
            "from the state (create_training_client_from_state)",
            "model_id",
        )
    name = _model_name(body)
    path = body.get("path")
    found = STATE_PATH.match(path) if isinstance(path, str) else None
    if found is None:
        raise TinkerError(400, "a tinker://<model>/weights/<name> path from save_state", "path")
    source_id, source_spec = await _db(
        factory, lambda s: (lambda r: (r.id, r.spec))(session_model(s, project_id, found["model"]))
    )
    folder = (
        settings.resolved_artifacts_dir / "runs" / str(source_id) / "checkpoints" / "weights" / found["name"]
    )
    if not (folder / TRAINABLE_FILE).exists():
        raise TinkerError(404, f"no state {found['name']!r} was saved by {found['model']}", "path")
    source = TrainingSessionSpec.model_validate(source_spec)
    spec = TrainingSessionSpec.model_validate(
        {
            "algorithm": "training_session",
            "model": source.model,
            "name": name,
            "hyperparameters": {"lora_rank": source.hyperparameters.lora_rank},
            "load_state": {
                "run_id": str(source_id),
                "name": found["name"],
                "optimizer": bool(body.get("optimizer")),
            },
        }
    )
    run_id = await _submit_session(spec, project_id, factory, settings, enqueue)
    return {"request_id": f"load.{run_id}", "model_id": name}
