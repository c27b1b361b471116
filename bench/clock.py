"""One clock for both sides of the rlrun-vs-TRL benches (bench/dpo_vs_trl.py, bench/grpo_vs_trl.py), so
"setup", "s/step", "cpu s/step" and "steady s/step" mean the same in every table: ``stamp`` readings,
``StepTimes`` (what a run's readings say), ``TimedReporter`` (rlrun's side) and ``trl_step_clock`` (TRL's
side); and ``loop_context``, where both run rlrun's loop. A sibling module (``python bench/x.py`` puts
bench/ first on sys.path); running it does nothing (``make bench`` runs every file in bench/). It imports
torch (through trainer.reporting): bench/common.py holds what the torch-free benches share."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from trainer.models import resolve_model
from trainer.reporting import LoopContext, MemoryReporter

WARMUP_STEPS = 5  # left out of the steady-state s/step


class Stamp(NamedTuple):
    wall: float  # time.perf_counter()
    cpu: float  # time.process_time(): this process's CPU time, all threads; less hurt by other load


def stamp() -> Stamp:
    return Stamp(time.perf_counter(), time.process_time())


@dataclass
class StepTimes:
    """Clock readings of one training run: its start, the end of its setup and the end of each step."""

    name: str
    start: Stamp
    setup_end: Stamp
    step_ends: list[Stamp]

    @property
    def steps(self) -> int:
        return len(self.step_ends)

    @property
    def setup_s(self) -> float:
        return self.setup_end.wall - self.start.wall

    @property
    def total_s(self) -> float:
        return self.step_ends[-1].wall - self.start.wall

    @property
    def per_step_s(self) -> float:
        return self.total_s / self.steps

    @property
    def cpu_per_step_s(self) -> float:
        return (self.step_ends[-1].cpu - self.start.cpu) / self.steps

    @property
    def steady_s(self) -> float:
        warm = min(WARMUP_STEPS, self.steps - 1)
        if warm == 0:
            return self.per_step_s
        return (self.step_ends[-1].wall - self.step_ends[warm - 1].wall) / (self.steps - warm)


def _never(message: str) -> bool:
    del message
    return False


@dataclass
class TimedReporter(MemoryReporter):
    """A MemoryReporter that also notes when setup ended and when each training step ended: a step is a
    ``log_metrics`` call holding ``step_key`` (a metric only a training step logs), setup ends at the
    first event whose message ``setup_ends`` says is the last before the step loop."""

    step_key: str = "loss"
    setup_ends: Callable[[str], bool] = _never
    setup_end: Stamp | None = None
    step_ends: dict[int, Stamp] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.step_key in metrics and step not in self.step_ends:
            self.step_ends[step] = stamp()
        super().log_metrics(step, metrics)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        if self.setup_end is None and self.setup_ends(message):
            self.setup_end = stamp()
        super().event(kind, message, data)


def loop_context(model_dir: Path, work: Path) -> LoopContext:
    """The context an rlrun loop runs in on the bench: models resolved from the tiny-model cache that
    ``model_dir`` sits in (or ``model_dir`` itself, its parent the model root), checkpoints under ``work``
    (only the final model is saved: checkpoint_every=0)."""
    cache = model_dir.parent.parent
    return LoopContext(
        cache_dir=cache,
        checkpoint_dir=work / "rlrun-checkpoints",
        resolve_model=lambda ref: resolve_model(
            ref, cache_dir=cache, run_output=lambda _ref: work, roots=[model_dir.parent]
        ),
    )


def trl_step_clock() -> Any:
    """A transformers ``TrainerCallback`` noting when the first step began (``first_begin``: the end of
    TRL's setup) and when each step ended (``ends``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.first_begin: Stamp | None = None
            self.ends: list[Stamp] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.first_begin is None:
                self.first_begin = stamp()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(stamp())

    return StepClock()
