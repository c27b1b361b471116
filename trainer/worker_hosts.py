"""A run with ``resources.nodes > 1``: the worker that claims it leads, ``nodes - 1`` workers of its queue
join, and each host starts its ``devices`` ranks once all have met (trainer/hosts.py: torch's c10d
rendezvous, all hosts or none).

- The leader holds the run's lease as for one host. It checks it can take the run itself (devices, models),
  serves the gathering's store at its address (``RLRUN_HOST_ADDRESS``), writes ``{endpoint, token, hosts}``
  on the run's row (``runs.rendezvous``) and sends ``nodes - 1`` join tasks (``rlrun.join_run``) to the
  run's queue; the token names this gathering, so a join task that arrives after it (a run requeued since)
  finds a different one and ends, and one more than the gathering has seats for (a redelivered task) ends
  too.
- A joining host checks it can take the run (devices, its models resolved from its own cache and roots)
  before it joins; one that cannot says why through the gathering, and the leader lets go at once.
- Global rank 0 trains on the leader's host and alone talks to the database, as on one host. The leader
  hands the other hosts the run's checkpoint folder and the checkpoint it resumes from through the store:
  every host must see the artifacts folder at the same path (shared storage), since whichever host leads
  next resumes from it.
- Hosts that do not all come within ``RLRUN_RENDEZVOUS_TIMEOUT_SECONDS`` (times 1 to 1.2, drawn per
  gathering) train nothing (``HostsNotGathered``): the leader puts the run back in the queue, saying how
  many came, and is free for other work. Two runs that each hold some of the hosts the other needs let go
  at different times, and the one that lets go first frees its hosts for the other. A cancel or pause while
  gathering closes the rendezvous at once; a broker that will not take the join tasks ends the gathering
  before it begins (the run back in the queue).
- A host lost mid-run fails every rank: its ranks die with their worker (trainer/rank_launch.py
  ``die_with``), and the peers' next collective fails on the closed connections. A host whose ranks fail,
  or that cannot start them, also says so through the gathering, so the leader ends its own ranks even
  where they would wait (e.g. to form the process group). The leader's ranks failing is the lost-rank path
  (requeued to resume from the last checkpoint); a joining host whose gathering is no longer the run's (the
  leader was lost and the run requeued, or the run ended) ends its ranks within a second. A host that
  vanishes without closing its connections is noticed by torch's collective timeout.
"""

from __future__ import annotations

import json
import logging
import random
import threading
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
from trainer.rank_launch import RankFailed
from trainer.reporting import LeaseLost, LoopContext, LoopResult, Reporter, RunData, one_line
from trainer.specs import AnyRunSpec
from trainer.worker_ranks import STOP_GRACE_SECONDS, StopPoll, Throttle, rank_job, train_on_ranks

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
        self.sf, self.run_id, self.token, self.due = session_factory, run_id, token, Throttle(every)
        self.left = False

    def __call__(self) -> bool:
        if not self.left and self.due():
            current = current_rendezvous(self.sf, self.run_id)
            self.left = current is None or current.get("token") != self.token
        return self.left


def _close_on(rdzv: Rendezvous, asked: Callable[[], bool], done: threading.Event) -> None:
    """A thread that closes the rendezvous (every host's wait ends) when ``asked`` turns True."""

    def watch() -> None:
        while not done.wait(POLL_SECONDS):
            try:
                if asked():
                    rdzv.stop()
                    return
            except Exception:  # noqa: BLE001 - a database hiccup: ask again next time
                log.debug("gathering watch failed", exc_info=True)

    threading.Thread(target=watch, name="rlrun-gather-stop", daemon=True).start()


class LeaderPoll:
    """The leader's poll while its ranks train: a stop they did not honour in time (``StopPoll``), or
    another host's failure (``Rendezvous.fail``: its ranks are gone, so the leader's would wait in their
    next collective), which it keeps to raise as ``RankFailed``."""

    def __init__(self, stop: Callable[[], bool], rdzv: Rendezvous):
        self.stop, self.rdzv, self.due = stop, rdzv, Throttle(POLL_SECONDS)
        self.host_failure: str | None = None

    def __call__(self) -> bool:
        if self.due():
            self.host_failure = self.rdzv.failed()
            if self.host_failure is not None:
                return True
        return self.stop()


def send_joins(settings: Settings, run_id: uuid.UUID, token: str, count: int, queue: str | None) -> None:
    """Ask ``count`` workers to join; a broker that does not take the tasks is a fault noted for the
    reconciler, and this gathering ends before it began (``HostsNotGathered``: the run goes back to the
    queue)."""
    try:
        CeleryEnqueue(settings).join(run_id, token, count, queue=queue)
    except Exception as exc:  # noqa: BLE001 - a broker fault (CeleryEnqueue notes it), told in the events
        raise HostsNotGathered(f"could not ask the broker for {count} more host(s): {one_line(exc)}") from exc


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
    gathering, or one the ranks did not honour in time), ``RankFailed`` (a rank here, or another host,
    failed) or ``LeaseLost``."""
    hosts = spec.resources.nodes
    job = rank_job(spec, data, ctx, reporter)  # this host can take the run: before anyone waits on it
    address = host_address(settings)
    store = serve_rendezvous(address)
    token = uuid.uuid4().hex
    endpoint = f"{address}:{store.port}"
    resume_from = str(ctx.resume_from) if ctx.resume_from else None
    store.set(PLAN_KEY, json.dumps({"checkpoint_dir": str(ctx.checkpoint_dir), "resume_from": resume_from}))
    gathering = {"endpoint": endpoint, "token": token, "hosts": hosts}
    if not publish_rendezvous(session_factory, run_id, worker_id, gathering):
        raise LeaseLost(f"run {run_id} is no longer held by {worker_id}")
    send_joins(settings, run_id, token, hosts - 1, spec.queue)
    # a little longer or shorter for each leader: two runs that each hold hosts the other needs time out
    # apart, and the first to let go frees its hosts for the other
    wait = settings.rendezvous_timeout_seconds * random.uniform(1.0, 1.2)
    events.event("info", f"gathering {hosts} hosts at {endpoint} (waiting up to {wait:.0f} s)", gathering)
    stop = StopPoll(session_factory, run_id, grace=0.0)
    done = threading.Event()
    rdzv = Rendezvous(
        store,
        rendezvous_key(run_id, token),
        hosts,
        address=address,
        timeout=wait,
        leader=True,
        identity=worker_id,
    )
    with rdzv:
        _close_on(rdzv, lambda: stop() or rdzv.failed() is not None, done)
        try:
            place = rdzv.gather()
        except HostsNotGathered:
            if rdzv.stopped and rdzv.failed() is None:
                raise RunStopped("a cancel or pause came while the run's hosts gathered") from None
            raise
        finally:
            done.set()
        events.event("info", f"{hosts} hosts gathered", {"hosts": rdzv.identities()})
        poll = LeaderPoll(StopPoll(session_factory, run_id, STOP_GRACE_SECONDS), rdzv)
        try:
            result = train_on_ranks(job, spec.resources.devices, poll=poll, place=place)
        except RunStopped:
            if poll.host_failure is not None:
                raise RankFailed(f"another host failed: {poll.host_failure}") from None
            raise
        except RankFailed as exc:  # the other hosts' ranks fail in their next collective with ours
            rdzv.fail(str(exc))
            raise
    assert result is not None  # the leader's host has rank 0
    return result


def no_rank_zero() -> Reporter:
    """The rank-0 reporter of a joining host's job, never built: global rank 0 trains on the leader's."""
    raise RuntimeError("a joining host has no rank 0 (it trains on the leader's host)")


def join_hosts(
    spec: AnyRunSpec,
    data: RunData,
    context: Callable[[Path, Path | None], LoopContext],
    *,
    session_factory: Any,
    settings: Settings,
    run_id: uuid.UUID,
    gathering: dict[str, Any],
    worker_id: str,
) -> HostPlace | None:
    """Join the gathering ``gathering`` (the run's ``rendezvous`` when the join task was read) and train on
    this host's ranks until the run ends; this host's place, or None when the gathering's seats were
    taken (a duplicate join task). ``context(checkpoint_dir, resume_from)`` is the loop context with the
    leader's folders. Raises ``HostsNotGathered``, ``RunStopped`` (the run left this gathering), or, told to
    the leader first, ``RankFailed`` and whatever kept this host from starting its ranks."""
    token = gathering["token"]
    store = connect_rendezvous(gathering["endpoint"], CONNECT_SECONDS)
    rdzv = Rendezvous(
        store,
        rendezvous_key(run_id, token),
        int(gathering["hosts"]),
        address=host_address(settings),
        timeout=settings.rendezvous_timeout_seconds * 1.2,  # the longest a leader waits
        leader=False,
        identity=worker_id,
    )
    if not rdzv.take_seat():
        return None
    plan = json.loads(store.get(PLAN_KEY).decode())
    left = GatheringLeft(session_factory, run_id, token)
    done = threading.Event()
    with rdzv:
        try:  # this host can take the run, before anyone waits on it
            ctx = context(
                Path(plan["checkpoint_dir"]), Path(plan["resume_from"]) if plan["resume_from"] else None
            )
            job = rank_job(spec, data, ctx, no_rank_zero)
        except Exception as exc:
            rdzv.fail(one_line(exc))
            raise
        _close_on(rdzv, left, done)
        try:
            place = rdzv.gather()
        finally:
            done.set()
        log.info("run %s: joined as host %d of %d", run_id, place.position, place.hosts)
        try:
            train_on_ranks(job, spec.resources.devices, poll=left, place=place)
        except RankFailed as exc:
            rdzv.fail(str(exc))
            raise
    return place
