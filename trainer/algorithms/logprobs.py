"""Per-token log-probabilities and entropies from logits, without materialising a (B, T, V) log-softmax."""

from __future__ import annotations

import torch
from torch import Tensor

# The most elements of logits a chunk of rows holds at once (64 MB in float32): a chunk is as many batch rows
# as fit, and at least one. Small vocabularies and short rows then take a few calls, not one per row (each
# call and its backward node has a fixed cost); a large model's rows go one at a time, as before.
CHUNK_ELEMENTS = 1 << 24


def _row_chunks(logits: Tensor) -> tuple[Tensor, ...]:
    """``logits`` (B, T, V) split along B into chunks of at most ``CHUNK_ELEMENTS`` (at least one row)."""
    per_row = max(1, logits[0].numel()) if logits.shape[0] else 1
    return torch.split(logits, max(1, CHUNK_ELEMENTS // per_row))


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label token under the logits.

    Naive equivalent (allocates a second (B, T, V) tensor)::

        torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    Here the label logit is gathered first and a ``logsumexp`` is taken a chunk of batch rows at a time
    (``_row_chunks``: at most ``CHUNK_ELEMENTS``, or one (T, V) row), so the peak extra memory is a chunk
    instead of (B, T, V) (TRL ``selective_log_softmax`` goes a row at a time). For half-precision logits
    ``logsumexp`` loses accuracy, so each chunk goes through ``log_softmax`` in its own dtype instead; the
    memory bound is the same.

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
        # A chunk of rows at a time: logsumexp allocates the chunk's (rows, T, V), not (B, T, V).
        lse = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in _row_chunks(logits)])
        return picked - lse
    if logits.shape[0] == 0:
        return logits.new_zeros(labels.shape)
    chunks = _row_chunks(logits)
    label_chunks = torch.split(labels, [len(c) for c in chunks])
    return torch.cat(
        [
            torch.log_softmax(chunk, dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
            for chunk, lab in zip(chunks, label_chunks, strict=True)
        ]
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at every position.

    Naive equivalent::

        p = torch.softmax(logits, -1); -(p * torch.log_softmax(logits, -1)).sum(-1)

    Args:
        logits: (B, T, V) unnormalised scores.

    Returns:
        (B, T) entropy in nats, differentiable; float32 for half-precision logits, else their dtype.

    Formula: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (equal to ``-sum p log p``), computed
    a chunk of batch rows at a time (``_row_chunks``); half-precision logits are upcast to float32 a chunk at
    a time (never the whole). Under ``torch.no_grad()`` (logging) the extra memory is one chunk's softmax;
    with grad (an entropy bonus) autograd keeps every chunk's softmax, as the naive version would.

    Degenerate: a uniform row gives ``log V``; a one-hot-like row (one logit far above the rest)
    gives ~0. B = 0 returns an empty (0, T) tensor.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:-1])
    out = []
    for chunk in _row_chunks(logits):
        if chunk.dtype in (torch.float16, torch.bfloat16):
            chunk = chunk.float()
        p = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(dim=-1))
    return torch.cat(out)
