"""Which model references may be loaded, and from where (torch-free: the API checks at submit, the worker
resolves at load, with the same rules).

- ``tiny:<preset>``, ``run:<id>[@<step>]`` and ``stage:<name>`` are checked elsewhere (specs, the DB).
- A local path (starting with ``/``, ``./``, ``../`` or ``~``) must resolve, symlinks followed, inside one
  of the server's model roots: a user cannot point a run at ``/etc`` or escape a root with ``..`` or a
  symlink.
- Any other name (``my-model``, ``org/name``: letters, digits, ``_ . -``, never ``..``) is a model
  folder under a root (``<root>/org/name`` holding a ``config.json``); failing that, a hub id, but only
  where the operator set ``RLRUN_ALLOW_HUB``. A name is never looked up relative to the worker's working
  directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")
MAX_LISTED = 50  # names an error message lists at most


class ModelOutsideRoots(ValueError):
    """A local path that resolves outside every model root."""


class UnknownModel(ValueError):
    """A name that is no model this server can load."""


def is_local_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def check_local_model(ref: str, roots: Sequence[Path]) -> Path:
    """The resolved folder of a local model reference, or ModelOutsideRoots."""
    path = Path(os.path.expanduser(ref)).resolve()  # follows symlinks: an escape shows in the real path
    for root in roots:
        if path.is_relative_to(Path(root).resolve()):
            return path
    allowed = ", ".join(str(r) for r in roots) or "(none configured)"
    raise ModelOutsideRoots(f"local model path {ref!r} is outside the server's model roots: {allowed}")


def check_hub_id(ref: str) -> str:
    if not _HUB_ID.match(ref) or ".." in ref:
        raise UnknownModel(
            f"{ref!r} is neither a model path, a model name (org/name), tiny:, run: nor stage:"
        )
    return ref


def find_in_roots(name: str, roots: Sequence[Path]) -> Path | None:
    """``<root>/<name>`` of the first root that holds a model folder (with ``config.json``) by that name."""
    check_hub_id(name)
    for root in roots:
        base = Path(root).resolve()
        folder = (base / name).resolve()
        if folder.is_relative_to(base) and (folder / "config.json").is_file():
            return folder
    return None


def models_in_roots(roots: Sequence[Path], limit: int = MAX_LISTED) -> list[str]:
    """Names of the model folders one or two levels under the roots (``name`` or ``org/name``)."""
    found: list[str] = []

    def children(folder: Path) -> Iterable[Path]:
        try:
            return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return []

    for root in roots:
        for first in children(Path(root)):
            if (first / "config.json").is_file():
                found.append(first.name)
            else:
                found += [f"{first.name}/{s.name}" for s in children(first) if (s / "config.json").is_file()]
            if len(found) >= limit:
                return found[:limit]
    return found


def resolve_name(ref: str, roots: Sequence[Path], *, allow_hub: bool, presets: Iterable[str] = ()) -> str:
    """What ``from_pretrained`` should load for a plain reference (not ``tiny:``/``run:``/``stage:``): the
    folder inside a root, or the hub id itself when the hub is allowed. UnknownModel lists what exists."""
    if is_local_path(ref):
        return str(check_local_model(ref, roots))
    folder = find_in_roots(ref, roots)
    if folder is not None:
        return str(folder)
    if allow_hub:
        return ref
    available = [f"tiny:{p}" for p in presets] + models_in_roots(roots)
    raise UnknownModel(
        f"model {ref!r} is not a tiny preset, a model folder under the server's model roots, nor a run: or "
        "stage: reference (hub downloads are off on this server: RLRUN_ALLOW_HUB); available: "
        + (", ".join(available) or "(none)")
        + "; or run:<id> of a succeeded run"
    )
