"""One training loop per run type; ``LOOPS`` maps a spec's ``algorithm`` to its loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from trainer.loops.dpo import run_dpo
from trainer.reporting import LoopContext, LoopResult, Reporter

Loop = Callable[[Any, list[dict[str, Any]], Reporter, LoopContext], LoopResult]

LOOPS: Mapping[str, Loop] = MappingProxyType({"dpo": run_dpo})
