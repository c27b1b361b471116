"""A run with ``resources.nodes > 1``: the worker that claims it leads, ``nodes - 1`` workers of its queue
join, and each host starts its ``devices`` ranks once all have met (trainer/hosts.py: torch's c10d
rendezvous, all hosts or none).

- The leader holds the run's lease as for one host. It serves the rendezvous store at its address
  (``RLRUN_HOST_ADDRESS``), writes ``{endpoint, token, hosts}`` on the run's row (``runs.rendezvous``) and
  sends ``nodes - 1`` join tasks (``rlrun.join_run``) to the run's queue; the token names this gathering,
  so a join task that arrives after it (a run requeued since) finds a different one and ends.
- Global rank 0 trains on the leader's host and alone talks to the database, as on one host. The leader
  hands the other hosts the run's checkpoint folder and the checkpoint it resumes from through the
  rendezvous store: every host must see the artifacts folder at the same path (shared storage), since
  whichever host leads next resumes from it.
- Hosts that do not all come within ``RLRUN_RENDEZVOUS_TIMEOUT_SECONDS`` train nothing (``HostsNotGathered``):
  the leader puts the run back in the queue, saying how many came, and is free for other work. Two runs
  that each hold some of the hosts the other needs therefore both let go at their timeouts instead of
  waiting on each other forever. A cancel or pause while gathering closes the rendezvous at once.
- A host lost mid-run fails every rank: its ranks die with their worker (trainer/rank_launch.py
  ``die_with``), and the peers' next collective fails on the closed connections. The leader's ranks failing
  is the lost-rank path (requeued to resume from the last checkpoint); a joining host whose ranks fail, or
  whose gathering is no longer the run's (the leader was lost and the run requeued), ends its ranks and its
  task. A host that vanishes without closing its connections is noticed by torch's collective timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from api.models import Run
from api.queue import CeleryEnqueue
from api.settings import Settings
from trainer.hosts import HostPlace, HostsNotGathered, Rendezvous, connect_rendezvous, serve_rendezvous
from trainer.phases import RunStopped
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import AnyRunSpec
from trainer.worker_ranks import STOP_GRACE_SECONDS, StopPoll, run_on_ranks

log = logging.getLogger("rlrun.worker")
PLAN_KEY = "rlrun/plan"
CONNECT_SECONDS = 30.0  # a joining host's wait for the leader's rendezvous store to answer
POLL_SECONDS = 1.0


def host_address(settings: Settings) -> str:
    import socket

    return settings.host_address or socket.getfqdn()


def rendezvous_key(run_id: uuid.UUID, token: str) -> str:
    return f"rlrun-{run_id}-{token}"


def publish_rendezvous(
    session_factory: Any, run_id: uuid.UUID, worker_id: str, value: dict[str, Any] | None
) -> bool:
    """Write where the run's hosts meet on its row, if ``worker_id`` still holds it running."""
    with session_factory.begin() as session:
        stmt = (
            update(Run)
            .where(Run.id == run_id, Run.worker_id == worker_id, Run.status == "running")
            .values(rendezvous=value)
            .execution_options(synchronize_session=False)
        )
        return int(session.execute(stmt).rowcount) == 1


def current_rendezvous(session_factory: Any, run_id: uuid.UUID) -> dict[str, Any] | None:
    """The run's rendezvous while it is running (None once it is not)."""
    with session_factory() as session:
        row = session.execute(select(Run.status, Run.rendezvous).where(Run.id == run_id)).one_or_none()
    return row[1] if row is not None and row[0] == "running" else None


class GatheringLeft:
    """True once the run is no longer running with the gathering ``token`` (its leader was lost, or it
    ended): a joining host's ranks then have no run to train for. Read at most every ``every`` seconds."""

    def __init__(self, session_factory: Any, run_id: uuid.UUID, token: str, every: float = POLL_SECONDS):
        self.sf, self.run_id, self.token, self.every = session_factory, run_id, token, every
        self.checked, self.left = 0.0, False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.left and now - self.checked >= self.every:
            self.checked = now
            current = current_rendezvous(self.sf, self.run_id)
            self.left = current is None or current.get("token") != self.token
        return self.left


def _close_on_stop(rdzv: Rendezvous, stop_asked: Callable[[], bool], done: threading.Event) -> None:
    """A thread that closes the rendezvous (every host's wait ends) when ``stop_asked`` turns True."""

    def watch() -> None:
        while not done.wait(POLL_SECONDS):
            if stop_asked():
                rdzv.stop()
                return

    threading.Thread(target=watch, name="rlrun-gather-stop", daemon=True).start()


def lead_on_hosts(
    spec: AnyRunSpec,
    data: RunData,
    ctx: LoopContext,
    *,
    reporter: Callable[[], Reporter],
    events: Reporter,
    session_factory: Any,
    settings: Settings,
    run_id: uuid.UUID,
    worker_id: str,
) -> LoopResult:
    """Gather the run's hosts as their leader, then train on this host's ranks; the loop's result as rank
    0 saw it. Raises ``HostsNotGathered`` (nobody trained), ``RunStopped`` (a cancel or pause while
    gathering, or one the ranks did not honour in time) or ``RankFailed``."""
    hosts = spec.resources.nodes
    address = host_address(settings)
    store = serve_rendezvous(address)
    token = uuid.uuid4().hex
    endpoint = f"{address}:{store.port}"
    resume_from = str(ctx.resume_from) if ctx.resume_from else None
    store.set(PLAN_KEY, json.dumps({"checkpoint_dir": str(ctx.checkpoint_dir), "resume_from": resume_from}))
    gathering = {"endpoint": endpoint, "token": token, "hosts": hosts}
    if not publish_rendezvous(session_factory, run_id, worker_id, gathering):
        raise RunStopped("the run is no longer this worker's")
    CeleryEnqueue(settings).join(run_id, token, hosts - 1, queue=spec.queue)
    wait = settings.rendezvous_timeout_seconds
    events.event("info", f"gathering {hosts} hosts at {endpoint} (waiting up to {wait:g} s)", gathering)
    stop = StopPoll(session_factory, run_id, grace=0.0)
    done = threading.Event()
    with Rendezvous(
        store,
        rendezvous_key(run_id, token),
        hosts,
        address=address,
        timeout=settings.rendezvous_timeout_seconds,
        leader=True,
        identity=worker_id,
    ) as rdzv:
        _close_on_stop(rdzv, stop, done)
        try:
            place = rdzv.gather()
        except HostsNotGathered:
            if rdzv.stopped:
                raise RunStopped("a cancel or pause came while the run's hosts gathered") from None
            raise
        finally:
            done.set()
        events.event("info", f"{hosts} hosts gathered", {"hosts": rdzv.identities()})
        result = run_on_ranks(
            spec,
            data,
            ctx,
            reporter=reporter,
            poll=StopPoll(session_factory, run_id, STOP_GRACE_SECONDS),
            place=place,
        )
    assert result is not None  # the leader's host has rank 0
    return result


def join_hosts(
    spec: AnyRunSpec,
    data: RunData,
    context: Callable[[Path, Path | None], LoopContext],
    *,
    reporter: Callable[[], Reporter],
    session_factory: Any,
    settings: Settings,
    run_id: uuid.UUID,
    gathering: dict[str, Any],
    worker_id: str,
) -> HostPlace:
    """Join the gathering ``gathering`` (the run's ``rendezvous`` when the join task was read) and train on
    this host's ranks until the run ends; this host's place. ``context(checkpoint_dir, resume_from)`` is
    the loop context with the leader's folders. Raises ``HostsNotGathered``, ``RunStopped`` (the run left
    this gathering) or ``RankFailed``."""
    token = gathering["token"]
    store = connect_rendezvous(gathering["endpoint"], CONNECT_SECONDS)
    plan = json.loads(store.get(PLAN_KEY).decode())
    ctx = context(Path(plan["checkpoint_dir"]), Path(plan["resume_from"]) if plan["resume_from"] else None)
    left = GatheringLeft(session_factory, run_id, token)
    done = threading.Event()
    with Rendezvous(
        store,
        rendezvous_key(run_id, token),
        int(gathering["hosts"]),
        address=host_address(settings),
        timeout=settings.rendezvous_timeout_seconds,
        leader=False,
        identity=worker_id,
    ) as rdzv:
        _close_on_stop(rdzv, left, done)
        try:
            place = rdzv.gather()
        finally:
            done.set()
        log.info("run %s: joined as host %d of %d", run_id, place.position, place.hosts)
        run_on_ranks(spec, data, ctx, reporter=reporter, poll=left, place=place)
    return place
