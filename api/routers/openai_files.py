"""/v1/files, OpenAI-compatible: a `fine-tune` file is an rlrun dataset (kind detected from its lines)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import IO, Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.datastructures import UploadFile

from api import openai_mapping as mapping
from api.body_limits import limit_body
from api.db import commit_unless_conflict
from api.deps import ProjectDep, SessionDep, SessionFactoryDep, SettingsDep
from api.errors import ApiError, DatasetInvalid, FileInUse, OpenAIErrorBody, UnsupportedMediaType
from api.multipart import read_form
from api.schemas_openai import FileDeleted, FileList, FileObject
from api.services import openai_compat as compat
from api.services.dataset_sources import has_source, source_bytes, store_source
from api.services.datasets import MAX_NAME_CHARS, ingest_dataset
from rlrun.formats import text_problem, upload_lines

router = APIRouter(prefix="/v1/files", tags=["openai"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody} for code in (400, 401, 404, 409, 413, 415, 422)
}
_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "JSONL: chat `messages` lines (supervised) or OpenAI preference "
                            "lines `input`/`preferred_output`/`non_preferred_output` (dpo)",
                        },
                        "purpose": {"type": "string", "enum": ["fine-tune"]},
                    },
                }
            }
        },
    }
}
FileIdPath = Annotated[str, Path(description="`file-...`")]


def _first_line(fileobj: IO[bytes], max_line_bytes: int) -> bytes:
    lines: Iterator[bytes] = upload_lines(fileobj, max_line_bytes)
    return next((line for line in lines if line.strip()), b"")


@router.post("", response_model=FileObject, responses=_ERRORS, openapi_extra=_UPLOAD_BODY)
async def create_file(
    request: Request, session: SessionDep, settings: SettingsDep, project_id: ProjectDep
) -> FileObject:
    """Upload a fine-tuning file: every line validated, all rows stored as a dataset or none."""
    request = limit_body(request, settings.max_upload_bytes)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UnsupportedMediaType("send multipart/form-data with `file` and `purpose` parts", field="file")
    form = await read_form(request, max_files=1, max_fields=10)
    try:
        purpose = form.get("purpose")
        if purpose != "fine-tune":
            raise ApiError(
                f"purpose must be 'fine-tune' (rlrun keeps files for fine-tuning only), got {purpose!r}",
                field="purpose",
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError("a JSONL file part named 'file' is required", field="file")
        name = (upload.filename or "file.jsonl")[:MAX_NAME_CHARS]
        if (problem := text_problem(name)) is not None:
            raise ApiError(f"the file's name {problem}", field="file")
        kind = mapping.detect_kind(_first_line(upload.file, settings.max_line_bytes))
        try:
            dataset = await run_in_threadpool(
                ingest_dataset,
                session=session,
                name=name,
                kind=kind,
                lines=upload_lines(upload.file, settings.max_line_bytes),
                max_bytes=settings.max_upload_bytes,
                max_line_bytes=settings.max_line_bytes,
                max_rows=settings.max_dataset_rows,
                project_id=project_id,
                kind_detected=True,  # a file's kind is always read from its first line
            )
            # the bytes as sent, for files.content (compressed: JSONL shrinks ~5-10x)
            await run_in_threadpool(store_source, session=session, dataset_id=dataset.id, fileobj=upload.file)
        except Exception as exc:
            await run_in_threadpool(session.rollback)  # atomic: a refused upload leaves no dataset, no row
            if isinstance(exc, DatasetInvalid):  # the message names the line; the parameter is the file
                raise DatasetInvalid(f"{exc.message} (read as {kind} data)", field="file") from None
            raise
    finally:
        await form.close()  # the spooled file
    await run_in_threadpool(session.commit)
    return mapping.file_object(dataset)


@router.get("", response_model=FileList, responses=_ERRORS)
def list_files(
    session: SessionDep,
    project_id: ProjectDep,
    after: Annotated[
        str | None, Query(min_length=1, description="A file id: the page starts after it.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Literal["asc", "desc"], Query(description="By created_at.")] = "desc",
    purpose: Annotated[str | None, Query(description="Only `fine-tune` files exist.")] = None,
) -> FileList:
    """The project's fine-tuning files (its sft and preference datasets)."""
    found = compat.list_files(
        session=session,
        project_id=project_id,
        after=after,
        limit=limit,
        desc=order == "desc",
        purpose=purpose,
    )
    data = [mapping.file_object(d) for d in found.rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=found.has_more,
    )


@router.get("/{file_id}", response_model=FileObject, responses=_ERRORS)
def retrieve_file(file_id: FileIdPath, session: SessionDep, project_id: ProjectDep) -> FileObject:
    """One file: an upload, or a job's result file (its metrics CSV)."""
    if mapping.parse_result_file_id(file_id) is not None:
        run = compat.get_result_run(session=session, file=file_id, project_id=project_id, param="file_id")
        size = sum(len(line.encode()) for line in compat.result_csv(session=session, run=run))
        return mapping.result_file_object(run, size)
    return mapping.file_object(
        compat.get_file(session=session, file=file_id, project_id=project_id, param="file_id")
    )


@router.get(
    "/{file_id}/content",
    responses=_ERRORS
    | {
        200: {
            "content": {"text/csv": {}, "application/jsonl": {}},
            "description": "A result file's CSV, or an uploaded file's bytes as sent.",
        }
    },
)
def file_content(file_id: FileIdPath, factory: SessionFactoryDep, project_id: ProjectDep) -> Response:
    """A file's content (`client.files.content`): a job's result file is its metrics as CSV, one line per
    step (`step`, OpenAI's `train_loss`, `train_accuracy`, `valid_loss`, `valid_mean_token_accuracy`, then
    every rlrun metric); an uploaded file gives the bytes uploaded, as OpenAI does (a dataset uploaded
    through /v1/datasets, which keeps no copy of its bytes, gives its rows as stored: validated and
    normalised JSON lines, in upload order)."""
    # Brief sessions only: a request session would hold its connection (SQLite's only one) while the rows
    # stream, and the stream's own reads would wait for it.
    with factory() as session:
        if mapping.parse_result_file_id(file_id) is not None:
            run = compat.get_result_run(session=session, file=file_id, project_id=project_id, param="file_id")
            return Response("".join(compat.result_csv(session=session, run=run)), media_type="text/csv")
        dataset = compat.get_file(session=session, file=file_id, project_id=project_id, param="file_id")
        dataset_id = dataset.id
        uploaded = has_source(session=session, dataset_id=dataset_id)
    content = (
        source_bytes(factory=factory, dataset_id=dataset_id)
        if uploaded
        else compat.dataset_lines(factory=factory, dataset_id=dataset_id)
    )
    return StreamingResponse(iterate_in_threadpool(content), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted, responses=_ERRORS)
def delete_file(file_id: FileIdPath, session: SessionDep, project_id: ProjectDep) -> FileDeleted:
    """Delete a file no run or running pipeline uses (409 otherwise: runs keep the data they used). A
    result file is its job's metrics and goes with the job (409)."""
    if mapping.parse_result_file_id(file_id) is not None:
        compat.get_result_run(session=session, file=file_id, project_id=project_id, param="file_id")
        raise FileInUse(f"{file_id} is a job's result file: it goes with the job", field="file_id")
    dataset = compat.get_file(session=session, file=file_id, project_id=project_id, param="file_id")
    dataset_id: uuid.UUID = dataset.id
    compat.delete_file(session=session, dataset=dataset, file=file_id)
    if not commit_unless_conflict(session):  # a run was submitted on it since the check
        raise FileInUse(f"{file_id} is used by a run and cannot be deleted", field="file_id")
    return FileDeleted(id=mapping.file_id(dataset_id), deleted=True)
