"""Preference pairs with the prompt computed once: one row per pair, ``prompt | chosen | rejected``.

The padded layout (``collate_pairs``) runs the prompt twice, once before the chosen answer and once before
the rejected one; on real conversations (HH-RLHF: the whole dialogue up to the last Assistant turn) the
prompt is most of a pair's tokens. Here each pair is one row holding the prompt, then the chosen answer,
then the rejected one, with

- position ids ``0..P-1`` for the prompt, then ``P..P+C-1`` for chosen and again ``P..P+R-1`` for rejected;
- a 4D attention mask in which a token sees the earlier tokens of its own part and the prompt: the
  rejected answer never sees the chosen one. Each answer token then has exactly the context (tokens and
  positions) it has in its own padded row, so its log-prob is the same (tested to 1e-5);
- logits only at the positions that predict an answer token: the prompt's last token (it predicts both
  ``chosen[0]`` and ``rejected[0]``) and each answer token but the last.

A pair costs ``P + C + R`` token positions instead of ``2P + C + R`` (the same idea as the shared-prefix /
tree attention of speculative decoding and of prefix-sharing trainers). It needs a model whose attention
takes a custom 4D mask (transformers' ``sdpa`` and ``eager``); ``check_shared_prompt`` probes it at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.data.preference import TokenizedPair

PROMPT, CHOSEN, REJECTED, PAD = 0, 1, 2, -1  # segment ids


@dataclass(frozen=True)
class SharedPromptBatch:
    """B pairs, one row each, right-padded to the longest row L.

    ``segment`` (B, L) says which part each token is (``PROMPT``, ``CHOSEN``, ``REJECTED``, ``PAD``).
    ``keep`` (K,) the positions whose logits some row needs; ``chosen_targets`` / ``rejected_targets``
    (B, K) the token the logits at ``keep[k]`` predict in that answer, counted where the matching mask
    (B, K) is 1.
    """

    input_ids: Tensor
    position_ids: Tensor
    segment: Tensor
    keep: Tensor
    chosen_targets: Tensor
    chosen_mask: Tensor
    rejected_targets: Tensor
    rejected_mask: Tensor
    n_tokens: int  # the pairs' sequence tokens as the padded layout counts them (2P + C + R each)

    @property
    def n_pairs(self) -> int:
        return int(self.input_ids.shape[0])


def collate_shared(pairs: list[TokenizedPair], pad_id: int) -> SharedPromptBatch:
    """One ``prompt | chosen | rejected`` row per pair (module docstring), right-padded with ``pad_id``."""
    width = max(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs)
    shape = (len(pairs), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    pos = torch.zeros(shape, dtype=torch.long)
    seg = torch.full(shape, PAD, dtype=torch.int8)
    targets = {CHOSEN: torch.zeros(shape, dtype=torch.long), REJECTED: torch.zeros(shape, dtype=torch.long)}
    masks = {CHOSEN: torch.zeros(shape), REJECTED: torch.zeros(shape)}
    n_tokens = 0
    for row, p in enumerate(pairs):
        n_p, n_c, n_r = len(p.prompt), len(p.chosen), len(p.rejected)
        ids[row, : n_p + n_c + n_r] = torch.tensor(p.prompt + p.chosen + p.rejected, dtype=torch.long)
        pos[row, : n_p + n_c] = torch.arange(n_p + n_c)
        pos[row, n_p + n_c : n_p + n_c + n_r] = torch.arange(n_p, n_p + n_r)
        seg[row, :n_p], seg[row, n_p : n_p + n_c], seg[row, n_p + n_c : n_p + n_c + n_r] = (
            PROMPT,
            CHOSEN,
            REJECTED,
        )
        n_tokens += 2 * n_p + n_c + n_r
        for part, answer, start in ((CHOSEN, p.chosen, n_p), (REJECTED, p.rejected, n_p + n_c)):
            # answer[0] is predicted by the prompt's last token, answer[t] by the answer's token t-1
            where = [n_p - 1] + list(range(start, start + len(answer) - 1)) if answer and n_p else []
            if answer and not n_p:  # no prompt: the first token has nothing to be predicted from
                where, answer = list(range(start, start + len(answer) - 1)), answer[1:]
            if where:
                targets[part][row, where] = torch.tensor(answer, dtype=torch.long)
                masks[part][row, where] = 1.0
    keep = ((masks[CHOSEN] + masks[REJECTED]).sum(0) > 0).nonzero().flatten()
    return SharedPromptBatch(
        input_ids=ids,
        position_ids=pos,
        segment=seg,
        keep=keep,
        chosen_targets=targets[CHOSEN][:, keep],
        chosen_mask=masks[CHOSEN][:, keep],
        rejected_targets=targets[REJECTED][:, keep],
        rejected_mask=masks[REJECTED][:, keep],
        n_tokens=n_tokens,
    )


def shared_attention(segment: Tensor) -> Tensor:
    """(B, 1, L, L) bool, True where query i may attend to key j: ``j <= i``, j not padding, and j in the
    prompt or in i's own part. A padding query attends to itself only (no empty row: SDPA would give NaN)."""
    length = segment.shape[1]
    index = torch.arange(length, device=segment.device)
    causal = index[None, :] <= index[:, None]
    key, query = segment[:, None, :], segment[:, :, None]
    allowed = causal & (key != PAD) & (query != PAD) & ((key == PROMPT) | (key == query))
    allowed |= torch.eye(length, dtype=torch.bool, device=segment.device)
    return allowed[:, None]
