"""OpenAI's grader templates: ``{{item.<field>}}``, ``{{sample.output_text}}`` and
``{{sample.output_json.<field>}}`` (dots walk nested objects; a list index is a number, ``item.tags.0``).

A value that is not a string is written as JSON. A reference to a field the item or the answer lacks raises
``TemplateError`` (the grader scores that sample 0 and counts a failure); a template naming anything but
``item`` or ``sample.output_text`` / ``sample.output_json`` is refused when the grader is submitted
(``check_template``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_PATH = re.compile(r"^(item(\.[^.\s]+)*|sample\.output_text|sample\.output_json(\.[^.\s]+)*)$")


class TemplateError(ValueError):
    """A placeholder that cannot be filled for this sample."""


def check_template(template: str) -> None:
    """ValueError naming the first placeholder that is not an item or sample reference."""
    for m in _PLACEHOLDER.finditer(template):
        if not _PATH.match(m.group(1)):
            raise ValueError(
                f"{{{{{m.group(1)}}}}}: a template reads item.<field>, sample.output_text or "
                "sample.output_json.<field>"
            )


def sample_json(output_text: str) -> Any:
    """The answer read as JSON, or None where it is not JSON."""
    try:
        return json.loads(output_text)
    except ValueError:
        return None


def _walk(value: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(f"{{{{{path}}}}}: no {part!r} there")
    return value


def lookup(path: str, item: Mapping[str, Any], output_text: str) -> Any:
    parts = path.split(".")
    if parts[0] == "item":
        return _walk(item, parts[1:], path)
    if parts[:2] == ["sample", "output_text"]:
        return output_text
    if parts[:2] == ["sample", "output_json"]:
        parsed = sample_json(output_text)
        if parsed is None:
            raise TemplateError(f"{{{{{path}}}}}: the sample is not JSON")
        return _walk(parsed, parts[2:], path)
    raise TemplateError(f"{{{{{path}}}}}: unknown reference")


def render(template: str, item: Mapping[str, Any], output_text: str) -> str:
    """``template`` with every placeholder filled from ``item`` and the sample."""

    def fill(m: re.Match[str]) -> str:
        value = lookup(m.group(1), item, output_text)
        return value if isinstance(value, str) else json.dumps(value)

    return _PLACEHOLDER.sub(fill, template)
