"""What a model gives the completion tokens of a token batch: the logits that predict them and their
log-probs, for each layout a batch comes in (padded rows, packed rows, one shared prompt per pair), and the
checks that refuse a layout a model cannot run.

Beside trainer/models.py because every function here runs a model's forward pass: trainer/data lays the
tokens out (and knows nothing of models), trainer/algorithms turns log-probs into losses (pure tensor math);
this module is the one step between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.data.packing import PackedBatch, pack_sequences
from trainer.data.pair_layout import UNGROUPED, AnyPairBatch, PairCollate, PairGrouping
from trainer.data.preference import TokenizedPair, collate_pairs
from trainer.data.shared_prompt import SharedPromptBatch, collate_shared, shared_attention
from trainer.distributed import unwrap
from trainer.phases import Phase


def completion_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict completion tokens, with those tokens and their mask: ``logits[:, k]``
    predicts ``targets[:, k]``, counted where ``mask[:, k]`` is 1.

    The LM head runs only from the position before the batch's earliest completion token to the end
    (transformers' ``logits_to_keep``), not over every prompt position: a (B, T, V) tensor shrinks to
    (B, K, V), K the longest completion span, which for a 150k vocabulary and long prompts is most of a
    step's activation memory. Same values as slicing the full logits.
    """
    length = input_ids.shape[1]
    scored = completion_mask[:, 1:].bool().any(0)  # label positions 1..T-1 that any row scores
    first = int(scored.nonzero()[0]) + 1 if bool(scored.any()) else length  # earliest scored label
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=length - first + 1
    ).logits
    return logits[:, :-1], input_ids[:, first:], completion_mask[:, first:]


def completion_logp_sums(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) ``sum_t log p(x_t | x_<t)`` over each row's completion tokens (``completion_logits``), the
    per-token log-probs in the logits' dtype and summed in float32."""
    logits, targets, mask = completion_logits(model, input_ids, attention_mask, completion_mask)
    logp = token_logprobs(logits, targets).float()
    return (logp * mask.to(logp.dtype)).sum(-1)


def packed_completion_logits(
    model: Any, batch: PackedBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``completion_logits`` of a packed batch (trainer/data/packing.py), and the sequence of each kept
    token: ``logits[:, k]`` predicts ``targets[:, k]``, scored where ``mask[:, k]``, which belongs to input
    sequence ``sequence[:, k]``.

    No attention mask and no cache, so transformers reads the sequence boundaries from the position ids
    (a block-diagonal causal mask); the LM head runs only at positions whose next token some row scores
    (``logits_to_keep`` as an index tensor).
    """
    input_ids, scored = batch.input_ids.to(device), batch.scored.to(device)
    keep = scored[:, 1:].any(0).nonzero().flatten()  # position p predicts token p + 1
    if keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=device)
    logits = model(
        input_ids=input_ids,
        position_ids=batch.position_ids.to(device),
        use_cache=False,
        logits_to_keep=keep,
    ).logits
    at = keep + 1
    return logits, input_ids[:, at], scored[:, at], batch.sequence.to(device)[:, at]


class PackingUnsupported(ValueError):
    """The model mixes packed sequences (its attention or other layers ignore the boundaries)."""


@torch.no_grad()
def check_packing(model: Any, device: torch.device) -> None:
    """Refuse packing for a model that lets packed sequences see each other: two short sequences, packed
    in one row and run alone, must give the same logits. Boundaries read from position ids hold for
    standard attention; linear-attention and convolution layers (Qwen3-Next, Mamba hybrids) ignore them
    (transformers' padding-free guide), and a custom model may too. Three forwards of a few tokens."""
    was_training = model.training
    model.eval()
    a, b = [1, 2, 3, 4], [5, 6, 7]
    batch = pack_sequences([(a, 1), (b, 1)], len(a) + len(b), 0)
    packed = (
        model(
            input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False
        )
        .logits[0]
        .float()
    )
    alone = [model(input_ids=torch.tensor([s], device=device)).logits[0].float() for s in (a, b)]
    model.train(was_training)
    if not torch.allclose(packed, torch.cat(alone), atol=1e-2, rtol=1e-2):
        raise PackingUnsupported(
            "packing: this model lets packed sequences attend to each other (layers that ignore the "
            "sequence boundaries in the position ids, such as linear attention); run it without packing"
        )


# Preference pairs: (2B,) log-probs of chosen then rejected answers, in any layout.


def attention_mask_for(model: Any, allowed: Tensor) -> Tensor:
    """A 4D mask in the form the model's attention takes it: boolean for SDPA (True: attend), additive
    float for eager attention (0, or the dtype's minimum where masked)."""
    if getattr(unwrap(model).config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
    return allowed


def shared_prompt_logps(model: Any, batch: SharedPromptBatch, device: torch.device) -> Tensor:
    """``sequence_logps`` of a shared-prompt batch: one forward with the 4D mask and position ids of
    trainer/data/shared_prompt.py, logits only at ``batch.keep``; (2B,) chosen then rejected."""
    allowed = shared_attention(batch.segment.to(device))
    logits = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=attention_mask_for(model, allowed),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
        logits_to_keep=batch.keep.to(device),
    ).logits
    sums = []
    for targets, mask in (
        (batch.chosen_targets, batch.chosen_mask),
        (batch.rejected_targets, batch.rejected_mask),
    ):
        logp = token_logprobs(logits, targets.to(device)).float()
        sums.append((logp * mask.to(device)).sum(-1))
    return torch.cat(sums)


class SharedPromptUnsupported(ValueError):
    """The model's attention does not follow a custom 4D mask (e.g. flash attention)."""


@torch.no_grad()
def check_shared_prompt(model: Any, device: torch.device) -> None:
    """Refuse the shared-prompt layout for a model whose attention ignores a custom 4D mask: a probe pair's
    log-probs must match the padded layout's (two forwards of a few tokens)."""
    was_training = model.training
    model.eval()
    pair = [TokenizedPair(prompt=[1, 2, 3], chosen=[4, 5, 6], rejected=[7, 8])]
    shared = shared_prompt_logps(model, collate_shared(pair, 0), device)
    padded = sequence_logps(model, collate_pairs(pair, 0), device)
    model.train(was_training)
    if not torch.allclose(shared, padded, atol=1e-2, rtol=1e-3):
        raise SharedPromptUnsupported(
            "shared_prompt: this model's attention does not follow a custom 4D mask (the rejected answer "
            f"would see the chosen one; log-probs {shared.tolist()} vs {padded.tolist()} padded)"
        )


def sequence_logps(model: Any, batch: AnyPairBatch, device: torch.device) -> Tensor:
    """(2B,) sum over completion tokens of log pi(y_t | x, y_<t); one forward pass for chosen and rejected,
    logits only where they predict a completion token (``completion_logits``), in the model's dtype (the
    per-token log-probs are summed in float32). A packed batch sums each token into its sequence; a
    shared-prompt batch runs each prompt once (``shared_prompt_logps``)."""
    if isinstance(batch, SharedPromptBatch):
        return shared_prompt_logps(model, batch, device)
    if isinstance(batch, PackedBatch):
        logits, targets, scored, sequence = packed_completion_logits(model, batch, device)
        logp = token_logprobs(logits, targets).float() * scored
        sums = torch.zeros(batch.n_sequences, device=logp.device, dtype=logp.dtype)
        return sums.index_add(0, sequence.clamp(min=0).flatten(), logp.flatten())  # padding adds 0
    return completion_logp_sums(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.completion_mask.to(device)
    )


@torch.no_grad()
def all_pair_logps(
    model: Any,
    pairs: Sequence[TokenizedPair],
    collate: PairCollate,
    batch_size: int,
    device: torch.device,
    progress: Phase | None = None,
    grouping: PairGrouping = UNGROUPED,
    equal_passes: bool = False,
) -> Tensor:
    """(N, 2) [chosen, rejected] sequence log-probs of every pair, in eval mode; ``progress`` counts pairs.
    Passes of at most ``batch_size`` pairs grouped by ``grouping`` (``equal_passes``: as many as any
    rank with as many pairs runs, for a sharded model); the rows come back in ``pairs``' order."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(pairs), 2)
    for group in grouping.groups(pairs, batch_size, equal_passes):
        logps = sequence_logps(model, collate([pairs[i] for i in group]), device)
        out[group] = torch.stack([logps[: len(group)], logps[len(group) :]], dim=1).cpu().float()
        if progress is not None:
            progress.advance(len(group))
    model.train(was_training)
    return out


@torch.no_grad()
def reply_logprobs(model: Any, context: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The model's log-probs of ``tokens`` after ``context`` at temperature ``T``: log softmax(z/T) of each
    token (T = 0 or 1 keeps the logits), in eval mode, without gradient. The distribution the transformers
    engine sampled from (an agent endpoint's ``logprobs``; the trainer's own recomputation is
    trainer/loops/rl_common.py ``forward_logps``), and at T = 1 a training session's sampler log-probs."""
    if not tokens:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([context + tokens], device=device)
        logits = model(input_ids=ids, logits_to_keep=len(tokens) + 1).logits[:, :-1].float()
    finally:
        model.train(was_training)
    if temperature > 0 and temperature != 1:
        logits = logits / temperature
    return [float(x) for x in token_logprobs(logits, torch.tensor([tokens], device=device))[0]]
