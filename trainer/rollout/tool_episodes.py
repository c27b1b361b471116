"""Multi-turn tool rollouts: episodes (trainer/rollout/episodes.py) in which the model's tool calls are run.

After each model turn that ended on its end-of-turn token, its tool calls (trainer/rollout/tool_calls.py)
are run in the sandbox (trainer/graders/sandbox.py ``run_tools``), all the turn's calls of the whole batch
in one sandbox, and the results go back as tool messages; a turn without calls is the final answer, which
the rewards score (``Episode.answer``). A tool that raises, loops past its time limit or exhausts its
memory, or a call that cannot run (bad JSON, an unknown tool), answers ``error: <why>`` to the model
(counted in ``Episode.tool_errors``); the episode goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from trainer.rollout.base import RolloutEngine
from trainer.rollout.episodes import EpisodeLimits, MultiTurnEngine, Running
from trainer.rollout.tool_calls import ToolCall, parse_tool_calls
from trainer.rollout.turn_format import TurnFormat

# (name, arguments) -> (result text, or None and why): the sandbox's run_tools, or a test's stand-in
ToolRunner = Callable[[list[tuple[str, dict[str, Any]]]], list[tuple[str | None, str | None]]]


class ToolCalls:
    """A ``Responder`` that runs the tool calls of each turn and replies with their results."""

    def __init__(self, tools: Sequence[str], run_tools: ToolRunner):
        self.tools = list(tools)
        self.run_tools = run_tools

    def respond(self, played: list[Running], last: bool) -> None:
        calls: dict[int, list[ToolCall]] = {}
        for k, e in enumerate(played):
            found = [] if e.cut else parse_tool_calls(e.answer, self.tools)
            if found:
                e.messages[-1]["tool_calls"] = [c.as_message() for c in found]
                calls[k] = found
        if last:  # the episode cannot go on: the calls are not run
            for k in calls:
                played[k].end("max_turns")
            return
        runnable = [(c.name, c.arguments) for found in calls.values() for c in found if c.error is None]
        ran = iter(self.run_tools(runnable) if runnable else [])
        for k, found in calls.items():
            e = played[k]
            for call in found:
                text, error = (None, call.error) if call.error is not None else next(ran)
                failed = text is None
                e.tool_calls += 1
                e.tool_errors += int(failed)
                content = f"error: {error}" if failed else text
                e.reply.append({"role": "tool", "name": call.name, "content": content, "error": failed})


def tool_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    tools: Sequence[str],
    run_tools: ToolRunner,
    turn_format: TurnFormat,
    limits: EpisodeLimits,
) -> MultiTurnEngine:
    """``engine`` playing tool episodes: up to ``limits.max_turns`` turns, ``tools`` run by ``run_tools``."""
    return MultiTurnEngine(engine, tokenizer, ToolCalls(tools, run_tools), turn_format, limits)


def sandbox_runner(source: str, max_result_chars: int) -> ToolRunner:
    """A ``ToolRunner`` over the grader sandbox: ``source``'s functions, each call with the python
    graders' limits (5 s, 1 GiB); the batch's wall-clock and CPU limits grow with its calls."""
    from trainer.graders.sandbox import run_tools

    def run(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, str | None]]:
        return [
            (r.text, r.error) for r in run_tools(source, calls, batch_limits(len(calls)), max_result_chars)
        ]

    return run


def batch_limits(calls: int) -> Any:
    """The python graders' per-call limits, with the batch's wall-clock and CPU limits grown to ``calls``
    calls at their per-call limit."""
    from trainer.graders.sandbox import DEFAULT_LIMITS

    worst = 10 + DEFAULT_LIMITS.call_seconds * calls
    return dataclasses.replace(
        DEFAULT_LIMITS,
        wall_seconds=max(DEFAULT_LIMITS.wall_seconds, worst),
        cpu_seconds=max(DEFAULT_LIMITS.cpu_seconds, int(worst)),
    )
