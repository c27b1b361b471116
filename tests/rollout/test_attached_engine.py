"""A running engine that runs attach to (``RLRUN_ENGINE_URL``) instead of starting one each: ``rlrun engine``
starts it and prints its URL; a GRPO run with the setting syncs its weights into that engine, generates
through it and leaves it running (its final weights are what the engine then serves); a URL where nothing
answers, an engine too short for the run, or one not started as ``rlrun engine`` starts one (a stand-in
answering as a plain ``vllm serve`` would), fails the run saying so; Ctrl+C stops the engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import free_port, self_signed_certificate
from tests.loop_context import loop_ctx
from tests.rollout.test_rank_engine import EngineCount
from tests.rollout.test_served_engine import (
    LOGPROB_TOLERANCE,
    ROWS,
    START,
    engine_python_or_skip,
    engine_servers,
    grpo_spec,
)
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import SamplingParams
from trainer.rollout.engine_process import EngineStartError
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.served_engine import ServedEngine, attach_served_engine

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128


class RunningEngine:
    """``rlrun engine --remote`` as its own process, the URL it printed for this host's workers, and the
    front's URL and token it printed for other hosts' (its front on loopback here, over https with a
    self-signed certificate: ``ca``, which those workers trust through ``RLRUN_ENGINE_CA``)."""

    def __init__(self, folder: Path, log: Path) -> None:
        self.log = log
        self.ca, key = self_signed_certificate(log.parent / "tls")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlrun.cli", "engine", "--model", str(folder)]
            + ["--max-model-len", str(MAX_MODEL_LEN), "--remote", "--host", "127.0.0.1"]
            + ["--tls-cert", str(self.ca), "--tls-key", str(key)],
            stdout=subprocess.PIPE,
            stderr=log.open("wb"),
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.front_url = self.token = self.ca_hint = ""
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:  # the command prints once the engine answers
            if "on this host at it: RLRUN_ENGINE_URL=" in line:
                self.url = line.strip().split("RLRUN_ENGINE_URL=", 1)[1]
            if "on other hosts at it: RLRUN_ENGINE_URL=" in line:
                told = dict(word.split("=", 1) for word in line.split() if "=" in word)
                self.front_url, self.token = told["RLRUN_ENGINE_URL"], told["RLRUN_ENGINE_TOKEN"]
                self.ca_hint = self.proc.stdout.readline()
                break
            assert time.monotonic() < deadline, "rlrun engine printed no URL"
        assert self.url and self.front_url, f"rlrun engine ended without its URLs:\n{log.read_text()[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def running(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    engine_python_or_skip()
    engine = RunningEngine(
        tiny_model_dir("llama-0.4m", tiny_cache), tmp_path_factory.mktemp("engine") / "log"
    )
    try:
        yield engine
    finally:
        engine.stop()


def grpo_run(tiny_cache: Path, out: Path, start: Path, **hp: Any) -> tuple[Any, MemoryReporter]:
    reporter = MemoryReporter()
    ctx = loop_ctx(tiny_cache, out, runs={START: start})
    result = LOOPS["grpo"](
        grpo_spec("vllm_server", **hp), RunData(train=ROWS, validation=ROWS), reporter, ctx
    )
    return result, reporter


def test_a_run_attached_to_a_running_engine_trains_through_it_and_leaves_it_running(
    running: RunningEngine, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLRUN_ENGINE_URL", running.url)
    count = EngineCount()  # every vLLM server below this process while the run runs
    try:
        # an entropy bonus moves the weights at every step, also when a step's groups all scored alike
        result, reporter = grpo_run(
            tiny_cache, tmp_path / "out", tiny_model_dir("llama-0.4m", tiny_cache), entropy_coef=0.05
        )
    finally:
        count.stop()
    assert result.status == "succeeded", reporter.events
    assert count.seen == engine_servers(running.proc.pid)  # only rlrun engine's: the run started none
    assert running.proc.poll() is None  # and left the attached one running
    metrics = {(step, key): value for step, key, value in reporter.metrics}
    # the engine scored its samples as the trainer does: it held the weights of each step
    for step in (1, 2):
        assert metrics[(step, "mismatch/logp_abs_diff")] < LOGPROB_TOLERANCE, step
    # the engine now serves the run's final weights: greedy answers equal the transformers engine's on them
    final, tokenizer = load_causal_lm(str(result.output_path))
    prompts = [tokenizer(r["prompt"]).input_ids for r in ROWS[:6]]
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    served = ServedEngine(running.url, max_model_len=MAX_MODEL_LEN)
    try:
        through_engine = [c.token_ids for c in served.generate(prompts, 1, greedy)]
    finally:
        served.close()
    assert through_engine == [c.token_ids for c in HFEngine(final, tokenizer).generate(prompts, 1, greedy)]


def test_a_run_whose_old_log_probs_are_the_engines_measures_the_mismatch_in_its_first_update(
    running: RunningEngine, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # old_logprobs 'sampler' with the real engine's log-probs (on the attached engine: no start of its own)
    monkeypatch.setenv("RLRUN_ENGINE_URL", running.url)
    result, reporter = grpo_run(
        tiny_cache,
        tmp_path / "out",
        tiny_model_dir("llama-0.4m", tiny_cache),
        old_logprobs="sampler",
        ppo_epochs=2,
        minibatches=2,
        entropy_coef=0.05,
    )
    assert result.status == "succeeded", reporter.events
    metrics = {(step, key): value for step, key, value in reporter.metrics}
    for step in (1, 2):  # fp32 on both sides: the first update's log-probs are the engine's, step's weights
        assert metrics[(step, "mismatch/logp_abs_diff")] < LOGPROB_TOLERANCE, step
        assert abs(metrics[(step, "mismatch/ratio_mean")] - 1) < LOGPROB_TOLERANCE, step
    assert not any(key == "mismatch/ratio_max" for _, key in metrics)  # no recomputed pass ran


def test_a_run_whose_engine_url_answers_nothing_fails_naming_the_setting(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_python_or_skip()
    nowhere = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("RLRUN_ENGINE_URL", nowhere)
    with pytest.raises(EngineStartError, match=f"no engine answers at RLRUN_ENGINE_URL={nowhere}"):
        grpo_run(tiny_cache, tmp_path / "out", tiny_model_dir("llama-0.4m", tiny_cache))


def test_an_engine_shorter_than_the_run_needs_is_refused_naming_both_lengths(
    running: RunningEngine, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLRUN_ENGINE_URL", running.url)
    needs = 160 + 6  # max_prompt_length + max_new_tokens
    with pytest.raises(EngineStartError, match=f"holds {MAX_MODEL_LEN} tokens .* this run needs {needs}"):
        grpo_run(
            tiny_cache, tmp_path / "out", tiny_model_dir("llama-0.4m", tiny_cache), max_prompt_length=160
        )
    assert running.proc.poll() is None


def test_a_run_on_an_engine_behind_its_front_uploads_its_weights_through_it(
    running: RunningEngine, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what a worker on another host sets: no folder is shared, the front takes the weights over https (it
    # has no route to name a folder: tests/rollout/test_engine_front.py)
    assert running.front_url.startswith("https://127.0.0.1:")
    assert f"RLRUN_ENGINE_CA=<a copy of {running.ca}, or of its issuer's certificate>" in running.ca_hint
    monkeypatch.setenv("RLRUN_ENGINE_URL", running.front_url)
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", running.token)
    monkeypatch.setenv("RLRUN_ENGINE_CA", str(running.ca))
    attached = attach_served_engine(running.front_url, torch.nn.Linear(1, 1), max_model_len=MAX_MODEL_LEN)
    attached.close()
    assert attached.upload
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", "")  # this host's URL: plain files in /dev/shm, no token asked
    here = attach_served_engine(running.url, torch.nn.Linear(1, 1), max_model_len=MAX_MODEL_LEN)
    here.close()
    assert not here.upload
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", running.token)
    result, reporter = grpo_run(
        tiny_cache, tmp_path / "out", tiny_model_dir("llama-0.4m", tiny_cache), entropy_coef=0.05
    )
    assert result.status == "succeeded", reporter.events
    metrics = {(step, key): value for step, key, value in reporter.metrics}
    for step in (1, 2):  # the engine held each step's weights, uploaded (it held another run's before)
        assert metrics[(step, "mismatch/logp_abs_diff")] < LOGPROB_TOLERANCE, step
    final, tokenizer = load_causal_lm(str(result.output_path))
    prompts = [tokenizer(r["prompt"]).input_ids for r in ROWS[:6]]
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    served = ServedEngine(running.front_url, max_model_len=MAX_MODEL_LEN, token=running.token)
    try:
        through_front = [c.token_ids for c in served.generate(prompts, 1, greedy)]
    finally:
        served.close()
    assert through_front == [c.token_ids for c in HFEngine(final, tokenizer).generate(prompts, 1, greedy)]


@pytest.mark.parametrize("token", ["", "wrong"], ids=["none", "wrong"])
def test_a_worker_without_the_fronts_token_is_refused_naming_the_setting(
    running: RunningEngine, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", token)
    monkeypatch.setenv("RLRUN_ENGINE_CA", str(running.ca))
    given = "the token in RLRUN_ENGINE_TOKEN" if token else "no RLRUN_ENGINE_TOKEN"
    with pytest.raises(EngineStartError, match=f"refused this worker \\({given}\\): .*rlrun engine --remote"):
        attach_served_engine(running.front_url, torch.nn.Linear(1, 1), max_model_len=MAX_MODEL_LEN)


def test_a_worker_that_does_not_trust_the_fronts_certificate_is_refused_naming_the_setting(
    running: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", running.token)
    monkeypatch.delenv("RLRUN_ENGINE_CA", raising=False)
    with pytest.raises(
        EngineStartError, match=r"does not trust \(no RLRUN_ENGINE_CA\): .*; set RLRUN_ENGINE_CA"
    ):
        attach_served_engine(running.front_url, torch.nn.Linear(1, 1), max_model_len=MAX_MODEL_LEN)


@contextmanager
def misconfigured_engine(server_info: dict[str, Any] | None) -> Iterator[str]:
    """A stand-in for an engine started by hand: it serves the model ``policy`` and, unless None,
    ``server_info`` as its /server_info (what a plain ``vllm serve`` lacks or reports)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/v1/models"):
                body: Any = {"data": [{"id": "policy", "max_model_len": MAX_MODEL_LEN}]}
            elif self.path.startswith("/server_info") and server_info is not None:
                body = server_info
            else:
                self.send_response(404)
                self.end_headers()
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: Any) -> None: ...

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.parametrize(
    ("server_info", "refusal"),
    [
        (None, "has no /server_info .* VLLM_SERVER_DEV_MODE=1"),
        (
            {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs", "generation_config": "auto"}}},
            r"--logprobs-mode raw_logprobs \(needs processed_logprobs\), "
            r"--generation-config auto \(needs vllm\)",
        ),
    ],
    ids=["no-dev-mode", "plain-vllm-serve-options"],
)
def test_an_engine_not_started_as_rlrun_starts_one_is_refused_saying_what_differs(
    server_info: dict[str, Any] | None, refusal: str
) -> None:
    with misconfigured_engine(server_info) as url, pytest.raises(EngineStartError, match=refusal):
        attach_served_engine(url, torch.nn.Linear(1, 1), max_model_len=32)


def test_ctrl_c_stops_rlrun_engine_and_its_engine(running: RunningEngine) -> None:
    own = engine_servers(running.proc.pid)
    assert own  # the engine server rlrun engine started (its RLRUN_ENGINE_OWNER_PID)
    running.stop()
    assert running.proc.returncode == 130
    deadline = time.monotonic() + 30
    while own & engine_servers():
        assert time.monotonic() < deadline, "the engine outlived rlrun engine"
        time.sleep(0.2)
