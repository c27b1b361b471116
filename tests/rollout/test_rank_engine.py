"""The ranks of a host share one engine process (trainer/rollout/rank_engine.py): a GRPO run with
``engine: vllm_server`` on 2 gloo ranks of one host (FSDP2) starts exactly one vLLM server, and on two
hosts of one rank each (DDP, FSDP2 with a LoRA adapter merged) one per host; the engines generate every
rank's share and follow every update (the engine's log-probs of the sampled tokens equal the trainer's at
every step, after the weights moved), greedy held-out decoding through them equals the one-process
transformers run's, and the engines are stopped when the run ends. A failed start reaches every rank."""

from __future__ import annotations

import functools
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from tests.loops.host_helpers import two_hosts
from tests.loops.rank_helpers import memory_reporter, metrics_and_result, rank_context
from tests.rollout.test_served_engine import LOGPROB_TOLERANCE, ROWS, engine_python_or_skip, engine_servers
from trainer.loops import LOOPS
from trainer.rank_launch import RankFailed, RankJob, launch
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks"),
]

STEPS = 3


def spec(engine: str, sharding: str = "ddp", hosts: int = 1, adapter: bool = False) -> dict[str, Any]:
    devices = 1 if engine == "hf" or hosts > 1 else 2
    return {
        **({"adapter": {"r": 4, "alpha": 8}} if adapter else {}),
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(uuid.uuid4()),
        "rewards": [{"name": "length_penalty", "params": {"target_tokens": 3}}],
        "resources": {"devices": devices, "nodes": hosts, "sharding": sharding},
        "hyperparameters": {
            "engine": engine,
            "max_steps": STEPS,
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
            "max_prompt_length": 16,
            "temperature": 0.8,
            "learning_rate": 1e-2,
            "entropy_coef": 0.05,  # the weights move every step, also when a step's groups all scored alike
            "eval_every": STEPS,
            "dynamic_sampling": False,
        },
    }


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = parent_of(pid)
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def engine_roots(pids: set[int]) -> set[int]:
    """The servers among ``pids`` that are not a child of another: vLLM forks its engine core from the
    server, and the child shows the server's command line until it sets its own title (a moment that a
    loaded machine stretches long enough to be sampled)."""
    roots = set()
    for pid in pids:
        try:
            if parent_of(pid) not in pids:
                roots.add(pid)
        except OSError:
            continue
    return roots


class EngineCount:
    """This test's own vLLM servers (started below this process: another xdist worker may run its own),
    sampled every 0.2 s: the most at once, and every one seen."""

    def __init__(self) -> None:
        self.most, self.seen = 0, set[int]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        me = os.getpid()
        while not self._stop.wait(0.2):
            own = engine_roots({pid for pid in engine_servers() if descends_from(pid, me)})
            self.most, self.seen = max(self.most, len(own)), self.seen | own

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def two_ranks(run: dict[str, Any], tiny_cache: Path, out: Path) -> dict[str, Any]:
    """``run`` on 2 ranks: of one host, or one on each of two hosts (``resources.nodes``: two threads of
    this process as hosts, tests/loops/test_hosts.py)."""
    job = RankJob(
        spec=run,
        data=RunData(train=ROWS, validation=ROWS),
        context=functools.partial(rank_context, str(tiny_cache), str(out)),
        reporter=memory_reporter,
        collect=metrics_and_result,
        sharding=run["resources"]["sharding"],
    )
    if run["resources"]["nodes"] > 1:
        lead, _ = two_hosts(job)
        return dict(lead)
    result: dict[str, Any] = launch(job, 2)
    return result


def test_the_ranks_of_a_host_share_one_engine_that_follows_every_update(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """FSDP2 on one host's 2 ranks: one engine, which rank 1 follows and rank 0 syncs as the shards are
    gathered. DDP on 2 hosts of one rank each: an engine per host, each synced by its own host's rank. FSDP2
    on 2 hosts with a LoRA adapter: an engine per host, each fed the merged weights from the same gathers
    (a fresh adapter leaves the model as it was, so step 0's greedy answers are still the base's)."""
    engine_python_or_skip()
    reporter = MemoryReporter()
    one = LOOPS["grpo"](
        parse_spec(spec("hf")),
        RunData(train=ROWS, validation=ROWS),
        reporter,
        loop_ctx(tiny_cache, tmp_path / "hf"),
    )
    assert one.status == "succeeded", reporter.events
    hf = {(step, key): value for step, key, value in reporter.metrics}
    eval_keys = [k for (step, k) in hf if step == 0 and k.startswith("eval/")]
    assert "eval/response_length" in eval_keys
    for sharding, hosts, adapter in (("fsdp", 1, False), ("ddp", 2, False), ("fsdp", 2, True)):
        count = EngineCount()
        try:
            run = spec("vllm_server", sharding, hosts, adapter)
            result = two_ranks(run, tiny_cache, tmp_path / f"{sharding}-{hosts}")
        finally:
            most = count.stop()
        assert result["status"] == "succeeded", result
        assert most == hosts, f"{sharding}: {most} engine processes at once"  # one per host
        assert count.seen and not count.seen & engine_servers()  # stopped when the run ended
        got = {(step, key): value for step, key, value in result["metrics"]}
        # greedy held-out decoding of the starting weights, each rank's share through the shared engine
        assert {k: got[(0, k)] for k in eval_keys} == {k: hf[(0, k)] for k in eval_keys}, sharding
        # every step's samples (both ranks' shares) scored by the engine as the trainer scores them: the
        # engine held the weights of that step, after the updates before it moved them
        for step in range(1, STEPS + 1):
            assert got[(step, "mismatch/logp_abs_diff")] < LOGPROB_TOLERANCE, (sharding, step)
            assert 1 - LOGPROB_TOLERANCE < got[(step, "mismatch/ratio_min")], (sharding, step)
            assert got[(step, "mismatch/ratio_max")] < 1 + LOGPROB_TOLERANCE, (sharding, step)
        assert got[(STEPS, "policy/entropy")] != pytest.approx(got[(1, "policy/entropy")], abs=1e-6)


def test_an_engine_that_cannot_start_fails_every_rank_with_its_reason(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_python_or_skip()
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'engine: cannot import vllm (a broken environment)' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("RLRUN_ENGINE_PYTHON", str(broken))
    with pytest.raises(RankFailed) as failed:
        two_ranks(spec("vllm_server"), tiny_cache, tmp_path / "out")
    message = str(failed.value)  # each rank's first line
    assert (
        "rank 0 of 2 failed: EngineStartError: the engine exited with code 3 before it was ready" in message
    )
    assert (
        "rank 1 of 2 failed: EngineError: rank 0 could not start the shared engine: EngineStartError: "
        "the engine exited with code 3 before it was ready"
    ) in message, message
