"""Upload statistics of a dataset: each stored row's profile and running totals (pure: no DB, no IO).
Lines are parsed and normalised by ``rlrun.formats``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


def content_hash(row: dict[str, Any]) -> str:
    """sha256 of the row's canonical JSON: equal rows, equal hashes."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _chars(text: str | list[dict[str, str]] | None) -> int:
    if text is None:
        return 0
    return len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)


def row_profile(kind: str, row: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, bool]]:
    """Lengths (characters) per field and boolean flags of one stored row, for the upload stats."""
    prompt = _chars(row["prompt"])
    if kind == "preference":
        c, r = row["chosen"], row["rejected"]
        return (
            {"prompt": [prompt], "chosen": [len(c)], "rejected": [len(r)]},
            {
                "empty_pairs": not c.strip() or not r.strip(),
                "identical_pairs": c == r,
                "with_margin": "margin" in row,
            },
        )
    if kind == "sft":
        return {"prompt": [prompt], "completion": [len(row["completion"])]}, {
            "empty_completions": not row["completion"].strip()
        }
    if kind == "ranking":
        responses = row["responses"]
        return (
            {"prompt": [prompt], "responses": [len(x) for x in responses], "candidates": [len(responses)]},
            {
                "duplicate_responses": len(set(responses)) < len(responses),
                "empty_responses": any(not x.strip() for x in responses),
            },
        )
    if kind == "unpaired":
        return {"prompt": [prompt], "completion": [len(row["completion"])]}, {
            "desirable": row["label"],
            "undesirable": not row["label"],
            "empty_completions": not row["completion"].strip(),
        }
    return {"prompt": [prompt], "answer": [_chars(row["answer"])]}, {"with_answer": row["answer"] is not None}


@dataclass
class _Length:
    total: int = 0
    count: int = 0
    max: int = 0

    def add(self, n: int) -> None:
        self.total += n
        self.count += 1
        self.max = max(self.max, n)


@dataclass
class DatasetStatsBuilder:
    """Running statistics of an upload; O(1) memory apart from the set of 16-byte row hashes."""

    kind: str
    rows: int = 0
    exact_duplicates: int = 0
    source_formats: dict[str, int] = field(default_factory=dict)
    lengths: dict[str, _Length] = field(default_factory=dict)
    flags: dict[str, int] = field(default_factory=dict)
    _seen: set[bytes] = field(default_factory=set, repr=False)

    def add(self, row: dict[str, Any], fmt: str, digest: str) -> None:
        self.rows += 1
        key = bytes.fromhex(digest)[:16]
        self.exact_duplicates += int(key in self._seen)
        self._seen.add(key)
        self.source_formats[fmt] = self.source_formats.get(fmt, 0) + 1
        lengths, flags = row_profile(self.kind, row)
        for name, values in lengths.items():
            for v in values:
                self.lengths.setdefault(name, _Length()).add(v)
        for name, on in flags.items():
            self.flags[name] = self.flags.get(name, 0) + int(on)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "exact_duplicates": self.exact_duplicates,
            "source_formats": dict(sorted(self.source_formats.items())),
            "lengths": {
                k: {"mean": v.total / v.count if v.count else 0.0, "max": v.max}
                for k, v in self.lengths.items()
            },
            "flags": dict(self.flags),
        }
