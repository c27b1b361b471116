"""One training loop per run type; ``LOOPS`` maps a spec's ``algorithm`` to its loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, get_args

from trainer.loops.dpo import run_dpo
from trainer.loops.group_rl import run_group_rl
from trainer.loops.ppo import run_ppo
from trainer.loops.reward_model import run_reward_model
from trainer.loops.sft import run_sft
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import GroupAlgorithm, PpoAlgorithm

Loop = Callable[[Any, RunData, Reporter, LoopContext], LoopResult]

LOOPS: Mapping[str, Loop] = MappingProxyType(
    {"dpo": run_dpo, "sft": run_sft, "reward_model": run_reward_model}
    | dict.fromkeys(get_args(GroupAlgorithm), run_group_rl)
    | dict.fromkeys(get_args(PpoAlgorithm), run_ppo)
)
