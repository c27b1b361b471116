"""vLLM engine without vLLM: the pure conversions on objects of vLLM's shape, the lazy import, the error."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from trainer.rollout.base import SamplingParams
from trainer.rollout.factory import make_engine
from trainer.rollout.vllm_engine import VllmEngine, completions_from_vllm, sampling_kwargs, vllm_available

EOS = 2


class StubTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ".".join(str(t) for t in ids if not (skip_special_tokens and t == EOS))


def sample(token_ids: list[int], text: str | None, finish: str, logprobs: Any, index: int) -> SimpleNamespace:
    return SimpleNamespace(
        token_ids=token_ids, text=text, finish_reason=finish, logprobs=logprobs, index=index
    )


def lp(token_logprobs: dict[int, float]) -> dict[int, SimpleNamespace]:
    return {tok: SimpleNamespace(logprob=v, rank=1, decoded_token=None) for tok, v in token_logprobs.items()}


def test_converts_request_outputs_prompt_major() -> None:
    prompts = [[1, 5, 6], [1, 7]]
    outputs = [
        SimpleNamespace(
            prompt_token_ids=[1, 5, 6],
            outputs=[  # finished out of order: sample 1 listed first
                sample(
                    [9, 10, 11],
                    "9 10 11",
                    "length",
                    [lp({9: -0.1}), lp({10: -0.2, 3: -2.0}), lp({11: -0.3})],
                    1,
                ),
                sample([8, EOS], "8", "stop", [lp({8: -1.5, 4: -0.5}), lp({EOS: -0.25})], 0),
            ],
        ),
        SimpleNamespace(
            prompt_token_ids=[1, 7],
            outputs=[
                sample([EOS], "", "stop", [lp({EOS: -0.75})], 0),
                sample([4, 4], None, "length", None, 1),
            ],
        ),
    ]
    out = completions_from_vllm(outputs, prompts, StubTokenizer())
    assert [(c.prompt_index, c.token_ids) for c in out] == [
        (0, [8, EOS]),
        (0, [9, 10, 11]),
        (1, [EOS]),
        (1, [4, 4]),
    ]
    assert [c.finish_reason for c in out] == ["eos", "length", "eos", "length"]
    assert [c.prompt_ids for c in out] == [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    # the sampled token's logprob, even where another token ranks higher
    assert [c.logprobs for c in out] == [[-1.5, -0.25], [-0.1, -0.2, -0.3], [-0.75], None]
    assert [c.text for c in out] == ["8", "9 10 11", "", "4.4"]  # vLLM's text; decoded only when absent


def test_without_index_attribute_the_listed_order_is_kept() -> None:
    request = SimpleNamespace(
        prompt_token_ids=[3],
        outputs=[
            SimpleNamespace(token_ids=[t], text=str(t), finish_reason="length", logprobs=None) for t in (7, 5)
        ],
    )
    assert [c.token_ids for c in completions_from_vllm([request], [[3]], StubTokenizer())] == [[7], [5]]


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ([SimpleNamespace(prompt_token_ids=[1, 5], outputs=[])], "different prompt"),
        ([], "0 request outputs for 1 prompts"),
        ([SimpleNamespace(prompt_token_ids=[1], outputs=[sample([4], "4", "abort", None, 0)])], "'abort'"),
        (
            [SimpleNamespace(prompt_token_ids=[1], outputs=[sample([4], "4", "length", [lp({5: -1.0})], 0)])],
            "no logprob",
        ),
        (
            [
                SimpleNamespace(
                    prompt_token_ids=[1], outputs=[sample([4, 5], "", "length", [lp({4: -1.0})], 0)]
                )
            ],
            "1 logprob",
        ),
    ],
)
def test_rejects_outputs_that_do_not_line_up(outputs: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        completions_from_vllm(outputs, [[1]], StubTokenizer())


def test_sampling_kwargs() -> None:
    greedy = sampling_kwargs(SamplingParams(max_new_tokens=9, greedy=True, temperature=0.8, top_k=5), 4)
    assert greedy == {
        "n": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 9,
        "seed": None,
        "logprobs": 0,
    }
    sampled = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=3), 2)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.9, -1, 3)
    assert sampling_kwargs(SamplingParams(top_k=5), 1)["top_k"] == 5
    assert sampling_kwargs(SamplingParams(temperature=0), 1)["temperature"] == 0.0


def test_importing_the_engines_needs_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, trainer.rollout.vllm_engine, trainer.rollout.factory, trainer.rollout.base; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_without_vllm_construction_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # behaves as not installed, even where it is
    assert vllm_available() is False
    with pytest.raises(ImportError, match=r"pip install 'rlrun\[vllm\]' in a GPU environment"):
        VllmEngine("some/model")
    with pytest.raises(ImportError, match=r"rlrun\[vllm\]"):
        make_engine("vllm", model=object(), tokenizer=object(), model_path="some/model")
