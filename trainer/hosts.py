"""One run's ranks on several hosts: the hosts meet through torch elastic's own rendezvous, all or none.

A run with ``resources.nodes > 1`` is led by the worker that claimed it (its lease holder, where global
rank 0 trains and talks to the database) and joined by ``nodes - 1`` other workers. The hosts gather with
torch's dynamic rendezvous (``DynamicRendezvousHandler`` on the ``c10d`` backend, what ``torchrun
--rdzv-backend c10d`` runs), its state kept in a ``TCPStore`` the leader serves at the address it publishes
on the run: the rendezvous admits exactly ``nodes`` hosts (``min_nodes = max_nodes``) within the join
timeout, or none of them (each side's ``next_rendezvous`` raises). Placement is therefore all or none, and
a host that waits for a run that cannot gather gives up after the timeout instead of holding it forever.

Then each host starts its ``devices`` ranks with ``trainer.rank_launch.launch`` at its place in the world:
the leader's host takes global ranks ``0 .. devices - 1``, the others follow in the rendezvous' order.
The ranks meet as ``torchrun``'s do: the TCPStore of the rendezvous' first host is the process group's
store (``TORCHELASTIC_USE_AGENT_STORE``), at the address the rendezvous hands every host
(``RendezvousInfo.bootstrap_store_info``).
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


class Rendezvous:
    """One host's part of a run's rendezvous (a context manager: its heartbeats and, on the host the
    rendezvous ranks first, the process group's store server, live until it closes)."""

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
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        self.store, self.hosts, self.leader, self.timeout = store, hosts, leader, timeout
        self.identity, self.stopped, self.round_store = identity or address, False, None
        self.arrivals = f"rlrun/arrived/{key}"
        backend = C10dRendezvousBackend(store, key)
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id=key,
            store=store,
            backend=backend,
            min_nodes=hosts,
            max_nodes=hosts,
            local_addr=address,
            timeout=RendezvousTimeout(join=timedelta(seconds=timeout), last_call=timedelta(seconds=1)),
        )

    def gather(self) -> HostPlace:
        """Wait for every host of the run (``HostsNotGathered`` after the timeout); this host's place."""
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        self.store.add(self.arrivals, 1)
        try:
            info = self.handler.next_rendezvous()
        except RendezvousError as exc:
            came = self.came()
            raise HostsNotGathered(
                f"{self.hosts} hosts did not gather within {self.timeout:g} s"
                + (f" ({came} came)" if came is not None else "")
                + (
                    ": the rendezvous was closed"
                    if self.stopped or "closed" in type(exc).__name__.lower()
                    else ""
                )  # fmt: skip
            ) from exc
        node, world = info.rank, info.world_size
        if world != self.hosts:  # min_nodes = max_nodes: torch admits exactly that many
            raise HostsNotGathered(f"the rendezvous admitted {world} hosts, not {self.hosts}")
        if self.leader:
            info.store.set(LEADER_KEY, str(node))
        leader_node = int(info.store.get(LEADER_KEY).decode())
        # the leader's host first, then the others in the rendezvous' order
        position = 0 if node == leader_node else node + 1 if node < leader_node else node
        info.store.set(f"rlrun/host/{position}", self.identity)
        self.round_store = info.store
        boot = info.bootstrap_store_info
        assert boot is not None
        return HostPlace(position, world, boot.master_addr, int(boot.master_port))

    def identities(self) -> list[str]:
        """Each gathered host's identity (its worker id), in position order (after ``gather``)."""
        assert self.round_store is not None
        return [self.round_store.get(f"rlrun/host/{p}").decode() for p in range(self.hosts)]

    def came(self) -> int | None:
        """How many hosts came to this gathering (None where the store no longer answers)."""
        try:
            return int(self.store.add(self.arrivals, 0))
        except Exception:  # noqa: BLE001 - a count for the message only
            return None

    def stop(self) -> None:
        """Close the rendezvous from another thread: every host waiting in ``gather`` stops waiting."""
        self.stopped = True
        self.handler.set_closed()

    def close(self) -> None:
        try:
            self.handler.shutdown()
        except Exception:  # noqa: BLE001 - torch logs it; a peer may have ended the store already
            log.debug("rendezvous shutdown failed", exc_info=True)

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
