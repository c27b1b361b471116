"""Builders shared by the reward tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.rewards.verifiers import Sample


def sample(
    completion: str = "",
    answer: Any = None,
    *,
    meta: Mapping[str, Any] | None = None,
    prompt: str = "Q:",
    n_tokens: int = 0,
    max_new_tokens: int = 100,
    truncated: bool = False,
) -> Sample:
    return Sample(
        prompt=prompt,
        completion=completion,
        row={"prompt": prompt, "answer": answer, "meta": dict(meta or {})},
        n_tokens=n_tokens,
        max_new_tokens=max_new_tokens,
        truncated=truncated,
    )
