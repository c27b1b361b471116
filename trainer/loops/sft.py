"""SFT run: supervised fine-tuning, next-token cross-entropy on completion tokens only.

Reads top to bottom: load -> tokenize -> steps (eval, checkpoints) -> final. The prompt is context, not
a target: its tokens (and padding) carry no loss, so the model learns to answer, not to write prompts.
The loss of a batch is the mean over all of its completion tokens (sum / count, as ``cross_entropy``
with ``ignore_index`` does), so a long answer weighs more than a short one, token for token. With
``packing`` the batch's sequences are packed into rows without padding (trainer/data/packing.py); the
sums, and so the loss, are the padded batch's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.completion_logps import check_packing, completion_logits, packed_completion_logits
from trainer.data.packing import PackedBatch, pack_sequences
from trainer.data.sft import SftBatch, TokenizedExample, collate_examples, tokenize_example
from trainer.distributed import share, sum_over_ranks
from trainer.loops.session import Final, TrainingSession, begin, eval_rows, load_policy, to_floats
from trainer.phases import Phase
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import SftSpec

EVAL_BATCH = 64  # examples per no-grad evaluation pass at most (never more than a training micro-batch)


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
    # Shift: position t predicts token t+1, so drop the last logit and the first id.
    return scored_sums(logits[:, :-1], input_ids[:, 1:], completion_mask[:, 1:])


def scored_sums(logits: Tensor, targets: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``completion_sums`` on aligned inputs (``logits[:, k]`` predicts ``targets[:, k]``), in the logits'
    dtype per token (no float32 copy of the logits) and summed in float32."""
    weight = mask.to(torch.float32)
    nll = -(token_logprobs(logits, targets).float() * weight).sum()
    hits = ((logits.argmax(-1) == targets).to(torch.float32) * weight).sum()
    return nll, hits, weight.sum()


def sft_loss(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the completion tokens of the batch; 0 if there are none."""
    nll, _, count = completion_sums(logits, input_ids, completion_mask)
    return nll / count.clamp(min=1)


Batch = SftBatch | PackedBatch


def collate(examples: list[TokenizedExample], pad_id: int, packing: int | None) -> Batch:
    """Padded rows (``collate_examples``), or with ``packing`` (a row capacity in tokens) packed rows
    (trainer/data/packing.py)."""
    if packing is None:
        return collate_examples(examples, pad_id)
    return pack_sequences([(e.prompt + e.completion, len(e.prompt)) for e in examples], packing, pad_id)


def scored_tokens(batch: Batch) -> int:
    """How many tokens of ``batch`` the loss reads."""
    if isinstance(batch, PackedBatch):
        return batch.n_scored
    return int(batch.completion_mask[:, 1:].sum())


def forward(model: Any, batch: Batch, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``completion_sums`` of one batch under ``model``, logits only where they predict a completion token
    (``completion_logits``, or ``packed_completion_logits`` for a packed batch)."""
    if isinstance(batch, PackedBatch):
        logits, targets, mask, _ = packed_completion_logits(model, batch, device)
        return scored_sums(logits, targets, mask)
    logits, targets, mask = completion_logits(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.completion_mask.to(device)
    )
    return scored_sums(logits, targets, mask)


@torch.no_grad()
def evaluate(
    model: Any,
    examples: list[TokenizedExample],
    pad_id: int,
    device: torch.device,
    prefix: str,
    progress: Phase | None = None,
    batch_size: int = EVAL_BATCH,
    packing: int | None = None,
) -> dict[str, float]:
    """``<prefix>/loss`` and ``<prefix>/token_accuracy`` over every completion token of ``examples``
    (``packing``: as ``collate``)."""
    was_training = model.training
    model.eval()
    nll, hits, count = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        b_nll, b_hits, b_count = forward(model, collate(chunk, pad_id, packing), device)
        nll, hits, count = nll + b_nll.cpu(), hits + b_hits.cpu(), count + b_count.cpu()
        if progress is not None:
            progress.advance(len(chunk))
    model.train(was_training)
    count = count.clamp(min=1)
    return to_floats({f"{prefix}/loss": nll / count, f"{prefix}/token_accuracy": hits / count})


def micro_losses(
    model: Any, parts: list[Batch], count: int, device: torch.device, sums: dict[str, Tensor]
) -> Iterator[Tensor]:
    """Each micro-batch's summed completion NLL over the whole batch's ``count`` tokens (their sum is the
    batch's mean NLL), one forward pass when asked; ``sums`` collects the detached NLL and hits."""
    for batch in parts:
        nll, hits, _ = forward(model, batch, device)
        sums["nll"] = sums.get("nll", 0) + nll.detach()
        sums["hits"] = sums.get("hits", 0) + hits
        yield nll / max(count, 1)


def run_sft(spec: SftSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Fine-tune ``spec.model`` on prompt/completion rows (loss on completion tokens only)."""
    hp, ranks = spec.hyperparameters, ctx.ranks
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    model, tokenizer = load_policy(start, hp)
    pad_id, device = tokenizer.pad_token_id, start.device

    with reporter.phase("tokenize", len(data.train) + len(data.validation)) as progress:

        def tokenize(rows: list[dict[str, Any]]) -> list[TokenizedExample]:
            out = []
            for r in rows:
                out.append(tokenize_example(r, tokenizer, max_length=hp.max_length))
                progress.advance()
            return out

        examples, val_examples = tokenize(data.train), tokenize(data.validation)
    held_out = [val_examples[i] for i in eval_rows(len(val_examples), hp.eval_max_rows, hp.seed)]
    final_rows = [examples[i] for i in eval_rows(len(examples), hp.eval_max_rows, hp.seed)]
    no_grad_batch = min(EVAL_BATCH, hp.micro_batch_size or hp.batch_size)
    packing = hp.max_length if hp.packing else None  # the row capacity of packed batches
    if hp.packing:
        check_packing(model, device)
    session = TrainingSession(start, hp, model, tokenizer, len(examples))
    if session.finished_before:
        return session.result
    reporter.event(
        "info",
        f"training on {len(examples)} examples ({len(val_examples)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )
    model.train()

    def final(progress: Phase) -> Final:  # training examples (up to eval_max_rows): did it learn the data?
        return Final(evaluate(model, final_rows, pad_id, device, "final", progress, no_grad_batch, packing))

    for _ in session.steps():
        t0 = time.perf_counter()
        # The global batch (the same on every rank), of which this rank trains its share.
        rows = [examples[i] for i in share(session.sampler.next_batch(), ranks)]
        parts = [collate(list(p), pad_id, packing) for p in session.micro_batches(rows)]
        mine = torch.tensor(sum(scored_tokens(b) for b in parts))
        count = int(sum_over_ranks(mine, ranks))  # the whole batch's loss tokens, over every rank
        sums: dict[str, Tensor] = {}
        grad_norm = session.update(micro_losses(model, parts, count, device, sums))
        loss = sum_over_ranks(sums["nll"], ranks) / max(count, 1)  # = sft_loss over the whole batch
        hits = sum_over_ranks(sums["hits"], ranks)
        n_tokens = int(sum_over_ranks(torch.tensor(sum(b.n_tokens for b in parts)), ranks))
        session.count_tokens(n_tokens)

        metrics: dict[str, float] = {}
        if session.log_due:
            stats = {"loss": loss, "token_accuracy": hits / max(count, 1), "grad_norm": grad_norm}
            metrics = session.train_metrics(stats, n_tokens, t0)
        metrics |= session.evaluate(
            held_out,
            lambda progress: evaluate(
                model, held_out, pad_id, device, "eval", progress, no_grad_batch, packing
            ),
        )
        session.end_step(metrics, final)
    return session.result
