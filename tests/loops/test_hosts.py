"""One run's ranks on two hosts (trainer/hosts.py): the hosts gather through torch's c10d rendezvous on the
leader's store, each starts its ranks at its place, and the run makes the single-process updates (DPO and
GRPO, DDP and FSDP2, losses and metrics to 1e-5 over 10 steps, as for two ranks of one host). Here the two
"hosts" are two threads of the test process, each with its own rendezvous handler and ranks, meeting over
loopback; tests/integration/test_multi_host_runs.py runs them as two Celery workers."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.loops.rank_helpers import failing_context, rank_context
from tests.loops.test_distributed import (
    assert_single_process_updates,
    gloo_only,
    rank_job,
    run_spec,
    single_once,
)
from trainer.hosts import (
    HostPlace,
    HostsNotGathered,
    Rendezvous,
    connect_rendezvous,
    host_position,
    serve_rendezvous,
)
from trainer.rank_launch import RankFailed, RankJob, RanksStopped, launch
from trainer.worker_hosts import LeaderPoll

LOOPBACK = "127.0.0.1"


def on_threads(*calls: Any) -> list[Any]:
    """Run each call on a thread of its own; their results (an exception is raised here, the first)."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out


def host(store: Any, key: str, hosts: int, *, leader: bool, timeout: float = 60.0, then: Any = None) -> Any:
    """One host's part: gather (as the leader on ``store``, or as a client of it), then ``then(place)``."""
    if not leader:
        store = connect_rendezvous(f"{LOOPBACK}:{store.port}", 30)
    with Rendezvous(store, key, hosts, address=LOOPBACK, timeout=timeout, leader=leader,
                    identity="leader" if leader else f"joiner-{threading.get_ident()}") as rdzv:  # fmt: skip
        place = rdzv.gather()
        return (place, then(place) if then is not None else None, rdzv.identities())


def two_hosts(job: RankJob, devices: int = 1) -> tuple[Any, Any]:
    """``job`` on two hosts of ``devices`` ranks each: (the leader's result, the other host's)."""
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"

    def train(place: HostPlace) -> Any:
        return launch(job, devices, place=place)

    lead, other = on_threads(
        lambda: host(store, key, 2, leader=True, then=train),
        lambda: host(store, key, 2, leader=False, then=train),
    )
    assert (lead[0].position, other[0].position) == (0, 1)
    return lead[1], other[1]


@pytest.mark.slow
@gloo_only
@pytest.mark.parametrize(
    ("algorithm", "sharding"),
    [("dpo", "ddp"), ("dpo", "fsdp"), ("grpo", "ddp"), ("grpo", "fsdp")],
)
def test_two_hosts_make_the_single_process_updates(
    algorithm: str, sharding: str, tiny_cache: Path, tmp_path: Path
) -> None:
    one = single_once(algorithm, tiny_cache, tmp_path / "one")
    job = rank_job(
        run_spec(algorithm), functools.partial(rank_context, str(tiny_cache), str(tmp_path / "two")), sharding
    )
    lead, other = two_hosts(job)
    assert other is None  # rank 0, and with it the run's outputs, is on the leader's host
    assert_single_process_updates(algorithm, one, lead)


@pytest.mark.slow
@gloo_only
def test_a_rank_that_fails_on_one_host_ends_the_ranks_of_both_naming_it(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """Global rank 1 (the other host's only rank) raises: both hosts' launches fail, the other host's
    naming its rank by its global number and host."""
    job = rank_job(run_spec(), functools.partial(failing_context, str(tiny_cache), str(tmp_path)))
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"
    errors: dict[bool, BaseException] = {}

    def train_catching(leader: bool) -> Any:
        def train(place: HostPlace) -> None:
            try:
                launch(job, 1, place=place)
            except RankFailed as exc:
                errors[leader] = exc

        return lambda: host(store, key, 2, leader=leader, then=train)

    started = time.monotonic()
    on_threads(train_catching(True), train_catching(False))
    assert time.monotonic() - started < 60
    assert set(errors) == {True, False}
    assert "rank 1 of 2 (host 1) failed: OSError: rank 1 lost its disk" in str(errors[False])
    assert "rank 0 of 2 (host 0) failed" in str(errors[True])  # its peer's connection closed under it


def test_the_leaders_host_comes_first_whatever_order_the_rendezvous_gives() -> None:
    """Three hosts, each of them the leader in turn: the leader's position is 0, the others 1 and 2 in the
    rendezvous' order, and every host sees the same identities in position order."""
    for leader in range(3):
        store = serve_rendezvous(LOOPBACK)
        key = f"test-{uuid.uuid4().hex}"
        got = on_threads(*(functools.partial(host, store, key, 3, leader=i == leader) for i in range(3)))
        places = [g[0] for g in got]
        assert places[leader].position == 0
        assert sorted(p.position for p in places) == [0, 1, 2]
        assert {(p.store_addr, p.store_port) for p in places} == {
            (places[0].store_addr, places[0].store_port)
        }
        assert all(g[2] == got[0][2] for g in got) and got[0][2][0] == "leader"
        assert [p.global_rank(1, 2) for p in sorted(places, key=lambda p: p.position)] == [1, 3, 5]


def test_hosts_that_do_not_all_come_gather_none_within_the_timeout() -> None:
    """Two of three hosts come: both give up after the join timeout, none placed, the message saying how
    many hosts were awaited."""
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"
    started = time.monotonic()
    with pytest.raises(HostsNotGathered, match=r"3 hosts did not gather within 2 s \(2 came\)"):
        on_threads(
            lambda: host(store, key, 3, leader=True, timeout=2),
            lambda: host(store, key, 3, leader=False, timeout=2),
        )
    assert time.monotonic() - started < 20


def test_a_stop_while_gathering_ends_every_hosts_wait_at_once() -> None:
    """The leader closes the rendezvous (a cancel while gathering): the waiting host stops waiting long
    before the join timeout, and the leader's own wait ends too."""
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"
    leader = Rendezvous(store, key, 3, address=LOOPBACK, timeout=120, leader=True)
    threading.Timer(2.0, leader.stop).start()
    started = time.monotonic()
    with pytest.raises(HostsNotGathered, match="closed"):
        on_threads(leader.gather, lambda: host(store, key, 3, leader=False, timeout=120))
    assert time.monotonic() - started < 30
    assert leader.stopped


def test_the_leaders_host_is_placed_first_and_the_others_keep_the_rendezvous_order() -> None:
    """Every node rank the rendezvous may give the leader, for up to 5 hosts: the leader at 0, the others
    at 1.. in their node order (checked against a list built by hand)."""
    for hosts in range(1, 6):
        for leader in range(hosts):
            expected = [leader] + [n for n in range(hosts) if n != leader]  # position -> node
            assert [host_position(node, leader) for node in expected] == list(range(hosts))


def test_a_duplicate_join_finds_no_seat_left() -> None:
    """A gathering of 3 hosts has 2 seats beside the leader: a third joining host is told so, instead of
    waiting on torch's full rendezvous until the run ends."""
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"
    joiners = [
        Rendezvous(
            connect_rendezvous(f"{LOOPBACK}:{store.port}", 30),
            key,
            3,
            address=LOOPBACK,
            timeout=5,
            leader=False,
        )  # fmt: skip
        for _ in range(3)
    ]
    assert [j.take_seat() for j in joiners] == [True, True, False]


@gloo_only
def test_a_host_that_fails_after_the_gathering_ends_the_leaders_ranks_at_once(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """The other host gathers, then cannot start its ranks (it tells the gathering): the leader's rank,
    waiting for its peer to join the process group, is ended within seconds with that host's reason,
    not after torch's 30-minute timeout."""
    job = rank_job(run_spec(), functools.partial(rank_context, str(tiny_cache), str(tmp_path)))
    store = serve_rendezvous(LOOPBACK)
    key = f"test-{uuid.uuid4().hex}"
    polls: list[LeaderPoll] = []

    def lead() -> float:
        with Rendezvous(store, key, 2, address=LOOPBACK, timeout=60, leader=True) as rdzv:
            place = rdzv.gather()
            polls.append(LeaderPoll(lambda: False, rdzv))
            started = time.monotonic()
            with pytest.raises(RanksStopped):
                launch(job, 1, place=place, poll=polls[0])
            return time.monotonic() - started

    def join_then_fail() -> None:
        client = connect_rendezvous(f"{LOOPBACK}:{store.port}", 30)
        with Rendezvous(
            client, key, 2, address=LOOPBACK, timeout=60, leader=False, identity="host-b"
        ) as rdzv:
            rdzv.gather()
            time.sleep(1.0)  # the leader's rank is waiting for this host's by now
            rdzv.fail("OSError: no space left on device")

    waited, _ = on_threads(lead, join_then_fail)
    assert waited < 15
    assert polls[0].host_failure == "host-b: OSError: no space left on device"
