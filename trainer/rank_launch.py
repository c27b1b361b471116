"""Run a loop as N ranks: torch's elastic launcher starts the processes, rendezvous on loopback.

``launch(job, world)`` starts ``world`` processes with ``torch.distributed.elastic.multiprocessing
.start_processes`` (the machinery under ``torchrun``), each with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set for a rendezvous on 127.0.0.1 at a free port. Each process (``run_rank``) joins the
process group (NCCL on CUDA, one GPU per rank; gloo on CPU) and runs the spec's loop with its ``Ranks``
in the loop context (trainer/distributed.py). Rank 0's reporter is the run's; the others' are silent.

Ranks are forked from a forkserver that has imported torch, transformers and the loops once
(``RANK_PRELOAD``), not spawned: a spawned rank imports all of them itself, ~5 CPU-seconds per rank and
run attempt (2 ranks on 2 cores: ~6 s before the first step), where a fork from the preloaded server takes
milliseconds. The server is started by the first launch of this process (a worker's first multi-rank run)
and ends with it. The forkserver has imported only, never computed, so no OpenMP pool or CUDA context is
inherited; each rank gets the launching process's environment and working folder of the moment it is
launched (``RankStart``), as a spawned one would, sets its thread count from it, and dies with the launching
process (``die_with``).

The caller gets rank 0's return value (``job.collect``). A rank that raises or dies ends every rank
(``RankFailed`` names each failed rank, earliest first, with its error or signal: a rank that fails
makes its peers fail in their next collective, so several may be named); ``poll`` returning True ends
them too (``RanksStopped``), e.g. a cancel that the ranks did not honour in time.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.distributed import Ranks, Sharding, current, from_main
from trainer.hosts import HostPlace
from trainer.phases import NoPhase, Phase
from trainer.ports import free_port
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData

POLL_SECONDS = 0.2
# What every rank imports before its loop starts, loaded once into the forkserver ranks are forked from.
RANK_PRELOAD = ("torch", "torch.distributed", "transformers", "trainer.loops", "trainer.specs", __name__)


class RankFailed(RuntimeError):
    """A rank raised or died; the others were stopped."""


class RanksStopped(RuntimeError):
    """The caller's ``poll`` asked to end the ranks."""


@dataclass(frozen=True)
class RankJob:
    """What every rank runs (pickled to each process, so its callables are module-level functions or
    ``functools.partial`` of them): the spec (JSON), the data, the loop context for a rank, rank 0's
    reporter and what rank 0 returns from its reporter and result."""

    spec: dict[str, Any]
    data: RunData
    context: Callable[[Ranks], LoopContext]
    reporter: Callable[[], Reporter]
    collect: Callable[[Reporter, LoopResult], Any]
    sharding: Sharding = "ddp"


class RankReporter:
    """Rank 0's reporter on rank 0, silence elsewhere; ``should_stop`` is rank 0's answer on every rank."""

    def __init__(self, inner: Reporter | None, ranks: Ranks):
        self.inner, self.ranks = inner, ranks

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.inner is not None:
            self.inner.log_metrics(step, metrics)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        if self.inner is not None:
            self.inner.event(kind, message, data)

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]) -> None:
        if self.inner is not None:
            self.inner.checkpoint_saved(step, path, size_bytes, metrics)

    def checkpoint_removed(self, step: int) -> None:
        if self.inner is not None:
            self.inner.checkpoint_removed(step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if self.inner is not None:
            self.inner.log_samples(step, samples)

    def should_stop(self) -> bool:
        return from_main(self.inner.should_stop() if self.inner is not None else False, self.ranks)

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]:
        return self.inner.phase(name, total) if self.inner is not None else NoPhase(name, total)

    def warn(self, code: str, step: int, message: str) -> None:
        if self.inner is not None:
            self.inner.warn(code, step, message)

    def agent_gateway(self, address: Mapping[str, str] | None) -> None:
        if self.inner is not None:
            self.inner.agent_gateway(address)


@dataclass(frozen=True)
class RankStart:
    """The launching process's state a rank takes on before anything else: its pid, whole environment (the
    rank's own variables included) and working folder at launch. A rank forked from the forkserver would
    otherwise see the server's, from the first launch."""

    launcher: int
    environ: dict[str, str]
    cwd: str

    def apply(self) -> None:
        """Die with the launcher; take on its environment (the launcher machinery's own per-rank variables,
        ``TORCHELASTIC_*`` with the error file among them, are kept), folder and thread count."""
        die_with(self.launcher)
        elastic = {k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_")}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(elastic)
        os.chdir(self.cwd)
        torch.set_num_threads(int(self.environ["OMP_NUM_THREADS"]))


def run_rank(job: RankJob, start: RankStart) -> Any:
    """One rank: take on the launcher's state, join the process group, run the loop, return
    ``job.collect(...)`` on rank 0."""
    from torch.distributed.elastic.multiprocessing.errors import record

    start.apply()
    return record(_run_rank)(job)


def die_with(pid: int) -> None:
    """End this process (SIGKILL) as soon as process ``pid`` has exited: a worker killed with -9 must not
    leave ranks training, and writing, behind it.

    A forked rank's parent is the forkserver, not the worker, so the parent-death signal cannot serve, and
    the server itself stays up while any process it forked holds its liveness pipe (by design: it serves
    them too). So the rank watches the worker itself: a daemon thread waits on a pidfd of ``pid`` (Linux
    5.3+; readable once the process has exited), or polls it each second where there are no pidfds. When
    the ranks are gone the server sees the pipe's last holder gone and exits too.
    """

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here (or pid already gone: the poll sees it at once)
            while _running(pid):
                time.sleep(1)
        else:
            select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rlrun-die-with-launcher", daemon=True).start()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _run_rank(job: RankJob) -> Any:
    from trainer.loops import LOOPS
    from trainer.specs import parse_spec

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        ranks = current(job.sharding)
        spec = parse_spec(job.spec)
        context = job.context(ranks)
        if ranks.main:  # a preset is built once, by rank 0 (transformers saves only on the main rank)
            for ref in {spec.model, *spec.model_refs.values()}:
                context.resolve_model(ref)
        dist.barrier()
        inner = job.reporter() if ranks.main else None
        reporter = RankReporter(inner, ranks)
        result = LOOPS[spec.algorithm](spec, job.data, reporter, context)
        return job.collect(inner, result) if inner is not None else None
    finally:
        dist.destroy_process_group()


def rank_env(local_rank: int, devices: int, port: int, place: HostPlace | None = None) -> dict[str, str]:
    """The torch.distributed variables of local rank ``local_rank`` of ``devices`` on this host: on one host
    rank 0 serves the process group's store on loopback at ``port``; among several (``place``) every rank
    is a client of the store the rendezvous serves (as under ``torchrun``)."""
    threads = max(1, (os.cpu_count() or 1) // devices)  # a host's ranks share its cores
    env = {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(devices),
        "OMP_NUM_THREADS": str(threads),
    }
    if place is None:
        return {**env, "RANK": str(local_rank), "WORLD_SIZE": str(devices), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}  # fmt: skip
    return {
        **env,
        "RANK": str(place.global_rank(local_rank, devices)),
        "WORLD_SIZE": str(place.hosts * devices),
        "GROUP_RANK": str(place.position),
        "MASTER_ADDR": place.store_addr,
        "MASTER_PORT": str(place.store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def rank_start_method() -> str:
    """``forkserver`` with ``RANK_PRELOAD`` (set before this process's server starts; later calls change
    nothing), or ``spawn`` where the platform has no forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(RANK_PRELOAD))
    return "forkserver"


def launch(
    job: RankJob, world: int, *, poll: Callable[[], bool] | None = None, place: HostPlace | None = None
) -> Any:
    """Run ``job`` on ``world`` ranks of this host (at ``place`` among a run's hosts, trainer/hosts.py);
    rank 0's ``collect`` value (None on a host without global rank 0). Raises ``RankFailed`` or
    ``RanksStopped`` (every rank of this host ended either way)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    port = free_port()
    envs = {r: rank_env(r, world, port, place) for r in range(world)}
    starts = {r: RankStart(os.getpid(), {**os.environ, **envs[r]}, os.getcwd()) for r in range(world)}
    with tempfile.TemporaryDirectory(prefix="rlrun-ranks-") as logs, _own_signal_handlers():
        context = start_processes(
            name="rlrun-rank",
            entrypoint=run_rank,
            args={r: (job, starts[r]) for r in range(world)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
            start_method=rank_start_method(),
        )
        try:
            while (done := context.wait(timeout=POLL_SECONDS, period=0.05)) is None:
                if poll is not None and poll():
                    raise RanksStopped("the ranks were stopped before they finished")
        finally:
            context.close()
        if done.failures:
            raise RankFailed(_failures(done.failures, context.error_files, _rank_label(world, place)))
        return done.return_values.get(0)


def _rank_label(devices: int, place: HostPlace | None) -> Callable[[int], str]:
    """How a failure names local rank ``r``: its global rank and the run's rank count (and the host's
    position among several)."""
    if place is None:
        return lambda r: f"rank {r} of {devices}"
    total = devices * place.hosts
    return lambda r: f"rank {place.global_rank(r, devices)} of {total} (host {place.position})"


def _failures(first: Mapping[int, Any], error_files: Mapping[int, str], label: Callable[[int], str]) -> str:
    """Every failed rank, earliest first: the launcher reports the first failure it sees, but the rank
    that caused it may be another (its peers then fail in their next collective), so each rank's error
    file is read too."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = dict(first)
    for rank, path in error_files.items():
        if rank not in failures and os.path.isfile(path) and os.path.getsize(path) > 0:
            failures[rank] = ProcessFailure(local_rank=rank, pid=0, exitcode=1, error_file=path)
    order = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    return "; ".join(f"{label(r)} failed: {_reason(f)}" for r, f in order)


def _reason(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip().splitlines()
    exit_info = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
    return f"{text[0] if text else 'no message'} ({exit_info})"


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """The launcher installs SIGTERM/SIGINT handlers that raise in this process; the caller's (a Celery
    worker's warm shutdown) come back once the ranks are done."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    kept = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in kept.items():
                signal.signal(sig, handler)
