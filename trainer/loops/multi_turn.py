"""Multi-turn rollouts for an online-RL run: its rollout engine wrapped to play tool episodes
(trainer/rollout/tool_episodes.py) or environment episodes (trainer/rollout/env_episodes.py), and the
environment's opening turns, from its ``reset``, as each row's prompt."""

from __future__ import annotations

from typing import Any

from trainer.reporting import Reporter, RunData
from trainer.rollout.base import RolloutEngine
from trainer.rollout.env_episodes import EnvRunner, env_episodes, opening, sandbox_env
from trainer.rollout.episodes import EpisodeLimits
from trainer.rollout.tool_episodes import sandbox_runner, tool_episodes
from trainer.rollout.turn_format import TurnFormat
from trainer.specs import GroupRlSpec, PpoSpec

RESET_BATCH = 1000  # reset calls per sandbox


def completion_tokens(spec: GroupRlSpec | PpoSpec) -> int:
    """The most tokens after a prompt: one completion's, or an episode's (every turn and every message
    appended between them) with tools or an environment."""
    hp = spec.hyperparameters
    episodes = spec.tools or spec.environment
    return hp.max_new_tokens if episodes is None else episodes.episode_tokens(hp.max_new_tokens)


def _turn_format(tokenizer: Any, data: RunData, reporter: Reporter, what: str) -> TurnFormat:
    """Turns in the chat template's markup when the prompts are chat messages and it can write them."""
    chat = any(not isinstance(r["prompt"], str) for r in data.train[:64])
    turn_format = TurnFormat(tokenizer, use_template=chat)
    how = (
        "the chat template's messages"
        if turn_format.uses_template
        else f"plain 'role: ...' lines ({turn_format.why_plain})"
    )
    reporter.event("info", f"{what}; messages between turns are written as {how}")
    return turn_format


def multi_turn_engine(
    spec: GroupRlSpec | PpoSpec,
    engine: RolloutEngine,
    tokenizer: Any,
    data: RunData,
    reporter: Reporter,
    rows: dict[tuple[int, ...], tuple[dict[str, Any], list[dict[str, str]]]],
) -> RolloutEngine:
    """``engine`` playing the spec's episodes (it must have tools or an environment); ``rows``: each
    tokenized prompt -> (its row, the environment's opening messages)."""
    limit = completion_tokens(spec)
    if spec.tools is not None:
        tools = spec.tools
        what = f"tools {', '.join(tools.names)}: up to {tools.max_turns} turns and {limit} tokens per episode"
        return tool_episodes(
            engine,
            tokenizer,
            tools.names,
            sandbox_runner(tools.source, tools.max_result_chars),
            _turn_format(tokenizer, data, reporter, what),
            EpisodeLimits(max_turns=tools.max_turns, max_tokens=limit),
        )
    env = spec.environment
    assert env is not None
    what = f"environment: up to {env.max_turns} turns and {limit} tokens per episode"
    return env_episodes(
        engine,
        tokenizer,
        sandbox_env(env.code),
        rows,
        _turn_format(tokenizer, data, reporter, what),
        EpisodeLimits(max_turns=env.max_turns, max_tokens=limit),
    )


def environment_openings(
    rows: list[dict[str, Any]], run_env: EnvRunner, reporter: Reporter, what: str
) -> tuple[list[dict[str, Any]], list[list[dict[str, str]]]]:
    """Each row's opening messages from the environment's ``reset(row)``, and the rows with them as their
    prompt; rows whose ``reset`` fails are left out (a warning event counts them and gives the first
    reason).

    Raises:
        ValueError: ``reset`` failed on every row.
    """
    if not rows:
        return [], []
    kept: list[dict[str, Any]] = []
    openings: list[list[dict[str, str]]] = []
    errors: list[str] = []
    results = [
        result
        for at in range(0, len(rows), RESET_BATCH)  # bounded sandbox batches (their results are capped)
        for result in run_env([("reset", {"row": r}) for r in rows[at : at + RESET_BATCH]])
    ]
    for row, (value, error) in zip(rows, results, strict=True):
        try:
            if error is not None:
                raise ValueError(error)
            messages = opening(value)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        kept.append({**row, "prompt": messages})
        openings.append(messages)
    if not kept:
        raise ValueError(
            f"the environment's reset failed on every {what} row ({len(rows)}); the first: {errors[0]}"
        )
    if errors:
        reporter.event(
            "warning",
            f"the environment's reset failed on {len(errors)} of {len(rows)} {what} rows, which "
            f"are left out; the first: {errors[0]}",
        )
    return kept, openings
