"""Multi-turn rollouts for an online-RL run: its rollout engine wrapped to play tool episodes
(trainer/rollout/tool_episodes.py), environment episodes (trainer/rollout/env_episodes.py) or the episodes
of the user's own agent (trainer/rollout/agent_episodes.py, served by trainer/rollout/agent_gateway.py),
and the environment's opening turns, from its ``reset``, as each row's prompt."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from typing import Any

from trainer.completion_logps import reply_logprobs
from trainer.data.prompts import PromptSet
from trainer.distributed import ONE, Ranks, gather_objects
from trainer.reporting import Reporter, RunData
from trainer.rollout.agent_episodes import AgentBoard, AgentEpisodes
from trainer.rollout.agent_gateway import AgentGateway
from trainer.rollout.base import RolloutEngine
from trainer.rollout.env_episodes import EnvRunner, env_episodes, opening, sandbox_env
from trainer.rollout.episodes import EpisodeLimits, TaggedPrompt
from trainer.rollout.tool_episodes import sandbox_runner, tool_episodes
from trainer.rollout.turn_format import TurnFormat
from trainer.specs import GroupRlSpec, PpoSpec

RESET_BATCH = 100  # reset calls per sandbox (a result may be 64 KiB of JSON)


def completion_tokens(spec: GroupRlSpec | PpoSpec) -> int:
    """The most tokens after a prompt: one completion's, or an episode's (every turn and every message
    appended between them) with tools or an environment."""
    hp = spec.hyperparameters
    episodes = spec.tools or spec.environment or spec.agent
    return hp.max_new_tokens if episodes is None else episodes.episode_tokens(hp.max_new_tokens)


def engine_context(spec: GroupRlSpec | PpoSpec) -> int:
    """The longest prompt + generation the engine must hold: a later turn of an episode generates with
    the room the roomiest episode has left (``MultiTurnEngine``), up to ``max_new_tokens`` past the
    budget of one whose context is nearly full."""
    hp = spec.hyperparameters
    multi_turn = spec.tools is not None or spec.environment is not None or spec.agent is not None
    extra = hp.max_new_tokens if multi_turn else 0
    return hp.max_prompt_length + completion_tokens(spec) + extra


def _turn_format(tokenizer: Any, chat: bool, reporter: Reporter, what: str) -> TurnFormat:
    """Turns in the chat template's markup when the prompts are chat messages and it can write them."""
    turn_format = TurnFormat(tokenizer, use_template=chat)
    how = (
        "the chat template's messages"
        if turn_format.uses_template
        else f"plain 'role: ...' lines ({turn_format.why_plain})"
    )
    reporter.event("info", f"{what}; messages between turns are written as {how}")
    return turn_format


def multi_turn_engine(
    spec: GroupRlSpec | PpoSpec, engine: RolloutEngine, tokenizer: Any, data: RunData, reporter: Reporter
) -> RolloutEngine:
    """``engine`` playing the spec's episodes (it must have tools or an environment; an environment's
    prompts must be ``TaggedPrompt``s, ``tag_openings``)."""
    limit = completion_tokens(spec)
    if spec.tools is not None:
        tools = spec.tools
        what = f"tools {', '.join(tools.names)}: up to {tools.max_turns} turns and {limit} tokens per episode"
        chat = any(not isinstance(r["prompt"], str) for r in data.train[:64])
        return tool_episodes(
            engine,
            tokenizer,
            tools.names,
            sandbox_runner(tools.source, tools.max_result_chars),
            _turn_format(tokenizer, chat, reporter, what),
            EpisodeLimits(max_turns=tools.max_turns, max_tokens=limit),
        )
    env = spec.environment
    assert env is not None
    what = f"environment: up to {env.max_turns} turns and {limit} tokens per episode"
    return env_episodes(
        engine,
        tokenizer,
        sandbox_env(env.code),
        _turn_format(tokenizer, True, reporter, what),  # reset's openings are chat messages
        EpisodeLimits(max_turns=env.max_turns, max_tokens=limit),
    )


def tag_openings(prompts: PromptSet, openings: list[list[dict[str, str]]]) -> PromptSet:
    """``prompts`` whose ids carry (their row, their opening messages), for the environment's ``step``."""
    ids: list[list[int]] = [
        TaggedPrompt(p, (row, opened))
        for p, row, opened in zip(prompts.ids, prompts.rows, openings, strict=True)
    ]
    return dataclasses.replace(prompts, ids=ids)


def environment_openings(
    rows: list[dict[str, Any]], run_env: EnvRunner, reporter: Reporter, what: str, ranks: Ranks = ONE
) -> tuple[list[dict[str, Any]], list[list[dict[str, str]]]]:
    """Each row's opening messages from the environment's ``reset(row)``, and the rows with them as their
    prompt; rows whose ``reset`` fails are left out (a warning event counts them and gives the first
    reason). On several ranks rank 0 runs them and the others take its answers, so every rank keeps the
    same rows (a timeout on one rank alone would otherwise give the ranks different step counts).

    Raises:
        ValueError: ``reset`` failed on every row.
    """
    if not rows:
        return [], []
    kept: list[dict[str, Any]] = []
    openings: list[list[dict[str, str]]] = []
    errors: list[str] = []
    results: list[tuple[Any, str | None]] = []
    if ranks.rank == 0:
        for at in range(0, len(rows), RESET_BATCH):  # bounded sandbox batches
            results += run_env([("reset", [r]) for r in rows[at : at + RESET_BATCH]])
    if ranks.active:
        results = gather_objects(results, ranks)[0]
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


def tag_rows(prompts: PromptSet) -> PromptSet:
    """``prompts`` whose ids carry their dataset rows, which an agent's episodes hand out."""
    ids: list[list[int]] = [TaggedPrompt(p, row) for p, row in zip(prompts.ids, prompts.rows, strict=True)]
    return dataclasses.replace(prompts, ids=ids)


def agent_engine(
    spec: GroupRlSpec | PpoSpec, engine: RolloutEngine, tokenizer: Any, reporter: Reporter, cleanup: ExitStack
) -> RolloutEngine:
    """``engine`` serving the run's agent: the gateway opens now (its address goes on the run's row, where
    the API finds it) and closes with the run; the prompts must be ``tag_rows``'."""
    agent = spec.agent
    assert agent is not None
    hp = spec.hyperparameters
    board = AgentBoard()
    gateway = AgentGateway(board)
    cleanup.callback(gateway.close)
    cleanup.callback(reporter.agent_gateway, None)  # first (last in, first out): the API stops proxying
    limit = completion_tokens(spec)
    what = (
        f"agent episodes: take them from GET /v1/runs/<id>/agent/episodes/next; up to {agent.max_turns} "
        f"calls and {limit} tokens per episode, {agent.timeout_s:g} s per step's episodes"
    )
    turn_format = _turn_format(tokenizer, True, reporter, what)
    model = getattr(engine, "model", None)  # the transformers engine reports no log-probs: compute them
    episodes = AgentEpisodes(
        engine,
        tokenizer,
        board,
        turn_format,
        timeout=agent.timeout_s,
        max_calls=agent.max_turns,
        budget=limit,
        max_prompt_tokens=hp.max_prompt_length,
        logprobs_of=None if model is None else (lambda ctx, ids, t: reply_logprobs(model, ctx, ids, t)),
    )
    reporter.agent_gateway(gateway.address)
    return episodes
