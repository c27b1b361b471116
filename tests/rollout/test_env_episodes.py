"""Environments as code: `reset`/`step` in the sandbox drive multi-turn episodes; their rewards add up, their
messages are appended untrained, and an environment that raises, loops or returns nonsense ends that
episode with its reason, never the batch, unless every episode failed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from trainer.graders.sandbox import isolation_problem
from trainer.loops.multi_turn import environment_openings
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.env_episodes import EnvironmentFailed, env_episodes, opening, sandbox_env, step_result
from trainer.rollout.episodes import EpisodeLimits, TaggedPrompt
from trainer.rollout.turn_format import TurnFormat

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))

# A guessing game: the model guesses the row's number; "higher"/"lower" until right (reward 1, done).
GUESS = """
def reset(row):
    return "Guess my number."

def step(messages, row):
    said = messages[-1]["content"].strip()
    target = int(row["answer"])
    if row.get("meta", {}).get("boom") and len(messages) > 2:
        raise RuntimeError("the environment broke")
    if row.get("meta", {}).get("spin"):
        while True:
            pass
    if row.get("meta", {}).get("junk"):
        return {"reward": 10 ** 400}
    if not said.isdigit():
        return {"messages": [{"role": "user", "content": "a number, please"}], "reward": -0.5, "done": False}
    guess = int(said)
    if guess == target:
        return {"reward": 1.0, "done": True}
    hint = "higher" if guess < target else "lower"
    return {"messages": [{"role": "user", "content": hint}], "reward": 0.0, "done": False}
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_cache: Path) -> Any:
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[1]


class Guesser:
    """Stands in for a policy: episode k (its row in the call) guesses from plans[k], one guess a turn."""

    def __init__(self, tokenizer: Any, plans: list[list[str]]):
        self.tokenizer, self.plans, self.turn = tokenizer, plans, [0] * len(plans)

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        out = []
        for p, ids in enumerate(prompts):
            for k in range(n):
                row = params.row_ids[p] if params.row_ids else params.first_row + p * n + k
                text = self.plans[row][self.turn[row]]
                self.turn[row] += 1
                tokens = self.tokenizer(text, add_special_tokens=False).input_ids + [
                    self.tokenizer.eos_token_id
                ]
                out.append(Completion(p, list(ids), tokens, text, "eos", [-0.25] * len(tokens)))
        return out

    def sync_weights(self, model: Any) -> None: ...

    def close(self) -> None: ...


def play(
    tokenizer: Any, rows: list[dict[str, Any]], plans: list[list[str]], turns: int = 4
) -> list[Completion]:
    kept, openings = environment_openings(rows, sandbox_env(GUESS), MemoryReporter(), "training")
    assert openings[0] == [{"role": "user", "content": "Guess my number."}]
    # the same opening for every row: each prompt tells its row apart by its tag, not by its tokens
    same = tokenizer(f"{openings[0][0]['content']}\nassistant: ").input_ids
    prompts = [TaggedPrompt(same, (row, o)) for row, o in zip(kept, openings, strict=True)]
    policy = Guesser(tokenizer, plans)
    engine = env_episodes(
        policy, tokenizer, sandbox_env(GUESS), TurnFormat(tokenizer), EpisodeLimits(turns, 300)
    )
    return engine.generate(prompts, 1, SamplingParams(max_new_tokens=16, seed=0))


def test_the_environment_drives_the_episode_and_its_rewards_add_up(tokenizer: Any) -> None:
    rows = [{"prompt": "", "answer": "7", "meta": {}}, {"prompt": "", "answer": "3", "meta": {}}]
    first, second = play(tokenizer, rows, [["5", "9", "7"], ["x", "1", "2", "4"]])
    assert first.episode is not None and second.episode is not None
    assert [m["content"] for m in first.episode.messages] == ["5", "higher", "9", "lower", "7"]
    assert (first.episode.ended, first.episode.env_return, first.episode.turns) == ("done", 1.0, 3)
    # never right within 4 turns: the last turn is still scored (0), the episode ends at the limit
    assert second.episode.ended == "max_turns" and second.episode.env_return == -0.5
    assert second.episode.messages[1]["content"] == "a number, please"
    # what trains: the guesses; the environment's replies (plain "user: ..." lines here) do not
    eos = tokenizer.eos_token_id
    guess = [tokenizer(t, add_special_tokens=False).input_ids + [eos] for t in ("5", "9", "7")]
    reply = [
        tokenizer(f"\nuser: {t}\nassistant: ", add_special_tokens=False).input_ids
        for t in ("higher", "lower")
    ]
    assert first.token_ids == guess[0] + reply[0] + guess[1] + reply[1] + guess[2]
    assert first.token_mask == (
        [1] * len(guess[0])
        + [0] * len(reply[0])
        + [1] * len(guess[1])
        + [0] * len(reply[1])
        + [1] * len(guess[2])
    )
    assert first.logprobs is not None and [
        lp for lp, m in zip(first.logprobs, first.token_mask, strict=True) if not m
    ] == [0.0] * (len(reply[0]) + len(reply[1]))


def test_a_failing_environment_ends_that_episode_only(tokenizer: Any) -> None:
    rows = [
        {"prompt": "", "answer": "7", "meta": {"boom": True}},
        {"prompt": "", "answer": "7", "meta": {"spin": True}},
        {"prompt": "", "answer": "7", "meta": {"junk": True}},
        {"prompt": "", "answer": "7", "meta": {}},
    ]
    boom, spin, junk, fine = play(tokenizer, rows, [["1", "2", "3"], ["1"], ["1"], ["7"]])
    assert boom.episode is not None and boom.episode.ended == "error"
    assert boom.episode.messages[-1] == {
        "role": "environment",
        "content": "error: RuntimeError: the environment broke",
        "error": True,
    }
    assert boom.episode.turns == 2 and boom.episode.env_return == 0.0  # what it earned before failing
    assert spin.episode is not None and spin.episode.messages[-1]["content"] == "error: timed out"
    assert junk.episode is not None
    assert "reward must be a number within ±1e+06" in junk.episode.messages[-1]["content"]
    assert fine.episode is not None and (fine.episode.ended, fine.episode.env_return) == ("done", 1.0)


def test_a_batch_whose_every_episode_fails_fails_saying_why(tokenizer: Any) -> None:
    rows = [{"prompt": "", "answer": "7", "meta": {"junk": True}}]
    with pytest.raises(
        EnvironmentFailed, match=r"every episode of the batch \(1\) failed .*reward must be a number"
    ):
        play(tokenizer, rows, [["1"]])


def test_reset_failures_leave_their_rows_out_or_fail_with_the_reason() -> None:
    source = (
        "def reset(row):\n    if row['answer'] == '0':\n        raise ValueError('no zero')\n"
        "    return [{'role': 'user', 'content': row['answer']}]\ndef step(m, r):\n    return {}\n"
    )
    reporter = MemoryReporter()
    rows = [{"prompt": "", "answer": str(i)} for i in range(3)]
    kept, openings = environment_openings(rows, sandbox_env(source), reporter, "training")
    assert [r["answer"] for r in kept] == ["1", "2"] and openings[0] == [{"role": "user", "content": "1"}]
    assert kept[0]["prompt"] == openings[0]
    ((_, message, _),) = [e for e in reporter.events if e[0] == "warning"]
    assert "failed on 1 of 3 training rows" in message and "ValueError: no zero" in message
    with pytest.raises(ValueError, match="failed on every held-out row .*no zero"):
        environment_openings(rows[:1], sandbox_env(source), reporter, "held-out")


def test_protocol_values_are_checked() -> None:
    assert opening("hi") == [{"role": "user", "content": "hi"}]
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], 3):
        with pytest.raises(ValueError):
            opening(bad)
    assert step_result({"reward": 2, "done": True}) == ([], 2.0, True)
    for bad in (
        {"reward": float("nan")},
        {"reward": True},
        {"reward": 10**400},
        {"done": "yes"},
        {"messages": "hi"},
        [],
    ):
        with pytest.raises(ValueError):
            step_result(bad)
