"""Builders shared by the reward tests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
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


def reward_model_dir(tiny_cache: Path, out: Path) -> Path:
    """A reward-model folder in ``out``: the tiny LM with a seeded score head, spread so scores differ."""
    import torch

    from trainer.loops.session import seed_everything
    from trainer.models import load_reward_model, tiny_model_dir

    seed_everything(0)
    model, tok = load_reward_model(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    with torch.no_grad():
        model.score.weight.mul_(30.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
