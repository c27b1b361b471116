"""Routers hold no SQL: parse, call a service, shape the response (STYLE "Routes are thin").

Decided: a router imports nothing from ``sqlalchemy`` at all, not even ``Session`` for a type; a helper
that takes the request's session annotates it ``SessionDep`` (api/deps.py). The session reaches routers
only to own the unit of work: ``commit`` and ``rollback`` (``api.db.commit_unless_conflict`` for a commit
that a constraint may refuse). Everything else a session does (``execute``, ``scalars``, ``get``,
``add``, ``delete``...) and every statement (``select(...)``...) lives in ``api/services/`` or
``api/lifecycle.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTERS = sorted((Path(__file__).resolve().parents[2] / "api" / "routers").glob("*.py"))
SESSION_MAY = {"commit", "rollback"}
STATEMENTS = {"select", "insert", "update", "delete", "text", "and_", "or_", "func", "tuple_"}


def sql_in(source: str) -> list[str]:
    """Every use of SQL in a module's source, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{node.lineno}: imports {n}" for n in names if n.split(".")[0] == "sqlalchemy"]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in STATEMENTS:
                found.append(f"{node.lineno}: {func.id}(...)")
            elif isinstance(func, ast.Attribute):
                receiver = func.value
                on_session = isinstance(receiver, ast.Name) and receiver.id == "session"
                if func.attr == "execute" or (on_session and func.attr not in SESSION_MAY):
                    found.append(f"{node.lineno}: .{func.attr}(...)")
    return sorted(found)


def test_the_scan_finds_sql() -> None:
    source = (
        "from sqlalchemy import select\n"
        "import sqlalchemy.orm\n"
        "def f(session):\n"
        "    session.scalars(select(X))\n"
        "    session.get(X, 1)\n"
        "    conn.execute('x')\n"
        "    session.commit()\n"
        "    form.get('file')\n"
    )
    assert sql_in(source) == [
        "1: imports sqlalchemy",
        "2: imports sqlalchemy.orm",
        "4: .scalars(...)",
        "4: select(...)",
        "5: .get(...)",
        "6: .execute(...)",
    ]


@pytest.mark.parametrize("router", ROUTERS, ids=lambda p: p.name)
def test_router_holds_no_sql(router: Path) -> None:
    assert sql_in(router.read_text()) == []
