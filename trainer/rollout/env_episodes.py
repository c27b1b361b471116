"""Environments as code: a user's Python source whose ``reset`` and ``step`` drive multi-turn episodes
(trainer/rollout/episodes.py), run in the python graders' sandbox.

The protocol (docs/runs.md, "Environments"):

    reset(row) -> messages                     # the episode's opening turns (a list of {role, content}),
                                               # or a string: one user message
    step(messages, row) -> {"messages": [...], "reward": float, "done": bool}

``row`` is the prompts dataset row (``prompt``, ``answer``, ``meta``); ``messages`` the whole conversation
so far, the model's last turn last. ``step`` is called after every model turn, the last one and one cut
short by the token budget included (so it can score it); its ``messages`` (``user`` or ``tool`` turns)
are appended and the model goes on, unless ``done`` or the turn limit ends the episode. The episode's
reward is the sum of the rewards ``step`` returned (``Episode.env_return``), added to the run's other
reward components as ``reward/environment``.

An environment keeps no state between calls: each turn of a batch runs in a fresh sandbox process, so
everything ``step`` needs is in ``messages`` and ``row``. A call that raises, runs past its time limit,
exhausts its memory or returns something else than the protocol ends that episode (``ended: error``, the
reason in its transcript, reward so far); a batch whose every episode failed raises ``EnvironmentFailed``,
which fails the run saying why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.rollout.base import Completion, RolloutEngine, SamplingParams
from trainer.rollout.episodes import EpisodeLimits, MultiTurnEngine, Running
from trainer.rollout.turn_format import TurnFormat

# (function name, keyword arguments) per call -> (the call's JSON result, or None and why)
EnvRunner = Callable[[list[tuple[str, dict[str, Any]]]], list[tuple[Any, str | None]]]
ROLES = ("user", "tool", "system")


class EnvironmentFailed(RuntimeError):
    """Every episode of a batch failed in the environment: the run cannot learn from it."""


def opening(value: Any) -> list[dict[str, str]]:
    """``reset``'s result as the episode's opening messages.

    Raises:
        ValueError: not a string or a non-empty list of ``{role, content}`` with string contents.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"reset must return a list of messages or a string, got {type(value).__name__}")
    return [_message(m, ("user", "system", "assistant", "tool")) for m in value]


def _message(m: Any, roles: Sequence[str]) -> dict[str, str]:
    if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or m.get("role") not in roles:
        raise ValueError(
            f"a message must be {{'role': one of {', '.join(roles)}, 'content': a string}}, got {m!r}"[:300]
        )
    return {"role": str(m["role"]), "content": str(m["content"])}


def step_result(value: Any) -> tuple[list[dict[str, str]], float, bool]:
    """``step``'s result as (messages to append, reward, done).

    Raises:
        ValueError: not ``{"messages": [...], "reward": a finite number, "done": bool}`` (messages may be
            left out when done).
    """
    if not isinstance(value, Mapping):
        raise ValueError(
            f"step must return a dict with messages, reward and done, got {type(value).__name__}"
        )
    reward, done = value.get("reward", 0.0), value.get("done", False)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"step's reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise ValueError(f"step's done must be true or false, got {done!r}")
    messages = value.get("messages") or []
    if not isinstance(messages, list):
        raise ValueError("step's messages must be a list")
    return [_message(m, ROLES) for m in messages], float(reward), done


class EnvironmentSteps:
    """A ``Responder`` that calls the environment's ``step`` after every turn of every episode.

    Args:
        run_env: runs a batch of calls in the sandbox.
        row_of: the dataset row of an episode's prompt (by its token ids).
        opening_of: the episode's opening messages (``reset``'s, by the prompt's token ids).
    """

    def __init__(
        self,
        run_env: EnvRunner,
        row_of: Callable[[list[int]], Mapping[str, Any]],
        opening_of: Callable[[list[int]], list[dict[str, str]]],
    ):
        self.run_env, self.row_of, self.opening_of = run_env, row_of, opening_of

    def respond(self, played: list[Running], last: bool) -> None:
        calls = [
            (
                "step",
                {
                    "messages": self.opening_of(e.prompt_ids) + _plain(e.messages),
                    "row": dict(self.row_of(e.prompt_ids)),
                },
            )
            for e in played
        ]
        for e, (value, error) in zip(played, self.run_env(calls), strict=True):
            e.env_return = e.env_return or 0.0
            try:
                if error is not None:
                    raise ValueError(error)
                messages, reward, done = step_result(value)
            except ValueError as exc:
                e.messages.append({"role": "environment", "content": f"error: {exc}", "error": True})
                e.end("error")
                continue
            e.env_return += reward
            if done:
                e.end("done")
            elif not messages and not last:
                e.end("answer")
            else:
                e.reply = messages


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The transcript as the environment reads it: role and content only."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class EnvironmentEpisodes(MultiTurnEngine):
    """``MultiTurnEngine`` with an environment: a batch whose every episode failed raises."""

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        out = super().generate(prompts, n, params)
        failed = [c.episode for c in out if c.episode is not None and c.episode.ended == "error"]
        if out and len(failed) == len(out):
            raise EnvironmentFailed(
                f"every episode of the batch ({len(out)}) failed in the environment; the first: "
                f"{failed[0].messages[-1]['content'].removeprefix('error: ')}"
            )
        return out


def env_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    run_env: EnvRunner,
    rows: Mapping[tuple[int, ...], tuple[Mapping[str, Any], list[dict[str, str]]]],
    turn_format: TurnFormat,
    limits: EpisodeLimits,
) -> MultiTurnEngine:
    """``engine`` playing environment episodes; ``rows``: each prompt's token ids -> (its dataset row, its
    opening messages)."""

    def row_of(ids: list[int]) -> Mapping[str, Any]:
        return rows[tuple(ids)][0]

    def opening_of(ids: list[int]) -> list[dict[str, str]]:
        return rows[tuple(ids)][1]

    responder = EnvironmentSteps(run_env, row_of, opening_of)
    return EnvironmentEpisodes(engine, tokenizer, responder, turn_format, limits)


def sandbox_env(source: str) -> EnvRunner:
    """An ``EnvRunner`` over the grader sandbox (results as JSON), with python graders' per-call limits."""
    from trainer.graders.sandbox import run_tools
    from trainer.rollout.tool_episodes import batch_limits

    def run(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[Any, str | None]]:
        out: list[tuple[Any, str | None]] = []
        for r in run_tools(source, calls, batch_limits(len(calls)), max_text_chars=1 << 20, as_json=True):
            if r.text is None:
                out.append((None, r.error))
            else:
                try:
                    out.append((json.loads(r.text), None))
                except ValueError:
                    out.append((None, "the result is not JSON-serialisable"))
        return out

    return run
