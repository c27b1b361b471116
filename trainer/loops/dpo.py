"""DPO run: a policy trained on preference pairs against a frozen reference (Rafailov et al. 2023).

Reads top to bottom: load -> tokenize -> reference log-probs (once) -> steps (eval, checkpoints) -> final.
The reference model never changes, so its sequence log-probs are computed once for every pair before
training instead of in a second forward pass at every step (TRL's ``precompute_ref_log_probs``); when
the reference is the starting model this also means no second copy of the model is kept in memory. The
precomputed values travel in each checkpoint, so a resumed run never needs the reference again.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.algorithms.preference_losses import PREFERENCE_LOSSES, PreferenceLossFn, PreferenceParams
from trainer.data.preference import PairBatch, TokenizedPair, collate_pairs, tokenize_pair
from trainer.loops.common import to_floats
from trainer.loops.session import Final, TrainingSession, begin, load_policy
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import DpoSpec


def sequence_logps(model: Any, batch: PairBatch, device: torch.device) -> Tensor:
    """(2B,) sum over completion tokens of log pi(y_t | x, y_<t); one forward pass for chosen and rejected."""
    ids = batch.input_ids.to(device)
    logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device)).logits
    # Position t predicts token t+1: drop the last logit and the first label.
    logp = token_logprobs(logits[:, :-1].float(), ids[:, 1:])
    mask = batch.completion_mask[:, 1:].to(device, logp.dtype)
    return (logp * mask).sum(-1)


@torch.no_grad()
def all_pair_logps(
    model: Any, pairs: list[TokenizedPair], pad_id: int, batch_size: int, device: torch.device
) -> Tensor:
    """(N, 2) [chosen, rejected] sequence log-probs of every pair, in eval mode."""
    was_training = model.training
    model.eval()
    out = [torch.zeros(0, 2)]
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        logps = sequence_logps(model, collate_pairs(chunk, pad_id), device)
        out.append(torch.stack([logps[: len(chunk)], logps[len(chunk) :]], dim=1).cpu())
    model.train(was_training)
    return torch.cat(out)


def pair_stats(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> dict[str, Tensor]:
    """Implicit rewards r = beta * log(pi/pi_ref) of chosen and rejected, their accuracy and margin."""
    chosen, rejected = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
        "rewards/margin": (chosen - rejected).mean(),
    }


def evaluate(
    model: Any,
    pairs: list[TokenizedPair],
    ref: Tensor,
    pad_id: int,
    device: torch.device,
    loss_fn: PreferenceLossFn,
    params: PreferenceParams,
    prefix: str,
) -> dict[str, float]:
    """``<prefix>/*`` metrics over ``pairs`` with the current policy (no grad)."""
    logps = all_pair_logps(model, pairs, pad_id, 64, device)
    chosen_logratio, rejected_logratio = logps[:, 0] - ref[:, 0], logps[:, 1] - ref[:, 1]
    stats = pair_stats(chosen_logratio, rejected_logratio, params.beta)
    stats["loss"] = loss_fn(chosen_logratio, rejected_logratio, params).mean()
    return {f"{prefix}/{k}": v for k, v in to_floats(stats).items()}


def reference_logps(
    spec: DpoSpec,
    policy: Any,
    pair_sets: list[list[TokenizedPair]],
    pad_id: int,
    ctx: LoopContext,
    device: torch.device,
) -> list[Tensor]:
    """(N, 2) reference log-probs for each list of pairs, from the reference model (default: the start)."""
    batch = max(spec.hyperparameters.batch_size, 8)
    if spec.reference_model is None or spec.reference_model == spec.model:
        return [all_pair_logps(policy, pairs, pad_id, batch, device) for pairs in pair_sets]
    reference, _ = load_causal_lm(ctx.resolve_model(spec.reference_model))
    reference.to(device)
    logps = [all_pair_logps(reference, pairs, pad_id, batch, device) for pairs in pair_sets]
    del reference  # needed only for this pass
    return logps


def run_dpo(spec: DpoSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the preference loss ``spec.hyperparameters.loss_type``."""
    hp = spec.hyperparameters
    start = begin(ctx, reporter, spec.model, hp.seed)
    model, tokenizer = load_policy(start)
    pad_id, device = tokenizer.pad_token_id, start.device

    def tokenize(rows: list[dict[str, Any]]) -> list[TokenizedPair]:
        return [
            tokenize_pair(r, tokenizer, max_length=hp.max_length, max_prompt_length=hp.max_prompt_length)
            for r in rows
        ]

    pairs, val_pairs = tokenize(data.train), tokenize(data.validation)
    loss_fn = PREFERENCE_LOSSES[hp.loss_type]
    params = PreferenceParams(beta=hp.beta, label_smoothing=hp.label_smoothing)
    session = TrainingSession(start, hp, model, tokenizer, len(pairs))
    if session.finished_before:
        return session.result
    if session.resumed:
        ref, val_ref = session.extra["ref_logps"]
    else:
        ref, val_ref = reference_logps(spec, model, [pairs, val_pairs], pad_id, ctx, device)
    session.extra_state = lambda: {"ref_logps": (ref, val_ref)}
    reporter.event(
        "info",
        f"training on {len(pairs)} pairs ({len(val_pairs)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )
    model.train()

    def final() -> Final:  # every training pair, with the trained policy: did it learn the data?
        return Final(evaluate(model, pairs, ref, pad_id, device, loss_fn, params, "final"))

    for _ in session.steps():
        t0 = time.perf_counter()
        idx = session.sampler.next_batch()
        batch = collate_pairs([pairs[i] for i in idx], pad_id)
        logps = sequence_logps(model, batch, device)
        chosen, rejected = logps[: len(idx)], logps[len(idx) :]
        ref_batch = ref[idx].to(device)
        chosen_logratio, rejected_logratio = chosen - ref_batch[:, 0], rejected - ref_batch[:, 1]
        loss = loss_fn(chosen_logratio, rejected_logratio, params).mean()
        grad_norm = session.update(loss)

        metrics: dict[str, float] = {}
        if session.log_due:
            stats = pair_stats(chosen_logratio, rejected_logratio, hp.beta)
            stats |= {
                "loss": loss.detach(),
                "grad_norm": grad_norm,
                "logps/chosen": chosen.detach().mean(),
                "logps/rejected": rejected.detach().mean(),
            }
            metrics = session.train_metrics(stats, batch.n_tokens, t0)
        metrics |= session.evaluate(
            val_pairs, lambda: evaluate(model, val_pairs, val_ref, pad_id, device, loss_fn, params, "eval")
        )
        session.end_step(metrics, final)
    return session.result
