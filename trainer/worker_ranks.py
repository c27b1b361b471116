"""A run with ``resources.devices > 1``: the worker claims it as usual and starts its loop as that many
ranks (trainer/rank_launch.py), staying the run's lease holder while they train.

- Models are resolved here first (tiny presets built, ``run:`` references looked up), so the ranks never
  query the database for them; rank 0 alone writes to the database (metrics, events, checkpoints).
- Devices: one GPU per rank on a CUDA worker (the worker's visible GPUs, ``CUDA_VISIBLE_DEVICES``), CPU
  processes with gloo on a worker without CUDA; a run asking for more than the worker has fails at start,
  saying how many it sees.
- Stops: rank 0 reads cancel/pause at each step boundary and every rank stops there (a checkpoint of the
  work since the last one is kept). A long phase is not interrupted inside a rank; if the ranks are still
  running ``STOP_GRACE_SECONDS`` after the request, the worker ends them (nothing kept since the last
  checkpoint), as a stop inside a phase does in a one-process run.
- A rank that dies or raises ends all of them (``RankFailed``); the worker then puts the run back in the
  queue to resume from its last checkpoint, or fails it after ``max_attempts`` losses, the lost-worker path.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from api.models import Run
from trainer.distributed import Ranks
from trainer.hosts import HostPlace
from trainer.phases import RunStopped
from trainer.rank_launch import RankJob, RanksStopped, launch
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import AnyRunSpec

STOP_GRACE_SECONDS = 60.0


def check_devices(devices: int) -> None:
    """Refuse a run that asks for more devices than this worker has, saying how many it sees."""
    if torch.cuda.is_available():
        have = torch.cuda.device_count()
        kind = "GPU(s) (CUDA_VISIBLE_DEVICES)"
    else:
        have = os.cpu_count() or 1
        kind = "CPU cores (no CUDA: ranks are CPU processes on gloo)"
    if devices > have:
        raise ValueError(
            f"resources.devices is {devices} but this worker sees {have} {kind}: send the run to a queue "
            "whose workers have that many (docs/runs.md, multi-device runs)"
        )


def rank_context(
    models: dict[str, str], cache_dir: str, checkpoint_dir: str, resume_from: str | None, ranks: Ranks
) -> LoopContext:
    """A rank's loop context: the models the worker resolved, the run's folders, its rank."""

    def resolve(ref: str) -> str:
        if ref not in models:
            raise ValueError(f"model {ref!r} was not resolved before the ranks started")
        return models[ref]

    return LoopContext(
        cache_dir=Path(cache_dir),
        checkpoint_dir=Path(checkpoint_dir),
        resolve_model=resolve,
        resume_from=Path(resume_from) if resume_from else None,
        ranks=ranks,
    )


def rank_zero_result(reporter: Reporter, result: LoopResult) -> dict[str, Any]:
    """What rank 0 hands back to the worker, its metrics written (and its metric sinks closed) first."""
    flush = getattr(reporter, "flush", None)
    if callable(flush):
        flush()
    close_sinks = getattr(reporter, "close_sinks", None)
    if callable(close_sinks):
        close_sinks(result.status, str(result.output_path) if result.output_path else None)
    watch = getattr(reporter, "watch", None)
    if watch is not None:
        watch.close()
    return {
        "status": result.status,
        "output": str(result.output_path) if result.output_path else None,
        "final_metrics": result.final_metrics,
    }


class Throttle:
    """True at most once every ``seconds`` (the first call is): how the polls of the database or of a
    gathering that a launcher calls in its loop space their reads."""

    def __init__(self, seconds: float):
        self.seconds, self.last = seconds, float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


class StopPoll:
    """True once a cancel or pause has waited ``grace`` seconds for the ranks to stop by themselves."""

    def __init__(self, session_factory: Any, run_id: uuid.UUID, grace: float, every: float = 1.0):
        self.sf, self.run_id, self.grace, self.due = session_factory, run_id, grace, Throttle(every)
        self.asked_at: float | None = None

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.asked_at is None and self.due():
            with self.sf() as session:
                row = session.execute(
                    select(Run.cancel_requested, Run.pause_requested).where(Run.id == self.run_id)
                ).one()
            if row[0] or row[1]:
                self.asked_at = now
        return self.asked_at is not None and now - self.asked_at >= self.grace


def rank_job(spec: AnyRunSpec, data: RunData, ctx: LoopContext, reporter: Callable[[], Reporter]) -> RankJob:
    """What this host's ranks of ``spec`` run, after checking the host has the devices and resolving the
    run's models here (so the ranks never query the database for them). Rank 0 builds its reporter with
    ``reporter`` (picklable: it travels to the rank's process; the worker's database reporter,
    ``trainer.worker.rank_zero_reporter``). Raises ``ValueError`` for a host with too few devices, and what
    resolving a model raises."""
    check_devices(spec.resources.devices)
    # Every model reference of the spec (``model_refs`` holds reference_model and reward models too).
    models = {ref: ctx.resolve_model(ref) for ref in {spec.model, *spec.model_refs.values()}}
    return RankJob(
        spec=spec.model_dump(mode="json"),
        data=data,
        context=functools.partial(
            rank_context,
            models,
            str(ctx.cache_dir),
            str(ctx.checkpoint_dir),
            str(ctx.resume_from) if ctx.resume_from else None,
        ),
        reporter=reporter,
        collect=rank_zero_result,
        sharding=spec.resources.sharding,
    )


def train_on_ranks(
    job: RankJob, devices: int, *, poll: Callable[[], bool], place: HostPlace | None = None
) -> LoopResult | None:
    """Run ``job`` on ``devices`` ranks of this host (at ``place`` among the run's hosts, trainer/hosts.py);
    the loop's result as rank 0 saw it (None on a host without rank 0). ``poll`` returning True ends the
    ranks (``StopPoll``: a stop the ranks did not honour in time), which raises ``RunStopped``; a lost rank
    raises ``RankFailed``."""
    try:
        out = launch(job, devices, poll=poll, place=place)
    except RanksStopped as exc:
        raise RunStopped(str(exc)) from exc
    if out is None:  # a host without rank 0
        return None
    output = out["output"]
    return LoopResult(
        status=out["status"], output_path=Path(output) if output else None, final_metrics=out["final_metrics"]
    )


def run_on_ranks(
    spec: AnyRunSpec,
    data: RunData,
    ctx: LoopContext,
    *,
    reporter: Callable[[], Reporter],
    poll: Callable[[], bool],
) -> LoopResult:
    """Train ``spec`` on ``spec.resources.devices`` ranks of this worker's host (``rank_job``, then
    ``train_on_ranks``); the loop's result as rank 0 saw it."""
    result = train_on_ranks(rank_job(spec, data, ctx, reporter), spec.resources.devices, poll=poll)
    assert result is not None  # one host: rank 0 is here
    return result
