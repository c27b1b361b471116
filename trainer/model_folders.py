"""What a model folder under a model root holds, read without torch (the API lists models with it): its
parameter count from the safetensors headers, and the record an import left (``rlrun-import.json``)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

IMPORT_RECORD = "rlrun-import.json"
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB


def safetensors_parameters(file: Path) -> int:
    """Elements in one safetensors file, from its header alone (8-byte little-endian length, then JSON
    ``{name: {"dtype", "shape", "data_offsets"}}``; safetensors' format). ValueError on a bad header."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file.name}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise ValueError(f"{file.name}: header length {length} is not a safetensors header")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file.name}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}: safetensors header is not an object")
    return sum(
        math.prod(entry["shape"])
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list)
    )


def parameter_count(folder: Path) -> int | None:
    """Parameters of the model in a folder (every ``*.safetensors`` file), or None where it holds none or
    one cannot be read."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    try:
        return sum(safetensors_parameters(f) for f in files)
    except (OSError, ValueError):
        return None


def read_import_record(folder: Path) -> dict[str, Any] | None:
    """The record ``rlrun models import`` wrote in a folder (where it came from, when), or None."""
    try:
        record = json.loads((Path(folder) / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
