"""The vLLM inference backend without vLLM: its pure conversions on objects of vLLM's shape, the engine loop's
scheduling (requests joining a running engine, aborts, a dying engine) on a scripted engine, and the refusal
where vLLM or CUDA is missing. The backend on a real GPU: scripts/gpu_vllm_inference.sh."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from api.settings import Settings
from trainer.inference.decode import DecodeParams
from trainer.inference.loaded import LoadError
from trainer.inference.vllm_served import (
    INSTALL_HINT,
    EngineLoop,
    VllmServed,
    deltas_from_output,
    sampling_kwargs,
)

EOS = 2


def entry(ranked: list[tuple[int, float]], sampled: tuple[int, float] | None = None) -> dict[int, Any]:
    """vLLM's per-position logprobs: the top-k with ranks 1..k, plus the sampled token if outside them."""
    out = {t: SimpleNamespace(logprob=v, rank=r, decoded_token=None) for r, (t, v) in enumerate(ranked, 1)}
    if sampled is not None:
        out[sampled[0]] = SimpleNamespace(logprob=sampled[1], rank=len(ranked) + 5, decoded_token=None)
    return out


def completion(
    index: int, text: str, tokens: list[int], logprobs: Any, finish: str | None
) -> SimpleNamespace:
    return SimpleNamespace(index=index, text=text, token_ids=tokens, logprobs=logprobs, finish_reason=finish)


def test_sampling_kwargs_say_what_decode_does() -> None:
    params = DecodeParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("\n",), top_logprobs=2)
    assert sampling_kwargs(params, 4) == {
        "n": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 7,
        "seed": 3,
        "stop": ["\n"],
        "include_stop_str_in_output": False,
        "logprobs": 2,
        "skip_special_tokens": True,
    }


def test_deltas_keep_the_sampled_logprob_and_the_top_k_most_likely_first() -> None:
    output = SimpleNamespace(
        outputs=[
            # sample 1 streams first; its token 9 is outside the top 2
            completion(
                1,
                "ab",
                [9, 7],
                [entry([(4, -0.1), (5, -0.9)], (9, -3.0)), entry([(7, -0.2), (8, -1.0)])],
                None,
            ),
            completion(0, "", [EOS], [entry([(EOS, -0.05), (4, -3.2)])], "stop"),
        ]
    )
    deltas = deltas_from_output(output, top_logprobs=2, eos_id=EOS)
    first, second = deltas
    assert (first.index, first.text, first.token_ids, first.logprobs) == (1, "ab", [9, 7], [-3.0, -0.2])
    assert first.top_logprobs == [[(4, -0.1), (5, -0.9)], [(7, -0.2), (8, -1.0)]]
    assert first.finish_reason is None
    # EOS is dropped from the tokens as decode does (the server's usage count adds it back)
    assert (second.index, second.text, second.token_ids, second.logprobs, second.finish_reason) == (
        0,
        "",
        [],
        [],
        "stop",
    )


def test_deltas_without_top_logprobs_and_a_length_finish() -> None:
    output = SimpleNamespace(outputs=[completion(0, "x", [5], [entry([(5, -0.5)])], "length")])
    (delta,) = deltas_from_output(output, top_logprobs=0, eos_id=EOS)
    assert delta.top_logprobs == [] and delta.logprobs == [-0.5] and delta.finish_reason == "length"


@pytest.mark.parametrize(
    "sample, message",
    [
        (completion(0, "", [5], [entry([(5, -0.5)])], "abort"), "'abort'"),
        (completion(0, "x", [5, 6], [entry([(5, -0.5)])], None), "1 logprob entries for 2 tokens"),
        (completion(0, "x", [5], [entry([(6, -0.5)])], None), "no logprob for token 5"),
        (completion(0, "x", [5], None, None), "no logprob for token 5"),
    ],
)
def test_deltas_refuse_what_decode_never_gives(sample: SimpleNamespace, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deltas_from_output(SimpleNamespace(outputs=[sample]), top_logprobs=0, eos_id=EOS)


class ScriptedEngine:
    """An engine with vLLM's LLMEngine surface that emits one token per unfinished request each step and
    records which requests shared each step."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}  # request id -> tokens left
        self.steps: list[set[str]] = []
        self.aborted: list[str] = []
        self.fail_at_step = fail_at_step

    def add_request(
        self, request_id: str, prompt: dict[str, Any], params: Any, lora_request: Any = None
    ) -> None:
        assert prompt["prompt_token_ids"]
        self.requests[request_id] = params.max_tokens

    def abort_request(self, ids: list[str]) -> None:
        for i in ids:
            self.aborted.append(i)
            self.requests.pop(i, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[SimpleNamespace]:
        if self.fail_at_step is not None and len(self.steps) == self.fail_at_step:
            raise RuntimeError("CUDA error: out of memory")
        time.sleep(0.01)
        self.steps.append(set(self.requests))
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            done = self.requests[rid] == 0
            if done:
                del self.requests[rid]
            sample = completion(0, "t", [7], [entry([(7, -0.1)])], "length" if done else None)
            outputs.append(SimpleNamespace(request_id=rid, outputs=[sample], finished=done))
        return outputs


class FakeVllmModule:
    """The two names VllmServed reads from the vllm module."""

    class SamplingParams:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    sampling_params = SimpleNamespace(RequestOutputKind=SimpleNamespace(DELTA="delta"))


def served(engine: ScriptedEngine) -> VllmServed:
    tokenizer = SimpleNamespace(eos_token_id=EOS)
    return VllmServed(EngineLoop(engine), tokenizer, 128, None, FakeVllmModule)


def test_concurrent_requests_share_the_engine_steps() -> None:
    engine = ScriptedEngine()
    model = served(engine)
    texts: dict[int, str] = {}

    def ask(i: int, tokens: int) -> None:
        out = ""
        for step in model.stream([1, 2], 1, DecodeParams(max_new_tokens=tokens)):
            out += "".join(d.text for d in step)
        texts[i] = out

    threads = [threading.Thread(target=ask, args=(i, 30)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert texts == {0: "t" * 30, 1: "t" * 30, 2: "t" * 30}
    # all three were decoded in the same steps (batched), not one after another: 30-odd steps, not 90
    assert max(len(s) for s in engine.steps) == 3
    assert len(engine.steps) < 60


def test_a_stream_closed_early_aborts_its_request() -> None:
    engine = ScriptedEngine()
    model = served(engine)
    stream = model.stream([1], 1, DecodeParams(max_new_tokens=1000))
    next(stream)
    stream.close()  # the client went away
    deadline = time.time() + 10
    while not engine.aborted and time.time() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == 1 and not engine.requests


def test_an_engine_failure_reaches_the_waiting_request() -> None:
    model = served(ScriptedEngine(fail_at_step=2))
    with pytest.raises(RuntimeError, match="out of memory"):
        for _ in model.stream([1], 1, DecodeParams(max_new_tokens=10)):
            pass
    with pytest.raises(RuntimeError, match="the vLLM engine stopped"):
        next(model.stream([1], 1, DecodeParams(max_new_tokens=10)))


def test_the_vllm_backend_is_refused_clearly_where_vllm_or_cuda_is_missing(tmp_path: Any) -> None:
    from trainer.inference.server import create_app

    with pytest.raises(LoadError) as caught:
        create_app(Settings(home=tmp_path, inference_backend="vllm"))
    assert INSTALL_HINT in str(caught.value)
