"""SFT run: supervised fine-tuning, next-token cross-entropy on completion tokens only.

Reads top to bottom: load -> tokenize -> steps (eval, checkpoints) -> final. The prompt is context, not
a target: its tokens (and padding) carry no loss, so the model learns to answer, not to write prompts.
The loss of a batch is the mean over all of its completion tokens (sum / count, as ``cross_entropy``
with ``ignore_index`` does), so a long answer weighs more than a short one, token for token.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.checkpoints import Checkpointer, load_trainer_state
from trainer.loops.common import (
    EpochSampler,
    is_due,
    make_optimizer,
    pick_device,
    seed_everything,
    set_lr,
    stop_requested,
    to_floats,
    update_or_skip,
    warmup_constant_lr,
)
from trainer.loops.sft_data import SftBatch, TokenizedExample, collate_examples, tokenize_example
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import SftSpec


def completion_sums(
    logits: Tensor, input_ids: Tensor, completion_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Sums over the completion tokens of a batch: (negative log-likelihood, argmax hits, token count).

    Args:
        logits: (B, T, V) model output; position t predicts token t+1.
        input_ids: (B, T) the sequences (padding holds any valid id).
        completion_mask: (B, T) 1 on completion tokens, 0 on prompt and padding.

    Returns:
        Three scalars: ``-sum log p(x_t | x_<t)``, ``sum [argmax_t-1 == x_t]`` and the number of scored
        tokens, each over positions t >= 1 with ``completion_mask[:, t] == 1``.
    """
    logits, targets = logits[:, :-1].float(), input_ids[:, 1:]  # shift: drop the last logit, first id
    mask = completion_mask[:, 1:].to(logits.dtype)
    nll = -(token_logprobs(logits, targets) * mask).sum()
    hits = ((logits.argmax(-1) == targets).to(mask.dtype) * mask).sum()
    return nll, hits, mask.sum()


def sft_loss(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the completion tokens of the batch; 0 if there are none."""
    nll, _, count = completion_sums(logits, input_ids, completion_mask)
    return nll / count.clamp(min=1)


def forward(model: Any, batch: SftBatch, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``completion_sums`` of one batch under ``model``."""
    ids = batch.input_ids.to(device)
    logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device)).logits
    return completion_sums(logits, ids, batch.completion_mask.to(device))


@torch.no_grad()
def evaluate(
    model: Any, examples: list[TokenizedExample], pad_id: int, device: torch.device, prefix: str
) -> dict[str, float]:
    """``<prefix>/loss`` and ``<prefix>/token_accuracy`` over every completion token of ``examples``."""
    was_training = model.training
    model.eval()
    nll, hits, count = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for i in range(0, len(examples), 64):
        b_nll, b_hits, b_count = forward(model, collate_examples(examples[i : i + 64], pad_id), device)
        nll, hits, count = nll + b_nll.cpu(), hits + b_hits.cpu(), count + b_count.cpu()
    model.train(was_training)
    count = count.clamp(min=1)
    return to_floats({f"{prefix}/loss": nll / count, f"{prefix}/token_accuracy": hits / count})


def run_sft(spec: SftSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Fine-tune ``spec.model`` on prompt/completion rows (loss on completion tokens only)."""
    hp = spec.hyperparameters
    # Resolve before seeding: building a tiny preset on first use draws from torch's RNG.
    model_path = str(ctx.resume_from) if ctx.resume_from else ctx.resolve_model(spec.model)
    gen = seed_everything(hp.seed)
    device = pick_device()
    model, tokenizer = load_causal_lm(model_path)
    model.to(device)
    pad_id = tokenizer.pad_token_id

    def tokenize(rows: list[dict[str, Any]]) -> list[TokenizedExample]:
        return [tokenize_example(r, tokenizer, max_length=hp.max_length) for r in rows]

    examples, val_examples = tokenize(data.train), tokenize(data.validation)
    optimizer = make_optimizer(model, hp.lr, hp.weight_decay)
    sampler = EpochSampler(len(examples), hp.batch_size, gen)
    checkpointer = Checkpointer(
        ctx.checkpoint_dir,
        reporter,
        keep_last=hp.keep_last_checkpoints,
        best_metric=hp.best_metric,
        best_mode=hp.best_mode,
    )
    start = 0
    if ctx.resume_from is not None:
        start = load_trainer_state(ctx.resume_from, optimizer=optimizer, sampler=sampler).step
        reporter.event("info", f"resumed from checkpoint at step {start}")
    reporter.event(
        "info",
        f"training on {len(examples)} examples ({len(val_examples)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )

    if start >= hp.max_steps and ctx.resume_from is not None:  # the final checkpoint was already written
        return LoopResult(status="succeeded", output_path=ctx.resume_from)
    model.train()
    last_eval: dict[str, float] = {}

    def keep_work(s: int) -> object:  # a checkpoint of the steps done, when a cancel or pause stops us
        return checkpointer.save(
            s, model=model, tokenizer=tokenizer, optimizer=optimizer, sampler=sampler, metrics=last_eval
        )

    for step in range(start + 1, hp.max_steps + 1):
        if stop_requested(reporter, step, start, checkpointer.saved, keep_work):
            return LoopResult(status="cancelled", output_path=None)
        t0 = time.perf_counter()
        batch = collate_examples([examples[i] for i in sampler.next_batch()], pad_id)
        lr = warmup_constant_lr(step, base_lr=hp.lr, warmup_steps=hp.warmup_steps)
        set_lr(optimizer, lr)

        nll, hits, count = forward(model, batch, device)
        loss = nll / count.clamp(min=1)  # = sft_loss: mean over the batch's completion tokens
        grad_norm = update_or_skip(
            model,
            optimizer,
            loss,
            max_grad_norm=hp.max_grad_norm,
            step=step,
            on_nonfinite=hp.on_nonfinite,
            reporter=reporter,
        )

        metrics: dict[str, float] = {}
        if is_due(step, hp.log_every, hp.max_steps):
            stats = {
                "loss": loss.detach(),
                "token_accuracy": hits / count.clamp(min=1),
                "grad_norm": grad_norm,
            }
            metrics = to_floats(stats) | {
                "lr": lr,
                "perf/tokens_per_s": batch.n_tokens / (time.perf_counter() - t0),
            }
        if val_examples and is_due(step, hp.eval_every, hp.max_steps):
            last_eval = evaluate(model, val_examples, pad_id, device, "eval")
            metrics |= last_eval
        if metrics:
            reporter.log_metrics(step, metrics)
        if is_due(step, hp.checkpoint_every, hp.max_steps):
            final_step = step == hp.max_steps
            if final_step:  # every training example, with the trained model: did it learn the data?
                metrics = evaluate(model, examples, pad_id, device, "final")
                reporter.log_metrics(step, metrics)
            path = checkpointer.save(
                step,
                model=model,
                tokenizer=tokenizer,
                optimizer=optimizer,
                sampler=sampler,
                metrics=metrics | last_eval,
            )
            if final_step:
                reporter.event("info", f"final model saved to {path}")
                return LoopResult(status="succeeded", output_path=path, final_metrics=metrics)
    raise AssertionError("unreachable: the last step always returns")
