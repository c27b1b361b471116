"""Every link in README.md and docs/*.md points at a file of this repository (and at a heading that
exists there); nothing points outside it; the repository paths the prose names exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from .markdown import ROOT, anchors, code_spans, doc_files, read, rel, without_blocks

# External links already in the docs before they moved to docs/ (the only ones allowed; prefer none).
ALLOWED_EXTERNAL = frozenset({"https://www.standardwebhooks.com"})
LOOPBACK = frozenset({"127.0.0.1", "localhost", "[::1]"})
DOCS = [pytest.param(p, id=rel(p)) for p in doc_files()]


@cache
def _ignored(path: Path) -> bool:
    """Whether git ignores the path (a local build output, not part of the repository)."""
    if shutil.which("git") is None:
        return False
    done = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, check=False)
    return done.returncode == 0


def _problem(page: Path, target: str) -> str | None:
    parts = urlsplit(target)
    if parts.scheme in ("http", "https"):
        host = parts.netloc.split("@")[-1].rsplit(":", 1)[0] if parts.netloc else ""
        if host in LOOPBACK or target.rstrip("/") in ALLOWED_EXTERNAL:
            return None
        return "is an external link (allowed only: " + ", ".join(sorted(ALLOWED_EXTERNAL)) + ")"
    if parts.scheme or parts.netloc:
        return "is not a relative link"
    path = unquote(parts.path)
    if path.startswith("/"):
        return "is an absolute path"
    dest = (page.parent / path).resolve() if path else page.resolve()
    try:
        dest.relative_to(ROOT)
    except ValueError:
        return "points outside the repository"
    if not dest.exists():
        return "points at a file that does not exist"
    if _ignored(dest):
        return "points at a file git ignores"
    if parts.fragment and dest.suffix == ".md" and parts.fragment not in anchors(read(dest)):
        return f"names #{parts.fragment}, which is no heading of {rel(dest)}"
    return None


@pytest.mark.parametrize("page", DOCS)
def test_links_stay_in_the_repository(page: Path) -> None:
    from .markdown import links

    problems = [f"{rel(page)}: link {t!r} {why}" for t in links(read(page)) if (why := _problem(page, t))]
    assert not problems, "\n".join(problems)


_OUTSIDE = re.compile(r"\.\./shared|/work/|file://|(?<![\w.])\.\./\.\.")


@pytest.mark.parametrize("page", DOCS)
def test_no_reference_outside_the_repository(page: Path) -> None:
    """Not even in code or plain text: no ../shared/..., no absolute paths of this machine."""
    hits = [line for line in read(page).split("\n") if _OUTSIDE.search(line)]
    assert not hits, f"{rel(page)} refers outside the repository:\n" + "\n".join(hits)


# A path of this repository named in prose or code: `trainer/worker.py`, `tests/fuzz`, examples/x.jsonl.
_REPO_PATH = re.compile(
    r"(?<![\w/.<>@-])((?:api|trainer|rlrun|tests|bench|examples|docs|migrations|\.ci)/[\w./-]*[\w/])"
)
_TOP_FILES = re.compile(r"^(?:[\w-]+\.(?:toml|yml|yaml|ini)|Makefile|Dockerfile)$")  # pyproject.toml, ...


@pytest.mark.parametrize("page", DOCS)
def test_named_repository_paths_exist(page: Path) -> None:
    text = read(page)
    named = set(_REPO_PATH.findall(text))
    named |= {s for s in code_spans(text) if _TOP_FILES.match(s)}
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{rel(page)} names paths that do not exist: {missing}"


def test_docs_pages_are_reachable_from_the_readme() -> None:
    """Every page under docs/ is linked from the README (the tour is the way in)."""
    readme = without_blocks(read(ROOT / "README.md"))
    unlinked = [rel(p) for p in doc_files()[1:] if f"({rel(p)})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
