"""SFT rows -> token tensors: ``prompt + completion + EOS``, right-padded, only completion tokens scored.

Truncation rule (``truncate``), for a sequence longer than ``max_length``:

1. The completion is the training signal, so it keeps its first ``max_length - 1`` tokens (all of it when
   it fits); at least one completion token always survives (``max_length >= 2``). A completion cut here
   loses its EOS: the model learns a prefix of the answer, never a wrong ending.
2. The prompt fills the remaining room from its *tail* (cut from the left): the end of the prompt, the
   part next to the answer (the chat template's assistant marker, the question), matters most. At least
   one prompt token is kept when the prompt has any, because position 0 is never a target: with no
   prompt token the first completion token would go unscored and the answer would have no context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.data.prompts import render_prompt

IGNORE_INDEX = -100  # the Hugging Face / torch cross_entropy convention for "no loss at this label"


@dataclass(frozen=True)
class TokenizedExample:
    prompt: list[int]
    completion: list[int]  # includes the EOS unless truncation cut it


@dataclass(frozen=True)
class SftBatch:
    """``input_ids``/``attention_mask``/``completion_mask`` are (B, T), right-padded.

    ``completion_mask[i, t]`` is 1 where token t belongs to the completion: the only tokens scored.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def labels(self) -> Tensor:
        """(B, T) Hugging Face style labels: the token id on completion tokens, -100 on prompt and padding."""
        return self.input_ids.masked_fill(self.completion_mask == 0, IGNORE_INDEX)


def truncate(prompt: list[int], completion: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Fit ``prompt + completion`` into ``max_length`` tokens by the module's rule; (prompt, completion)."""
    if len(prompt) + len(completion) <= max_length:
        return prompt, completion
    completion = completion[: max_length - min(len(prompt), 1)]
    room = max_length - len(completion)
    return (prompt[-room:] if room > 0 else []), completion


def tokenize_example(row: dict[str, Any], tokenizer: Any, *, max_length: int) -> TokenizedExample:
    """Prompt rendered (chat template when there is one) and tokenized; completion + EOS; ``truncate``d."""
    prompt: list[int] = tokenizer(render_prompt(row["prompt"], tokenizer)).input_ids
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    completion: list[int] = tokenizer(row["completion"], add_special_tokens=False).input_ids + eos
    prompt, completion = truncate(prompt, completion, max_length)
    return TokenizedExample(prompt=prompt, completion=completion)


def collate_examples(examples: list[TokenizedExample], pad_id: int) -> SftBatch:
    """Right-pad ``prompt + completion`` sequences to the longest in the batch."""
    width = max(len(e.prompt) + len(e.completion) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    comp = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n_p, n = len(e.prompt), len(e.prompt) + len(e.completion)
        ids[i, :n] = torch.tensor(e.prompt + e.completion, dtype=torch.long)
        attn[i, :n] = 1
        comp[i, n_p:n] = 1
    return SftBatch(input_ids=ids, attention_mask=attn, completion_mask=comp)
