"""KTO run: a policy trained on unpaired answers marked desirable or undesirable (Ethayarajh et al. 2024).

Reads top to bottom: load -> tokenize -> steps (reference and KL estimate, eval, checkpoints) -> final.
Each step takes a batch of (prompt, answer, label) examples and, for the KL reference point z_0, the same
prompts with the next example's answer (example ``i`` with answer ``(i + 1) mod B``: a mismatched pair, as
TRL's KTOTrainer builds them; never an example with its own answer, see ``mismatched``). The reference
model (the starting policy, kept as a frozen copy, or ``reference_model``; with an adapter, the policy with
its adapter off) scores both; the policy scores the mismatched pairs without gradient (z_0 is detached, as
the paper says) and the examples with it. The loss
is ``kto`` (trainer/algorithms/preference_losses.py) averaged over the batch's examples.

The reference log-prob of each example is computed the first time a step uses it and kept for the rest of
the run (a frozen model gives the same value every epoch); the mismatched pairs change with every batch, so
theirs are computed per step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import adapter_off, has_adapter
from trainer.algorithms.preference_losses import KtoParams, kto, kto_reference_point
from trainer.completion_logps import completion_logp_sums
from trainer.data.sft import TokenizedExample, collate_examples, tokenize_example
from trainer.distributed import ONE, Ranks, is_sharded, share, sum_over_ranks, unwrap
from trainer.loops.reference import Reference
from trainer.loops.session import Final, TrainingSession, begin, eval_rows, load_policy, to_floats
from trainer.phases import Phase
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import KtoSpec

NO_GRAD_BATCH = 64  # examples per no-grad pass at most


def answer_logps(
    model: Any, examples: Sequence[TokenizedExample], pad_id: int, device: torch.device
) -> Tensor:
    """(B,) ``log pi(answer | prompt)`` summed over each example's answer tokens, one padded pass."""
    batch = collate_examples(list(examples), pad_id)
    return completion_logp_sums(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.completion_mask.to(device)
    )


@torch.no_grad()
def no_grad_logps(
    model: Any, examples: Sequence[TokenizedExample], pad_id: int, device: torch.device, adapter: bool = False
) -> Tensor:
    """``answer_logps`` in chunks without gradient; ``adapter``: with the model's adapter switched off
    (the reference of an adapter run)."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(examples), NO_GRAD_BATCH):
            chunk = examples[i : i + NO_GRAD_BATCH]
            if adapter:
                with adapter_off(unwrap(model)):
                    out.append(answer_logps(model, chunk, pad_id, device))
            else:
                out.append(answer_logps(model, chunk, pad_id, device))
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, device=device)


def mismatched(
    examples: Sequence[TokenizedExample], max_length: int, spare: Sequence[TokenizedExample] = ()
) -> list[TokenizedExample]:
    """Each example's prompt with the answer of the next *other* example of the set (the last wrapping
    to the first), cut to ``max_length``: the pairs z_0 is estimated on.

    "Other" is another example, not another position: a batch that holds one example twice (an epoch's
    end meeting the next one's start) skips the repeat. A set of one example (a held-out set of one row)
    takes the answer of the first example of ``spare`` that is not itself (the run passes its training
    examples). With no other example anywhere it raises: z_0 would be the example's own log-ratio, which
    the loss then cancels (KTO's estimate needs answers written for other prompts; TRL refuses a batch
    of one)."""
    n = len(examples)
    out = []
    for i, e in enumerate(examples):
        other = next((examples[(i + k) % n] for k in range(1, n) if examples[(i + k) % n] is not e), None)
        if other is None:
            other = next((x for x in spare if x is not e), None)
        if other is None:
            raise ValueError(
                "KTO's reference point needs at least 2 different examples (each prompt is paired with "
                "another example's answer); this run has 1"
            )
        answer = other.completion
        out.append(TokenizedExample(prompt=e.prompt, completion=answer[: max(1, max_length - len(e.prompt))]))
    return out


def kto_stats(logratio: Tensor, desirable: Tensor, beta: float) -> dict[str, Tensor]:
    """Implicit rewards ``beta * r`` of the desirable and undesirable answers (those present)."""
    out: dict[str, Tensor] = {}
    rewards = beta * logratio.detach()
    if bool(desirable.any()):
        out["rewards/chosen"] = rewards[desirable].mean()
    if bool((~desirable).any()):
        out["rewards/rejected"] = rewards[~desirable].mean()
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margin"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def run_kto(spec: KtoSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the KTO loss on an ``unpaired`` dataset."""
    hp, ranks = spec.hyperparameters, ctx.ranks
    same_reference = spec.reference_model is None or spec.reference_model == spec.model
    ref_path = ctx.resolve_model(spec.reference_model or spec.model)  # before seeding, as ``begin`` says
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    model, tokenizer = load_policy(start, hp)
    pad_id, device = tokenizer.pad_token_id, start.device
    params = KtoParams(hp.beta, hp.desirable_weight, hp.undesirable_weight)

    with reporter.phase("tokenize", len(data.train) + len(data.validation)) as progress:

        def tokenize(rows: list[dict[str, Any]]) -> tuple[list[TokenizedExample], Tensor]:
            out = []
            for r in rows:
                example = tokenize_example(r, tokenizer, max_length=hp.max_length)
                prompt = example.prompt[-hp.max_prompt_length :]
                out.append(TokenizedExample(prompt=prompt, completion=example.completion))
                progress.advance()
            return out, torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)

        (examples, labels), (val_examples, val_labels) = tokenize(data.train), tokenize(data.validation)
    session = TrainingSession(start, hp, model, tokenizer, len(examples))
    if session.finished_before:
        return session.result

    adapter_reference = same_reference and has_adapter(unwrap(model))
    reference = Reference(ref_path, reporter, device, dtype=frozen_dtype(hp.precision, device))
    if adapter_reference:
        reference.model = model
    elif not session.resumed and same_reference and not is_sharded(model):
        reference.model = copy.deepcopy(unwrap(model)).to(reference.dtype).eval().requires_grad_(False)

    def reference_logps(rows: Sequence[TokenizedExample]) -> Tensor:
        return no_grad_logps(reference.get(), rows, pad_id, device, adapter=adapter_reference)

    kept_reference = torch.zeros(len(examples))  # training examples' reference log-probs, once known
    known = torch.zeros(len(examples), dtype=torch.bool)

    def example_reference_logps(idx: Sequence[int]) -> Tensor:
        """Reference log-probs of training examples ``idx``, computing only those not known yet."""
        missing = [i for i in dict.fromkeys(idx) if not known[i]]
        if missing:
            kept_reference[missing] = reference_logps([examples[i] for i in missing]).float().cpu()
            known[missing] = True
        return kept_reference[list(idx)].to(device)

    def losses(idx: Sequence[int], z0: Tensor) -> tuple[Tensor, Tensor]:
        """(B,) KTO losses of training examples ``idx`` (with gradient) and their log-ratios (detached)."""
        policy = answer_logps(model, [examples[i] for i in idx], pad_id, device)
        logratio = policy - example_reference_logps(idx).to(policy.dtype)
        return kto(logratio, labels[list(idx)].to(device), z0, params), logratio.detach()

    def reference_point(rows: Sequence[TokenizedExample], ranks: Ranks) -> Tensor:
        """``kto_reference_point`` over every rank's mismatched pairs (each rank pairs within its share;
        a set of one example borrows a training example's answer)."""
        pairs = mismatched(rows, hp.max_length, spare=examples[:2])
        policy, ref = no_grad_logps(model, pairs, pad_id, device), reference_logps(pairs)
        if not ranks.active:
            return kto_reference_point(policy, ref)
        total = sum_over_ranks((policy - ref).sum(), ranks)
        count = sum_over_ranks(torch.tensor(float(len(pairs)), device=policy.device), ranks)
        return (total / count.clamp(min=1)).clamp(min=0).detach()

    def evaluate(
        rows: Sequence[TokenizedExample], desirable: Tensor, prefix: str, progress: Phase | None
    ) -> dict[str, float]:
        if not rows:
            return {}
        z0 = reference_point(rows, ONE)
        with torch.no_grad():
            logratio = no_grad_logps(model, rows, pad_id, device) - reference_logps(rows)
        loss = kto(logratio, desirable.to(device), z0, params).mean()
        if progress is not None:
            progress.advance(len(rows))
        stats = {"loss": loss, "kl": z0} | kto_stats(logratio, desirable.to(device), hp.beta)
        return {f"{prefix}/{k}": v for k, v in to_floats(stats).items()}

    def micro_losses(
        idx: list[int], z0: Tensor, total: int, out: dict[str, list[Tensor]]
    ) -> Iterator[Tensor]:
        """Each micro-batch's summed KTO loss over the whole batch's ``total`` examples (their sum is the
        batch's mean), one forward pass when asked; ``out`` collects the losses and log-ratios."""
        for part in session.micro_batches(list(range(len(idx)))):
            per_example, logratio = losses([idx[k] for k in part], z0)
            out.setdefault("loss", []).append(per_example.detach().sum())
            out.setdefault("logratio", []).append(logratio)
            yield per_example.sum() / total

    val_idx = eval_rows(len(val_examples), hp.eval_max_rows, hp.seed)
    final_idx = eval_rows(len(examples), hp.eval_max_rows, hp.seed)
    held_out = [val_examples[i] for i in val_idx]
    held_labels = val_labels[val_idx] if val_idx else torch.zeros(0, dtype=torch.bool)
    desirable_count = int(labels.sum())
    reporter.event(
        "info",
        f"training on {len(examples)} answers ({desirable_count} desirable, "
        f"{len(examples) - desirable_count} undesirable; {len(val_examples)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )
    model.train()

    def final(progress: Phase) -> Final:
        return Final(evaluate([examples[i] for i in final_idx], labels[final_idx], "final", progress))

    for _ in session.steps():
        t0 = time.perf_counter()
        idx = session.sampler.next_batch()
        mine = share(idx, ranks)
        rows = [examples[i] for i in mine]
        desirable = labels[mine]
        z0 = reference_point(rows, ranks)
        out: dict[str, list[Tensor]] = {}
        grad_norm = session.update(micro_losses(list(mine), z0, len(idx), out))
        loss = sum_over_ranks(torch.stack(out["loss"]).sum(), ranks) / len(idx)
        n_tokens = int(
            sum_over_ranks(torch.tensor(sum(len(r.prompt) + len(r.completion) for r in rows)), ranks)
        )
        session.count_tokens(n_tokens)

        metrics: dict[str, float] = {}
        if session.log_due:
            logratio = torch.cat(out["logratio"])
            stats = {"loss": loss, "kl": z0, "grad_norm": grad_norm}
            stats |= kto_stats(logratio, desirable.to(logratio.device), hp.beta)
            metrics = session.train_metrics(stats, n_tokens, t0)
        metrics |= session.evaluate(
            held_out, lambda progress: evaluate(held_out, held_labels, "eval", progress)
        )
        session.end_step(metrics, final)
    return session.result
