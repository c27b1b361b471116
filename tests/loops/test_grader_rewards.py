"""A GRPO run whose reward is a grader (issue 22 item 1): a python grader in the sandbox and a multi grader
score every completion, the stored samples' rewards equal the graders' definitions recomputed here from the
sample text, and the run trains and logs per-grader metrics."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from tests.loop_context import loop_ctx
from trainer.loops.group_rl import run_group_rl
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {"a": a}} for a in range(4) for b in range(4)]
DIGITS = {
    "type": "python",
    "name": "digits",
    "source": "def grade(sample, item):\n"
    "    text = sample['output_text']\n"
    "    return sum(ch.isdigit() for ch in text) / max(1, len(text)) + item['a']\n",
}
MULTI = {
    "type": "multi",
    "name": "mixed",
    "graders": {
        "has_answer": {
            "type": "string_check",
            "name": "has_answer",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "like",
        },
        "digits": DIGITS,
    },
    "calculate_output": "2 * has_answer + min(digits, 1)",
}


def digits(text: str, a: int) -> float:
    return sum(ch.isdigit() for ch in text) / max(1, len(text)) + a


def spec(rewards: list[dict[str, Any]]) -> Any:
    return parse_spec(
        {
            "algorithm": "grpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": rewards,
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                "sample_every": 1,
                "samples_to_store": 16,
                "dynamic_sampling": False,
            },
        }
    )


def test_graders_reward_a_grpo_run(tiny_cache: Path, tmp_path: Path) -> None:
    reporter = MemoryReporter()
    rewards = [{"grader": DIGITS}, {"grader": MULTI, "weight": 0.5}]
    result = run_group_rl(
        spec(rewards), RunData(train=ROWS, validation=[]), reporter, loop_ctx(tiny_cache, tmp_path)
    )
    assert result.status == "succeeded", result
    keys = {k for _, k, _ in reporter.metrics}
    assert {"reward/digits/mean", "reward/mixed/mean", "reward/mean"} <= keys
    prompt_a = {f"{r['prompt']}": int(r["meta"]["a"]) for r in ROWS}
    checked = 0
    for _, sample in reporter.samples:
        a = next(v for p, v in prompt_a.items() if sample["prompt"].endswith(p))
        answer = str(a + int(sample["prompt"].rstrip("=").split("+")[-1]))
        text = sample["completion"]
        expected_digits = digits(text, a)
        expected_multi = 2 * float(answer in text) + min(expected_digits, 1)
        assert sample["components"]["digits"] == expected_digits
        assert sample["components"]["mixed"] == expected_multi
        assert sample["reward"] == expected_digits + 0.5 * expected_multi
        checked += 1
    assert checked == 32
    failures = [v for _, k, v in reporter.metrics if k == "reward/failures"]
    assert failures and all(v == 0 for v in failures)


def test_a_score_model_judge_rewards_a_run(tiny_cache: Path, tmp_path: Path) -> None:
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny:llama-0.4m",  # a generative judge: its first number, clamped, or a failure
        "input": [{"role": "user", "content": "Rate 0-9: {{sample.output_text}}"}],
        "range": [0, 9],
        "sampling_params": {"max_completions_tokens": 8},
    }
    reporter = MemoryReporter()
    result = run_group_rl(
        spec([{"grader": judge}]),
        RunData(train=ROWS, validation=[]),
        reporter,
        loop_ctx(tiny_cache, tmp_path),
    )
    assert result.status == "succeeded", result
    means = [v for _, k, v in reporter.metrics if k == "reward/judge/mean"]
    failures = [v for _, k, v in reporter.metrics if k == "reward/failures"]
    assert len(means) == 2 and all(0 <= m <= 9 for m in means) and len(failures) == 2
    for _, sample in reporter.samples:
        assert 0 <= sample["components"]["judge"] <= 9
