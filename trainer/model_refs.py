"""Which model references may be loaded (torch-free: the API checks at submit, the worker at load).

A local path (starting with ``/``, ``./``, ``../`` or ``~``) must resolve, symlinks followed, inside one
of the server's model roots: a user cannot point a run at ``/etc`` or escape a root with ``..`` or a
symlink. Anything else that is not ``tiny:``, ``run:`` or ``stage:`` is a hub id ``name`` or
``org/name`` (letters, digits, ``_ . -``), never containing ``..``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


def is_local_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def check_local_model(ref: str, roots: Sequence[Path]) -> Path:
    """The resolved folder of a local model reference, or ValueError if it is outside every root."""
    path = Path(os.path.expanduser(ref)).resolve()  # follows symlinks: an escape shows in the real path
    for root in roots:
        if path.is_relative_to(Path(root).resolve()):
            return path
    allowed = ", ".join(str(r) for r in roots) or "(none configured)"
    raise ValueError(f"local model path {ref!r} is outside the server's model roots: {allowed}")


def check_hub_id(ref: str) -> str:
    if not _HUB_ID.match(ref) or ".." in ref:
        raise ValueError(f"{ref!r} is neither a model path, a hub id (org/name), tiny:, run: nor stage:")
    return ref


def check_loadable(ref: str, roots: Sequence[Path]) -> None:
    """Refuse a plain model reference that is a local path outside the roots or a malformed hub id."""
    if ref.startswith(("tiny:", "run:", "stage:")):
        return
    if is_local_path(ref):
        check_local_model(ref, roots)
    else:
        check_hub_id(ref)
