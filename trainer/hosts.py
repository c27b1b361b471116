"""One run's ranks on several hosts: the hosts meet through torch elastic's own rendezvous, all or none.

A run with ``resources.nodes > 1`` is led by the worker that claimed it (its lease holder, where global
rank 0 trains and talks to the database) and joined by ``nodes - 1`` other workers. The hosts gather with
torch's dynamic rendezvous (``DynamicRendezvousHandler`` on the ``c10d`` backend, what ``torchrun
--rdzv-backend c10d`` runs), its state kept in a ``TCPStore`` the leader serves, fresh for each gathering,
at the address it publishes on the run: the rendezvous admits exactly ``nodes`` hosts (``min_nodes =
max_nodes``) within the join timeout, or none of them (each side's ``next_rendezvous`` raises). Placement is
therefore all or none, and a host that waits for a run that cannot gather gives up after the timeout
instead of holding it forever. The leader's store also carries what the hosts tell each other: the seats
left for joining hosts, how many came, each host's identity, and a host's failure.

Then each host starts its ``devices`` ranks with ``trainer.rank_launch.launch`` at its place in the world:
the leader's host takes global ranks ``0 .. devices - 1``, the others follow in the rendezvous' order. The
ranks meet as ``torchrun``'s do, every one a client of an existing store (``TORCHELASTIC_USE_AGENT_STORE``):
here the leader's, which lives as long as the lease holder's part of the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

LEADER_KEY = "rlrun/leader_node"
log = logging.getLogger("rlrun.hosts")


class HostsNotGathered(RuntimeError):
    """The run's hosts did not all join within the rendezvous' timeout (none of them trains)."""


@dataclass(frozen=True)
class HostPlace:
    """This host's place among a run's hosts: its position (0: the leader's host, where global rank 0
    runs), how many hosts, and the process group's store address every rank connects to."""

    position: int
    hosts: int
    store_addr: str
    store_port: int

    def global_rank(self, local_rank: int, devices: int) -> int:
        return self.position * devices + local_rank


def serve_rendezvous(address: str) -> Any:
    """The leader's rendezvous store: a TCPStore server on ``address`` at a free port (``.port``)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(address, 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def connect_rendezvous(endpoint: str, timeout: float) -> Any:
    """A client of the leader's rendezvous store at ``host:port`` (raises after ``timeout`` seconds)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host, _, port = endpoint.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def host_position(node: int, leader_node: int) -> int:
    """A host's position among the run's hosts from its node rank in the rendezvous: the leader's host
    first, then the others in the rendezvous' order."""
    if node == leader_node:
        return 0
    return node + 1 if node < leader_node else node


class Rendezvous:
    """One host's part of one gathering of a run's hosts, on the leader's store (fresh for each gathering,
    so the keys below need no prefix): a context manager."""

    ARRIVALS, SEATS, FAILED = "rlrun/arrived", "rlrun/seats", "rlrun/failed"

    def __init__(
        self,
        store: Any,
        key: str,
        hosts: int,
        *,
        address: str,
        timeout: float,
        leader: bool,
        identity: str = "",
    ):
        self.store, self.key, self.hosts, self.leader, self.timeout = store, key, hosts, leader, timeout
        self.address, self.identity = address, identity or address
        self.stopped, self.round_store = False, None
        self.handler = self._handler()

    def _handler(self) -> Any:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        return DynamicRendezvousHandler.from_backend(
            run_id=self.key,
            store=self.store,
            backend=C10dRendezvousBackend(self.store, self.key),
            min_nodes=self.hosts,
            max_nodes=self.hosts,
            local_addr=self.address,
            timeout=RendezvousTimeout(join=timedelta(seconds=self.timeout), last_call=timedelta(seconds=1)),
        )

    def take_seat(self) -> bool:
        """A joining host's claim on one of the gathering's ``hosts - 1`` seats beside the leader: False
        when they are taken (a duplicate join task; torch would keep it waiting on a full rendezvous
        until the run ended)."""
        return int(self.store.add(self.SEATS, 1)) <= self.hosts - 1

    def gather(self) -> HostPlace:
        """Wait for every host of the run; this host's place. Raises ``HostsNotGathered`` after the
        timeout, or at once when the rendezvous is closed (``stop``, a host's ``fail``)."""
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

        self.store.add(self.ARRIVALS, 1)
        try:
            info = self.handler.next_rendezvous()
        except RendezvousError as exc:
            came = self.came()
            count = f" ({came} came)" if came is not None else ""
            failed = self.failed()
            if failed is not None:
                raise HostsNotGathered(f"a host could not join: {failed}") from exc
            if self.stopped or isinstance(exc, RendezvousClosedError):
                raise HostsNotGathered(f"the gathering of {self.hosts} hosts was closed{count}") from exc
            raise HostsNotGathered(
                f"{self.hosts} hosts did not gather within {self.timeout:g} s{count}"
            ) from exc
        # the hosts' keep-alives only serve while they wait for each other; the leader's store may end first
        self.handler._stop_heartbeats()  # noqa: SLF001 - torch starts them in next_rendezvous
        node, world = info.rank, info.world_size
        if world != self.hosts:  # min_nodes = max_nodes: torch admits exactly that many
            raise HostsNotGathered(f"the rendezvous admitted {world} hosts, not {self.hosts}")
        if self.leader:
            info.store.set(LEADER_KEY, str(node))
        position = host_position(node, int(info.store.get(LEADER_KEY).decode()))
        info.store.set(f"rlrun/host/{position}", self.identity)
        self.round_store = info.store
        # the process group's store is the leader's (it lives as long as the lease holder's part of the run;
        # torch's own would live on whichever host the rendezvous ranked first)
        return HostPlace(position, world, self.store.host, int(self.store.port))

    def identities(self) -> list[str]:
        """Each gathered host's identity (its worker id), in position order (after ``gather``)."""
        assert self.round_store is not None
        return [self.round_store.get(f"rlrun/host/{p}").decode() for p in range(self.hosts)]

    def came(self) -> int | None:
        """How many hosts came to this gathering (None where the store no longer answers)."""
        try:
            return int(self.store.add(self.ARRIVALS, 0))
        except Exception:  # noqa: BLE001 - a count for the message only
            return None

    def fail(self, message: str) -> None:
        """Tell the other hosts this one cannot go on (its ranks failed, or it could not start them): the
        leader ends its ranks (or its gathering) with ``message`` rather than waiting in a collective."""
        try:
            self.store.set(self.FAILED, f"{self.identity}: {message}")
        except Exception:  # noqa: BLE001 - the leader's store is gone: so is the run's leader
            log.debug("could not report a host failure", exc_info=True)

    def failed(self) -> str | None:
        """A host's ``fail`` message, if one came (None where the store no longer answers)."""
        try:
            if self.store.check([self.FAILED]):
                return str(self.store.get(self.FAILED).decode())
        except Exception:  # noqa: BLE001 - nothing to read
            return None
        return None

    def stop(self) -> None:
        """Close the rendezvous from another thread: every host waiting in ``gather`` stops waiting. A
        handler of its own does it (torch's handlers are not shared between threads); the state it closes
        is the one every host's handler reads."""
        self.stopped = True
        try:
            self._handler().set_closed()
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting on it
            log.debug("could not close the rendezvous", exc_info=True)

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handler = None  # its store server (torch's, on the first host) ends with it
