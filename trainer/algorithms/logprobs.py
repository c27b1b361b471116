"""Per-token log-probabilities and entropies from logits, without materialising a (B, T, V) log-softmax."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label token under the logits.

    Naive equivalent (allocates a second (B, T, V) tensor)::

        torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    Here the label logit is gathered first and a ``logsumexp`` is taken one batch row at a time, so the
    peak extra memory is one (T, V) row instead of (B, T, V) (TRL ``selective_log_softmax``). For
    half-precision logits ``logsumexp`` loses accuracy, so each row goes through ``log_softmax`` in its
    own dtype instead; the memory bound is the same.

    Args:
        logits: (B, T, V) unnormalised scores; position t predicts ``labels[:, t]`` (shift beforehand).
        labels: (B, T) int64 token ids in ``[0, V)``. Padding positions must hold a valid id (e.g. 0)
            and be masked by the caller; an out-of-range id (such as -100) raises an index error.

    Returns:
        (B, T) ``log p(labels[b, t] | logits[b, t])``, same dtype as ``logits``, differentiable.

    Formula: ``logp = z[label] - logsumexp_v z[v]``.

    Degenerate: B = 0 or T = 0 returns an empty (B, T) tensor.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if logits.shape[0] == 0:
            return picked
        # One row at a time: logsumexp allocates (T, V) per row, not (B, T, V).
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    rows = [
        torch.log_softmax(row, dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        for row, lab in zip(logits, labels, strict=True)
    ]
    if not rows:
        return logits.new_zeros(labels.shape)
    return torch.stack(rows)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at every position.

    Naive equivalent::

        p = torch.softmax(logits, -1); -(p * torch.log_softmax(logits, -1)).sum(-1)

    Args:
        logits: (B, T, V) unnormalised scores.

    Returns:
        (B, T) entropy in nats, differentiable; float32 for half-precision logits, else their dtype.

    Formula: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (equal to ``-sum p log p``), computed
    one batch row at a time; half-precision logits are upcast to float32 a row at a time (never the whole).
    Under ``torch.no_grad()`` (logging) the extra memory is one (T, V) softmax; with grad (an entropy
    bonus) autograd keeps every row's softmax, as the naive version would.

    Degenerate: a uniform row gives ``log V``; a one-hot-like row (one logit far above the rest)
    gives ~0. B = 0 returns an empty (0, T) tensor.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:-1])
    rows = []
    for row in logits:
        if row.dtype in (torch.float16, torch.bfloat16):
            row = row.float()
        p = torch.softmax(row, dim=-1)
        rows.append(torch.logsumexp(row, dim=-1) - (p * row).sum(dim=-1))
    return torch.stack(rows)
