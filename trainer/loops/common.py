"""Small helpers shared by the loops: seeding, devices, schedules, timing."""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, TypeVar

import torch

from trainer.algorithms.logprobs import token_logprobs
from trainer.data.packing import PackedBatch, pack_sequences
from trainer.distributed import Ranks, all_true, current, from_main, grad_sum_factor, local_norm
from trainer.precision import enable_loss_scaling, loss_scaler

T = TypeVar("T")


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python and torch; return a generator for data order so sampling never shifts init RNG."""
    random.seed(seed)
    torch.manual_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def warmup_constant_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup from 0 to ``base_lr`` over ``warmup_steps`` (1-based step), then constant."""
    if warmup_steps <= 0 or step > warmup_steps:
        return base_lr
    return base_lr * step / warmup_steps


def is_due(step: int, every: int, last_step: int) -> bool:
    """True at every ``every``-th step (``every`` > 0) and always at the last step."""
    return step == last_step or (every > 0 and step % every == 0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the loss or the gradients: the update is refused and the run stops."""


def backward_and_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    max_grad_norm: float,
    *,
    step: int | None = None,
    skip_nonfinite: bool = False,
) -> Any:
    """zero_grad -> backward -> clip -> step on one loss; ``accumulate_and_step`` with one micro-batch."""
    return accumulate_and_step(
        model, optimizer, [loss], max_grad_norm, step=step, skip_nonfinite=skip_nonfinite
    )


def accumulate_and_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    losses: Iterable[torch.Tensor],
    max_grad_norm: float,
    *,
    step: int | None = None,
    skip_nonfinite: bool = False,
) -> Any:
    """zero_grad -> backward of each micro-batch loss as it comes -> clip -> step; returns the pre-clip
    gradient norm. Gradients add up over backward calls, so when each micro-batch loss is already scaled
    for the whole batch (their sum is the batch loss) the step is the whole batch's (gradient
    accumulation); ``losses`` may be a generator that runs each micro-batch's forward pass when asked,
    so only one micro-batch's activations are alive at a time.

    Never trains on NaN: a non-finite micro-batch loss or gradient norm raises NonFiniteError naming the
    step and the tensor, before the optimizer touches the weights; with ``skip_nonfinite`` it returns None
    instead (the batch is skipped, the weights unchanged). The check is one host sync per micro-batch.
    An fp16 run's optimizer has a loss scaler (trainer/precision.py): each loss is scaled before its
    backward and the gradients unscaled before clipping; a gradient that overflows skips the step and
    lowers the scale (the norm returned is then inf), as dynamic loss scaling means to.
    """
    where = f" at step {step}" if step is not None else ""
    scaler = loss_scaler(optimizer)  # fp16: losses scaled up for the backward, gradients unscaled below
    ranks, factor = current(), grad_sum_factor()  # DDP/FSDP average the ranks' gradients: undo it
    optimizer.zero_grad(set_to_none=True)
    micro = iter(losses)
    for loss in micro:
        if not all_true(bool(torch.isfinite(loss.detach()).all()), ranks):  # every rank skips, or none
            optimizer.zero_grad(set_to_none=True)
            if skip_nonfinite:
                for _ in micro:  # the rest still run (no backward), so the step's statistics are whole
                    pass
                return None
            raise NonFiniteError(f"loss is {float(loss.detach().float().sum())}{where}; no update applied")
        if factor != 1:
            loss = loss * factor
        with torch.autocast(loss.device.type, enabled=False):  # backward outside autocast, as torch asks
            (loss if scaler is None else scaler.scale(loss)).backward()  # type: ignore[no-untyped-call]
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = local_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if scaler is not None:
        # An overflow at this scale is expected now and then: the scaler skips the step and lowers the
        # scale (the returned norm is inf, counted as a skipped update), it is not a diverging run.
        scaler.step(optimizer)
        scaler.update()
        return grad_norm
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        if skip_nonfinite:
            return None
        raise NonFiniteError(f"gradient norm is {float(grad_norm)}{where}; no update applied")
    optimizer.step()
    return grad_norm


def micro_batches(rows: Sequence[T], size: int | None) -> list[Sequence[T]]:
    """``rows`` cut into consecutive micro-batches of ``size`` (the last may be smaller); one when None."""
    if size is None or size >= len(rows):
        return [rows]
    return [rows[i : i + size] for i in range(0, len(rows), size)]


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


def to_floats(stats: dict[str, Any]) -> dict[str, float]:
    """Tensors -> floats, at log interval only: each ``.item()`` is a device sync point."""
    return {k: float(v.item()) if isinstance(v, torch.Tensor) else float(v) for k, v in stats.items()}


def make_optimizer(
    model: Any, lr: float, weight_decay: float, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, fused (one kernel for all tensors) where torch supports it
    for the parameters' device: it is the same update, computed with fewer passes over memory. With
    ``precision`` fp16 it gets a dynamic loss scaler (trainer/precision.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    enable_loss_scaling(optimizer, precision, params[0].device if params else torch.device("cpu"))
    return optimizer


def stop_requested(
    reporter: Any,
    step: int,
    start: int,
    saved_steps: Container[int],
    save: Callable[[int], object],
    ranks: Ranks | None = None,
) -> bool:
    """True if a cancel or pause asks the loop to stop before ``step``. The work done is kept first:
    ``save(step - 1)`` writes a checkpoint unless nothing new was trained or it exists already. In a
    multi-rank run rank 0's answer is every rank's (``from_main``), so all stop at the same step."""
    if not from_main(reporter.should_stop(), ranks or Ranks()):
        return False
    reporter.event("info", f"stopping before step {step}: cancel or pause requested")
    if step - 1 > start and step - 1 not in saved_steps:
        save(step - 1)
    return True


def update_or_skip(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor | Iterable[torch.Tensor],
    *,
    max_grad_norm: float,
    step: int,
    on_nonfinite: str,
    reporter: Any,
) -> Any:
    """``accumulate_and_step`` over ``loss`` (one tensor, or the micro-batch losses of one step) honouring
    the spec's ``on_nonfinite``: "skip" reports the skipped batch as an event and returns a NaN norm (the
    reporter drops non-finite values); "fail" raises NonFiniteError."""
    losses = [loss] if isinstance(loss, torch.Tensor) else loss
    grad_norm = accumulate_and_step(
        model, optimizer, losses, max_grad_norm, step=step, skip_nonfinite=on_nonfinite == "skip"
    )
    if grad_norm is None:
        reporter.event(
            "warning", f"step {step}: non-finite loss or gradient; batch skipped, weights unchanged"
        )
        return torch.tensor(float("nan"))
    return grad_norm
