"""Fixtures of the worker tests: settings in a temporary home, and one committed dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.models import Dataset
from api.settings import Settings
from tests.factories import make_dataset


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, lease_seconds=60)


@pytest.fixture
def dataset(committing_factory: sessionmaker[Session]) -> Dataset:
    with committing_factory.begin() as s:
        return make_dataset(s)
