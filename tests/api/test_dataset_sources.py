"""api/services/dataset_sources.py: an upload's bytes come back exactly, across several stored chunks, and
memory stays a block at a time even where a chunk inflates a hundredfold."""

from __future__ import annotations

import io
import os
from contextlib import nullcontext

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import DatasetSource
from api.services.dataset_sources import READ_BLOCK, SOURCE_CHUNK, has_source, source_bytes, store_source
from tests.factories import make_dataset


def test_random_bytes_over_several_chunks_come_back_exactly(session: Session) -> None:
    dataset = make_dataset(session)
    data = os.urandom(2 * SOURCE_CHUNK + 12_345)  # incompressible: three stored chunks
    assert not has_source(session=session, dataset_id=dataset.id)
    store_source(session=session, dataset_id=dataset.id, fileobj=io.BytesIO(data))
    chunks = session.scalar(select(func.count()).where(DatasetSource.dataset_id == dataset.id))
    assert chunks == 3 and has_source(session=session, dataset_id=dataset.id)
    got = b"".join(source_bytes(factory=lambda: nullcontext(session), dataset_id=dataset.id))
    assert got == data


def test_a_very_repetitive_upload_is_inflated_a_block_at_a_time(session: Session) -> None:
    dataset = make_dataset(session)
    data = b'{"prompt": "1+1=", "completion": "2"}\n' * 500_000  # ~19 MB that gzip makes ~50 kB
    store_source(session=session, dataset_id=dataset.id, fileobj=io.BytesIO(data))
    pieces = list(source_bytes(factory=lambda: nullcontext(session), dataset_id=dataset.id))
    assert b"".join(pieces) == data
    assert len(pieces) > 1 and max(len(p) for p in pieces) <= READ_BLOCK
