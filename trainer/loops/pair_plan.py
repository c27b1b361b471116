"""How a preference-pair run's pairs go through its model: the layout the model can run (shared prompt and
packing checked on it first), the length groups its passes take, how many pairs a pass holds, how many
tokens of each answer are scored, and which pairs each evaluation reads. Built once, before step 1, by
``pair_plan``; the steps, the reference log-probs and the evaluations all read it.

The layouts themselves are trainer/data/pair_layout.py; the checks that refuse a layout a model cannot run,
trainer/completion_logps.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.completion_logps import SharedPromptUnsupported, check_packing, check_shared_prompt
from trainer.data.length_groups import CPU_PASS_OVERHEAD, GPU_PASS_OVERHEAD, PaddingCost, attention_span_of
from trainer.data.pair_layout import PairCollate, PairGrouping, pair_collate, pair_tokens
from trainer.data.preference import TokenizedPair
from trainer.distributed import Ranks, unwrap
from trainer.loops.session import eval_rows
from trainer.reporting import Reporter
from trainer.specs import DpoHyperparameters, OrpoHyperparameters

# Pairs per no-grad pass (reference log-probs, evaluation) at most; never more than a training
# (micro-)batch, so these passes never need more activation memory than a step.
REFERENCE_BATCH = 16


@dataclass(frozen=True)
class PairPlan:
    """The passes of a pair run (see the module): ``collate`` lays a group of pairs out, ``grouping`` cuts
    pairs into groups of at most ``max_rows`` (a training pass) or ``no_grad_batch`` (reference log-probs,
    evaluation), ``equal_passes`` when the ranks must run as many passes as each other. ``tokens`` and
    ``val_tokens`` are the (N, 2) scored-token counts of the training and validation pairs (``pair_tokens``);
    ``val_idx`` the validation pairs an evaluation reads, ``final_idx`` the training pairs the final one
    reads."""

    collate: PairCollate
    grouping: PairGrouping
    max_rows: int
    no_grad_batch: int
    equal_passes: bool
    tokens: Tensor
    val_tokens: Tensor
    val_idx: list[int]
    final_idx: list[int]


def pair_grouping(model: Any, device: torch.device, packing: bool, shared_prompt: bool) -> PairGrouping:
    """The grouping of a run's layout on ``device``: a pass's fixed cost measured on CPU (a guess on GPU),
    attention's cost from the model's shape. A padded pair is two rows (chosen, rejected): half the
    overhead per row keeps ``cost.of(rows, L)`` the cost of that many pairs."""
    if packing:
        return PairGrouping(None)
    config = unwrap(model).config
    config = getattr(config, "get_text_config", lambda: config)()
    n_parameters = sum(p.numel() for p in unwrap(model).parameters())
    span = attention_span_of(n_parameters, config.hidden_size, config.num_hidden_layers)
    overhead = GPU_PASS_OVERHEAD if device.type == "cuda" else CPU_PASS_OVERHEAD
    return PairGrouping(PaddingCost(overhead if shared_prompt else overhead / 2, span), shared_prompt)


def pair_plan(
    model: Any,
    device: torch.device,
    pad_id: int,
    hp: DpoHyperparameters | OrpoHyperparameters,
    pairs: Sequence[TokenizedPair],
    val_pairs: Sequence[TokenizedPair],
    reporter: Reporter,
    ranks: Ranks,
) -> PairPlan:
    """The plan of a run with ``hp`` on ``model``: the shared-prompt layout when asked and the model follows
    its mask (else the padded one, with a warning), packed rows when asked (refused for a model that cannot
    run them); pairs in groups of similar length (trainer/data/length_groups.py: the same losses and
    gradients, less padding), ranks whose pairs differ running as many passes as each other."""
    shared_prompt = hp.shared_prompt and not hp.packing
    if shared_prompt:
        try:
            check_shared_prompt(model, device)
        except SharedPromptUnsupported as exc:
            shared_prompt = False
            reporter.event("warning", f"{exc}; using the padded layout (the same values, slower)")
    collate = pair_collate(pad_id, hp.max_length if hp.packing else None, shared_prompt)
    if hp.packing:
        check_packing(model, device)
    max_rows = hp.micro_batch_size or hp.batch_size
    return PairPlan(
        collate=collate,
        grouping=pair_grouping(model, device, bool(hp.packing), shared_prompt),
        max_rows=max_rows,
        no_grad_batch=min(REFERENCE_BATCH, max_rows),
        equal_passes=ranks.active,
        tokens=pair_tokens(pairs),
        val_tokens=pair_tokens(val_pairs),
        val_idx=eval_rows(len(val_pairs), hp.eval_max_rows, hp.seed),
        final_idx=eval_rows(len(pairs), hp.eval_max_rows, hp.seed),
    )
