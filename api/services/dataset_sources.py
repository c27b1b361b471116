"""The bytes an OpenAI file upload sent, kept beside its dataset (``dataset_sources``): gzip-compressed
while the spooled upload is read in blocks, stored in chunks of at most ``SOURCE_CHUNK`` compressed bytes,
and read back chunk by chunk, each in a session of its own (the response streams after the request's
session is gone). Memory stays a block and a chunk, whatever the upload's size."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import IO

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from api.models import DatasetSource

SOURCE_CHUNK = 1 << 20  # compressed bytes per stored row
READ_BLOCK = 1 << 20
GZIP = 16 + zlib.MAX_WBITS  # zlib's wbits for a gzip container


def store_source(*, session: Session, dataset_id: uuid.UUID, fileobj: IO[bytes]) -> None:
    """Compress ``fileobj`` from its start and store it as ``dataset_id``'s source (flush only: the
    caller's commit keeps it with the dataset, its rollback drops both)."""
    fileobj.seek(0)
    compressor = zlib.compressobj(6, zlib.DEFLATED, GZIP)
    pending = bytearray()
    seq = 0

    def put(chunk: bytes) -> None:
        nonlocal seq
        session.execute(insert(DatasetSource), [{"dataset_id": dataset_id, "seq": seq, "data": chunk}])
        seq += 1

    while block := fileobj.read(READ_BLOCK):
        pending += compressor.compress(block)
        while len(pending) >= SOURCE_CHUNK:
            put(bytes(pending[:SOURCE_CHUNK]))
            del pending[:SOURCE_CHUNK]
    pending += compressor.flush()
    for start in range(0, len(pending), SOURCE_CHUNK):
        put(bytes(pending[start : start + SOURCE_CHUNK]))


def has_source(*, session: Session, dataset_id: uuid.UUID) -> bool:
    found = session.scalar(
        select(DatasetSource.seq).where(DatasetSource.dataset_id == dataset_id, DatasetSource.seq == 0)
    )
    return found is not None


def source_bytes(
    *, factory: Callable[[], AbstractContextManager[Session]], dataset_id: uuid.UUID
) -> Iterator[bytes]:
    """The upload's bytes as sent, in order, at most ``READ_BLOCK`` at a time: a stored chunk of very
    repetitive lines can hold a hundred times its size, so it is inflated a block at a time."""
    decompressor = zlib.decompressobj(GZIP)
    seq = 0
    while True:
        with factory() as session:
            chunk = session.scalar(
                select(DatasetSource.data).where(
                    DatasetSource.dataset_id == dataset_id, DatasetSource.seq == seq
                )
            )
        if chunk is None:
            break
        while chunk:
            if out := decompressor.decompress(chunk, READ_BLOCK):
                yield out
            chunk = decompressor.unconsumed_tail
        seq += 1
    if tail := decompressor.flush():
        yield tail
