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
exhausts its memory or returns something else than the protocol (a result over 64 KiB of JSON, a reward
beyond ±1e6) ends that episode (``ended: error``, the
reason in its transcript, reward so far); a batch whose every episode failed raises ``EnvironmentFailed``,
which fails the run saying why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.rollout.base import Completion, RolloutEngine, SamplingParams
from trainer.rollout.episodes import EpisodeLimits, MultiTurnEngine, Running
from trainer.rollout.turn_format import TurnFormat

# (function name, positional arguments) per call -> (the call's JSON result, or None and why)
EnvRunner = Callable[[list[tuple[str, list[Any]]]], list[tuple[Any, str | None]]]
ROLES = ("user", "tool", "system")
MAX_RESULT_CHARS = 64 * 1024  # one reset/step result's JSON, at most
MAX_REWARD = 1e6  # |reward| of one step, at most (a sum of them stays finite)


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
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not abs(reward) <= MAX_REWARD:
        raise ValueError(f"step's reward must be a number within ±{MAX_REWARD:g}, got {reward!r}"[:300])
    if not isinstance(done, bool):
        raise ValueError(f"step's done must be true or false, got {done!r}")
    messages = value.get("messages") or []
    if not isinstance(messages, list):
        raise ValueError("step's messages must be a list")
    return [_message(m, ROLES) for m in messages], float(reward), done


class EnvironmentSteps:
    """A ``Responder`` that calls the environment's ``step`` after every turn of every episode; each
    episode's prompt carries its dataset row and opening messages (``TaggedPrompt.tag``)."""

    def __init__(self, run_env: EnvRunner):
        self.run_env = run_env

    def respond(self, played: list[Running], last: bool) -> None:
        calls: list[tuple[str, list[Any]]] = []
        for e in played:
            row, opened = e.tag
            calls.append(("step", [opened + _plain(e.messages), dict(row)]))
        for e, (value, error) in zip(played, self.run_env(calls), strict=True):
            e.env_return = e.env_return or 0.0
            try:
                if error is not None:
                    raise ValueError(error)
                messages, reward, done = step_result(value)
            except ValueError as exc:
                e.fail(str(exc))
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
    turn_format: TurnFormat,
    limits: EpisodeLimits,
) -> MultiTurnEngine:
    """``engine`` playing environment episodes; every prompt must be a ``TaggedPrompt`` whose tag is
    (its dataset row, its opening messages)."""
    return EnvironmentEpisodes(engine, tokenizer, EnvironmentSteps(run_env), turn_format, limits)


def sandbox_env(source: str) -> EnvRunner:
    """An ``EnvRunner`` over the grader sandbox (results as JSON), with python graders' per-call limits."""
    from trainer.graders.sandbox import run_tools
    from trainer.rollout.tool_episodes import batch_limits

    def run(calls: list[tuple[str, list[Any]]]) -> list[tuple[Any, str | None]]:
        out: list[tuple[Any, str | None]] = []
        limits = batch_limits(len(calls))
        for r in run_tools(source, calls, limits, max_text_chars=MAX_RESULT_CHARS, as_json=True):
            if r.text is None:
                out.append((None, r.error))
            else:
                try:
                    out.append((json.loads(r.text), None))
                except ValueError:
                    out.append((None, "the result is not JSON-serialisable"))
        return out

    return run
