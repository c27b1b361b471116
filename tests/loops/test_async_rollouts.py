"""One step off-policy rollouts (``async_rollouts: 1``, trainer/loops/async_rollouts.py) through the GRPO and
PPO loops, with a stand-in engine that samples from a snapshot of the weights last synced to it (what a
separate engine process holds) and reports that snapshot's log-probs: which weights each step's rollouts
came from, that the engine's weights never change mid-generation, the prompts drawn, resume, a background
failure and a cancel. The real engine runs an async GRPO run in tests/rollout/test_served_engine.py."""

from __future__ import annotations

import copy
import hashlib
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.data.sampling import EpochSampler
from trainer.loops import LOOPS, rl_common
from trainer.loops.async_rollouts import clone_sampler
from trainer.phases import RunStopped
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.hf_engine import HFEngine
from trainer.specs import parse_spec
from trainer.stop_watch import raise_in_thread

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(5) for b in range(5)]


def fingerprint(model: Any) -> str:
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


class SnapshotEngine:
    """Samples with the transformers engine from a copy of the weights last synced (the trainer may update
    its own model meanwhile, as beside a real engine process); reports that copy's log-probs at the sampling
    temperature. Records each call's weights (``version``: the order in which distinct weights were first
    synced) and prompts, and any sync that arrived while a generation ran."""

    def __init__(self, tokenizer: Any, slow_from_call: int | None = None, fail_on_call: int | None = None):
        self.tokenizer = tokenizer
        self.versions: dict[str, int] = {}
        self.version = -1
        self.snapshot: Any = None
        self.calls: list[tuple[int, bool, list[list[int]]]] = []  # (version, greedy, prompts)
        self.overlaps: list[str] = []
        self.generating = threading.Event()
        self.slow_from_call, self.fail_on_call = slow_from_call, fail_on_call
        self.slow_started = threading.Event()
        self.slow_interrupted = False

    def sync_weights(self, model: Any) -> None:
        if self.generating.is_set():
            self.overlaps.append(f"sync during generation (call {len(self.calls)})")
        key = fingerprint(model)
        self.version = self.versions.setdefault(key, len(self.versions))
        self.snapshot = copy.deepcopy(model).eval()

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        self.generating.set()
        try:
            call = len(self.calls)
            self.calls.append((self.version, params.is_greedy, [list(p) for p in prompts]))
            if self.fail_on_call == call:
                raise RuntimeError("the engine fell over")
            if self.slow_from_call is not None and call >= self.slow_from_call:
                self.slow_started.set()
                try:
                    for _ in range(1200):  # a minute of generation, unless stopped
                        time.sleep(0.05)
                except RunStopped:
                    self.slow_interrupted = True
                    raise
            out = HFEngine(self.snapshot, self.tokenizer).generate(prompts, n, params)
            temperature = 1.0 if params.is_greedy else params.temperature
            with torch.no_grad():
                return [self._with_logprobs(c, temperature) for c in out]
        finally:
            self.generating.clear()

    def _with_logprobs(self, c: Completion, temperature: float) -> Completion:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        logits = self.snapshot(ids).logits[0, len(c.prompt_ids) - 1 : -1] / temperature
        logp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        return Completion(
            prompt_index=c.prompt_index,
            prompt_ids=c.prompt_ids,
            token_ids=c.token_ids,
            text=c.text,
            finish_reason=c.finish_reason,
            logprobs=logp.tolist(),
        )

    def sampled(self) -> list[tuple[int, list[list[int]]]]:
        """(version, prompts) of the rollout calls (the held-out evals are greedy)."""
        return [(v, p) for v, greedy, p in self.calls if not greedy]

    def close(self) -> None:
        pass


def spec(algorithm: str, **hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "regex", "params": {"pattern": "[a-m]"}}],  # some completions match
            "hyperparameters": {
                "engine": "vllm_server",  # never started: make_engine is the stand-in
                "max_steps": 4,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
                "temperature": 1.0,
                "learning_rate": 1e-2,
                "dynamic_sampling": False,
                "eval_every": 2,
                "checkpoint_every": 2,
                **hp,
            },
        }
    )


def run(
    engine: SnapshotEngine,
    monkeypatch: pytest.MonkeyPatch,
    tiny_cache: Path,
    out: Path,
    algorithm: str = "grpo",
    resume_from: Path | None = None,
    **hp: Any,
) -> MemoryReporter:
    monkeypatch.setattr(rl_common, "make_engine", lambda name, **_: engine)
    reporter = MemoryReporter()
    result = LOOPS[algorithm](
        spec(algorithm, **hp),
        RunData(train=ROWS, validation=ROWS[:3]),
        reporter,
        loop_ctx(tiny_cache, out, resume_from=resume_from),
    )
    assert result.status == "succeeded", reporter.events
    return reporter


def metric(reporter: MemoryReporter, key: str) -> dict[int, float]:
    return {step: value for step, k, value in reporter.metrics if k == key}


@pytest.fixture(scope="module")
def tokenizer(tiny_cache: Path) -> Any:
    from trainer.models import load_causal_lm, tiny_model_dir

    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[1]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_each_update_trains_on_rollouts_one_update_old_drawn_as_the_sync_run_draws_them(
    algorithm: str, tokenizer: Any, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline, overlapped = SnapshotEngine(tokenizer), SnapshotEngine(tokenizer)
    sync_rep = run(inline, monkeypatch, tiny_cache, tmp_path / "sync", algorithm)
    async_rep = run(overlapped, monkeypatch, tiny_cache, tmp_path / "async", algorithm, async_rollouts=1)

    # versions count the updates done when the weights were synced: step k's rollouts come from the policy
    # after k - 1 updates on the plain path, after k - 2 (the first step's: none) with async_rollouts
    assert [v for v, _ in inline.sampled()] == [0, 1, 2, 3]
    assert [v for v, _ in overlapped.sampled()] == [0, 0, 1, 2]
    # the same prompts, in the same order
    assert [p for _, p in overlapped.sampled()] == [p for _, p in inline.sampled()]
    assert overlapped.overlaps == [] and inline.overlaps == []  # never a sync while generating (evals too)

    # the engine's log-probs are the weights it sampled with: the lag shows in the mismatch metrics
    assert all(v < 1e-4 for v in metric(sync_rep, "mismatch/logp_abs_diff").values())
    lag = metric(async_rep, "mismatch/logp_abs_diff")
    assert lag[1] < 1e-4 and min(lag[2], lag[3], lag[4]) > 1e-3
    background = metric(async_rep, "perf/gen_background_s")
    assert sorted(background) == [2, 3, 4] and all(s > 0 for s in background.values())
    assert metric(sync_rep, "perf/gen_background_s") == {}
    assert sorted(metric(async_rep, "eval/accuracy")) == [0, 2, 4]


def test_a_resumed_run_draws_the_prompts_the_uninterrupted_run_drew_and_runs_no_step_twice(
    tokenizer: Any, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = SnapshotEngine(tokenizer)
    first = run(whole, monkeypatch, tiny_cache, tmp_path / "a", async_rollouts=1)
    # the checkpoint at step 2 was written while step 3's rollouts were generating
    again = SnapshotEngine(tokenizer)
    resumed = run(
        again, monkeypatch, tiny_cache, tmp_path / "b", resume_from=first.checkpoints[2], async_rollouts=1
    )
    assert [p for _, p in again.sampled()] == [p for _, p in whole.sampled()][2:]
    assert sorted(metric(resumed, "reward/mean")) == [3, 4]
    assert [v for v, _ in again.sampled()] == [0, 0]  # step 3 in the foreground, step 4 prefetched


def test_a_failure_in_the_background_fails_the_step_that_takes_it(
    tokenizer: Any, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = SnapshotEngine(tokenizer, fail_on_call=2)  # call 0: eval, 1: step 1, 2: step 2 in the background
    with pytest.raises(RuntimeError, match="the engine fell over"):
        run(engine, monkeypatch, tiny_cache, tmp_path, async_rollouts=1)
    assert not [t for t in threading.enumerate() if t.name == "rlrun-rollouts"]


def test_a_cancel_stops_the_background_generation_within_seconds(
    tokenizer: Any, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = SnapshotEngine(tokenizer, slow_from_call=2)  # step 2's rollouts take a minute
    main = threading.get_ident()

    def cancel_once_slow() -> None:  # what trainer/stop_watch.py does when a run is cancelled
        engine.slow_started.wait(60)
        time.sleep(0.3)
        raise_in_thread(main, RunStopped)

    watcher = threading.Thread(target=cancel_once_slow)
    watcher.start()
    began = time.monotonic()
    try:
        with pytest.raises(RunStopped):
            run(engine, monkeypatch, tiny_cache, tmp_path, async_rollouts=1)
    finally:
        watcher.join()
    assert time.monotonic() - began < 30  # the minute of generation was cut short
    assert engine.slow_interrupted
    assert not [t for t in threading.enumerate() if t.name == "rlrun-rollouts"]


def test_the_background_sampler_is_a_copy_until_its_draws_are_taken() -> None:
    shared = torch.Generator().manual_seed(5)
    sampler = EpochSampler(7, 3, shared)
    sampler.next_batch()
    state = sampler.state_dict()
    mine = clone_sampler(sampler)
    drawn = [mine.next_batch() for _ in range(4)]  # crosses an epoch: a new permutation from its generator
    assert sampler.state_dict()["order"] == state["order"]
    assert torch.equal(shared.get_state(), state["generator"])  # the run's generator untouched
    sampler.load_state_dict(mine.state_dict())
    replay = EpochSampler(7, 3, torch.Generator())
    replay.load_state_dict(state)
    assert [replay.next_batch() for _ in range(4)] == drawn  # the copy drew what the run's sampler would


def test_async_rollouts_needs_an_engine_in_its_own_process() -> None:
    refused = "async_rollouts needs engine 'vllm_server'"
    with pytest.raises(ValueError, match=f"{refused}.*very model being updated"):
        spec("grpo", engine="hf", async_rollouts=1)
    with pytest.raises(ValueError, match="async_rollouts needs engine 'vllm_server'"):
        spec("ppo", engine="vllm", async_rollouts=1)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        spec("grpo", async_rollouts=2)
