"""Dataset ingest: streamed, validated line by line, atomic. Never commits (the router does)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from api.errors import DatasetInvalid, DatasetNotFound, ErrorDetail, InvalidRequest, PayloadTooLarge
from api.ingest import (
    NORMALIZERS,
    DatasetStatsBuilder,
    LineError,
    content_hash,
    parse_json_line,
    text_problem,
)
from api.models import DEFAULT_PROJECT_ID, Dataset, DatasetRow

MAX_REPORTED_ERRORS = 20
INSERT_BATCH = 500
MAX_NAME_CHARS = 200  # datasets.name is VARCHAR(200): PostgreSQL refuses longer, SQLite would keep it


def check_name(name: str) -> None:
    """Refuse, as 422 naming ``name``, a dataset name that one backend would store and another refuse."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"name: at most {MAX_NAME_CHARS} characters, got {len(name)}", field="name")
    if (problem := text_problem(name)) is not None:
        raise InvalidRequest(f"name: {problem}", field="name")


def ingest_dataset(
    *,
    session: Session,
    name: str,
    kind: str,
    lines: Iterable[bytes],
    max_bytes: int,
    max_line_bytes: int = 8 * 1024 * 1024,
    max_rows: int = 1_000_000,
    project_id: uuid.UUID = DEFAULT_PROJECT_ID,
) -> Dataset:
    """Validate every line of ``lines`` and store the dataset with all its rows, or raise.

    Invariants: rows are inserted in batches as they are read (memory does not grow with the file);
    the first bad line stops inserting but validation goes on to report up to 20 errors; any error
    raises before the caller commits, so the caller's rollback leaves no dataset and no row. Nothing
    stored can fail on one backend and pass on the other: the name and every line are checked first
    (``check_name``, ``parse_json_line``: no NUL, no lone surrogate, at most ``MAX_ROW_DEPTH`` deep).
    """
    normalize = NORMALIZERS.get(kind)
    if normalize is None:
        raise InvalidRequest(f"kind must be one of {sorted(NORMALIZERS)}, got {kind!r}", field="kind")
    check_name(name)
    dataset = Dataset(
        id=uuid.uuid4(), project_id=project_id, name=name, kind=kind, row_count=0, size_bytes=0, stats={}
    )
    session.add(dataset)
    session.flush()

    stats = DatasetStatsBuilder(kind)
    errors: list[ErrorDetail] = []
    n_errors = 0
    batch: list[dict[str, Any]] = []
    size = 0
    for line_no, raw in enumerate(lines, start=1):
        size += len(raw)
        if size > max_bytes:
            raise PayloadTooLarge(f"upload is larger than the limit of {max_bytes} bytes", field="file")
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:  # the reader hands over at most max_line_bytes + 1 of a line
            n_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(
                    ErrorDetail(line=line_no, message=f"line is longer than {max_line_bytes} bytes")
                )
            continue
        if stats.rows >= max_rows:
            raise PayloadTooLarge(f"more than {max_rows} rows; split the dataset", field="file")
        try:
            row, fmt = normalize(parse_json_line(raw.rstrip(b"\r\n")))
        except LineError as exc:
            n_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(ErrorDetail(line=line_no, field=exc.field, message=exc.message))
            continue
        if n_errors:
            continue
        digest = content_hash(row)
        stats.add(row, fmt, digest)
        batch.append({"dataset_id": dataset.id, "index": stats.rows - 1, "data": row, "content_hash": digest})
        if len(batch) >= INSERT_BATCH:
            session.execute(insert(DatasetRow), batch)
            batch.clear()

    if n_errors:
        first = errors[0]
        raise DatasetInvalid(
            f"{n_errors} invalid line(s); first at line {first.line}: {first.message}",
            field=f"line {first.line}",
            details=errors,
        )
    if stats.rows == 0:
        raise DatasetInvalid("the upload holds no rows", field="file")
    if batch:
        session.execute(insert(DatasetRow), batch)
    dataset.row_count = stats.rows
    dataset.size_bytes = size
    dataset.stats = stats.as_dict()
    session.flush()
    return dataset


def get_dataset(*, session: Session, dataset_id: uuid.UUID, project_id: uuid.UUID | None = None) -> Dataset:
    """The dataset, if it exists in ``project_id`` (None: any project; the worker's view)."""
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or (project_id is not None and dataset.project_id != project_id):
        raise DatasetNotFound(f"dataset {dataset_id} does not exist", field="dataset_id")
    return dataset


def load_rows(*, session: Session, dataset_id: uuid.UUID) -> list[dict[str, Any]]:
    """All rows of a dataset in upload order (the worker loads them once per run)."""
    stmt = select(DatasetRow.data).where(DatasetRow.dataset_id == dataset_id).order_by(DatasetRow.index)
    return list(session.scalars(stmt))
