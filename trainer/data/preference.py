"""Preference pairs -> token tensors: chosen and rejected of a batch in one padded (2B, T) batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.data.prompts import render_prompt
from trainer.phases import Phase


@dataclass(frozen=True)
class TokenizedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True)
class PairBatch:
    """``input_ids``/``attention_mask``/``completion_mask`` are (2B, T): rows [0, B) chosen, [B, 2B) rejected.

    ``completion_mask[i, t]`` is 1 where token t belongs to the completion (the only tokens scored).
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())


def tokenize_pair(
    row: dict[str, Any], tokenizer: Any, *, max_length: int, max_prompt_length: int
) -> TokenizedPair:
    """Prompt cut from the left to ``max_prompt_length``; completions (+EOS) cut to fit ``max_length``."""
    prompt = tokenizer(render_prompt(row["prompt"], tokenizer)).input_ids[-max_prompt_length:]
    room = max_length - len(prompt)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def completion(text: str) -> list[int]:
        ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids + eos
        return ids[:room]

    return TokenizedPair(
        prompt=prompt, chosen=completion(row["chosen"]), rejected=completion(row["rejected"])
    )


def tokenize_pairs(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    max_prompt_length: int,
    progress: Phase | None = None,
) -> list[TokenizedPair]:
    """``tokenize_pair`` of each row, in order; ``progress`` counts the rows."""
    out = []
    for row in rows:
        out.append(tokenize_pair(row, tokenizer, max_length=max_length, max_prompt_length=max_prompt_length))
        if progress is not None:
            progress.advance()
    return out


def collate_pairs(pairs: list[TokenizedPair], pad_id: int) -> PairBatch:
    """Right-pad ``prompt + completion`` sequences to the longest in the batch."""
    seqs = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    width = max(len(a) + len(b) for a, b in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    comp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (prompt, compl) in enumerate(seqs):
        n_p, n = len(prompt), len(prompt) + len(compl)
        ids[i, :n] = torch.tensor(prompt + compl, dtype=torch.long)
        attn[i, :n] = 1
        comp[i, n_p:n] = 1
    return PairBatch(input_ids=ids, attention_mask=attn, completion_mask=comp)
