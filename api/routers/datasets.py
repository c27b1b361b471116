"""/v1/datasets: upload (multipart JSONL or a JSON body), list, read, rows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from api.body_limits import limit_body
from api.deps import DatasetDep, ProjectDep, SessionDep, SettingsDep
from api.errors import (
    DatasetRowUnreadable,
    ErrorBody,
    InvalidRequest,
    UnsupportedMediaType,
    validation_details,
)
from api.ingest import MAX_ROW_DEPTH, upload_lines
from api.models import Dataset, DatasetRow
from api.pagination import AfterCursor, decode_cursor, encode_cursor
from api.schemas import DatasetCreateJson, DatasetRead, DatasetRowRead, Page
from api.services.datasets import ingest_dataset

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
                            "enum": ["preference", "sft", "ranking", "prompts"],
                            "default": "preference",
                        },
                    },
                }
            },
            "application/json": {"schema": {"$ref": "#/components/schemas/DatasetCreateJson"}},
        },
    }
}
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 413, 415, 422)}


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
    """Upload a dataset: every line validated, all rows stored or none."""
    request = limit_body(request, settings.max_upload_bytes)
    content_type = request.headers.get("content-type", "")
    form: FormData | None = None
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=10)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            await form.close()
            raise InvalidRequest("file: a JSONL file part named 'file' is required", field="file")
        name = str(form.get("name") or upload.filename or "dataset")
        kind = str(form.get("kind") or "preference")
        lines: Iterator[bytes] = upload_lines(upload.file, settings.max_line_bytes)
    elif content_type.startswith("application/json"):
        try:
            body = DatasetCreateJson.model_validate_json(await request.body())
        except ValidationError as exc:
            details = validation_details(exc.errors())
            where = details[0].field or "body"  # invalid JSON (a lone surrogate, say) is at no field
            raise InvalidRequest(f"{where}: {details[0].message}", field=where, details=details) from None
        name, kind = body.name, body.kind
        lines = (json.dumps(row).encode() for row in body.rows)
    else:
        raise UnsupportedMediaType("send multipart/form-data with a 'file' part, or application/json")
    try:
        dataset = await run_in_threadpool(
            ingest_dataset,
            session=session,
            name=name,
            kind=kind,
            lines=lines,
            max_bytes=settings.max_upload_bytes,
            max_line_bytes=settings.max_line_bytes,
            max_rows=settings.max_dataset_rows,
            project_id=project_id,
        )
    except Exception:
        await run_in_threadpool(session.rollback)  # atomic: a refused upload leaves no dataset, no row
        raise
    finally:
        if form is not None:
            await form.close()  # the spooled file
    await run_in_threadpool(session.commit)
    return DatasetRead.model_validate(dataset)


@router.get("", response_model=Page[DatasetRead])
def list_datasets(
    session: SessionDep,
    project_id: ProjectDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: AfterCursor = None,
) -> Page[DatasetRead]:
    """List datasets, newest first."""
    stmt = (
        select(Dataset)
        .where(Dataset.project_id == project_id)
        .order_by(Dataset.created_at.desc(), Dataset.id.desc())
        .limit(limit + 1)
    )
    if after is not None:
        created, did = decode_cursor(after, 2)
        try:
            stmt = stmt.where(
                (Dataset.created_at < datetime.fromisoformat(created))
                | ((Dataset.created_at == datetime.fromisoformat(created)) & (Dataset.id < uuid.UUID(did)))
            )
        except ValueError:
            raise InvalidRequest("after: not a cursor returned by this API", field="after") from None
    rows = list(session.scalars(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    cursor = encode_cursor(rows[-1].created_at.isoformat(), rows[-1].id) if more else None
    return Page(data=[DatasetRead.model_validate(d) for d in rows], has_more=more, next_cursor=cursor)


@router.get("/{dataset_id}", response_model=DatasetRead, responses=_ERRORS)
def read_dataset(dataset: DatasetDep) -> DatasetRead:
    """One dataset with its upload stats."""
    return DatasetRead.model_validate(dataset)


@router.get("/{dataset_id}/rows", response_model=Page[DatasetRowRead], responses=_ERRORS)
def list_dataset_rows(
    dataset: DatasetDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: AfterCursor = None,
) -> Response:
    """Normalised rows in upload order."""
    stmt = (
        select(DatasetRow)
        .where(DatasetRow.dataset_id == dataset.id)
        .order_by(DatasetRow.index)
        .limit(limit + 1)
    )
    if after is not None:
        (last,) = decode_cursor(after, 1)
        if not isinstance(last, int):
            raise InvalidRequest("after: not a cursor returned by this API", field="after")
        stmt = stmt.where(DatasetRow.index > last)
    rows = list(session.scalars(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    cursor = encode_cursor(rows[-1].index) if more else None
    data = [DatasetRowRead.model_validate(r) for r in rows]
    page = Page[DatasetRowRead](data=data, has_more=more, next_cursor=cursor)
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
