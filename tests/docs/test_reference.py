"""docs/api.md and docs/specs.md are generated from the OpenAPI schema: the committed files must be what
the code generates now, and generating must not depend on the order of the schema's dicts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from docs import gen_reference

from .markdown import ROOT, anchors, openapi


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return copy.deepcopy(openapi())


@pytest.fixture(scope="module")
def rendered(schema: dict[str, Any]) -> dict[str, str]:
    return gen_reference.render_all(copy.deepcopy(schema))


def test_committed_reference_is_current(rendered: dict[str, str]) -> None:
    stale = gen_reference.stale(rendered)
    assert not stale, "\n".join(f"docs/{name} is stale: run {gen_reference.COMMAND}" for name in stale)


def test_check_command_agrees(rendered: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    expected = 1 if gen_reference.stale(rendered) else 0
    assert gen_reference.main(["--check"]) == expected
    assert capsys.readouterr().out == ""  # --check writes nothing


def _reversed(node: Any) -> Any:
    """The same schema with every dict's keys in reverse order (lists keep theirs: order is their meaning)."""
    if isinstance(node, dict):
        return {k: _reversed(node[k]) for k in reversed(list(node))}
    if isinstance(node, list):
        return [_reversed(v) for v in node]
    return node


def test_output_does_not_depend_on_dict_order(schema: dict[str, Any], rendered: dict[str, str]) -> None:
    assert gen_reference.render_all(_reversed(copy.deepcopy(schema))) == rendered


def test_every_route_and_spec_field_is_documented(schema: dict[str, Any], rendered: dict[str, str]) -> None:
    api = rendered["api.md"]
    for path, item in schema["paths"].items():
        for method in item:
            if method in gen_reference.METHODS:
                assert f"### `{method.upper()} {path}`" in api, f"{method.upper()} {path} missing from api.md"
    specs = rendered["specs.md"]
    components = schema["components"]["schemas"]
    for name in gen_reference.spec_names(schema):
        for algorithm in gen_reference.algorithms_of(components[name]):
            assert f"| `{algorithm}` |" in specs
        for ref in gen_reference.closure([name], components):
            section = specs.split(f"### `{ref}`", 1)[1].split("\n### ", 1)[0]
            for field in components[ref].get("properties", {}):
                assert f"| `{field}` |" in section, f"{ref}.{field} missing from specs.md"


def test_generated_links_resolve(rendered: dict[str, str]) -> None:
    """The generator's own anchors (route index, schema links) exist as headings, GitHub-style."""
    import re

    targets = {name: anchors(text) for name, text in rendered.items()}
    for name, text in rendered.items():
        for page, anchor in re.findall(r"\]\(((?:api|specs)\.md)?#([^)]+)\)", text):
            assert anchor in targets[page or name], f"{name}: link to {page or name}#{anchor} has no heading"
    assert (ROOT / "docs" / "gen_reference.py").is_file()
