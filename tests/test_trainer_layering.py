"""Floors inside trainer/: data, models, rewards and specs never reach up into the loops; specs stay
torch-free; no two trainer modules import each other, directly or around a circle. Checked on the import
statements themselves (AST), so a lazy import inside a function counts."""

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


@pytest.mark.parametrize(
    "floor",
    ["rewards", "data", "specs", "models.py", "checkpoints.py", "algorithms", "completion_logps.py"],
)
def test_lower_floors_never_import_the_loops(floor: str) -> None:
    assert offenders(files_of(floor), ("trainer.loops", "trainer.worker")) == {}


def test_specs_never_import_torch_or_models() -> None:
    assert offenders(files_of("specs"), ("torch", "transformers", "trainer.models", "trainer.data")) == {}


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("def late():\n    from trainer.loops.common import to_floats\n")
    assert imported_modules(f) == {"trainer.loops.common"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, lazy imports included. ``from a import b`` names
    module ``a.b`` when that is a module, else ``a``; a package's ``__init__`` is module ``a``."""
    root = package.parent
    modules = {module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: counted from this module's package
                    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    kept = package_parts[: len(package_parts) - (node.level - 1)]
                    base = ".".join(kept + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets |= {full} if full in modules else ({base} if base in modules else set())
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_trainer() -> None:
    assert circles(import_graph(TRAINER)) == []


def test_the_circle_scan_sees_a_lazy_circle_and_a_package_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "trainer"
    (pkg / "specs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    # worker <-> worker_ranks, one side importing lazily (the circle trainer/ had)
    (pkg / "worker.py").write_text("from trainer.worker_ranks import run_on_ranks\n")
    (pkg / "worker_ranks.py").write_text("def f():\n    from trainer.worker import DbReporter\n")
    # a package whose __init__ imports a module that imports the package back (lazily), and a bystander
    (pkg / "specs" / "__init__.py").write_text("from trainer.specs.base import Spec\n")
    (pkg / "specs" / "base.py").write_text("from trainer import lr\n")
    (pkg / "lr.py").write_text("def g():\n    from trainer.specs import TINY\n")
    (pkg / "models.py").write_text("from trainer.specs.base import Spec\nfrom . import lr\n")
    assert sorted(circles(import_graph(pkg))) == [
        ["trainer.lr", "trainer.specs", "trainer.specs.base"],
        ["trainer.worker", "trainer.worker_ranks"],
    ]
    (pkg / "lr.py").write_text("def g():\n    from trainer.specs.refs import TINY\n")  # the way out
    assert circles(import_graph(pkg)) == [["trainer.worker", "trainer.worker_ranks"]]
