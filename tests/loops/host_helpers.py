"""Two "hosts" of a run in one test process (trainer/hosts.py): each a thread with its own rendezvous
handler and its own rank processes, meeting over loopback."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from trainer.hosts import HostPlace, Rendezvous, connect_rendezvous, serve_rendezvous
from trainer.rank_launch import RankJob, launch

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
