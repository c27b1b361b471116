"""score_model graders (trainer/graders/judges.py): a reward-model judge's score mapped into the range by
a sigmoid, checked against the model's own score of the unpadded sequence computed here; a generative judge
answers and its first number (clamped) is the score; refusals at validation; graders/run says the API
loads no judge."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from tests.rewards.helpers import reward_model_dir
from trainer.graders.grade import NO_JUDGE, grade_batch
from trainer.graders.judges import Judges, first_number, squash
from trainer.models import load_reward_model, tiny_model_dir
from trainer.specs.graders import Grader

GRADER: TypeAdapter[Any] = TypeAdapter(Grader)
CPU = torch.device("cpu")


def judge_grader(model: str, **over: Any) -> Any:
    return GRADER.validate_python(
        {
            "type": "score_model",
            "name": "judge",
            "model": model,
            "input": [
                {"role": "system", "content": "Rate the answer from 0 to 10."},
                {"role": "user", "content": "Q: {{item.question}}\nA: {{sample.output_text}}"},
            ],
        }
        | over
    )


@pytest.fixture(scope="module")
def rm_dir(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward-model folder: the tiny LM with a seeded score head (tests/rewards/helpers.py)."""
    return reward_model_dir(tiny_cache, tmp_path_factory.mktemp("judge-rm"))


def test_first_number_and_squash() -> None:
    assert [first_number(t) for t in ("Score: 7/10", "-0.5 points", "about .25", "1e-3", "none")] == [
        7.0,
        -0.5,
        0.25,
        0.001,
        None,
    ]
    assert squash(0.0, 0.0, 10.0) == 5.0 and squash(-1000, 1.0, 3.0) == 1.0
    assert squash(2.0, -1.0, 1.0) == pytest.approx(-1 + 2 / (1 + math.exp(-2)))


def test_a_reward_model_judge_scores_within_the_range(rm_dir: Path, tiny_cache: Path) -> None:
    from trainer.data.prompts import render_prompt

    grader = judge_grader("tiny:llama-0.4m", range=[1, 5])
    judges = Judges(lambda ref: rm_dir, CPU)
    texts, items = (
        ["four", "5", "twenty two"],
        [{"question": "2+2?"}, {"question": "2+3?"}, {"question": "11*2?"}],
    )
    graded = grade_batch(grader, texts, items, judges=judges)
    assert graded.failed == [False, False, False]
    model, tok = load_reward_model(str(rm_dir))
    model.eval()
    for text, item, got in zip(texts, items, graded.scores, strict=True):
        messages = [
            {"role": "system", "content": "Rate the answer from 0 to 10."},
            {"role": "user", "content": f"Q: {item['question']}\nA: {text}"},
        ]
        ids = tok(render_prompt(messages, tok)).input_ids + tok(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            raw = float(model(input_ids=torch.tensor([ids + [tok.eos_token_id]])).logits[0, 0])
        assert got == pytest.approx(1 + 4 / (1 + math.exp(-raw)), abs=1e-4)
        assert 1 <= got <= 5


def test_a_generative_judge_gives_its_first_number_clamped_or_fails(tiny_cache: Path) -> None:
    grader = judge_grader("tiny:llama-0.4m", range=[0, 10], sampling_params={"max_completions_tokens": 12})
    judges = Judges(lambda ref: tiny_model_dir("llama-0.4m", tiny_cache), CPU)
    texts = [str(i) for i in range(6)]
    graded = grade_batch(grader, texts, [{"question": f"{i}+0?"} for i in range(6)], judges=judges)
    answers = judges._answers(*judges._judge("tiny:llama-0.4m"), grader, [[{"role": "user", "content": "x"}]])
    assert len(answers) == 1
    for score, failed in zip(graded.scores, graded.failed, strict=True):
        assert (failed and score == 0.0) or (0.0 <= score <= 10.0)
    if any(graded.failed):
        assert "wrote no number" in (graded.first_error or "")


def test_a_missing_item_field_fails_that_sample_before_the_judge() -> None:
    calls: list[int] = []

    def judge(grader: Any, conversations: Any, texts: Any) -> list[tuple[float | None, str | None]]:
        calls.append(len(conversations))
        return [(0.5, None)] * len(conversations)

    graded = grade_batch(judge_grader("tiny:llama-0.4m"), ["a", "b"], [{"question": "q"}, {}], judges=judge)
    assert graded.scores == [0.5, 0.0] and graded.failed == [False, True] and calls == [1]


def test_without_a_judge_every_sample_fails_saying_why() -> None:
    graded = grade_batch(judge_grader("tiny:llama-0.4m"), ["a"], [{"question": "q"}])
    assert graded.failed == [True] and graded.first_error == NO_JUDGE


@pytest.mark.parametrize(
    "over, words",
    [
        ({"range": [1, 1]}, "lowest score below"),
        ({"model": "run:not-a-uuid"}, "a run reference is"),
        ({"input": [{"role": "user", "content": "{{secrets}}"}]}, "template"),
        ({"sampling_params": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ],
)
def test_refusals(over: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        judge_grader(over.pop("model", "tiny:llama-0.4m"), **over)
