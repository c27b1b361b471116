"""Fixtures of the served client and CLI tests (each module starts its own server and defines ``rl``)."""

from __future__ import annotations

import pytest

from rlrun import Client
from rlrun.demo import addition_pairs
from rlrun.schemas import DatasetRead
from tests.factories import jsonl


@pytest.fixture(scope="module")
def pairs(rl: Client, tmp_path_factory: pytest.TempPathFactory) -> DatasetRead:
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_bytes(jsonl(addition_pairs(64)))
    return rl.datasets.upload(path)
