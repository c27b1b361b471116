"""The inference process: OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` over loaded models.

It listens on loopback only and trusts the API in front of it (``api/routers/inference.py``), which
checks the caller's project, resolves the model name and sends the model's folder in the
``x-rlrun-model-source`` header (``tiny:<preset>`` for a preset). The folder must still lie under the
server's artifacts, cache or model roots. Models stay loaded in an LRU of
``RLRUN_INFERENCE_MAX_MODELS``, by a backend (``RLRUN_INFERENCE_BACKEND``): ``hf``
(trainer/inference/loaded.py: adapter runs share their loaded base; requests are served one at a time, a
request's ``n`` choices decoding together in one batch, trainer/inference/decode.py) or ``vllm``
(trainer/inference/vllm_served.py, GPU: concurrent requests batched continuously by vLLM's engine).

Errors answer in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.settings import Settings
from trainer.data.prompts import render_prompt
from trainer.inference.decode import DecodeParams, Delta
from trainer.inference.loaded import LoadedModels, LoadError
from trainer.inference.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from trainer.rollout.engine_process import EngineError

MODEL_SOURCE_HEADER = "x-rlrun-model-source"  # api/routers/inference.py sends it
DEFAULT_CHAT_TOKENS = 256


class InferenceError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body)


def model_folder(source: str | None, settings: Settings) -> str:
    """The folder the API resolved, checked to lie where models live on this server."""
    if not source:
        raise InferenceError(
            400, f"missing {MODEL_SOURCE_HEADER}: call the API, not this process", code="no_model"
        )
    if source.startswith("tiny:"):
        from trainer.models import tiny_model_dir
        from trainer.specs import TINY_PRESETS

        preset = source.removeprefix("tiny:")
        if preset not in TINY_PRESETS:
            raise InferenceError(404, f"no preset {source!r}", param="model", code="model_not_found")
        return str(tiny_model_dir(preset, settings.resolved_cache_dir))
    folder = Path(source).resolve()
    allowed = [settings.resolved_artifacts_dir, settings.resolved_cache_dir, *settings.resolved_model_roots]
    if not any(folder.is_relative_to(root) for root in allowed):
        raise InferenceError(
            403, "model folder outside the server's model folders", code="model_outside_roots"
        )
    if not folder.is_dir():
        raise InferenceError(404, "the model's files are gone", param="model", code="model_not_found")
    return str(folder)


class Served(Protocol):
    """A model a backend serves: its tokenizer, context length, and the decode of one prompt."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_context(self) -> int | None: ...

    def stream(self, prompt_ids: list[int], n: int, params: DecodeParams) -> Iterator[list[Delta]]: ...


class Backend(Protocol):
    """Loads models by folder (raising LoadError). ``serial``: one request decodes at a time."""

    name: str
    serial: bool

    def get(self, folder: str) -> Served: ...

    def describe(self) -> list[dict[str, Any]]: ...


def make_backend(settings: Settings) -> Backend:
    """The backend ``RLRUN_INFERENCE_BACKEND`` names (LoadError, saying what is missing, for vllm without
    vLLM or CUDA, and for vllm_server without the engine environment)."""
    if settings.inference_backend == "vllm_server":
        from trainer.inference.engine_served import EngineModels

        return EngineModels(
            settings.inference_max_models,
            python=settings.engine_python,
            max_context=settings.inference_max_context,
            max_lora_rank=settings.inference_max_lora_rank,
        )
    if settings.inference_backend == "vllm":
        from trainer.inference.vllm_served import VllmModels

        return VllmModels(
            settings.inference_max_models,
            gpu_memory_utilization=settings.inference_gpu_memory_utilization,
            max_lora_rank=settings.inference_max_lora_rank,
        )
    return LoadedModels(settings.inference_max_models)


class Generation:
    """One request's decode: its choices (one per prompt x n), their text, tokens and usage."""

    def __init__(self, served: Served, prompts: list[str], n: int, params: DecodeParams) -> None:
        self.served, self.n, self.params = served, n, params
        self.tokenizer = tokenizer = served.tokenizer
        self.prompt_ids = [tokenizer(p).input_ids for p in prompts]
        limit = served.max_context
        for ids in self.prompt_ids:
            if not ids:
                raise InferenceError(
                    400, "the prompt encodes to no tokens", param="prompt", code="empty_prompt"
                )
            if limit is not None and len(ids) + params.max_new_tokens > limit:
                raise InferenceError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids) + params.max_new_tokens} tokens ({len(ids)} in the messages, "
                    f"{params.max_new_tokens} in the completion). Please reduce the length of the messages "
                    "or completion.",
                    param="messages",
                    code="context_length_exceeded",
                )
        self.completion_tokens = 0

    def deltas(self) -> Iterator[tuple[int, Delta]]:
        """(choice index, delta) as they come; choice ``p * n + j`` is sample ``j`` of prompt ``p``.

        Raises:
            InferenceError: an engine process (vllm_server backend) refused or broke off, with its message
                (its 4xx status kept, else 502).
        """
        for p, ids in enumerate(self.prompt_ids):
            try:
                for step in self.served.stream(ids, self.n, self.params):
                    for delta in step:
                        self.completion_tokens += len(delta.token_ids) + (
                            delta.finish_reason == "stop" and not delta.token_ids
                        )
                        yield p * self.n + delta.index, delta
            except EngineError as exc:
                status = exc.status if 400 <= exc.status < 500 else 502
                raise InferenceError(status, f"the engine: {exc}", code="engine_error") from None

    def usage(self) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.prompt_ids)  # once per prompt, whatever n (as OpenAI counts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


class Choice:
    """A choice's accumulated text, tokens, log-probs and finish reason (non-streaming answers)."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.tokens += delta.token_ids
        self.logprobs += delta.logprobs
        self.top += delta.top_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


def chat_logprobs(
    gen: Generation, tokens: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], k: int
) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = gen.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in (top[j] if j < len(top) else [])[:k]]}
            for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))
        ],
        "refusal": None,
    }


def completion_logprobs(
    gen: Generation, tokens: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], offset: int
) -> dict[str, Any]:
    texts = [gen.token_text(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [{gen.token_text(i): v for i, v in row} for row in top] or None,
        "text_offset": offsets,
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    models = make_backend(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        close = getattr(models, "close", None)  # a backend with processes of its own stops them
        if close is not None:
            await run_in_threadpool(close)

    app = FastAPI(title="rlrun inference", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.backend = models
    loading = threading.Lock()  # one model loads at a time
    # A serial backend (hf) decodes one request at a time, and loads under the same lock (loading an adapter
    # changes the model a decode may be using); vllm's engine batches concurrent requests itself.
    compute: AbstractContextManager[Any] = loading if models.serial else nullcontext()

    @app.exception_handler(InferenceError)
    async def _inference_error(_: Request, exc: InferenceError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.get("/healthz")
    def health() -> dict[str, Any]:
        return {"status": "ok", "backend": models.name, "loaded": models.describe()}

    def parse(model_type: type[SamplingRequest], body: Any) -> Any:
        try:
            return model_type.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            message = first["msg"].removeprefix("Value error, ")
            if where is None and ":" in message and message.split(":")[0].isidentifier():
                where = message.split(":")[0]  # a check over several fields names the one at fault
                message = message.split(":", 1)[1].strip()
            raise InferenceError(
                400, f"{where}: {message}" if where else message, param=where, code="invalid_value"
            ) from None

    def prepare(
        req: SamplingRequest,
        prompts: list[str] | Callable[[Any], list[str]],
        source: str | None,
        max_new: int,
        top_logprobs: int,
    ) -> Generation:
        try:
            params = DecodeParams(
                max_new_tokens=max_new,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stops(),
                top_logprobs=top_logprobs,
            )
        except ValueError as exc:
            raise InferenceError(400, str(exc), param="stop", code="invalid_value") from None
        try:
            loaded = models.get(model_folder(source, settings))
        except LoadError as exc:
            if not exc.generative:
                raise InferenceError(400, str(exc), param="model", code="model_not_generative") from None
            raise InferenceError(500, str(exc), code="model_load_failed") from None
        if callable(prompts):
            prompts = prompts(loaded.tokenizer)
        return Generation(loaded, prompts, req.n, params)

    def respond(gen: Generation, build: Any, stream_chunks: Any, stream: bool) -> Any:
        if not stream:
            with compute:
                choices = [Choice() for _ in range(len(gen.prompt_ids) * gen.n)]
                for index, delta in gen.deltas():
                    choices[index].add(delta)
            return build(choices)

        def events() -> Iterator[bytes]:
            with compute:
                for chunk in stream_chunks():
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await _json(request)
        return await run_in_threadpool(chat_answer, body, request.headers.get(MODEL_SOURCE_HEADER))

    def chat_answer(body: Any, source: str | None) -> Any:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        k = req.top_logprobs or 0
        if k and not req.logprobs:
            raise InferenceError(
                400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value"
            )
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
        ]
        with loading:
            gen = prepare(
                req,
                lambda tok: [render_prompt(messages, tok)],
                source,
                req.max_new_tokens(DEFAULT_CHAT_TOKENS),
                k,
            )
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": ident, "created": created, "model": req.model, "system_fingerprint": None}

        def build(choices: list[Choice]) -> dict[str, Any]:
            return base | {
                "object": "chat.completion",
                "usage": gen.usage(),
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": c.text, "refusal": None},
                        "logprobs": chat_logprobs(gen, c.tokens, c.logprobs, c.top, k)
                        if req.logprobs
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(choices)
                ],
            }

        def chunks() -> Iterator[dict[str, Any]]:
            chunk = base | {"object": "chat.completion.chunk"}
            for i in range(req.n):
                yield chunk | {
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                }
            for i, d in gen.deltas():
                if d.text or d.finish_reason or (req.logprobs and d.token_ids):
                    logprobs = (
                        chat_logprobs(gen, d.token_ids, d.logprobs, d.top_logprobs, k)
                        if req.logprobs
                        else None
                    )
                    yield chunk | {
                        "choices": [
                            {
                                "index": i,
                                "delta": {"content": d.text} if d.text else {},
                                "logprobs": logprobs,
                                "finish_reason": d.finish_reason,
                            }
                        ]
                    }
            if req.stream_options and req.stream_options.include_usage:
                yield chunk | {"choices": [], "usage": gen.usage()}

        return respond(gen, build, chunks, req.stream)

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await _json(request)
        return await run_in_threadpool(complete_answer, body, request.headers.get(MODEL_SOURCE_HEADER))

    def complete_answer(body: Any, source: str | None) -> Any:
        req: CompletionRequest = parse(CompletionRequest, body)
        try:
            prompts = req.prompts()
        except ValueError as exc:
            raise InferenceError(400, str(exc), param="prompt", code="invalid_value") from None
        k = req.logprobs
        with loading:
            gen = prepare(req, prompts, source, req.max_tokens, k or 0)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {
            "id": ident,
            "created": created,
            "model": req.model,
            "object": "text_completion",
            "system_fingerprint": None,
        }

        def build(choices: list[Choice]) -> dict[str, Any]:
            return base | {
                "usage": gen.usage(),
                "choices": [
                    {
                        "index": i,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "logprobs": completion_logprobs(gen, c.tokens, c.logprobs, c.top, 0)
                        if k is not None
                        else None,
                    }
                    for i, c in enumerate(choices)
                ],
            }

        def chunks() -> Iterator[dict[str, Any]]:
            offsets: dict[int, int] = {}
            for i, d in gen.deltas():
                if d.text or d.finish_reason or (k is not None and d.token_ids):
                    logprobs = (
                        completion_logprobs(gen, d.token_ids, d.logprobs, d.top_logprobs, offsets.get(i, 0))
                        if k is not None
                        else None
                    )
                    offsets[i] = offsets.get(i, 0) + len(d.text)
                    yield base | {
                        "choices": [
                            {
                                "index": i,
                                "text": d.text,
                                "finish_reason": d.finish_reason,
                                "logprobs": logprobs,
                            }
                        ]
                    }
            if req.stream_options and req.stream_options.include_usage:
                yield base | {"choices": [], "usage": gen.usage()}

        return respond(gen, build, chunks, req.stream)

    return app


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise InferenceError(400, "the request body is not JSON", code="invalid_json") from None
