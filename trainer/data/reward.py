"""Reward-model rows -> token tensors: every response of a batch in one right-padded (N, T) batch.

A dataset is either *preference* rows ``{"prompt", "chosen", "rejected", "margin"?}`` or *ranking* rows
``{"prompt", "responses": [best, ..., worst]}`` (K >= 2, K may differ between rows). Both become a
``TokenizedGroup``: one prompt and its responses best first, so a pair is simply a group of two
(``[chosen, rejected]``) and the loop has one data path for both kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from trainer.data.prompts import render_prompt

RewardDataKind = Literal["preference", "ranking"]


@dataclass(frozen=True)
class TokenizedGroup:
    """One prompt's scored sequences, best first; each is ``prompt + response`` already truncated."""

    sequences: list[list[int]]
    margin: float | None = None  # the row's required score gap (preference rows only)


@dataclass(frozen=True)
class GroupBatch:
    """Sequences of B groups flattened row-major: group b's k-th response is row ``index[b, k]``.

    ``input_ids``/``attention_mask`` are (N, T), right-padded; ``index`` and ``mask`` are (B, K) with K
    the largest group in the batch (``mask`` False where a group has fewer responses; ``index`` is 0
    there). ``margins`` is (B,), 0 for rows without one, or None when no row of the batch has a margin.
    """

    input_ids: Tensor
    attention_mask: Tensor
    index: Tensor
    mask: Tensor
    margins: Tensor | None

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())


def detect_kind(rows: list[dict[str, Any]]) -> RewardDataKind:
    """``ranking`` if the first row has ``responses``, ``preference`` if it has ``chosen``/``rejected``."""
    if not rows:
        raise ValueError("the dataset has no rows")
    first = rows[0]
    if "responses" in first:
        return "ranking"
    if "chosen" in first and "rejected" in first:
        return "preference"
    raise ValueError(
        f"row 0 is neither a preference row (prompt, chosen, rejected) nor a ranking row (prompt, "
        f"responses); its keys are {sorted(first)}"
    )


def responses_of(row: dict[str, Any], kind: RewardDataKind) -> list[str]:
    """The row's responses best first; raises ValueError when the row does not fit ``kind``."""
    if kind == "preference":
        if "chosen" not in row or "rejected" not in row:
            raise ValueError(
                f"a preference dataset needs 'chosen' and 'rejected' in every row: {sorted(row)}"
            )
        return [row["chosen"], row["rejected"]]
    responses = row.get("responses")
    if not isinstance(responses, list) or len(responses) < 2:
        raise ValueError("a ranking row needs 'responses': a list of at least 2 responses, best first")
    return list(responses)


def tokenize_group(
    row: dict[str, Any], kind: RewardDataKind, tokenizer: Any, *, max_length: int
) -> TokenizedGroup:
    """Each response becomes ``prompt + response`` of at most ``max_length`` tokens.

    The response keeps its first ``max_length`` tokens and the prompt is cut from the left to fill the
    rest, so what is scored is always the response and the end of its prompt. EOS is appended to each
    response (before truncation, as in ``tokenize_pair``) unless the tokenizer pads with EOS: the score is
    read at the last non-pad token, which a trailing pad-valued EOS would hide.
    """
    prompt: list[int] = tokenizer(render_prompt(row["prompt"], tokenizer)).input_ids
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    eos = [eos_id] if eos_id is not None and eos_id != pad_id else []
    sequences = []
    for text in responses_of(row, kind):
        response = (tokenizer(text, add_special_tokens=False).input_ids + eos)[:max_length]
        room = max_length - len(response)
        sequence = (prompt[-room:] if room > 0 else []) + response
        if not sequence:
            raise ValueError("a row has an empty prompt and an empty response: nothing to score")
        sequences.append(sequence)
    margin = row.get("margin") if kind == "preference" else None
    return TokenizedGroup(sequences=sequences, margin=None if margin is None else float(margin))


def tokenize_groups(
    rows: list[dict[str, Any]],
    kind: RewardDataKind,
    tokenizer: Any,
    *,
    max_length: int,
    advance: Callable[[int], None] | None = None,
) -> list[TokenizedGroup]:
    """Every row as a TokenizedGroup; ``advance(1)`` is called after each (progress)."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(tokenize_group(row, kind, tokenizer, max_length=max_length))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{kind} row {i}: {exc}") from exc
        if advance is not None:
            advance(1)
    return out


def collate_groups(groups: list[TokenizedGroup], pad_id: int) -> GroupBatch:
    """Right-pad every sequence of ``groups`` to the longest; see ``GroupBatch`` for the layout."""
    seqs = [s for g in groups for s in g.sequences]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    k_max = max(len(g.sequences) for g in groups)
    index = torch.zeros((len(groups), k_max), dtype=torch.long)
    mask = torch.zeros((len(groups), k_max), dtype=torch.bool)
    row = 0
    for b, g in enumerate(groups):
        k = len(g.sequences)
        index[b, :k] = torch.arange(row, row + k)
        mask[b, :k] = True
        row += k
    margins = None
    if any(g.margin is not None for g in groups):
        margins = torch.tensor([g.margin if g.margin is not None else 0.0 for g in groups])
    return GroupBatch(input_ids=ids, attention_mask=attn, index=index, mask=mask, margins=margins)


def to_groups(flat_scores: Tensor, index: Tensor, mask: Tensor) -> Tensor:
    """(N,) scores of flattened sequences -> (B, K) best first; padded slots hold 0 (see ``mask``)."""
    return torch.where(mask.to(flat_scores.device), flat_scores[index.to(flat_scores.device)], 0.0)
