"""Runs across hosts with real processes: three `rlrun worker` processes stand for three hosts (each its
own RLRUN_HOME, cache and forkserver; the artifacts folder shared, as multi-host runs require), with
PostgreSQL, a private Redis and an API process that runs the reconciler (tests/integration/
test_fault_drills.py's stack). A 2-host run is gathered through torch's c10d rendezvous on the leader's
store, all or none: two such runs submitted together on the three hosts run one after the other, with
one process's losses (DDP and FSDP2; GRPO too: tests/loops/test_hosts.py), and a host killed mid-run
ends every rank of the run, which resumes from its checkpoint on the hosts left and ends with each step
once."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.flow import FINISHED, all_metrics, wait_for
from tests.integration.test_fault_drills import Proc, Stack, loss_steps, open_stack, upload
from tests.integration.test_multi_rank_runs import rank_pids

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks"),
]

LEASE_SECONDS = 6


class Hosts:
    """The stack and its worker processes, one per "host"."""

    def __init__(self, stack: Stack):
        self.stack, self.procs = stack, []

    def start(self) -> Proc:
        n = len(self.procs)
        home = self.stack.home / f"host{n}"
        home.mkdir()
        env = {**self.stack.env, "RLRUN_HOME": str(home)}
        proc = Proc(f"host{n}", [sys.executable, "-m", "rlrun.cli", "worker"], env, self.stack.home).start()
        self.procs.append(proc)
        self.stack.workers.append(proc)  # stopped with the stack
        return proc

    def home_of(self, worker_id: str) -> Path:
        pid = int(worker_id.rsplit(":", 1)[1])
        for proc in self.procs:
            if proc.p is not None and proc.p.pid == pid:
                return Path(proc.env["RLRUN_HOME"])
        raise AssertionError(f"no host of this test is {worker_id}")

    def proc_of(self, worker_id: str) -> Proc:
        home = self.home_of(worker_id)
        return next(p for p in self.procs if p.env["RLRUN_HOME"] == str(home))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    home = tmp_path_factory.mktemp("multi-host")
    env = {
        "RLRUN_ARTIFACTS_DIR": str(home / "shared-artifacts"),  # storage every host mounts at one path
        "RLRUN_HOST_ADDRESS": "127.0.0.1",
        "RLRUN_RENDEZVOUS_TIMEOUT_SECONDS": "120",
        "RLRUN_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    with open_stack(home, **env) as stack:
        h = Hosts(stack)
        for _ in range(3):
            h.start()
        yield h


def submit(hosts: Hosts, dataset_id: str, nodes: int = 2, **hp: Any) -> str:
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": dataset_id,
        "resources": {"nodes": nodes, "devices": 1, "sharding": hp.pop("sharding", "ddp")},
        "hyperparameters": {"learning_rate": 1e-3, "batch_size": 8, **hp},
    }
    resp = hosts.stack.client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    run_id: str = resp.json()["id"]
    return run_id


def events(hosts: Hosts, run_id: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = hosts.stack.client.get(
        f"/v1/runs/{run_id}/events", params={"limit": 1000}
    ).json()["data"]
    return data


def gathered(hosts: Hosts, run_id: str) -> list[dict[str, Any]]:
    return [e for e in events(hosts, run_id) if e["message"] == "2 hosts gathered"]


def losses(hosts: Hosts, run_id: str) -> list[float]:
    points = [m for m in all_metrics(hosts.stack.client, run_id) if m["key"] == "loss"]
    return [m["value"] for m in sorted(points, key=lambda m: m["step"])]


def test_two_2_host_runs_on_3_hosts_run_one_after_the_other_and_both_finish(hosts: Hosts) -> None:
    """A DDP and an FSDP2 run on two hosts each, and the same run on one process beside them, submitted
    together to three single-task workers: the 2-host runs cannot train at once (2 + 2 > 3), so one
    waits while the other trains; neither deadlocks, each is gathered once (no timeout), both finish, and
    their losses are the one process's."""
    dataset = upload(hosts.stack.client, 64)
    runs = [submit(hosts, dataset, max_steps=12, sharding=sharding) for sharding in ("ddp", "fsdp")]
    one = submit(hosts, dataset, nodes=1, max_steps=12)
    done = [
        wait_for(hosts.stack.client, r, lambda x: x["status"] in FINISHED, timeout=300) for r in [*runs, one]
    ]
    assert [d["status"] for d in done] == ["succeeded"] * 3, done
    expected = losses(hosts, one)
    assert len(expected) == 12
    for run_id in runs:
        assert loss_steps(hosts.stack.client, run_id) == list(range(1, 13))
        assert losses(hosts, run_id) == pytest.approx(expected, abs=1e-5)
        placed = gathered(hosts, run_id)
        assert len(placed) == 1 and len(set(placed[0]["data"]["hosts"])) == 2  # once, on two workers


def ranks_of(hosts: Hosts, run_id: str) -> list[int]:
    """The rank processes of the run's hosts of its last gathering."""
    return [
        pid
        for worker in gathered(hosts, run_id)[-1]["data"]["hosts"]
        for pid in rank_pids(hosts.home_of(worker))
    ]


def wait_for_step(hosts: Hosts, run_id: str, step: int) -> None:
    deadline = time.monotonic() + 180
    while max(loss_steps(hosts.stack.client, run_id), default=0) < step:
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        time.sleep(0.2)


def gone_within(pids: list[int], seconds: float, what: str) -> None:
    started = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() - started < seconds, what
        time.sleep(0.2)


def test_a_pause_and_a_killed_leading_host_reach_every_rank_and_the_run_resumes_each_time(
    hosts: Hosts,
) -> None:
    """One FSDP2 run on two hosts. A pause: rank 0 reads it at a step boundary and the ranks of both hosts
    stop there (a checkpoint kept); resumed, the run is gathered again. Then its leading host (the lease
    holder, with global rank 0) is killed with -9: the other host's rank ends within the lease (none left
    waiting in a collective), and the run resumes from its last checkpoint on the two hosts left. It ends
    with each step once and its final checkpoint."""
    client = hosts.stack.client
    run_id = submit(hosts, upload(client, 64), max_steps=40, checkpoint_every=4, sharding="fsdp")
    wait_for_step(hosts, run_id, 3)
    ranks = ranks_of(hosts, run_id)
    assert len(ranks) == 2, ranks
    assert client.post(f"/v1/runs/{run_id}/pause").status_code == 200
    paused = wait_for(client, run_id, lambda r: r["status"] in ("paused", *FINISHED), timeout=120)
    assert paused["status"] == "paused", paused
    gone_within(ranks, 10, "a rank outlived the pause")
    at_pause = max(loss_steps(client, run_id))
    assert at_pause < 30
    assert client.post(f"/v1/runs/{run_id}/resume").status_code == 200
    wait_for_step(hosts, run_id, at_pause + 2)
    assert len(gathered(hosts, run_id)) == 2  # gathered again after the resume
    leader, joiner = gathered(hosts, run_id)[-1]["data"]["hosts"]
    joiner_ranks = rank_pids(hosts.home_of(joiner))
    assert len(joiner_ranks) == 1, joiner_ranks
    hosts.proc_of(leader).kill9()
    gone_within(joiner_ranks, LEASE_SECONDS, "the other host's rank outlived the lease")
    done = wait_for(client, run_id, lambda r: r["status"] in FINISHED, timeout=300)
    assert done["status"] == "succeeded", done
    assert loss_steps(client, run_id) == list(range(1, 41))  # each step once (upserted on resume)
    resumed = [
        e["message"] for e in events(hosts, run_id) if e["message"].startswith("resumed from checkpoint")
    ]
    assert len(resumed) == 2 and resumed[0] == f"resumed from checkpoint at step {at_pause}", resumed
    last = gathered(hosts, run_id)[-1]["data"]["hosts"]
    assert len(gathered(hosts, run_id)) == 3 and leader not in last and len(set(last)) == 2  # the hosts left
    checkpoints = client.get(f"/v1/runs/{run_id}/checkpoints").json()
    assert max(c["step"] for c in checkpoints) == 40
