"""A run's hosts (trainer/hosts.py): placement (the leader's host first), the rendezvous' timeout, a stop
while gathering, seats against duplicate joins, and failures that cross hosts (a rank failing on one host
ends both; a host failing after the gathering ends the leader's rank at once). The "hosts" are threads of
the test process, each with its own rendezvous handler and ranks, meeting over loopback
(tests/loops/host_helpers.py); that two hosts make one process's updates is in
tests/loops/test_distributed.py, and through worker processes in tests/integration/test_multi_host_runs.py."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.loops.host_helpers import LOOPBACK, host, on_threads
from tests.loops.rank_helpers import failing_context, rank_context
from tests.loops.test_distributed import (
    gloo_only,
    rank_job,
    run_spec,
)
from trainer.hosts import (
    HostPlace,
    HostsNotGathered,
    Rendezvous,
    connect_rendezvous,
    host_position,
    serve_rendezvous,
)
from trainer.rank_launch import RankFailed, RanksStopped, launch
from trainer.worker_hosts import LeaderPoll


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


def test_a_throttle_is_due_at_first_then_once_per_period() -> None:
    import time

    from trainer.worker_ranks import Throttle

    due = Throttle(0.3)
    assert due() and not due() and not due()
    time.sleep(0.35)
    assert due() and not due()
