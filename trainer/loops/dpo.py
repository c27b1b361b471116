"""DPO run: a policy trained on preference pairs against a frozen reference (Rafailov et al. 2023).

Reads top to bottom: load -> tokenize -> reference log-probs (once) -> steps -> final eval -> save.
The reference model never changes, so its sequence log-probs are computed once for every pair before
training instead of in a second forward pass at every step (TRL's ``precompute_ref_log_probs``); when
the reference is the starting model this also means no second copy of the model is kept in memory.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.algorithms.preference_losses import PREFERENCE_LOSSES, PreferenceParams
from trainer.loops.common import EpochSampler, pick_device, seed_everything, warmup_constant_lr
from trainer.loops.preference_data import PairBatch, TokenizedPair, collate_pairs, tokenize_pair
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter
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
    out = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        logps = sequence_logps(model, collate_pairs(chunk, pad_id), device)
        out.append(torch.stack([logps[: len(chunk)], logps[len(chunk) :]], dim=1))
    model.train(was_training)
    return torch.cat(out).cpu()


def pair_stats(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> dict[str, Tensor]:
    """Implicit rewards r = beta * log(pi/pi_ref) of chosen and rejected, their accuracy and margin."""
    chosen, rejected = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
        "rewards/margin": (chosen - rejected).mean(),
    }


def _reference_logps(
    spec: DpoSpec,
    policy: Any,
    pairs: list[TokenizedPair],
    pad_id: int,
    ctx: LoopContext,
    device: torch.device,
) -> Tensor:
    batch = max(spec.hyperparameters.batch_size, 8)
    if spec.reference_model is None or spec.reference_model == spec.model:
        return all_pair_logps(policy, pairs, pad_id, batch, device)
    reference, _ = load_causal_lm(ctx.resolve_model(spec.reference_model))
    logps = all_pair_logps(reference.to(device), pairs, pad_id, batch, device)
    del reference  # the reference is needed only for this pass
    return logps


def run_dpo(spec: DpoSpec, rows: list[dict[str, Any]], reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the preference loss ``spec.hyperparameters.loss_type`` on ``rows``."""
    hp = spec.hyperparameters
    gen = seed_everything(hp.seed)
    device = pick_device()
    model, tokenizer = load_causal_lm(ctx.resolve_model(spec.model))
    model.to(device)
    pad_id = tokenizer.pad_token_id

    pairs = [
        tokenize_pair(r, tokenizer, max_length=hp.max_length, max_prompt_length=hp.max_prompt_length)
        for r in rows
    ]
    ref = _reference_logps(spec, model, pairs, pad_id, ctx, device)  # (N, 2), fixed for the whole run
    reporter.event("info", f"training on {len(pairs)} pairs for {hp.max_steps} steps on {device.type}")

    loss_fn = PREFERENCE_LOSSES[hp.loss_type]
    params = PreferenceParams(beta=hp.beta, label_smoothing=hp.label_smoothing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    sampler = EpochSampler(len(pairs), hp.batch_size, gen)
    model.train()
    for step in range(1, hp.max_steps + 1):
        if reporter.should_stop():
            reporter.event("info", f"stopping at step {step}: cancel requested")
            return LoopResult(status="cancelled", output_path=None)
        t0 = time.perf_counter()
        idx = sampler.next_batch()
        batch = collate_pairs([pairs[i] for i in idx], pad_id)
        lr = warmup_constant_lr(step, base_lr=hp.learning_rate, warmup_steps=hp.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        logps = sequence_logps(model, batch, device)
        chosen, rejected = logps[: len(idx)], logps[len(idx) :]
        ref_batch = ref[idx].to(device)
        chosen_logratio, rejected_logratio = chosen - ref_batch[:, 0], rejected - ref_batch[:, 1]
        loss = loss_fn(chosen_logratio, rejected_logratio, params).mean()

        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
        optimizer.step()

        if step % hp.log_every == 0 or step == hp.max_steps:
            # .item() only here, at log interval: each one is a device sync point.
            stats = pair_stats(chosen_logratio, rejected_logratio, hp.beta)
            stats |= {
                "loss": loss.detach(),
                "grad_norm": grad_norm,
                "logps/chosen": chosen.detach().mean(),
                "logps/rejected": rejected.detach().mean(),
            }
            metrics = {k: float(v.item()) for k, v in stats.items()}
            metrics |= {"lr": lr, "perf/tokens_per_s": batch.n_tokens / (time.perf_counter() - t0)}
            reporter.log_metrics(step, metrics)

    final = evaluate(model, pairs, ref, pad_id, hp.beta, device, loss_fn, params)
    reporter.log_metrics(hp.max_steps, final)
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(ctx.output_dir)
    tokenizer.save_pretrained(ctx.output_dir)
    reporter.event("info", f"final model saved to {ctx.output_dir}")
    return LoopResult(status="succeeded", output_path=ctx.output_dir, final_metrics=final)


def evaluate(
    model: Any,
    pairs: list[TokenizedPair],
    ref: Tensor,
    pad_id: int,
    beta: float,
    device: torch.device,
    loss_fn: Any,
    params: PreferenceParams,
) -> dict[str, float]:
    """``final/*`` metrics over every training pair with the trained policy (no grad)."""
    logps = all_pair_logps(model, pairs, pad_id, 64, device)
    chosen_logratio, rejected_logratio = logps[:, 0] - ref[:, 0], logps[:, 1] - ref[:, 1]
    stats = pair_stats(chosen_logratio, rejected_logratio, beta)
    stats["loss"] = loss_fn(chosen_logratio, rejected_logratio, params).mean()
    return {f"final/{k}": float(v.item()) for k, v in stats.items()}
