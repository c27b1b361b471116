"""Request and response bodies of the public API."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from trainer.specs import DpoSpec

T = TypeVar("T")


class _Read(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    """One page of a list; pass ``next_cursor`` as ``after`` to get the next page."""

    data: list[T]
    has_more: bool
    next_cursor: str | None = Field(
        default=None, description="Opaque cursor for `after`; null on the last page."
    )


class LengthStats(BaseModel):
    mean: float
    max: int


class DatasetStats(BaseModel):
    """Computed at upload. Lengths are in characters (the API has no tokenizer)."""

    rows: int
    exact_duplicates: int = Field(description="Rows identical to an earlier row (after normalisation).")
    empty_pairs: int = Field(description="Rows whose chosen or rejected completion is empty or blank.")
    identical_pairs: int = Field(description="Rows whose chosen and rejected completions are equal.")
    source_formats: dict[str, int] = Field(description="How many lines came in each accepted input format.")
    prompt_chars: LengthStats
    chosen_chars: LengthStats
    rejected_chars: LengthStats


class DatasetRead(_Read):
    id: uuid.UUID
    name: str
    kind: str
    row_count: int
    size_bytes: int
    stats: DatasetStats
    created_at: datetime


class DatasetRowRead(_Read):
    index: int
    data: dict[str, Any]


class DatasetCreateJson(BaseModel):
    """Small datasets as one JSON body; large ones go as a multipart JSONL file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    kind: Literal["preference"] = "preference"
    rows: list[dict[str, Any]] = Field(description="Lines as objects, in any accepted format for `kind`.")


class Progress(BaseModel):
    step: int
    total_steps: int | None


class RunRead(_Read):
    id: uuid.UUID
    name: str | None
    algorithm: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    spec: DpoSpec
    dataset_id: uuid.UUID | None
    attempt: int
    progress: Progress
    cancel_requested: bool
    error: str | None = Field(description="One-line reason when the run failed.")
    output_path: str | None = Field(
        description="Folder of the final model (Hugging Face format) once succeeded."
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class MetricRead(_Read):
    key: str
    step: int
    value: float
    logged_at: datetime


class EventRead(_Read):
    id: int
    kind: str
    message: str
    data: dict[str, Any] | None
    created_at: datetime
