"""API errors: one exception family, one JSON shape ``{"error": {"code", "message", "field"}}``.

The OpenAI-compatible paths (``/v1/files``, ``/v1/fine_tuning``) answer the same errors in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` so the official SDK raises its typed errors.
No handler ever puts a stack trace in a response; unexpected exceptions are logged and answered 500.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlrun.schemas import ErrorBody, ErrorDetail, ErrorInfo
from trainer.specs import ALGORITHMS

log = logging.getLogger("rlrun.api")


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str = Field(description="`invalid_request_error` for 4xx, `server_error` for 5xx.")
    param: str | None = Field(description="The request parameter at fault, if one is.")
    code: str | None = Field(description="rlrun's stable machine code (e.g. `file_not_found`).")


class OpenAIErrorBody(BaseModel):
    """Every error on /v1/files, /v1/fine_tuning, /v1/models, /v1/chat and /v1/completions has this shape
    (OpenAI's)."""

    error: OpenAIErrorInfo


OPENAI_PREFIXES = ("/v1/files", "/v1/fine_tuning", "/v1/models", "/v1/chat", "/v1/completions")


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PREFIXES)


def openai_error_response(
    status: int,
    message: str,
    *,
    param: str | None,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body. OpenAI answers invalid parameters with 400, so a 422 becomes 400 here. A 4xx
    carries ``x-should-retry: false``: the SDK otherwise retries 409 and 429 with backoff, and these
    answers (a finished job, the runs-in-flight limit) do not change within its retry window."""
    status = 400 if status == 422 else status
    info = OpenAIErrorInfo(
        message=message,
        type="server_error" if status >= 500 else "invalid_request_error",
        param=param,
        code=code,
    )
    headers = {**(headers or {}), **({"x-should-retry": "false"} if 400 <= status < 500 else {})}
    return JSONResponse(status_code=status, content=OpenAIErrorBody(error=info).model_dump(), headers=headers)


class ApiError(Exception):
    """An error with its HTTP status, a stable machine code, a message and optionally the field."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, field: str | None = None, details: list[ErrorDetail] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(code=self.code, message=self.message, field=self.field, details=self.details)
        return ErrorBody(error=info).model_dump(exclude_none=True)


class NotFound(ApiError):
    status = 404
    code = "not_found"


class RunNotFound(NotFound):
    code = "run_not_found"


class DatasetNotFound(NotFound):
    code = "dataset_not_found"


class InvalidTransition(ApiError):
    status = 409
    code = "invalid_transition"


class IncompatibleDataset(ApiError):
    status = 409
    code = "incompatible_dataset"


class IdempotencyConflict(ApiError):
    status = 409
    code = "idempotency_conflict"


class InvalidReference(ApiError):
    status = 409
    code = "invalid_reference"


class TooManyRuns(ApiError):
    status = 429
    code = "too_many_runs"


class TooManyStreams(ApiError):
    status = 429
    code = "too_many_streams"


class DatasetInvalid(ApiError):
    status = 422
    code = "dataset_invalid"


class DatasetRowUnreadable(ApiError):
    """A stored row the API cannot serialise (stored before uploads were limited to MAX_ROW_DEPTH)."""

    status = 409
    code = "dataset_row_unreadable"


class FileNotFound(NotFound):
    code = "file_not_found"


class JobNotFound(NotFound):
    code = "fine_tuning_job_not_found"


class FileInUse(ApiError):
    status = 409
    code = "file_in_use"


class ModelNotFound(NotFound):
    code = "model_not_found"


class ModelNotDeletable(ApiError):
    status = 403
    code = "model_not_deletable"


class ModelNotGenerative(ApiError):
    status = 400
    code = "model_not_generative"


class ModelImportRefused(ApiError):
    status = 400
    code = "model_import_refused"


class ModelExists(ApiError):
    status = 409
    code = "model_exists"


class InferenceUnavailable(ApiError):
    status = 503
    code = "inference_unavailable"


class InvalidRequest(ApiError):
    status = 422
    code = "validation_error"


class PayloadTooLarge(ApiError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    code = "unsupported_media_type"


def field_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``("body", "dpo", "hyperparameters", "beta")`` -> ``"hyperparameters.beta"``.

    Drops the request part and the discriminator tag that pydantic puts in union locations.
    """
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    if parts and parts[0] in ALGORITHMS:
        parts = parts[1:]
    return ".".join(parts)


_NAMED_IN_MESSAGE = re.compile(r"^Value error, ([a-z_][a-z0-9_.]*): ")


FASTAPI_BODY_ERROR = "There was an error parsing the body"  # fastapi/routing.py's 400 detail


def _error_field(error: Any) -> str:
    if error.get("type") == "json_invalid":  # its loc is ("body", <character offset>): no field at all
        return "body"
    path = field_path(error.get("loc", ()))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # the discriminator itself
        tag = str(error.get("ctx", {}).get("discriminator", "algorithm")).strip("'")
        path = f"{path}.{tag}" if path else tag
    # A check over several fields (a model validator) names the one at fault first: "field: why".
    named = _NAMED_IN_MESSAGE.match(str(error.get("msg", "")))
    if named and not path.endswith(named.group(1)):
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path


def _error_message(error: Any) -> str:
    message = str(error.get("msg", "invalid"))
    if error.get("type") == "json_invalid":  # say where: FastAPI's loc holds the character offset
        where = error.get("loc", ())[-1:]
        reason = error.get("ctx", {}).get("error")
        return f"not valid JSON{f' ({reason})' if reason else ''}" + (
            f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        )
    return message


def validation_details(errors: Any) -> list[ErrorDetail]:
    return [ErrorDetail(message=_error_message(e), field=_error_field(e)) for e in errors]


def _respond(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def _internal_error(path: str) -> JSONResponse:
    if is_openai_path(path):
        return openai_error_response(500, "internal server error", param=None, code="internal_error")
    body = ErrorBody(error=ErrorInfo(code="internal_error", message="internal server error"))
    return _respond(500, body.model_dump(exclude_none=True))


class UnexpectedErrors:
    """ASGI middleware: an unexpected exception before the response started is logged and answered 500
    here, inside Starlette's ServerErrorMiddleware. That one would answer too but then re-raise, and the
    server closes the client's keep-alive connection on a re-raised error."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await _internal_error(str(scope.get("path", "")))(scope, receive, send)


def allowed_methods(request: Request) -> list[str]:
    """Every method the API documents at this path: a 405's ``Allow`` (RFC 9110 15.5.6). Starlette's own
    lists only the first route that matched the path (``/v1/runs`` has a GET and a POST route)."""
    path = request.url.path
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in operations}
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, expected or not, in the one shape (OpenAI's on the OpenAI-compatible paths)."""
    from sqlalchemy.exc import DataError  # here, not at the top: the client imports this module

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if is_openai_path(request.url.path):
            return openai_error_response(exc.status, exc.message, param=exc.field, code=exc.code)
        return _respond(exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc.errors())
        first = details[0] if details else ErrorDetail(message="invalid request")
        message = f"{first.field}: {first.message}" if first.field else first.message
        err = InvalidRequest(message, field=first.field or None, details=details)
        if is_openai_path(request.url.path):
            return openai_error_response(err.status, message, param=err.field, code=err.code)
        return _respond(err.status, err.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
            # FastAPI's answer to a body it could not even decode (JSON bytes that are not UTF-8, say): the
            # same request error as malformed JSON, with its documented status and the field named
            cause = exc.__cause__
            reason = "not UTF-8" if isinstance(cause, UnicodeDecodeError) else type(cause).__name__
            error = {"type": "json_invalid", "loc": ("body",), "msg": "", "ctx": {"error": reason}}
            return await _validation(request, RequestValidationError([error]))
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        if is_openai_path(request.url.path):
            return openai_error_response(
                exc.status_code, str(exc.detail), param=None, code=code, headers=headers
            )
        body = ErrorBody(error=ErrorInfo(code=code, message=str(exc.detail)))
        return _respond(exc.status_code, body.model_dump(exclude_none=True), headers)

    @app.exception_handler(DataError)
    async def _data(request: Request, exc: DataError) -> JSONResponse:
        # The last line of defence: inputs are bounded and NUL-free at validation, so this means a check
        # is missing; answer the client's mistake as one, not as a server error.
        log.warning("database refused a value on %s %s: %s", request.method, request.url.path, exc.orig)
        err = InvalidRequest(
            "a value is out of range or holds a character the database cannot store (such as U+0000)"
        )
        if is_openai_path(request.url.path):
            return openai_error_response(err.status, err.message, param=None, code=err.code)
        return _respond(err.status, err.body())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _internal_error(request.url.path)

    app.add_middleware(UnexpectedErrors)
