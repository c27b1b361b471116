"""The generation engine for real: vLLM's server started from the engine environment (.venv-engine, built
by `make engine`) on the tiny preset, once for this module, against the transformers engine on the same
weights."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import IN_CI
from tests.loop_context import loop_ctx
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.phases import RunStopped
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.engine_front import EngineFront
from trainer.rollout.engine_process import (
    EngineOptions,
    EngineProcess,
    EngineStartError,
    EngineUnavailable,
    engine_python,
)
from trainer.rollout.episodes import EpisodeLimits, MultiTurnEngine
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.served_engine import ServedEngine, start_served_engine
from trainer.rollout.tool_episodes import tool_episodes
from trainer.rollout.turn_format import TurnFormat
from trainer.specs import parse_spec
from trainer.stop_watch import raise_in_thread

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
# fp32 on both sides: measured max |delta log p| 1e-6 on this machine; the bound leaves room for other
# CPUs' kernels, far below what a wrong token, position or temperature would give (>= 0.1).
LOGPROB_TOLERANCE = 1e-3


def engine_python_or_skip() -> Path:
    try:
        return engine_python()
    except EngineUnavailable as exc:
        if IN_CI:
            raise
        pytest.skip(str(exc))


# A checkpoint's own sampling defaults (Qwen2.5-7B-Instruct's generation_config.json carries
# repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7), which vLLM's server applies to every
# setting a request leaves out unless started with `--generation-config vllm`. A rollout must sample what
# its request says (the trainer's log-probs assume it), so the module's engine serves the tiny preset with
# defaults that would change its greedy tokens (the penalty) and its sampled log-probs (top-k, min-p).
CHECKPOINT_SAMPLING_DEFAULTS = {"repetition_penalty": 1.5, "top_k": 2, "min_p": 0.3, "temperature": 0.3}


@pytest.fixture(scope="module")
def engine(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEngine]:
    python = engine_python_or_skip()
    folder = tmp_path_factory.mktemp("tiny") / "llama-0.4m"
    shutil.copytree(tiny_model_dir("llama-0.4m", tiny_cache), folder)
    config = folder / "generation_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | CHECKPOINT_SAMPLING_DEFAULTS))
    options = EngineOptions(model_dir=folder, max_model_len=MAX_MODEL_LEN)
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EngineProcess(options, log_path=log, python=python) as process:
        served = ServedEngine(process.base_url, max_model_len=MAX_MODEL_LEN, process=process)
        try:
            yield served
        finally:
            served.close()


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=10, greedy=True)


def test_greedy_tokens_equal_the_transformers_engine_before_and_after_a_sync(
    engine: ServedEngine, tiny: tuple[Any, Any], eos_prone: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    model, tokenizer = tiny
    engine.sync_weights(model)  # the preset as loaded (another test may have synced other weights)
    before = engine.generate(prompts, 1, greedy())
    expected = HFEngine(model, tokenizer).generate(prompts, 1, greedy())
    assert [c.token_ids for c in before] == [c.token_ids for c in expected]

    # the EOS-prone copy: some completions stop on EOS, which both engines keep as the last token
    other, _ = eos_prone
    engine.sync_weights(other)
    after = engine.generate(prompts, 2, greedy())
    expected_after = HFEngine(other, tokenizer).generate(prompts, 2, greedy())
    assert [(c.prompt_index, c.token_ids, c.finish_reason) for c in after] == [
        (c.prompt_index, c.token_ids, c.finish_reason) for c in expected_after
    ]
    assert {c.finish_reason for c in after} == {"eos", "length"}
    assert all(c.token_ids[-1] == tokenizer.eos_token_id for c in after if c.finish_reason == "eos")
    assert [c.token_ids for c in after[::2]] != [c.token_ids for c in before]  # the sync took effect


def test_sampled_log_probs_are_the_trainers_after_a_sync(
    engine: ServedEngine, tiny: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    model, _ = tiny
    moved = copy.deepcopy(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(moved)
    temperature = 0.7
    got = engine.generate(prompts, 3, SamplingParams(max_new_tokens=8, temperature=temperature))
    assert [c.prompt_index for c in got] == [i for i in range(len(prompts)) for _ in range(3)]
    for c in got:
        assert c.prompt_ids == prompts[c.prompt_index] and c.logprobs is not None
        assert len(c.logprobs) == len(c.token_ids) >= 1
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = moved(ids).logits[0, len(c.prompt_ids) - 1 : -1] / temperature
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(mine, torch.tensor(c.logprobs), atol=LOGPROB_TOLERANCE), (mine, c.logprobs)


class FirstTurnCalls:
    """Turn 1 of every episode is a fixed tool call (a policy trained to call, standing in); every later
    turn is ``engine``'s own generation."""

    def __init__(self, engine: Any, tokenizer: Any):
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Any]:
        if params.row_ids is not None:  # a later turn
            return self.engine.generate(prompts, n, params)
        call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        ids = self.tokenizer(call, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        return [
            Completion(k // n, list(prompts[k // n]), ids, call, "eos", [-1.0] * len(ids))
            for k in range(len(prompts) * n)
        ]

    def sync_weights(self, model: Any) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None: ...


def test_tool_episodes_continue_through_the_engine_as_through_transformers(
    engine: ServedEngine, tiny: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    model, tokenizer = tiny
    engine.sync_weights(model)

    def episodes(inner: Any) -> MultiTurnEngine:
        return tool_episodes(
            FirstTurnCalls(inner, tokenizer),
            tokenizer,
            ["add"],
            lambda calls: [(str(a["a"] + a["b"]), None) for _, a in calls],
            TurnFormat(tokenizer),
            EpisodeLimits(max_turns=2, max_tokens=MAX_MODEL_LEN - max(map(len, prompts))),
        )

    got = episodes(engine).generate(prompts, 1, greedy())
    expected = episodes(HFEngine(model, tokenizer)).generate(prompts, 1, greedy())
    assert [(c.token_ids, c.token_mask) for c in got] == [(c.token_ids, c.token_mask) for c in expected]
    assert all(c.episode is not None and c.episode.turns == 2 for c in got)

    # sampled second turns: the engine's log-probs are the trainer's on the whole episode, tool tokens
    # included in the context and excluded from the mask
    temperature = 0.7
    sampled = episodes(engine).generate(prompts, 2, SamplingParams(max_new_tokens=8, temperature=temperature))
    for c in sampled:
        assert c.logprobs is not None and c.token_mask is not None and len(c.logprobs) == len(c.token_ids)
        second = [i for i in range(c.token_mask.index(0), len(c.token_ids)) if c.token_mask[i]]
        assert second  # the engine's own turn
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1] / temperature
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        engine_lp = torch.tensor([c.logprobs[i] for i in second])
        assert torch.allclose(mine[second], engine_lp, atol=LOGPROB_TOLERANCE), (mine[second], engine_lp)


def test_an_adapter_policy_syncs_only_its_lora_and_the_sampler_follows_it(
    tiny_cache: Path, prompts: list[list[int]]
) -> None:
    engine_python_or_skip()
    from peft import LoraConfig, get_peft_model

    folder = tiny_model_dir("llama-0.4m", tiny_cache)
    base, tokenizer = load_causal_lm(str(folder))
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))

    def move_adapter(seed: int) -> None:  # B starts at 0 (a no-op adapter): make each version matter
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3)

    def tokens(completions: list[Any]) -> list[list[int]]:
        return [c.token_ids for c in completions]

    restarts: list[str] = []
    served = start_served_engine(
        str(folder), policy, max_model_len=MAX_MODEL_LEN, on_restart=restarts.append, adapter_sync="lora"
    )
    try:
        with policy.disable_adapter():
            base_tokens = tokens(HFEngine(policy, tokenizer).generate(prompts, 1, greedy()))
        versions = []
        for seed in (1, 2):
            move_adapter(seed)
            served.sync_weights(policy)
            got = tokens(served.generate(prompts, 1, greedy()))
            assert got == tokens(HFEngine(policy, tokenizer).generate(prompts, 1, greedy()))
            versions.append(got)
            # the sampler's log-probs are the adapter's, at the sampling temperature
            for c in served.generate(prompts[:2], 2, SamplingParams(max_new_tokens=6, temperature=0.7)):
                ids = torch.tensor([c.prompt_ids + c.token_ids])
                with torch.no_grad():
                    logits = policy(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1] / 0.7
                mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
                assert torch.allclose(mine, torch.tensor(c.logprobs), atol=LOGPROB_TOLERANCE)
        assert versions[0] != base_tokens and versions[1] != versions[0]  # each sync took effect
        assert [p.name for p in served.weights_dir.iterdir()] == ["adapter-2"]  # the older one unloaded

        # the engine dies (OOM killer, a crash): the next call starts it again with the adapter last synced
        assert served.process is not None and served.process.proc is not None
        dead = served.process.proc
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        assert tokens(served.generate(prompts, 1, greedy())) == versions[1]
        assert len(restarts) == 1 and "exited (code -9); started it again" in restarts[0]

        # the same engine behind `rlrun engine --remote`'s front: a worker elsewhere uploads its adapter
        # (a tar of peft's folder), the front loads it from its own folder, and unloads it at the close
        uploads = Path(tempfile.mkdtemp(prefix="rlrun-test-front-"))
        front = EngineFront(served.base_url, "t0ken", uploads, host="127.0.0.1")
        remote = ServedEngine(
            f"http://127.0.0.1:{front.port}",
            max_model_len=MAX_MODEL_LEN,
            token="t0ken",
            upload=True,
            adapter_sync="lora",
        )
        try:
            move_adapter(3)
            remote.sync_weights(policy)
            got = tokens(remote.generate(prompts, 1, greedy()))
            assert got == tokens(HFEngine(policy, tokenizer).generate(prompts, 1, greedy()))
            assert got not in versions
            assert [p.name for p in (uploads / "adapters").iterdir()] == [remote.model_name]
            remote.close()
            assert not any((uploads / "adapters").iterdir())  # unloaded, its folder removed
        finally:
            remote.close()
            front.close()
            shutil.rmtree(uploads, ignore_errors=True)
    finally:
        served.close()
    assert served.process is not None and served.process.proc is None


def test_a_merged_adapter_sync_serves_the_policy_without_touching_it_or_running_lora(
    engine: ServedEngine, tiny_cache: Path, prompts: list[list[int]]
) -> None:
    """The default on CPU: the adapter folded into the base and reloaded as full weights (the module's
    engine runs the same base without LoRA); the policy's own weights stay bit for bit as they were."""
    from tests.factories import lora_policy

    base, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    policy = lora_policy(base, seed=3, std=0.3)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    merged = ServedEngine(engine.base_url, max_model_len=MAX_MODEL_LEN, adapter_sync="merged")
    try:
        merged.sync_weights(policy)
        got = [c.token_ids for c in merged.generate(prompts, 1, greedy())]
    finally:
        merged.close()
    assert got == [c.token_ids for c in HFEngine(policy, tokenizer).generate(prompts, 1, greedy())]
    with policy.disable_adapter():
        assert got != [c.token_ids for c in HFEngine(policy, tokenizer).generate(prompts, 1, greedy())]
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())


def test_a_cancel_during_generation_lands_within_seconds_and_the_engine_drops_the_work(
    engine: ServedEngine, prompts: list[list[int]]
) -> None:
    long = SamplingParams(max_new_tokens=MAX_MODEL_LEN - 16, temperature=1.0)  # the prompts have <= 12 tokens
    main = threading.get_ident()
    # what trainer/stop_watch.py does when a run is cancelled: RunStopped raised into the run's thread
    timer = threading.Timer(1.0, lambda: raise_in_thread(main, RunStopped))
    began = time.monotonic()
    timer.start()
    with pytest.raises(RunStopped):
        engine.generate(prompts * 40, 16, long)  # ~360k tokens: minutes of work
    timer.join()
    assert time.monotonic() - began < 5
    began = time.monotonic()  # the dropped requests were aborted: a small call is answered at once
    assert len(engine.generate(prompts, 1, greedy())) == len(prompts)
    assert time.monotonic() - began < 5


def test_the_engines_worker_spins_50_ms_after_a_step_not_a_second(tmp_path: Path) -> None:
    """vLLM's worker busy-waits a second after each step, stealing a core from the update that follows;
    the engine's start-up patch (trainer/rollout/engine_site/sitecustomize.py) cuts it to 50 ms."""
    python = engine_python_or_skip()
    module = "vllm.distributed.device_communicators.shm_broadcast"
    code = (
        f"import inspect, {module} as m; "
        "print(inspect.signature(m.SpinCondition).parameters['busy_loop_s'].default)"
    )
    env = EngineOptions(model_dir=tmp_path).environment()
    patched = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert patched.stdout.strip() == "0.05", patched.stderr[-2000:]
    unpatched = subprocess.run(
        [str(python), "-c", code], env=env | {"PYTHONPATH": ""}, capture_output=True, text=True, timeout=300
    )
    assert unpatched.stdout.strip() == "1", unpatched.stderr[-2000:]  # what vLLM does on its own


def test_the_engine_core_is_forked_from_the_server_into_its_process_group(engine: ServedEngine) -> None:
    """vLLM's server spawns its engine core (a fresh interpreter importing vLLM again, ~4.5 s of a start);
    the start-up patch (trainer/rollout/engine_site/sitecustomize.py) has it forked, as vLLM's library
    does, where the model runs in the core. The patch's fork hook logs each process forked (a spawn runs no
    Python fork hook). The core stays in the server's process group, which the owner watch and ``stop()``
    end."""
    assert engine.process is not None and engine.process.proc is not None
    server = engine.process.proc.pid

    def stat(pid: int) -> list[str]:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()

    children = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and int(stat(int(p.name))[1]) == server
    ]
    assert len(children) == 1, children  # the engine core, and no worker process (the model runs in it)
    core = children[0]
    assert f"rlrun engine_site: process {core} forked from {server}" in engine.process.log_path.read_text()
    assert stat(core)[3] == stat(server)[3] == str(server)  # one process group, led by the server


def test_a_prompt_over_the_engines_length_is_refused_naming_the_limit(engine: ServedEngine) -> None:
    with pytest.raises(ValueError, match=f"max_model_len is {MAX_MODEL_LEN}"):
        engine.generate([[5] * 10, [5] * MAX_MODEL_LEN], 1, greedy())


def test_an_engine_that_cannot_load_its_model_fails_with_its_own_error(tmp_path: Path) -> None:
    python = engine_python_or_skip()
    empty = tmp_path / "no-model"
    empty.mkdir()
    process = EngineProcess(EngineOptions(model_dir=empty), log_path=tmp_path / "engine.log", python=python)
    with pytest.raises(EngineStartError, match="exited with code") as caught:
        process.start()
    assert str(empty) in str(caught.value)  # vLLM's own message names the folder it could not load
    assert process.proc is None or process.proc.poll() is not None


def test_a_missing_engine_environment_names_the_setting_and_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLRUN_ENGINE_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(EngineUnavailable, match="RLRUN_ENGINE_PYTHON.*make engine"):
        engine_python()


# ---------- through a run: the loops start, use and stop the engine ----------

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(4) for b in range(4)]


START = f"run:{uuid.uuid4()}"  # the EOS-prone copy, saved as a run's output: greedy lengths differ


def grpo_spec(engine: str, **hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "grpo",
            "model": START,
            "dataset_id": str(uuid.uuid4()),
            # scored by length, so the held-out accuracy depends on every greedy completion's length
            "rewards": [{"name": "length_penalty", "params": {"target_tokens": 3}}],
            "hyperparameters": {
                "engine": engine,
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
                "max_prompt_length": 16,
                "temperature": 0.8,  # the trainer's log-probs are of the tempered distribution too
                "learning_rate": 1e-2,
                "eval_every": 2,
                "dynamic_sampling": False,
                **hp,
            },
        }
    )


def engine_servers(owner: int | None = None) -> set[int]:
    """Pids of running vLLM OpenAI servers; with ``owner``, only those process ``owner`` started (their
    RLRUN_ENGINE_OWNER_PID, kept even if one outlived it): another xdist worker may run engines of its own."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                if b"vllm.entrypoints.openai.api_server" not in cmdline:
                    continue
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if owner is None or f"RLRUN_ENGINE_OWNER_PID={owner}".encode() in environ:
                found.add(int(proc.name))
    return found


@pytest.fixture(scope="module")
def eos_prone_folder(eos_prone: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("eos-prone")
    model, tokenizer = eos_prone
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_grpo_run_generates_through_the_engine_and_stops_it(
    engine: ServedEngine, eos_prone_folder: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    before = engine_servers(os.getpid())  # the module's own engine
    data = RunData(train=ROWS, validation=ROWS)
    runs = {}
    # the third: step 2's rollouts generated by the engine while step 1 trained (one step off-policy)
    # (an entropy bonus moves the weights at every step, also when a step's groups all scored alike)
    overlapped = {
        "async_rollouts": 1,
        "importance_sampling_cap": 2.0,
        "max_steps": 3,
        "eval_every": 3,
        "entropy_coef": 0.05,
    }
    for name, engine_name, hp in [
        ("hf", "hf", {}),
        ("vllm_server", "vllm_server", {}),
        ("async", "vllm_server", overlapped),
    ]:
        reporter = MemoryReporter()
        ctx = loop_ctx(tiny_cache, tmp_path / name, runs={START: eos_prone_folder})
        result = LOOPS["grpo"](grpo_spec(engine_name, **hp), data, reporter, ctx)
        assert result.status == "succeeded", reporter.events
        runs[name] = {(step, key): value for step, key, value in reporter.metrics}
    assert engine_servers(os.getpid()) == before  # the run's engine was stopped when the loop returned
    # step 0's held-out accuracy is greedy decoding of the same starting weights: both engines agree
    eval_keys = [k for (step, k) in runs["hf"] if step == 0 and k.startswith("eval/")]
    assert "eval/response_length" in eval_keys
    assert {k: runs["vllm_server"][(0, k)] for k in eval_keys} == {k: runs["hf"][(0, k)] for k in eval_keys}
    assert 1 < runs["hf"][(0, "eval/response_length")] < 6  # some stop on EOS, some run to the limit
    assert "reward/mean" in {k for _, k in runs["vllm_server"]}
    # the engine's log-probs of its samples against the trainer's, every step (fp32 on both sides)
    served = {k: v for (step, k), v in runs["vllm_server"].items() if step == 2}
    assert served["mismatch/logp_abs_diff"] < LOGPROB_TOLERANCE
    assert (
        1 - LOGPROB_TOLERANCE
        < served["mismatch/ratio_min"]
        <= served["mismatch/ratio_max"]
        < 1 + LOGPROB_TOLERANCE
    )
    assert not any(k.startswith("mismatch/") for _, k in runs["hf"])  # same kernels: nothing to compare
    # async: step 1 in the foreground, then each step's rollouts generated during the previous update with
    # the engine's log-probs compared every step (which weights they came from is tested with a snapshot
    # engine in tests/loops/test_async_rollouts.py)
    overlapped_run = runs["async"]
    assert {k: overlapped_run[(0, k)] for k in eval_keys} == {k: runs["hf"][(0, k)] for k in eval_keys}
    assert sorted(s for s, k in overlapped_run if k == "perf/gen_background_s") == [2, 3]
    for step in (1, 2, 3):
        assert overlapped_run[(step, "mismatch/logp_abs_diff")] >= 0
        assert 0 <= overlapped_run[(step, "mismatch/capped_frac")] <= 1


def test_a_run_whose_engine_cannot_start_fails_saying_why(tiny_cache: Path, tmp_path: Path) -> None:
    engine_python_or_skip()
    broken = tmp_path / "python"  # says what it was started with, then fails
    broken.write_text(
        "#!/bin/sh\necho \"engine: $*\" >&2\necho 'engine: cannot import vllm (a broken environment)' >&2\n"
        "exit 3\n"
    )
    broken.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLRUN_ENGINE_PYTHON", str(broken))
        with pytest.raises(EngineStartError, match="cannot import vllm") as caught:
            LOOPS["grpo"](
                grpo_spec("vllm_server", seed=7),
                RunData(train=ROWS, validation=ROWS[:6]),
                MemoryReporter(),
                loop_ctx(
                    tiny_cache, tmp_path / "out", runs={START: tiny_model_dir("llama-0.4m", tiny_cache)}
                ),
            )
    # the engine samples with the run's seed (its requests carry none): --seed 7, not vLLM's default 0
    assert "--seed 7 " in str(caught.value)


# ---------- a start that does not finish leaves nothing behind ----------


def never_ready(tmp_path: Path) -> Path:
    """A stand-in for the engine's python that starts and never answers (only the waiting is tested)."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec sleep 600\n")
    script.chmod(0o755)
    return script


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def started_pids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pids of the processes started from here on (the engine server's own)."""
    pids: list[int] = []
    original = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> Any:
        proc = original(*args, **kwargs)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording)
    return pids


def test_a_start_cancelled_by_the_runs_stop_watch_stops_the_engine(
    tmp_path: Path, started_pids: list[int]
) -> None:
    process = EngineProcess(EngineOptions(model_dir=tmp_path), python=never_ready(tmp_path))
    log_dir = process.log_path.parent
    main = threading.get_ident()
    # what trainer/stop_watch.py does when a cancel lands in the model_load phase
    timer = threading.Timer(1.0, lambda: raise_in_thread(main, RunStopped))
    timer.start()
    with pytest.raises(RunStopped):
        process.start()
    timer.join()
    assert started_pids and all(gone(pid) for pid in started_pids)
    assert process.proc is None and not log_dir.exists()  # its own log folder goes with it


def test_a_start_that_times_out_stops_the_engine(tmp_path: Path, started_pids: list[int]) -> None:
    process = EngineProcess(
        EngineOptions(model_dir=tmp_path), python=never_ready(tmp_path), startup_timeout=1
    )
    with pytest.raises(EngineStartError, match="did not answer /health within 1 s"):
        process.start()
    assert started_pids and all(gone(pid) for pid in started_pids)


def answers_health(tmp_path: Path) -> Path:
    """A stand-in for the engine's python: this project's python with the engine's environment (its
    start-up file among it), answering /health on the port it is given (the engine's ``--port``) and
    starting a child of its own, as vLLM's server starts its engine core."""
    script = tmp_path / "python"
    server = (
        "import http.server, subprocess, sys\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()\n"
    )
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{server}" "$@"\n')
    script.chmod(0o755)
    return script


def test_an_engine_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A worker or rank killed with -9 leaves no engine behind: each engine process watches its starter
    (trainer/rollout/engine_site/sitecustomize.py) and ends its process group, child included."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from trainer.rollout.engine_process import EngineOptions, EngineProcess\n"
            "p = EngineProcess(EngineOptions(model_dir=Path(sys.argv[1])), python=Path(sys.argv[2]))\n"
            "p.start()\n"
            "print(p.proc.pid, flush=True)\n"
            "time.sleep(600)\n",
            str(tmp_path),
            str(answers_health(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    started = 0
    try:
        assert owner.stdout is not None
        server = started = int(owner.stdout.readline())  # answering /health: its child is started
        group = started_in_group(server)
        assert len(group) == 2, group  # the server and its child
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while started_in_group(server):
            assert time.monotonic() < deadline, "the engine outlived its starter by 10 s"
            time.sleep(0.1)
    finally:
        owner.kill()
        owner.wait(timeout=10)
        if started and started_in_group(started):  # this test's failure must not leave it running
            os.killpg(started, signal.SIGKILL)


def started_in_group(group: int) -> list[int]:
    """Running (not zombie) processes of process group ``group``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == group:
                found.append(int(entry.name))
    return found


def test_a_killed_engine_restarts_with_the_full_weights_last_synced(
    engine: ServedEngine, eos_prone: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    """Last in the module: it kills the module's engine (the next call starts it again)."""
    other, _ = eos_prone
    engine.sync_weights(other)  # weights the engine's folder does not hold
    before = engine.generate(prompts, 1, greedy())
    restarts: list[str] = []
    engine.on_restart = restarts.append
    assert engine.process is not None and engine.process.proc is not None
    dead = engine.process.proc
    os.killpg(dead.pid, signal.SIGKILL)
    dead.wait()
    after = engine.generate(prompts, 1, greedy())
    assert [c.token_ids for c in after] == [
        c.token_ids for c in before
    ]  # the synced weights, not the folder's
    assert len(restarts) == 1 and "started it again with the last synced weights" in restarts[0]
