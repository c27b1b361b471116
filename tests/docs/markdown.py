"""Reading the repository's Markdown for the docs tests: files, fenced blocks, code spans, links, headings.

Small on purpose (no Markdown library): the docs keep to fenced blocks, single-backtick spans and inline
links, and these helpers read exactly that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("docs/api.md", "docs/specs.md")  # written by docs/gen_reference.py from the OpenAPI schema


def doc_files() -> list[Path]:
    """README.md and every page under docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_files() -> list[Path]:
    """The hand-written pages (the generated ones mirror the schema by construction)."""
    return [p for p in doc_files() if rel(p) not in GENERATED]


def rel(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


@cache
def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@cache
def openapi() -> dict[str, Any]:
    """The app's OpenAPI schema, built once per test session (read it, never change it)."""
    from docs.gen_reference import openapi_schema

    return openapi_schema()


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string (language), body, and the line its fence opens on."""

    lang: str
    body: str
    line: int
    before: str  # the text between the previous block (or the file start) and this fence


_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")


def blocks(text: str) -> list[Block]:
    out: list[Block] = []
    lines = text.split("\n")
    i, last_end = 0, 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match[1], match[2], i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence[:3]):
            i += 1
        out.append(Block(lang, "\n".join(lines[start + 1 : i]), start + 1, "\n".join(lines[last_end:start])))
        i += 1
        last_end = i
    return out


def without_blocks(text: str) -> str:
    """The text with every fenced block's lines blanked (line numbers kept)."""
    lines = text.split("\n")
    inside = None
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if inside is None and match:
            inside = match[1][:3]
            lines[i] = ""
        elif inside is not None:
            if line.startswith(inside):
                inside = None
            lines[i] = ""
    return "\n".join(lines)


_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def code_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return [" ".join(m[2].split()) for m in _SPAN.finditer(without_blocks(text))]


def prose_only(text: str) -> str:
    """The text outside fenced blocks and code spans (where links are links)."""
    return _SPAN.sub("", without_blocks(text))


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?|ftp|file|mailto):[^>\s]+)>")
_BARE_URL = re.compile(r"(?<![(<\w])(https?://[^\s)>\]`]+)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.M)


def links(text: str) -> list[str]:
    """Every link target in the prose: inline links and images, autolinks, bare URLs, reference
    definitions."""
    prose = prose_only(text)
    found = [m[1] for m in _LINK.finditer(prose)]
    found += [m[1] for m in _AUTOLINK.finditer(prose)]
    found += [m[1].rstrip(".,;:") for m in _BARE_URL.finditer(_LINK.sub("", prose))]
    found += [m[1] for m in _REF_DEF.finditer(prose)]
    return found


_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@cache
def anchors(text: str) -> frozenset[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in without_blocks(text).split("\n"):
        match = _HEADING.match(line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match[2])  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)
