"""Dataset ingest: streamed, validated line by line, atomic (or, with skip_invalid, storing the valid
rows and recording the others). Never commits (the router does)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from api.errors import DatasetInvalid, DatasetNotFound, InvalidRequest, PayloadTooLarge
from api.ingest import DatasetStatsBuilder, content_hash
from api.models import DEFAULT_PROJECT_ID, Dataset, DatasetRow, DatasetSkippedLine
from api.pagination import Keyset, Slice, paginate
from rlrun.formats import NORMALIZERS, LineError, parse_json_line, text_problem
from rlrun.schemas import ErrorDetail

MAX_REPORTED_ERRORS = 20
INSERT_BATCH = 500
MAX_NAME_CHARS = 200  # datasets.name is VARCHAR(200): PostgreSQL refuses longer, SQLite would keep it
MAX_REASON_CHARS = 500  # a skipped line's stored reason (it may quote the line's data) is cut to this


def check_name(name: str) -> None:
    """Refuse, as 422 naming ``name``, a dataset name that one backend would store and another refuse."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"name: at most {MAX_NAME_CHARS} characters, got {len(name)}", field="name")
    if (problem := text_problem(name)) is not None:
        raise InvalidRequest(f"name: {problem}", field="name")


MAX_STORED_SKIPPED = 10_000  # lines listed by /skipped; past that they are only counted (skipped_count)
DATASETS_ORDER = Keyset(Dataset.created_at, Dataset.id, desc=True)  # newest first
ROWS_ORDER = Keyset(DatasetRow.index)
SKIPPED_ORDER = Keyset(DatasetSkippedLine.line)


@dataclass
class _BadLines:
    """The invalid lines of one upload: the first ``MAX_REPORTED_ERRORS`` for a 422, and with
    ``store`` (skip_invalid) every one written to ``dataset_skipped_lines`` in batches of
    ``INSERT_BATCH``, so memory does not grow with their number."""

    session: Session
    dataset_id: uuid.UUID
    store: bool
    count: int = 0
    first: list[ErrorDetail] = field(default_factory=list)
    _batch: list[dict[str, Any]] = field(default_factory=list)

    def add(self, line: int, exc: LineError) -> None:
        self.count += 1
        if len(self.first) < MAX_REPORTED_ERRORS:
            self.first.append(ErrorDetail(line=line, field=exc.field, message=exc.message))
        if self.store and self.count <= MAX_STORED_SKIPPED:
            where = None if exc.field is None else _storable(exc.field)
            row = {"dataset_id": self.dataset_id, "line": line, "reason": _storable(exc.message)}
            self._batch.append(row | {"field": where})
            if len(self._batch) >= INSERT_BATCH:
                self.flush()

    def flush(self) -> None:
        if self._batch:
            self.session.execute(insert(DatasetSkippedLine), self._batch)
            self._batch.clear()

    def invalid(self, prefix: str = "") -> DatasetInvalid:
        first = self.first[0]
        return DatasetInvalid(
            f"{prefix}{self.count} invalid line(s); first at line {first.line}: {first.message}",
            field=f"line {first.line}",
            details=self.first,
        )


def _storable(text: str) -> str:
    """``text`` cut to ``MAX_REASON_CHARS`` and safe to store on both backends (an error message may quote
    the user's data; ``repr`` already escapes NUL and surrogates, this makes sure)."""
    text = text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"
    if text_problem(text) is not None:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return text


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
    skip_invalid: bool = False,
    kind_detected: bool = False,
) -> Dataset:
    """Validate every line of ``lines`` and store the dataset with all its rows, or raise.

    Invariants: rows are inserted in batches as they are read (memory does not grow with the file);
    the first bad line stops inserting but validation goes on to report up to 20 errors; any error
    raises before the caller commits, so the caller's rollback leaves no dataset and no row. Nothing
    stored can fail on one backend and pass on the other: the name and every line are checked first
    (``check_name``, ``parse_json_line``: no NUL, no lone surrogate, at most ``MAX_ROW_DEPTH`` deep).

    With ``skip_invalid`` a bad line does not stop the upload: the valid rows are stored and each bad
    line is recorded (line number, reason, field) in ``dataset_skipped_lines``, inserted in batches, so no
    line is lost silently and memory stays bounded. An upload without one valid row still raises (422)
    and stores nothing; limits (size, rows) still raise 413. ``stats`` records ``skipped_count`` and
    ``kind_detected`` (whether the caller detected ``kind``), which ``DatasetRead`` shows.
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
    bad = _BadLines(session, dataset.id, store=skip_invalid)
    batch: list[dict[str, Any]] = []
    size = 0
    for line_no, raw in enumerate(lines, start=1):
        size += len(raw)
        if size > max_bytes:
            raise PayloadTooLarge(f"upload is larger than the limit of {max_bytes} bytes", field="file")
        if not raw.strip():
            continue
        try:
            if len(raw) > max_line_bytes:  # the reader hands over at most max_line_bytes + 1 of a line
                raise LineError(f"line is longer than {max_line_bytes} bytes")
            if stats.rows >= max_rows:
                raise PayloadTooLarge(f"more than {max_rows} rows; split the dataset", field="file")
            row, fmt = normalize(parse_json_line(raw.rstrip(b"\r\n")))
        except LineError as exc:
            bad.add(line_no, exc)
            continue
        if bad.count and not skip_invalid:
            continue
        digest = content_hash(row)
        stats.add(row, fmt, digest)
        batch.append({"dataset_id": dataset.id, "index": stats.rows - 1, "data": row, "content_hash": digest})
        if len(batch) >= INSERT_BATCH:
            session.execute(insert(DatasetRow), batch)
            batch.clear()

    if bad.count and not skip_invalid:
        raise bad.invalid()
    if stats.rows == 0:
        if bad.count:  # skip_invalid, but nothing to keep: refused like an atomic upload
            raise bad.invalid(prefix="no valid line to store: ")
        raise DatasetInvalid("the upload holds no rows", field="file")
    if batch:
        session.execute(insert(DatasetRow), batch)
    bad.flush()
    dataset.row_count = stats.rows
    dataset.size_bytes = size
    dataset.stats = stats.as_dict() | {"skipped_count": bad.count, "kind_detected": kind_detected}
    session.flush()
    return dataset


def list_skipped(
    *, session: Session, dataset_id: uuid.UUID, limit: int, after: str | None = None
) -> Slice[DatasetSkippedLine]:
    """Skipped lines of a dataset in line order, at most ``limit``, after the cursor ``after``."""
    stmt = select(DatasetSkippedLine).where(DatasetSkippedLine.dataset_id == dataset_id)
    return paginate(session, stmt, SKIPPED_ORDER, limit=limit, cursor=after)


def list_datasets(
    *, session: Session, project_id: uuid.UUID, after: str | None, limit: int
) -> Slice[Dataset]:
    """The project's datasets, newest first."""
    stmt = select(Dataset).where(Dataset.project_id == project_id)
    return paginate(session, stmt, DATASETS_ORDER, limit=limit, cursor=after)


def list_rows(*, session: Session, dataset_id: uuid.UUID, after: str | None, limit: int) -> Slice[DatasetRow]:
    """A dataset's normalised rows in upload order."""
    stmt = select(DatasetRow).where(DatasetRow.dataset_id == dataset_id)
    return paginate(session, stmt, ROWS_ORDER, limit=limit, cursor=after)


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
