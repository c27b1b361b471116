"""Floors inside trainer/: data, models, rewards and specs never reach up into the loops; specs stay
torch-free. Checked on the import statements themselves (AST), so a lazy import inside a function counts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "trainer"


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def files_of(*parts: str) -> list[Path]:
    found: list[Path] = []
    for part in parts:
        target = TRAINER / part
        found += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    return found


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for f in files:
        hits = sorted(
            m for m in imported_modules(f) if any(m == p or m.startswith(p + ".") for p in forbidden)
        )
        if hits:
            bad[str(f.relative_to(TRAINER.parent))] = hits
    return bad


@pytest.mark.parametrize("floor", ["rewards", "data", "specs", "models.py", "checkpoints.py", "algorithms"])
def test_lower_floors_never_import_the_loops(floor: str) -> None:
    assert offenders(files_of(floor), ("trainer.loops", "trainer.worker")) == {}


def test_specs_never_import_torch_or_models() -> None:
    assert offenders(files_of("specs"), ("torch", "transformers", "trainer.models", "trainer.data")) == {}


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("def late():\n    from trainer.loops.common import to_floats\n")
    assert imported_modules(f) == {"trainer.loops.common"}
