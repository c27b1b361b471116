"""Registry lookup shared by the ``get_<family>`` functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

V = TypeVar("V")


def lookup(registry: Mapping[str, V], name: str, family: str) -> V:
    """Return ``registry[name]``, or raise ValueError naming the family and listing the valid names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {family} {name!r}; valid names: {', '.join(sorted(registry))}") from None
