"""The Celery worker: a thin task that claims a run in the DB and runs its loop.

The broker only carries run ids; the DB decides ownership. ``claim_run`` is one atomic UPDATE, so a
second delivery of the same id (acks_late redelivery, a re-sent id) finds nothing to claim and returns.
Everything a run produces goes through ``DbReporter`` in short transactions; no session is held open
across training steps.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery
from sqlalchemy import delete, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api import lifecycle
from api.db import make_engine, make_session_factory
from api.metric_store import write_points
from api.models import Checkpoint, Run, RunSample, utcnow
from api.queue import JOIN_TASK_NAME, TASK_NAME, CeleryEnqueue, make_celery
from api.services.datasets import load_rows
from api.services.pipelines import advance
from api.settings import Settings, get_settings
from trainer.metric_sinks import Point, RunIdentity, make_sink
from trainer.phases import Phase, RunStopped
from trainer.reporting import LeaseLost, LoopContext, LoopResult, Reporter, RunData, one_line
from trainer.sink_mirror import SinkMirror
from trainer.specs import (
    AnyRunSpec,
    EvalSpec,
    MergeSpec,
    TrainingSessionSpec,
    parse_run_ref,
    parse_run_ref_step,
    parse_spec,
    without_nul,
)
from trainer.specs.sinks import MetricSinkSpec
from trainer.stop_watch import StopWatch

log = logging.getLogger("rlrun.worker")
SessionFactory = sessionmaker[Session]
T = TypeVar("T")
# How long a transaction is retried while SQLite is busy. Each try already waits out the connection's busy
# timeout (30 s, api/db.py), so this only matters when the lock is held longer than that: by 200 readers
# queueing for it, say. A finish that cannot be recorded loses the run's outcome, so it waits longest.
BUSY_RETRY_SECONDS = 120.0
FINISH_RETRY_SECONDS = 600.0


def is_busy(exc: BaseException) -> bool:
    """SQLite's "database is locked" (SQLITE_BUSY): another connection holds the write lock."""
    text = str(getattr(exc, "orig", exc)).lower()
    return isinstance(exc, OperationalError) and ("database is locked" in text or "database is busy" in text)


def retry_busy(what: str, fn: Callable[[], T], *, seconds: float = BUSY_RETRY_SECONDS) -> T:
    """``fn()`` (one whole short transaction), tried again with a growing pause (50 ms doubling to 1 s)
    while SQLite answers "database is locked", for up to ``seconds``; any other error raises at once.

    A lock held for a while (readers queueing for it, a long write) is not a training failure: a stop
    check or a metrics flush that dies on it would fail the run, and then fail to record why.
    """
    delay, deadline = 0.05, time.monotonic() + seconds
    while True:
        try:
            return fn()
        except OperationalError as exc:
            if not is_busy(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: database is locked; trying again in %.2f s", what, delay)
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def claim_run(session_factory: SessionFactory, run_id: uuid.UUID, worker_id: str, lease_seconds: int) -> bool:
    """Atomically take ``run_id`` if it is queued or its lease expired (``api.lifecycle.claim``). True if
    this worker now owns it."""

    def claim() -> bool:  # the time is taken at each try: a wait on a busy database must not age the lease
        with session_factory.begin() as session:
            return lifecycle.claim(session, run_id, worker_id, lease_seconds=lease_seconds, now=utcnow())

    claimed = retry_busy(f"run {run_id}: claim", claim)
    if claimed:
        log.info("run %s claimed by %s", run_id, worker_id)
    return claimed


def _updated(session: Session, stmt: Any) -> int:
    """Rows matched by an UPDATE (its rowcount)."""
    return int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]


def extend_lease(
    session: Session, run_id: uuid.UUID, worker_id: str, lease_seconds: int, *, step: int | None = None
) -> bool:
    """Extend the lease (and record ``step``) if ``worker_id`` still holds the running run."""
    values: dict[str, Any] = {"lease_expires_at": utcnow() + timedelta(seconds=lease_seconds)}
    if step is not None:
        values["step"] = step
    stmt = (
        update(Run)
        .where(Run.id == run_id, Run.worker_id == worker_id, Run.status == "running")
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return _updated(session, stmt) == 1


class DbReporter:
    """Buffers metrics and writes them in batches; heartbeats the lease; reads the cancel flag.

    Every write is tried again while SQLite is busy (``retry_busy``); the stop check gives up after
    ``stop_check_seconds`` and answers "not yet"."""

    stop_check_seconds = 30.0

    def __init__(
        self,
        session_factory: SessionFactory,
        run_id: uuid.UUID,
        worker_id: str,
        lease_seconds: int,
        flush_seconds: float = 1.0,
        flush_rows: int = 2000,
    ):
        self.sf, self.run_id, self.worker_id = session_factory, run_id, worker_id
        self.lease_seconds, self.flush_seconds, self.flush_rows = lease_seconds, flush_seconds, flush_rows
        self.buffer: dict[tuple[str, int], dict[str, Any]] = {}
        self.step = 0
        self.last_flush = time.monotonic()
        self.stopping = False  # the loop was told to stop: it is keeping its work, then returns
        self.watch = StopWatch(self.stop_interrupts, self.write_progress)
        self.progress_events: dict[str, float] = {}  # phase -> when its last progress event was written
        self.mirror: SinkMirror | None = None  # the run's metric sinks, fed after each flush

    def attach_sinks(self, run: RunIdentity, sinks: list[MetricSinkSpec]) -> None:
        """Mirror every flushed point, the latest checkpoint's path and the output path to ``sinks``
        (``trainer/sink_mirror.py``: a thread; a sink's failure is a warning of this run, never an error)."""
        if not sinks or self.mirror is not None:
            return
        self.mirror = SinkMirror(
            [make_sink(spec, run) for spec in sinks],
            self.warn,
            lambda message: self.event("info", message),
        )
        self.mirror.start()

    def close_sinks(self, status: str, output_path: str | None = None) -> None:
        """The run's end as the sinks record it (after a last try to send what is pending); idempotent."""
        mirror, self.mirror = self.mirror, None
        if mirror is None:
            return
        if output_path:
            mirror.tag("output_path", output_path)
        mirror.close(status)

    progress_event_seconds = 10.0

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]:
        """A long phase watched by ``self.watch`` (start it first): progress shown, stops land in it."""
        return self.watch.phase(name, total)

    def write_progress(self, state: tuple[str, int, int | None] | None) -> None:
        """The open phase on the run's row (None: none); a ``progress`` event when a phase first shows
        and every ``progress_event_seconds`` after. Runs in the watcher's thread."""
        name, done, total = state if state is not None else (None, None, None)

        def write() -> None:
            with self.sf.begin() as session:
                stmt = (
                    update(Run)
                    .where(Run.id == self.run_id, Run.worker_id == self.worker_id, Run.status == "running")
                    .values(phase=name, phase_done=done, phase_total=total)
                    .execution_options(synchronize_session=False)
                )
                if _updated(session, stmt) and name is not None and event_due:
                    of = f"/{total}" if total is not None else ""
                    lifecycle.add_event(
                        session,
                        self.run_id,
                        "progress",
                        f"{name} {done}{of}",
                        {"phase": name, "done": done, "total": total},
                    )

        now = time.monotonic()
        last_event = self.progress_events.get(name or "", -1e9)
        event_due = name is not None and now - last_event >= self.progress_event_seconds
        retry_busy(f"run {self.run_id}: progress", write, seconds=self.stop_check_seconds)
        if event_due and name is not None:
            self.progress_events[name] = now

    def agent_gateway(self, address: Mapping[str, str] | None) -> None:
        """The run's agent gateway address on its row (``runs.agent_gateway``), where the API finds it;
        None clears it. Written only while this worker holds the run."""
        value = dict(address) if address is not None else None

        def write() -> None:
            with self.sf.begin() as session:
                session.execute(
                    update(Run)
                    .where(Run.id == self.run_id, Run.worker_id == self.worker_id)
                    .values(agent_gateway=value)
                    .execution_options(synchronize_session=False)
                )

        retry_busy(f"run {self.run_id}: agent gateway", write)

    def warn(self, code: str, step: int, message: str) -> None:
        """Add ``{code, step, message}`` to the run's warnings (once per code: a resumed attempt that
        raises it again adds nothing) and a ``warning`` event."""

        def write() -> None:
            with self.sf.begin() as session:
                run = session.get(Run, self.run_id)
                if run is None or any(w.get("code") == code for w in run.warnings or []):
                    return
                run.warnings = [*(run.warnings or []), {"code": code, "step": step, "message": message}]
                run.warning_count = len(run.warnings)
                lifecycle.add_event(session, self.run_id, "warning", message, {"code": code, "step": step})

        retry_busy(f"run {self.run_id}: warning", write)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        now = utcnow()
        for key, value in metrics.items():
            if not math.isfinite(value):  # JSON has no NaN/inf; the step's event says what happened
                continue
            self.buffer[(key, step)] = {
                "run_id": self.run_id,
                "key": key,
                "step": step,
                "value": float(value),
                "logged_at": now,
            }
        self.step = max(self.step, step)
        if len(self.buffer) >= self.flush_rows or time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write buffered metrics, progress and a fresh lease in one short transaction (tried again while
        SQLite is busy; the buffer is kept until it commits)."""
        rows = list(self.buffer.values())

        def write() -> None:
            with self.sf.begin() as session:
                owned = extend_lease(session, self.run_id, self.worker_id, self.lease_seconds, step=self.step)
                if not owned:
                    raise LeaseLost(f"run {self.run_id} is no longer held by {self.worker_id}")
                write_points(session, rows)

        retry_busy(f"run {self.run_id}: metrics flush", write)
        self.buffer.clear()
        self.last_flush = time.monotonic()
        if self.mirror is not None:
            self.mirror.put(
                [Point(r["key"], r["step"], r["value"], r["logged_at"].timestamp()) for r in rows]
            )

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        def write() -> None:
            with self.sf.begin() as session:
                lifecycle.add_event(session, self.run_id, kind, message, data)

        retry_busy(f"run {self.run_id}: event", write)

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]) -> None:
        self.flush()  # metrics up to this step land before the checkpoint that refers to them

        def write() -> None:
            with self.sf.begin() as session:
                existing = session.get(Checkpoint, (self.run_id, step))
                if existing is not None:  # re-written by a resumed attempt
                    session.delete(existing)
                    session.flush()
                session.add(
                    Checkpoint(
                        run_id=self.run_id,
                        step=step,
                        path=str(path),
                        size_bytes=size_bytes,
                        metrics=dict(metrics),
                    )
                )
                lifecycle.add_event(
                    session,
                    self.run_id,
                    "checkpoint",
                    f"checkpoint at step {step}",
                    {"step": step, "size_bytes": size_bytes},
                )

        retry_busy(f"run {self.run_id}: checkpoint", write)
        if self.mirror is not None:
            self.mirror.tag("last_checkpoint", str(path))

    def checkpoint_removed(self, step: int) -> None:
        def write() -> None:
            with self.sf.begin() as session:
                session.execute(
                    delete(Checkpoint).where(Checkpoint.run_id == self.run_id, Checkpoint.step == step)
                )

        retry_busy(f"run {self.run_id}: checkpoint removal", write)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Store completions with their rewards. U+0000 (NUL) in the prompt, the completion or any string
        of the extra fields (keys included, at any depth) is stored as U+FFFD, the Unicode replacement
        character, on every backend: PostgreSQL text and JSON cannot hold NUL, and a sampled completion
        that contains one must not fail the run (SQLite could store it, but both backends read alike)."""
        rows = [
            {
                "run_id": self.run_id,
                "step": step,
                "prompt": without_nul(str(s["prompt"])),
                "completion": without_nul(str(s["completion"])),
                "reward": float(s["reward"]),
                "data": without_nul(
                    {k: v for k, v in s.items() if k not in ("prompt", "completion", "reward")}
                ),
            }
            for s in samples
        ]

        def write() -> None:
            with self.sf.begin() as session:
                session.add_all([RunSample(**row) for row in rows])

        retry_busy(f"run {self.run_id}: samples", write)

    def should_stop(self) -> bool:
        """The loop's question: whether a cancel or pause was asked for. Once it answers yes the loop stops
        on its own, keeping its work first (a checkpoint of the steps since the last one), so the phase
        watcher leaves the phases it opens meanwhile alone (``stop_interrupts``): it interrupted that very
        save when it took longer than the watcher's grace, and the run lost the steps it was keeping."""
        stop = self.stop_requested()
        self.stopping = self.stopping or stop
        return stop

    def stop_interrupts(self) -> bool:
        """The phase watcher's question: a stop the loop has not been told of yet."""
        return not self.stopping and self.stop_requested()

    def stop_requested(self) -> bool:
        """Whether the run's cancel or pause flag is set. While SQLite stays busy past the retries the
        answer is "not yet" (logged): the loop asks again next step, and training goes on meanwhile."""

        def read() -> bool:
            with self.sf() as session:
                row = session.execute(
                    select(Run.cancel_requested, Run.pause_requested).where(Run.id == self.run_id)
                ).one_or_none()
            return row is not None and bool(row[0] or row[1])

        try:
            return retry_busy(f"run {self.run_id}: stop check", read, seconds=self.stop_check_seconds)
        except OperationalError as exc:
            if not is_busy(exc):
                raise
            log.warning("run %s: stop check skipped, database still locked", self.run_id)
            return False


class LeaseKeeper(threading.Thread):
    """Renews the run's lease every ``lease_seconds / 3`` while the loop works, so a long step, model
    loading or a slow first rollout never looks like a dead worker. It dies with the process: a killed
    worker stops renewing and the reconciler requeues the run when the lease expires."""

    def __init__(
        self, session_factory: SessionFactory, run_id: uuid.UUID, worker_id: str, lease_seconds: int
    ):
        super().__init__(name=f"lease-{run_id}", daemon=True)
        self.sf, self.run_id, self.worker_id, self.lease_seconds = (
            session_factory,
            run_id,
            worker_id,
            lease_seconds,
        )
        self.stopped = threading.Event()
        self.lost = False

    def renew(self) -> bool:
        """Extend the lease; False if the run is no longer ours."""
        with self.sf.begin() as session:
            return extend_lease(session, self.run_id, self.worker_id, self.lease_seconds)

    def renew_retrying(self) -> bool:
        """``renew``, tried again while SQLite is busy for up to one tick (the next tick tries anew)."""
        return retry_busy(f"run {self.run_id}: lease", self.renew, seconds=self.lease_seconds / 3)

    def run(self) -> None:
        while not self.stopped.wait(self.lease_seconds / 3):
            try:
                if not self.renew_retrying():
                    self.lost = True
                    return
            except Exception:  # noqa: BLE001 - try again next tick; the lease has slack for a few misses
                log.warning("run %s: lease renewal failed", self.run_id, exc_info=True)

    def stop(self) -> None:
        self.stopped.set()


def rank_zero_reporter(
    database_url: str,
    run_id: str,
    worker_id: str,
    lease_seconds: int,
    sinks: tuple[RunIdentity, list[MetricSinkSpec]] | None = None,
) -> Reporter:
    """Rank 0's reporter: the run's database reporter, its phases shown but never interrupted inside the
    rank (every rank must stop at the same point: step boundaries, or the worker ends them all). Rank 0
    logs the metrics, so it feeds the run's metric sinks (``sinks``), closed by ``rank_zero_result``."""
    factory = make_session_factory(make_engine(database_url))
    reporter = DbReporter(factory, uuid.UUID(run_id), worker_id, lease_seconds)
    reporter.watch = StopWatch(lambda: False, reporter.write_progress)
    reporter.watch.start()
    if sinks is not None:
        reporter.attach_sinks(*sinks)
    return reporter


def finish_run(
    session_factory: SessionFactory,
    run_id: uuid.UUID,
    worker_id: str,
    *,
    status: str,
    error: str | None = None,
    output_path: str | None = None,
    result: dict[str, float] | None = None,
) -> bool:
    """Set the final status if this worker still owns the run (``api.lifecycle.finish``); one event says
    what happened. Tried again for up to ``FINISH_RETRY_SECONDS`` while SQLite is busy: a run must be able
    to record its end."""

    def write() -> bool:
        with session_factory.begin() as session:
            return lifecycle.finish(
                session, run_id, worker_id, status=status, error=error, output_path=output_path, result=result
            )

    done = retry_busy(f"run {run_id}: finish", write, seconds=FINISH_RETRY_SECONDS)
    log.info("run %s %s%s", run_id, status, f": {error}" if error else "")
    return done


def model_path_of_run_ref(session_factory: SessionFactory, ref: str) -> Path:
    """``run:<id>`` -> the succeeded run's final model; ``run:<id>@<step>`` -> that checkpoint's folder."""
    run_id, step = parse_run_ref(ref), parse_run_ref_step(ref)
    if run_id is None:
        raise ValueError(f"not a run reference: {ref!r}")
    with session_factory() as session:
        if step is not None:
            ckpt = session.get(Checkpoint, (run_id, step))
            if ckpt is None:
                raise ValueError(f"run {run_id} has no checkpoint at step {step}")
            return Path(ckpt.path)
        run = session.get(Run, run_id)
    if run is None or run.status != "succeeded" or not run.output_path:
        raise ValueError(f"run {run_id} has no final model (it must have succeeded)")
    return Path(run.output_path)


def load_run_data(session: Session, spec: AnyRunSpec) -> RunData:
    """Training rows, and validation rows from the validation dataset or a seeded hold-out split (an eval
    reads every row as ``train``: it holds nothing out; a merge reads none)."""
    if isinstance(spec, MergeSpec | TrainingSessionSpec):
        return RunData(train=[])
    rows = load_rows(session=session, dataset_id=spec.dataset_id)
    if isinstance(spec, EvalSpec):
        return RunData(train=rows)
    if spec.validation_dataset_id is not None:
        return RunData(
            train=rows, validation=load_rows(session=session, dataset_id=spec.validation_dataset_id)
        )
    from trainer.data.sampling import split_validation  # torch: loaded with the first run (_execute_claimed)

    seed: int = spec.hyperparameters.seed
    train, validation = split_validation(rows, spec.validation_fraction, seed)
    return RunData(train=train, validation=validation)


def latest_checkpoint(session_factory: SessionFactory, run_id: uuid.UUID) -> Path | None:
    """The newest checkpoint folder of the run still on disk (what a re-claimed run resumes from)."""
    with session_factory() as session:
        rows = session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step.desc())
        )
        for ckpt in rows:
            if Path(ckpt.path, "trainer_state.pt").exists():
                return Path(ckpt.path)
    return None


def execute_run(
    run_id: uuid.UUID,
    *,
    session_factory: SessionFactory,
    settings: Settings,
    loops: Mapping[str, Any] | None = None,
    worker_id: str | None = None,
) -> str | None:
    """Claim and run one run to its end. Returns the final status, or None if it was not ours to run."""
    if loops is None:
        from trainer.loops import LOOPS

        loops = LOOPS
    worker_id = worker_id or default_worker_id()
    if not claim_run(session_factory, run_id, worker_id, settings.lease_seconds):
        log.info("run %s: nothing to claim (already taken or ended)", run_id)
        return None
    reporter = DbReporter(session_factory, run_id, worker_id, settings.lease_seconds)
    keeper = LeaseKeeper(session_factory, run_id, worker_id, settings.lease_seconds)
    keeper.start()
    reporter.watch.start()
    try:
        return _execute_claimed(run_id, session_factory, settings, loops, worker_id, reporter)
    finally:
        reporter.close_sinks("failed")  # a path that ended without closing them (closed ones: no-op)
        reporter.watch.close()
        keeper.stop()


def _execute_claimed(
    run_id: uuid.UUID,
    session_factory: SessionFactory,
    settings: Settings,
    loops: Mapping[str, Any],
    worker_id: str,
    reporter: DbReporter,
) -> str | None:
    # torch and transformers load with the first run, not when the worker starts: an idle worker is up in
    # about a second instead of five (a restart after a crash, or a `rlrun serve` with nothing to train)
    from trainer.hosts import HostsNotGathered
    from trainer.rank_launch import RankFailed
    from trainer.worker_hosts import lead_on_hosts
    from trainer.worker_ranks import STOP_GRACE_SECONDS, StopPoll, run_on_ranks

    try:
        with session_factory() as session:
            run = session.get(Run, run_id)
            assert run is not None
            spec = parse_spec(run.spec)  # re-validated: the stored JSON may predate this code
            data = load_run_data(session, spec)
            identity = RunIdentity(
                run.id, run.algorithm, dict(run.spec), settings.resolved_artifacts_dir / "runs" / str(run.id)
            )
        # null: the worker's default (RLRUN_METRIC_SINKS), where tracking servers and credentials are known
        chosen = settings.metric_sinks if spec.metric_sinks is None else spec.metric_sinks
        sinks = (identity, list(chosen)) if chosen else None
        ctx = run_context(
            settings,
            session_factory,
            settings.resolved_artifacts_dir / "runs" / str(run_id) / "checkpoints",
            latest_checkpoint(session_factory, run_id),
        )
        ranks_reporter = functools.partial(
            rank_zero_reporter,
            settings.resolved_database_url,
            str(run_id),
            worker_id,
            settings.lease_seconds,
            sinks,
        )
        if spec.resources.nodes > 1:  # several hosts, this one their leader and the lease holder
            result = lead_on_hosts(
                spec,
                data,
                ctx,
                reporter=ranks_reporter,
                events=reporter,
                session_factory=session_factory,
                settings=settings,
                run_id=run_id,
                worker_id=worker_id,
            )
        elif spec.resources.devices > 1:  # several ranks, this process their lease holder
            result = run_on_ranks(
                spec,
                data,
                ctx,
                reporter=ranks_reporter,
                poll=StopPoll(session_factory, run_id, STOP_GRACE_SECONDS),
            )
        else:
            if sinks is not None:
                reporter.attach_sinks(*sinks)
            result = loops[spec.algorithm](spec, data, reporter, ctx)
        reporter.flush()
    except RunStopped:  # a cancel or pause landed inside a long phase: nothing to keep since the last save
        reporter.event("info", "stopped during a long phase: cancel or pause requested")
        reporter.flush()
        result = LoopResult(status="cancelled", output_path=None)
    except LeaseLost as exc:
        log.warning("run %s: %s; stopping without touching it", run_id, exc)
        reporter.close_sinks("failed")
        return None
    except RankFailed as exc:  # the lost-worker path, at once: requeued to resume, or failed at last
        log.warning("run %s: %s", run_id, exc)
        return requeue_lost_rank(session_factory, settings, run_id, worker_id, str(exc))
    except HostsNotGathered as exc:  # nobody trained: gathered again from the queue
        log.warning("run %s: %s", run_id, exc)
        return requeue_ungathered(session_factory, settings, run_id, worker_id, str(exc))
    except Exception as exc:
        log.exception("run %s failed", run_id)
        try:
            reporter.flush()  # keep the metrics logged before the failure
        except Exception:  # noqa: BLE001 - the failure below is what matters
            log.warning("run %s: could not flush metrics after failure", run_id)
        reporter.close_sinks("failed")
        finish_run(session_factory, run_id, worker_id, status="failed", error=one_line(exc))
        advance_pipeline_of(run_id, session_factory, settings)
        return "failed"
    output = str(result.output_path) if result.output_path else None
    reporter.close_sinks(result.status, output)
    if result.status == "cancelled" and _pause_requested(session_factory, run_id):
        pause_claimed_run(session_factory, run_id, worker_id)
        return "paused"
    final = result.final_metrics if result.status == "succeeded" else None
    finish_run(session_factory, run_id, worker_id, status=result.status, output_path=output, result=final)
    advance_pipeline_of(run_id, session_factory, settings)
    status: str = result.status
    return status


def run_context(
    settings: Settings, session_factory: SessionFactory, checkpoint_dir: Path, resume_from: Path | None
) -> LoopContext:
    """A run's loop context on this worker: its models resolved with this worker's cache, model roots and
    the database's run outputs; checkpoints under ``checkpoint_dir``, resumed from ``resume_from``."""
    from trainer.models import resolve_model

    cache_dir = settings.resolved_cache_dir
    return LoopContext(
        cache_dir=cache_dir,
        checkpoint_dir=checkpoint_dir,
        resolve_model=lambda ref: resolve_model(
            ref,
            cache_dir=cache_dir,
            run_output=lambda r: model_path_of_run_ref(session_factory, r),
            roots=settings.resolved_model_roots,
            allow_hub=settings.allow_hub,
        ),
        resume_from=resume_from,
    )


def _send_again(session_factory: SessionFactory, settings: Settings, run_id: uuid.UUID, why: str) -> None:
    """Send a run this worker has just put back in the queue to the broker at once (the reconciler sends
    it otherwise)."""
    try:
        with session_factory.begin() as session:
            run = session.get_one(Run, run_id)
            run.enqueued_at = utcnow()
        with session_factory() as session:
            lifecycle.send_committed(
                session=session, enqueue=CeleryEnqueue(settings), runs=[session.get_one(Run, run_id)]
            )
    except Exception:  # noqa: BLE001 - queued in the DB: the reconciler sends it
        log.warning("run %s: could not send it again after %s", run_id, why, exc_info=True)


def requeue_ungathered(
    session_factory: SessionFactory, settings: Settings, run_id: uuid.UUID, worker_id: str, reason: str
) -> str | None:
    """A multi-host run's hosts did not all come: back in the queue (``lifecycle.release_ungathered``),
    sent to the broker at once, to be gathered again by whichever worker takes it (or cancelled or paused
    where that was asked meanwhile)."""

    def write() -> str | None:
        with session_factory.begin() as session:
            return lifecycle.release_ungathered(session, run_id, worker_id, reason)

    status = retry_busy(f"run {run_id}: ungathered", write, seconds=FINISH_RETRY_SECONDS)
    if status == "queued":
        _send_again(session_factory, settings, run_id, "its hosts did not gather")
    elif status == "cancelled":
        advance_pipeline_of(run_id, session_factory, settings)
    return status


def join_run(
    run_id: uuid.UUID,
    token: str,
    *,
    session_factory: SessionFactory,
    settings: Settings,
    worker_id: str | None = None,
) -> str:
    """This worker's part in another worker's multi-host run (trainer/worker_hosts.py): join the
    gathering ``token`` and train this host's ranks until the run ends. What became of it: ``stale`` (the
    run is no longer gathering as ``token``, or the gathering has all its hosts), ``done``,
    ``not_gathered``, ``left`` (the run left this gathering: its leader was lost, or it ended) or
    ``failed`` (this host could not train: the leader hears why and requeues the run)."""
    from trainer.hosts import HostsNotGathered
    from trainer.worker_hosts import current_rendezvous, join_hosts

    worker_id = worker_id or default_worker_id()
    gathering = current_rendezvous(session_factory, run_id)
    if gathering is None or gathering.get("token") != token:
        log.info("run %s: gathering %s is over; nothing to join", run_id, token)
        return "stale"
    with session_factory() as session:
        run = session.get_one(Run, run_id)
        spec = parse_spec(run.spec)
        data = load_run_data(session, spec)
    try:
        place = join_hosts(
            spec,
            data,
            functools.partial(run_context, settings, session_factory),
            session_factory=session_factory,
            settings=settings,
            run_id=run_id,
            gathering=gathering,
            worker_id=worker_id,
        )
    except HostsNotGathered as exc:
        log.warning("run %s: %s", run_id, exc)
        return "not_gathered"
    except RunStopped:
        log.warning(
            "run %s: the run is no longer running as gathering %s; this host's ranks ended", run_id, token
        )
        return "left"
    except Exception as exc:  # told to the leader (Rendezvous.fail), which requeues the run
        log.warning("run %s: this host could not train its ranks: %s", run_id, one_line(exc))
        return "failed"
    if place is None:
        log.info("run %s: gathering %s has all its hosts; nothing to join", run_id, token)
        return "stale"
    return "done"


def requeue_lost_rank(
    session_factory: SessionFactory, settings: Settings, run_id: uuid.UUID, worker_id: str, reason: str
) -> str | None:
    """A rank of this worker's run died: ``lifecycle.release_lost_rank`` (queued again to resume from its
    last checkpoint, or failed after ``max_attempts``), the queued run sent to the broker at once."""

    def write() -> str | None:
        with session_factory.begin() as session:
            run = session.get_one(Run, run_id)
            return lifecycle.release_lost_rank(
                session, run, worker_id, reason, now=utcnow(), max_attempts=settings.max_attempts
            )

    status = retry_busy(f"run {run_id}: lost rank", write, seconds=FINISH_RETRY_SECONDS)
    if status == "queued":
        _send_again(session_factory, settings, run_id, "a lost rank")
    elif status in ("failed", "cancelled"):
        advance_pipeline_of(run_id, session_factory, settings)
    return status


def _pause_requested(session_factory: SessionFactory, run_id: uuid.UUID) -> bool:
    def read() -> bool:
        with session_factory() as session:
            row = session.execute(
                select(Run.pause_requested, Run.cancel_requested).where(Run.id == run_id)
            ).one()
        return bool(row[0]) and not bool(row[1])  # a cancel wins over a pause

    return retry_busy(f"run {run_id}: pause check", read, seconds=FINISH_RETRY_SECONDS)


def pause_claimed_run(session_factory: SessionFactory, run_id: uuid.UUID, worker_id: str) -> None:
    """The loop stopped for a pause (its checkpoint is saved): release the run as ``paused``
    (``api.lifecycle.release_paused``)."""

    def write() -> bool:
        with session_factory.begin() as session:
            return lifecycle.release_paused(session, run_id, worker_id)

    retry_busy(f"run {run_id}: pause", write, seconds=FINISH_RETRY_SECONDS)
    log.info("run %s paused", run_id)


def advance_pipeline_of(run_id: uuid.UUID, session_factory: SessionFactory, settings: Settings) -> None:
    """If the run is a pipeline stage, start the stages it unblocked (or end the pipeline)."""

    def write() -> list[Run]:
        with session_factory.begin() as session:
            pipeline_id = session.scalar(select(Run.pipeline_id).where(Run.id == run_id))
            created = advance(session=session, pipeline_id=pipeline_id) if pipeline_id else []
            return [session.get_one(Run, r) for r in created]

    created = retry_busy(f"run {run_id}: pipeline", write, seconds=FINISH_RETRY_SECONDS)
    if not created:
        return
    try:
        with session_factory() as session:
            lifecycle.send_committed(session=session, enqueue=CeleryEnqueue(settings), runs=created)
    except Exception:  # noqa: BLE001 - the stages are queued in the DB; the reconciler sends them
        log.warning("run %s: could not send its pipeline's next stages", run_id, exc_info=True)


@lru_cache
def _session_factory(url: str) -> SessionFactory:
    return make_session_factory(make_engine(url))


def make_worker_app(settings: Settings | None = None) -> Celery:
    """The Celery app with the ``rlrun.train_run`` task registered (run with the solo pool)."""
    settings = settings or get_settings()
    app = make_celery(settings)

    @app.task(name=TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def train_run(run_id: str) -> None:
        execute_run(
            uuid.UUID(run_id),
            session_factory=_session_factory(settings.resolved_database_url),
            settings=settings,
        )

    @app.task(name=JOIN_TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def join_multi_host_run(run_id: str, token: str) -> None:
        join_run(
            uuid.UUID(run_id),
            token,
            session_factory=_session_factory(settings.resolved_database_url),
            settings=settings,
        )

    return app
