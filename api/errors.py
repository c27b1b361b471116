"""API errors: one exception family, one JSON shape ``{"error": {"code", "message", "field"}}``.

No handler ever puts a stack trace in a response; unexpected exceptions are logged and answered 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainer.specs import ALGORITHMS

log = logging.getLogger("rlrun.api")


class ErrorDetail(BaseModel):
    """One problem: where (``field``, and ``line`` for uploads) and what."""

    message: str
    field: str | None = None
    line: int | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: list[ErrorDetail] | None = None


class ErrorBody(BaseModel):
    """Every error response has this shape."""

    error: ErrorInfo


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


class DatasetInvalid(ApiError):
    status = 422
    code = "dataset_invalid"


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


def _error_field(error: Any) -> str:
    path = field_path(error.get("loc", ()))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # the discriminator itself
        tag = str(error.get("ctx", {}).get("discriminator", "algorithm")).strip("'")
        path = f"{path}.{tag}" if path else tag
    return path


def validation_details(errors: Any) -> list[ErrorDetail]:
    return [ErrorDetail(message=str(e.get("msg", "invalid")), field=_error_field(e)) for e in errors]


def _respond(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(status_code=status, content=body)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, expected or not, in the one shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _respond(exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc.errors())
        first = details[0] if details else ErrorDetail(message="invalid request")
        message = f"{first.field}: {first.message}" if first.field else first.message
        err = InvalidRequest(message, field=first.field or None, details=details)
        return _respond(err.status, err.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "http_error")
        body = ErrorBody(error=ErrorInfo(code=code, message=str(exc.detail)))
        return _respond(exc.status_code, body.model_dump(exclude_none=True))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        body = ErrorBody(error=ErrorInfo(code="internal_error", message="internal server error"))
        return _respond(500, body.model_dump(exclude_none=True))
