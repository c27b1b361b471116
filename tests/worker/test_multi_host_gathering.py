"""The leader's side of a multi-host run with no other host about (trainer/worker_hosts.py): hosts that do
not all come within the rendezvous' timeout put the run back in the queue, saying how many came, with no
worker counted lost; a cancel while gathering ends the run at once; a join task for a gathering that is
over does nothing. Both database backends; the broker is the embedded SQL one (the join tasks and the
re-sent run go to it). A run gathered and trained on real hosts: tests/integration/test_multi_host_runs.py."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Event, Run
from api.services.runs import cancel_run
from api.settings import Settings
from tests.factories import make_dataset, make_run
from trainer.worker import execute_run, join_run


def two_host_spec(dataset_id: uuid.UUID, model: str = "tiny:llama-0.4m") -> dict[str, Any]:
    return {
        "algorithm": "dpo",
        "model": model,
        "dataset_id": str(dataset_id),
        "resources": {"nodes": 2},
        "hyperparameters": {"max_steps": 4, "batch_size": 4, "learning_rate": 1e-3},
    }


def settings(tmp_path: Path, timeout: float, **over: Any) -> Settings:
    return Settings(home=tmp_path, host_address="127.0.0.1", rendezvous_timeout_seconds=timeout, **over)


def new_run(factory: sessionmaker[Session], model: str = "tiny:llama-0.4m") -> uuid.UUID:
    with factory.begin() as s:
        ds = make_dataset(s)
        return make_run(s, ds, spec=two_host_spec(ds.id, model)).id


def in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(value=call()))
    thread.start()
    return thread, out


def wait_for_gathering(factory: sessionmaker[Session], run_id: uuid.UUID) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        with factory() as s:
            gathering = s.get_one(Run, run_id).rendezvous
        if gathering is not None:
            return gathering
        assert time.monotonic() < deadline, "the leader never started gathering"
        time.sleep(0.1)


def events(factory: sessionmaker[Session], run_id: uuid.UUID) -> list[Event]:
    with factory() as s:
        return list(s.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))


def last_status(factory: sessionmaker[Session], run_id: uuid.UUID) -> Event:
    return [e for e in events(factory, run_id) if e.kind == "status"][-1]


def test_hosts_that_do_not_come_put_the_run_back_in_the_queue_saying_how_many_came(
    committing_factory: sessionmaker[Session], tiny_cache: Path, tmp_path: Path
) -> None:
    run_id = new_run(committing_factory)
    started = time.monotonic()
    leader = settings(tmp_path, 2, cache_dir=tiny_cache)
    status = execute_run(run_id, session_factory=committing_factory, settings=leader)
    assert status == "queued"
    assert time.monotonic() - started < 30
    with committing_factory() as s:
        run = s.get_one(Run, run_id)
        assert (run.status, run.worker_id, run.rendezvous, run.lost_workers) == ("queued", None, None, 0)
        assert run.enqueued_at is not None  # sent to the broker again at once
    evs = events(committing_factory, run_id)
    gathering = next(e for e in evs if e.message.startswith("gathering 2 hosts at 127.0.0.1:"))
    assert gathering.data is not None and gathering.data["hosts"] == 2
    queued = evs[-1]
    assert (queued.kind, queued.message) == ("status", "queued")
    assert queued.data is not None
    # each leader waits the timeout times 1 to 1.2 (two leaders holding hosts the other needs let go apart)
    waited = float(queued.data["reason"].split(" within ")[1].split(" s ")[0])
    assert 2 <= waited <= 2.4
    assert queued.data == {"reason": f"2 hosts did not gather within {waited:g} s (1 came)"}


def test_a_host_that_cannot_take_the_run_tells_the_leader_which_lets_go_at_once(
    committing_factory: sessionmaker[Session], tiny_cache: Path, tmp_path: Path
) -> None:
    """The model is in the leader's model roots only: the joining host cannot resolve it, says so through
    the gathering, and the leader puts the run back in the queue with that reason long before its
    timeout (nobody waits in a collective for ranks that will never start)."""
    from trainer.models import resolve_model

    root = tmp_path / "models"
    preset = resolve_model("tiny:llama-0.4m", cache_dir=tiny_cache, run_output=lambda ref: Path())
    shutil.copytree(preset, root / "mini")
    run_id = new_run(committing_factory, model="mini")
    (tmp_path / "leader").mkdir()
    (tmp_path / "joiner").mkdir()
    leader = settings(tmp_path / "leader", 120, model_roots=[root], cache_dir=tiny_cache)
    thread, out = in_thread(lambda: execute_run(run_id, session_factory=committing_factory, settings=leader))
    gathering = wait_for_gathering(committing_factory, run_id)
    started = time.monotonic()
    joiner = settings(tmp_path / "joiner", 120, cache_dir=tiny_cache)
    assert (
        join_run(run_id, gathering["token"], session_factory=committing_factory, settings=joiner) == "failed"
    )
    thread.join(timeout=60)
    assert not thread.is_alive() and out["value"] == "queued"
    assert time.monotonic() - started < 20
    reason = last_status(committing_factory, run_id).data
    assert reason is not None and reason["reason"].startswith("a host could not join: "), reason
    assert "model 'mini' is not a tiny preset" in reason["reason"]


def test_a_cancel_while_the_hosts_gather_ends_the_run_at_once(
    committing_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    run_id = new_run(committing_factory)
    out: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: out.update(
            status=execute_run(run_id, session_factory=committing_factory, settings=settings(tmp_path, 300))
        )
    )
    worker.start()
    deadline = time.monotonic() + 60
    while not any(e.message.startswith("gathering") for e in events(committing_factory, run_id)):
        assert time.monotonic() < deadline, "the leader never started gathering"
        time.sleep(0.1)
    with committing_factory.begin() as s:
        cancel_run(session=s, run=s.get_one(Run, run_id))
    asked = time.monotonic()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert time.monotonic() - asked < 10  # not the 300 s of the rendezvous' timeout
    assert out["status"] == "cancelled"
    with committing_factory() as s:
        assert s.get_one(Run, run_id).status == "cancelled"


def test_a_join_task_for_a_gathering_that_is_over_does_nothing(
    committing_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    run_id = new_run(committing_factory)
    gathering = {"endpoint": "127.0.0.1:1", "token": "current", "hosts": 2}
    with committing_factory.begin() as s:
        run = s.get_one(Run, run_id)
        run.status, run.worker_id, run.rendezvous = "running", "leader:1", gathering
    kwargs: dict[str, Any] = {"session_factory": committing_factory, "settings": settings(tmp_path, 2)}
    assert join_run(run_id, "an-earlier-one", **kwargs) == "stale"
    with committing_factory.begin() as s:
        s.get_one(Run, run_id).status = "succeeded"
    assert join_run(run_id, "current", **kwargs) == "stale"  # the run is over


def test_a_broker_that_will_not_take_the_join_tasks_puts_the_run_back_in_the_queue(
    committing_factory: sessionmaker[Session], tiny_cache: Path, tmp_path: Path
) -> None:
    run_id = new_run(committing_factory)
    gone = f"sqla+sqlite:///{tmp_path / 'no-such-folder' / 'broker.db'}"  # the broker cannot be reached
    leader = settings(tmp_path, 120, cache_dir=tiny_cache, broker_url=gone)
    started = time.monotonic()
    assert execute_run(run_id, session_factory=committing_factory, settings=leader) == "queued"
    assert time.monotonic() - started < 30  # not the rendezvous' 120 s
    with committing_factory() as s:
        assert s.get_one(Run, run_id).lost_workers == 0
    queued = last_status(committing_factory, run_id)
    assert queued.message == "queued" and queued.data is not None
    reason = queued.data
    assert reason["reason"].startswith("could not ask the broker for 1 more host(s): ")


def test_join_tasks_the_broker_refuses_are_a_broker_fault(tmp_path: Path) -> None:
    """As for a run id (api/queue.py): the reconciler re-sends every queued run once the broker is back."""
    from api.queue import BrokerHealth, CeleryEnqueue

    health = BrokerHealth()
    gone = f"sqla+sqlite:///{tmp_path / 'no-such-folder' / 'broker.db'}"
    with pytest.raises(Exception, match="unable to open database file"):
        CeleryEnqueue(Settings(home=tmp_path, broker_url=gone), health=health).join(uuid.uuid4(), "t", 1)
    assert health.pending() == 1
