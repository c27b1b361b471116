"""/v1/datasets: upload (multipart JSONL or a JSON body), list, read, rows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.deps import DatasetDep, ProjectDep, SessionDep, SettingsDep
from api.errors import ErrorBody, InvalidRequest, PayloadTooLarge, UnsupportedMediaType, validation_details
from api.ingest import upload_lines
from api.models import Dataset, DatasetRow
from api.pagination import decode_cursor, encode_cursor
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
    declared = int(request.headers.get("content-length") or 0)
    if declared > settings.max_upload_bytes + 64 * 1024:  # + room for multipart framing
        raise PayloadTooLarge(
            f"upload is larger than the limit of {settings.max_upload_bytes} bytes", field="file"
        )
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=10)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("file: a JSONL file part named 'file' is required", field="file")
        name = str(form.get("name") or upload.filename or "dataset")
        kind = str(form.get("kind") or "preference")
        lines: Iterator[bytes] = upload_lines(upload.file, settings.max_line_bytes)
    elif content_type.startswith("application/json"):
        try:
            body = DatasetCreateJson.model_validate_json(await request.body())
        except ValidationError as exc:
            details = validation_details(exc.errors())
            raise InvalidRequest(
                f"{details[0].field}: {details[0].message}", field=details[0].field, details=details
            ) from None
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
    await run_in_threadpool(session.commit)
    return DatasetRead.model_validate(dataset)


@router.get("", response_model=Page[DatasetRead])
def list_datasets(
    session: SessionDep,
    project_id: ProjectDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[str | None, Query(description="Cursor from the previous page")] = None,
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
    after: Annotated[str | None, Query(description="Cursor from the previous page")] = None,
) -> Page[DatasetRowRead]:
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
    return Page(data=[DatasetRowRead.model_validate(r) for r in rows], has_more=more, next_cursor=cursor)
