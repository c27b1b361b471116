"""Online RL with multi-turn episodes, through the loops: a scripted calculator-calling policy's tool calls
and a scripted guesser's environment run in the real sandbox, the GRPO and PPO loops train on them, and
the metrics and samples tell what happened."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.graders.sandbox import isolation_problem
from trainer.loops import rl_common
from trainer.loops.group_rl import run_group_rl
from trainer.loops.ppo import run_ppo
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import Completion, SamplingParams
from trainer.specs import parse_spec

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
TOOLS = {
    "source": "def add(a, b):\n    return a + b\n",
    "definitions": [{"type": "function", "function": {"name": "add", "description": "a + b"}}],
    "max_turns": 3,
    "max_episode_tokens": 160,
}


class ScriptedPolicy:
    """Stands in for a policy: ``say(context, row)`` is its text for a context (decoded) whose sample is
    on global row ``row``; every turn ends with EOS. Records the contexts it was given."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.contexts: list[str] = []

    def say(self, context: str, row: int) -> str:
        raise NotImplementedError

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        out = []
        for p, ids in enumerate(prompts):
            context = self.tokenizer.decode(ids, skip_special_tokens=True)
            self.contexts.append(context)
            for k in range(n):
                row = params.row_ids[p] if params.row_ids else params.first_row + p * n + k
                text = self.say(context, row)
                tokens = self.tokenizer(text, add_special_tokens=False).input_ids + [
                    self.tokenizer.eos_token_id
                ]
                out.append(Completion(p, list(ids), tokens, text, "eos"))
        return out

    def sync_weights(self, model: Any) -> None: ...

    def close(self) -> None: ...


class CalculatorPolicy(ScriptedPolicy):
    """Calls ``add`` on its prompt's numbers, then answers what the tool said (plus ``row % 2``: half the
    answers are wrong, so groups have reward variance)."""

    def say(self, context: str, row: int) -> str:
        said = re.findall(r"tool: (\d+)", context)
        if said:
            return str(int(said[-1]) + row % 2)
        a, b = re.match(r"(\d+)\+(\d+)=", context).groups()  # type: ignore[union-attr]
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def spec_of(algorithm: str, **hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "exact_match"}],
            "tools": TOOLS,
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 64,
                "max_length": 256,
                "max_prompt_length": 16,
                "learning_rate": 1e-2,
                "sample_every": 1,
                "samples_to_store": 2,
                "eval_every": 2,
                **hp,
            },
        }
    )


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_tool_episodes_train_and_report(
    algorithm: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    policy = CalculatorPolicy(tokenizer)
    monkeypatch.setattr(rl_common, "make_engine", lambda name, **_: policy)
    reporter = MemoryReporter()
    run = run_group_rl if algorithm == "grpo" else run_ppo
    extra = {"dynamic_sampling": False} if algorithm == "grpo" else {}
    result = run(
        spec_of(algorithm, **extra),
        RunData(train=ROWS, validation=ROWS[:2]),
        reporter,
        loop_ctx(tiny_cache, tmp_path),
    )
    assert result.status == "succeeded", reporter.events

    # every episode: a call, the sandbox's sum, an answer (right for even rows, one more for odd rows)
    metrics = {(s, k): v for s, k, v in reporter.metrics}
    for step in (1, 2):
        assert metrics[(step, "episode/turns_mean")] == 2.0
        assert metrics[(step, "episode/tool_call_rate")] == 1.0
        assert metrics[(step, "episode/tool_errors")] == 0.0
        assert metrics[(step, "reward/mean")] == 0.5
        assert metrics[(step, "response/length_mean")] < 64  # the model's own tokens only
    assert metrics[(2, "eval/tool_calls_mean")] == 1.0 and metrics[(2, "eval/turns_mean")] == 2.0
    assert any("tool: " in c for c in policy.contexts)
    (_, record), *_ = reporter.samples
    transcript = record["transcript"]
    assert [m["role"] for m in transcript] == ["assistant", "tool", "assistant"]
    a, b = re.match(r"(\d+)\+(\d+)=", record["prompt"]).groups()  # type: ignore[union-attr]
    assert transcript[1]["content"] == str(int(a) + int(b)) and record["answer"] == transcript[2]["content"]
    assert transcript[0]["tool_calls"] == [{"name": "add", "arguments": {"a": int(a), "b": int(b)}}]
    assert any("tools add: up to 3 turns and 160 tokens" in m for _, m, _ in reporter.events)
    trained, _ = load_causal_lm(str(result.output_path))
    start, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    assert not torch.equal(trained.lm_head.weight, start.lm_head.weight)


# The environment asks for the sum, says "try again" once to a wrong one, and pays 1 for a right one.
ENVIRONMENT = {
    "source": (
        "def reset(row):\n"
        "    return [{'role': 'user', 'content': row['prompt'] + ' (sum)'}]\n"
        "def step(messages, row):\n"
        "    right = messages[-1]['content'].strip() == row['answer']\n"
        "    if right or len(messages) > 2:\n"
        "        return {'reward': float(right), 'done': True}\n"
        "    again = [{'role': 'user', 'content': 'try again'}]\n"
        "    return {'messages': again, 'reward': -0.25, 'done': False}\n"
    ),
    "max_turns": 3,
    "max_episode_tokens": 64,
}


class Guesser(ScriptedPolicy):
    """Answers the sum, wrong by one on its first try for odd rows."""

    def say(self, context: str, row: int) -> str:
        a, b = re.search(r"(\d+)\+(\d+)= \(sum\)", context).groups()  # type: ignore[union-attr]
        return str(int(a) + int(b) + int(bool(row % 2 and "try again" not in context)))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_environment_episodes_train_and_report(
    algorithm: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    monkeypatch.setattr(rl_common, "make_engine", lambda name, **_: Guesser(tokenizer))
    spec = spec_of(algorithm, **({"dynamic_sampling": False} if algorithm == "grpo" else {})).model_dump()
    spec = parse_spec({**spec, "tools": None, "environment": ENVIRONMENT, "rewards": []})
    reporter = MemoryReporter()
    run = run_group_rl if algorithm == "grpo" else run_ppo
    result = run(spec, RunData(train=ROWS, validation=ROWS[:2]), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded", reporter.events

    # even rows: right at once (1); odd rows: wrong, "try again" (-0.25), then right (+1)
    metrics = {(s, k): v for s, k, v in reporter.metrics}
    for step in (1, 2):
        assert metrics[(step, "episode/turns_mean")] == 1.5
        assert metrics[(step, "episode/done_frac")] == 1.0
        assert metrics[(step, "reward/mean")] == pytest.approx((1 + 0.75) / 2)
        assert metrics[(step, "reward/environment/mean")] == metrics[(step, "reward/mean")]
    (_, record), *_ = reporter.samples
    assert record["prompt"].endswith("(sum)\nassistant: ")  # the environment's opening, rendered
    assert record["transcript"][-1]["role"] == "assistant" and record["ended"] == "done"
    assert any("environment: up to 3 turns and 64 tokens" in m for _, m, _ in reporter.events)
