"""The one way out of a training loop: metrics, events, checkpoints and the stop flag (minGPT callbacks,
typed), plus what a loop is given: its data and its context."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from trainer.phases import Counter, Phase, RunStopped
from trainer.ranks import Ranks


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message`` (that line cut at ``limit`` characters): a failure as a run's
    error or warning shows it."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit]}" if text else type(exc).__name__


class Reporter(Protocol):
    """What a loop may tell the outside world, and the one thing it asks."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record metric values at ``step`` (buffered; the implementation decides when to write)."""

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        """Record something a user should see in the run's events (warnings, milestones)."""

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]) -> None:
        """A complete checkpoint for ``step`` now exists at ``path``."""

    def checkpoint_removed(self, step: int) -> None:
        """Retention deleted the checkpoint of ``step``."""

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Store a few completions with their rewards (prompt, completion, reward, components, ...)."""

    def should_stop(self) -> bool:
        """True once the run was cancelled; loops check it every step."""

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]:
        """Open a long phase (``trainer/phases.py``): its progress is shown, and a stop asked for while it
        runs ends it by raising ``RunStopped`` out of it."""

    def warn(self, code: str, step: int, message: str) -> None:
        """The run's health checks flagged ``code`` at ``step`` (kept with the run, once per code)."""

    def agent_gateway(self, address: Mapping[str, str] | None) -> None:
        """Where the run's agent gateway listens (``{"url", "token"}``, trainer/rollout/agent_gateway.py),
        for the API to proxy agents to; None: it closed."""


@dataclass(frozen=True)
class RunData:
    """Normalised dataset rows: training and (possibly empty) validation."""

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LoopContext:
    """Where a loop reads models from and writes its outputs to."""

    cache_dir: Path
    checkpoint_dir: Path  # checkpoints go to <checkpoint_dir>/step-<N>/; the last one is the final model
    resolve_model: Callable[[str], str]  # model reference -> a path or hub id for from_pretrained
    resume_from: Path | None = None  # a checkpoint folder of this run to continue from
    ranks: Ranks = field(default_factory=Ranks)  # this process's rank in a multi-rank run (trainer/ranks.py)
    # What a loop starts and must stop whatever way it ends (an engine process): closed by the wrapper every
    # loop in trainer.loops.LOOPS runs in, after the loop returns or raises.
    cleanup: ExitStack = field(default_factory=ExitStack)


class LeaseLost(RuntimeError):
    """Another worker owns the run now (our lease expired and it was re-claimed)."""


@dataclass
class LoopResult:
    status: Literal["succeeded", "cancelled"]
    output_path: Path | None
    final_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class MemoryReporter:
    """Keeps everything in lists (tests); ``stop_after`` simulates a cancel after N should_stop calls,
    ``stop_in_phase`` a stop that lands the first time that phase opens."""

    stop_after: int | None = None
    stop_in_phase: str | None = None
    phases: list[Counter] = field(default_factory=list)
    warnings: list[tuple[str, int, str]] = field(default_factory=list)
    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    events: list[tuple[str, str, dict[str, Any] | None]] = field(default_factory=list)
    checkpoints: dict[int, Path] = field(default_factory=dict)
    samples: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    checks: int = 0
    gateway: dict[str, str] | None = None

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.extend((step, k, float(v)) for k, v in metrics.items())

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((kind, message, data))

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]) -> None:
        self.checkpoints[step] = path

    def checkpoint_removed(self, step: int) -> None:
        del self.checkpoints[step]

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self.samples.extend((step, s) for s in samples)

    def should_stop(self) -> bool:
        self.checks += 1
        return self.stop_after is not None and self.checks > self.stop_after

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]:
        counter = Counter(name, total)
        self.phases.append(counter)
        return _MemoryPhase(counter, stop=name == self.stop_in_phase)

    def agent_gateway(self, address: Mapping[str, str] | None) -> None:
        self.gateway = dict(address) if address is not None else None

    def warn(self, code: str, step: int, message: str) -> None:
        if all(code != c for c, _, _ in self.warnings):
            self.warnings.append((code, step, message))
            self.events.append(("warning", message, {"code": code, "step": step}))

    def series(self, key: str) -> list[float]:
        return [v for _, k, v in self.metrics if k == key]


class _MemoryPhase(AbstractContextManager[Counter]):
    def __init__(self, counter: Counter, *, stop: bool):
        self.counter, self.stop = counter, stop

    def __enter__(self) -> Counter:
        if self.stop:
            raise RunStopped(f"stop requested during {self.counter.name}")
        return self.counter

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None
