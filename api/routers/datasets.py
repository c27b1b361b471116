"""/v1/datasets: upload (multipart JSONL or a JSON body), list, read, rows, skipped lines."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from api.body_limits import limit_body
from api.deps import DatasetDep, ProjectDep, SessionDep, SettingsDep
from api.errors import (
    DatasetRowUnreadable,
    InvalidRequest,
    UnsupportedMediaType,
    validation_details,
)
from api.models import Dataset
from api.multipart import read_form
from api.pagination import AfterCursor
from api.schemas import DatasetCreateJson
from api.services import datasets as service
from api.settings import Settings
from rlrun.formats import MAX_ROW_DEPTH, LineError, detect_upload_kind, upload_lines
from rlrun.schemas import (
    SKIPPED_IN_RESPONSE,
    DatasetKind,
    DatasetRead,
    DatasetRowRead,
    ErrorBody,
    Page,
    SkippedLineRead,
)

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "JSONL, one row a line",
                        },
                        "name": {"type": "string", "description": "Default: the file name"},
                        "kind": {
                            "type": "string",
                            "enum": list(get_args(DatasetKind)),
                            "description": "Omit to detect it from the keys of the first lines "
                            "(`kind_detected` in the response)",
                        },
                        "skip_invalid": {
                            "type": "boolean",
                            "default": False,
                            "description": "Store the valid rows and list the invalid lines instead of "
                            "refusing the whole upload",
                        },
                    },
                }
            },
            "application/json": {"schema": {"$ref": "#/components/schemas/DatasetCreateJson"}},
        },
    }
}
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 413, 415, 422)}


@dataclass
class _Upload:
    """An upload's parts, whichever way it came; ``lines()`` reads them from the start each call."""

    name: str
    kind: str | None
    skip_invalid: bool
    lines: Callable[[], Iterator[bytes]]


async def _read_upload(request: Request, settings: Settings) -> tuple[_Upload, FormData | None]:
    """The upload in ``request`` (multipart JSONL file or JSON body), and the form to close."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await read_form(request, max_files=1, max_fields=10)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            await form.close()
            raise InvalidRequest("file: a JSONL file part named 'file' is required", field="file")
        try:
            skip_invalid = _form_bool(form.get("skip_invalid"), "skip_invalid")
        except InvalidRequest:
            await form.close()
            raise
        return _Upload(
            name=str(form.get("name") or upload.filename or "dataset"),
            kind=str(form.get("kind") or "") or None,
            skip_invalid=skip_invalid,
            lines=lambda: upload_lines(upload.file, settings.max_line_bytes),
        ), form
    if content_type.startswith("application/json"):
        try:
            body = DatasetCreateJson.model_validate_json(await request.body())
        except ValidationError as exc:
            details = validation_details(exc.errors())
            where = details[0].field or "body"  # invalid JSON (a lone surrogate, say) is at no field
            raise InvalidRequest(f"{where}: {details[0].message}", field=where, details=details) from None
        return _Upload(
            name=body.name,
            kind=body.kind,
            skip_invalid=body.skip_invalid,
            lines=lambda: (json.dumps(row).encode() for row in body.rows),
        ), None
    raise UnsupportedMediaType("send multipart/form-data with a 'file' part, or application/json")


def _form_bool(value: str | UploadFile | None, name: str) -> bool:
    if value is None or (isinstance(value, str) and value.lower() in ("", "false", "0", "no", "off")):
        return False
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    raise InvalidRequest(f"{name}: must be true or false", field=name)


def _detect_kind(upload: _Upload) -> str:
    try:
        return detect_upload_kind(upload.lines())
    except LineError as exc:
        raise InvalidRequest(f"kind: {exc.message}", field="kind") from None


def _ingest(session: SessionDep, settings: Settings, project_id: uuid.UUID, upload: _Upload) -> DatasetRead:
    """Detect the kind if it was not given, ingest, and read back the first skipped lines (a thread)."""
    kind = upload.kind or _detect_kind(upload)
    dataset = service.ingest_dataset(
        session=session,
        name=upload.name,
        kind=kind,
        lines=upload.lines(),
        max_bytes=settings.max_upload_bytes,
        max_line_bytes=settings.max_line_bytes,
        max_rows=settings.max_dataset_rows,
        project_id=project_id,
        skip_invalid=upload.skip_invalid,
        kind_detected=upload.kind is None,
    )
    return _with_skipped(session, dataset)


def _with_skipped(session: SessionDep, dataset: Dataset) -> DatasetRead:
    """The dataset with its first ``SKIPPED_IN_RESPONSE`` skipped lines (one query, only if it has any)."""
    read = DatasetRead.model_validate(dataset)
    first = (
        service.list_skipped(session=session, dataset_id=dataset.id, limit=SKIPPED_IN_RESPONSE).rows
        if read.skipped_count
        else []
    )
    return read.model_copy(update={"skipped": [SkippedLineRead.model_validate(s) for s in first]})


@router.post(
    "",
    status_code=201,
    response_model=DatasetRead,
    responses=_ERRORS,
    openapi_extra=_UPLOAD_BODY,
)
async def create_dataset(
    request: Request, session: SessionDep, settings: SettingsDep, project_id: ProjectDep
) -> DatasetRead:
    """Upload a dataset: every line validated, all rows stored or none (or, with skip_invalid, the valid
    ones, the others listed)."""
    request = limit_body(request, settings.max_upload_bytes)
    upload, form = await _read_upload(request, settings)
    try:
        dataset = await run_in_threadpool(_ingest, session, settings, project_id, upload)
    except Exception:
        await run_in_threadpool(session.rollback)  # atomic: a refused upload leaves no dataset, no row
        raise
    finally:
        if form is not None:
            await form.close()  # the spooled file
    await run_in_threadpool(session.commit)
    return dataset


@router.get("", response_model=Page[DatasetRead])
def list_datasets(
    session: SessionDep,
    project_id: ProjectDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: AfterCursor = None,
) -> Page[DatasetRead]:
    """List datasets, newest first."""
    found = service.list_datasets(session=session, project_id=project_id, after=after, limit=limit)
    return found.as_page(DatasetRead.model_validate)


@router.get("/{dataset_id}", response_model=DatasetRead, responses=_ERRORS)
def read_dataset(dataset: DatasetDep, session: SessionDep) -> DatasetRead:
    """One dataset with its upload stats and its first skipped lines."""
    return _with_skipped(session, dataset)


@router.get("/{dataset_id}/skipped", response_model=Page[SkippedLineRead], responses=_ERRORS)
def list_skipped_lines(
    dataset: DatasetDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: AfterCursor = None,
) -> Page[SkippedLineRead]:
    """Lines an upload with skip_invalid left out, in line order: number, reason, field."""
    found = service.list_skipped(session=session, dataset_id=dataset.id, limit=limit, after=after)
    return found.as_page(SkippedLineRead.model_validate)


@router.get("/{dataset_id}/rows", response_model=Page[DatasetRowRead], responses=_ERRORS)
def list_dataset_rows(
    dataset: DatasetDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: AfterCursor = None,
) -> Response:
    """Normalised rows in upload order."""
    rows = service.list_rows(session=session, dataset_id=dataset.id, after=after, limit=limit)
    data = [DatasetRowRead.model_validate(r) for r in rows.rows]
    page = Page[DatasetRowRead](data=data, has_more=rows.has_more, next_cursor=rows.next_cursor)
    try:  # serialised here, not by FastAPI after return, so that a row that cannot be is a 409, not a 500
        return Response(page.model_dump_json(), media_type="application/json")
    except (ValueError, RecursionError):
        bad = next((r for r in page.data if not _serialisable(r)), page.data[0])
        raise DatasetRowUnreadable(
            f"row {bad.index} is nested too deeply to be returned (it was stored before uploads were "
            f"limited to {MAX_ROW_DEPTH} levels); delete the dataset and upload it again",
            field=f"row {bad.index}",
        ) from None


def _serialisable(row: DatasetRowRead) -> bool:
    try:
        row.model_dump_json()
    except (ValueError, RecursionError):
        return False
    return True
