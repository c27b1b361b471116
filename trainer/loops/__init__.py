"""One loop per run type (training, an ``eval``'s scoring or a ``merge``); ``LOOPS`` maps a spec's
``algorithm`` to its loop, run in the spec's precision (``in_precision``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, get_args

from trainer.loops.dpo import run_dpo
from trainer.loops.evaluate import run_eval
from trainer.loops.group_rl import run_group_rl
from trainer.loops.kto import run_kto
from trainer.loops.merge import run_merge
from trainer.loops.ppo import run_ppo
from trainer.loops.reward_model import run_reward_model
from trainer.loops.sft import run_sft
from trainer.loops.training_session import run_training_session
from trainer.models import pick_device
from trainer.precision import autocast, check_precision
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import GroupAlgorithm, PpoAlgorithm

Loop = Callable[[Any, RunData, Reporter, LoopContext], LoopResult]


def in_precision(loop: Loop) -> Loop:
    """``loop`` refused before it loads anything when this worker cannot give the spec's
    ``hyperparameters.precision``, else run with every forward pass under its autocast
    (trainer/precision.py); what the loop registered in ``ctx.cleanup`` is closed when it ends."""

    @functools.wraps(loop)
    def run(spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        precision = getattr(spec.hyperparameters, "precision", "fp32")  # a merge keeps its own dtype
        device = pick_device()
        check_precision(precision, device)
        with ctx.cleanup, autocast(precision, device):
            return loop(spec, data, reporter, ctx)

    return run


LOOPS: Mapping[str, Loop] = MappingProxyType(
    {
        name: in_precision(loop)
        for name, loop in (
            {
                "dpo": run_dpo,
                "orpo": run_dpo,
                "kto": run_kto,
                "sft": run_sft,
                "reward_model": run_reward_model,
            }
            | {"eval": run_eval, "merge": run_merge, "training_session": run_training_session}
            | dict.fromkeys(get_args(GroupAlgorithm), run_group_rl)
            | dict.fromkeys(get_args(PpoAlgorithm), run_ppo)
        ).items()
    }
)
