"""Tiny models for rollout tests: the random preset, and a copy that often stops on EOS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.models import load_causal_lm, tiny_model_dir

# Scaling EOS's output row makes its logit swing with the hidden state, so with 10 new tokens some
# completions stop on EOS (at different lengths) and some run to the limit, greedy or sampled.
EOS_ROW_SCALE = 12.0
PROMPT_TEXTS = ["1+2=", "the of and to in is you", "Human: what", "42", "7*8=56 3-1=2"]


@pytest.fixture(scope="module")
def tiny(tiny_cache: Path) -> tuple[Any, Any]:
    """The random llama-0.4m preset and its tokenizer (pad id distinct from EOS)."""
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))


@pytest.fixture(scope="module")
def eos_prone(tiny_cache: Path) -> tuple[Any, Any]:
    """Its own copy of the preset with the EOS row of ``lm_head`` scaled (see ``EOS_ROW_SCALE``)."""
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= EOS_ROW_SCALE
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(tiny: tuple[Any, Any]) -> list[list[int]]:
    """Prompts of different lengths (1 to 12 tokens), so batches need left padding."""
    tokenizer = tiny[1]
    ids: list[list[int]] = [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]
    assert len({len(p) for p in ids}) >= 3
    return ids
