"""Multi-turn tool rollouts: a ``RolloutEngine`` that runs each sample as an episode over another engine.

An episode, for one prompt (verl's multi-turn rollout, TRL's tool-calling GRPO; the loss mask of Qwen's
and SkyRL's agent trainers):

1. the model generates a turn (at most ``max_new_tokens``, and no more than the episode budget left);
2. a turn that ended on the end-of-turn token and holds tool calls (trainer/rollout/tool_calls.py) has
   them run in the sandbox (trainer/graders/sandbox.py ``run_tools``), and the results are appended as
   the chat template writes tool messages, followed by the opening of the model's next turn
   (trainer/rollout/tool_turns.py); back to 1;
3. it ends on a turn without tool calls (the final answer), after ``max_turns`` model turns, or when the
   budget of ``max_tokens`` tokens after the prompt (the model's and the tools' alike) runs out.

The episode comes back as one ``Completion``: ``token_ids`` the whole transcript after the prompt,
``token_mask`` 1 on the tokens the model sampled and 0 on every appended token (tool results and template
markup: the loss, the KL and the entropy cover only the model's tokens), ``logprobs`` the engine's for
the model's tokens (0.0 on the appended ones, which the mask drops), and ``episode`` the transcript and
its counts; rewards score ``episode.answer``, the last turn's text. A tool that raises, loops past its
time limit or exhausts its memory answers ``error: <why>`` to the model (counted in
``Episode.tool_errors``); the episode goes on.

Each turn after the first generates only the episodes still going, in one call per per-turn budget, and
each episode keeps its own sampling stream (``SamplingParams.row_ids``: its global row), so an episode's
tokens do not depend on which others are still going.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.rollout.base import Completion, Episode, FinishReason, RolloutEngine, SamplingParams
from trainer.rollout.tool_calls import ToolCall, parse_tool_calls
from trainer.rollout.tool_turns import ToolTurnFormat

Ended = Literal["answer", "max_turns", "length"]
# (name, arguments) -> (result text, or None and why): the sandbox's run_tools, or a test's stand-in
ToolRunner = Callable[[list[tuple[str, dict[str, Any]]]], list[tuple[str | None, str | None]]]


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` model turns, ``max_tokens`` tokens after the prompt (all turns and tool results)."""

    max_turns: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(
                f"max_turns and max_tokens must be >= 1, got {self.max_turns}, {self.max_tokens}"
            )


@dataclass
class _Running:
    """One episode being played."""

    row: int  # the episode's global row (its sampling stream)
    prompt_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: FinishReason = "eos"
    ended: Ended | None = None
    pending: list[ToolCall] = field(default_factory=list)

    def add_turn(self, c: Completion, budget: int, names: Sequence[str], last_turn: bool) -> None:
        """Append the model's turn (cut to the budget left) and read its tool calls."""
        room = budget - len(self.tokens)
        tokens, logprobs = c.token_ids[:room], (c.logprobs or [])[:room]
        cut = len(tokens) < len(c.token_ids)
        self.tokens += tokens
        self.mask += [1] * len(tokens)
        if self.logprobs is not None and c.logprobs is not None:
            self.logprobs += logprobs
        else:
            self.logprobs = None
        self.turns += 1
        self.answer = c.text
        calls = [] if cut or c.finish_reason != "eos" else parse_tool_calls(c.text, names)
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if calls:
            message["tool_calls"] = [call.as_message() for call in calls]
        self.messages.append(message)
        if cut or c.finish_reason == "length":
            self.finish, self.ended = "length", "length"
        elif not calls:
            self.finish, self.ended = "eos", "answer"
        elif last_turn:
            self.finish, self.ended = "eos", "max_turns"
        else:
            self.pending = calls

    def add_results(self, results: list[tuple[str, bool]], ids: list[int], budget: int) -> None:
        """Append the tool results (their rendered ``ids``, not trained); the budget may end the episode."""
        for call, (text, failed) in zip(self.pending, results, strict=True):
            self.tool_calls += 1
            self.tool_errors += int(failed)
            self.messages.append({"role": "tool", "name": call.name, "content": text, "error": failed})
        self.pending = []
        if len(self.tokens) + len(ids) >= budget:  # no room left for the model to answer
            self.finish, self.ended = "length", "length"
            return
        self.tokens += ids
        self.mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)

    def completion(self, tokenizer: Any) -> Completion:
        return Completion(
            prompt_index=self.prompt_index,
            prompt_ids=self.prompt_ids,
            token_ids=self.tokens,
            text=tokenizer.decode(self.tokens, skip_special_tokens=True),
            finish_reason=self.finish,
            logprobs=self.logprobs,
            token_mask=self.mask,
            episode=Episode(
                messages=tuple(self.messages),
                answer=self.answer,
                turns=self.turns,
                tool_calls=self.tool_calls,
                tool_errors=self.tool_errors,
                ended=self.ended or "max_turns",
            ),
        )


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """Turn ``turn``'s sampling seed (turn 1 keeps the call's)."""
    return None if seed is None or turn == 1 else (seed * 1_000_003 + turn) % (1 << 62)


class ToolEpisodes:
    """A ``RolloutEngine`` whose samples are multi-turn tool episodes over ``engine`` (module docstring).

    Args:
        engine: generates each turn (hf, vllm, vllm_server); its weights are the policy's.
        tokenizer: decodes the transcripts; renders tool turns through ``turn_format``.
        tools: the names of the tools the model may call.
        run_tools: runs a batch of calls (the sandbox); one ``(text, error)`` per call.
        turn_format: how tool results become tokens.
        limits: turns and tokens per episode.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        tools: Sequence[str],
        run_tools: ToolRunner,
        turn_format: ToolTurnFormat,
        limits: EpisodeLimits,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.run_tools = run_tools
        self.turn_format = turn_format
        self.limits = limits

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` episodes per prompt, prompt-major; see ``RolloutEngine.generate``."""
        budget, last = self.limits.max_tokens, self.limits.max_turns
        first = self.engine.generate(
            prompts, n, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget))
        )
        episodes = [
            _Running(row=params.first_row + k, prompt_index=c.prompt_index, prompt_ids=list(c.prompt_ids))
            for k, c in enumerate(first)
        ]
        if params.row_ids is not None:  # one sample per prompt, each on its own named row
            for e, row in zip(episodes, params.row_ids, strict=True):
                e.row = row
        for e, c in zip(episodes, first, strict=True):
            e.add_turn(c, budget, self.tools, last_turn=last == 1)
        for turn in range(2, last + 1):
            calling = [e for e in episodes if e.pending]
            if not calling:
                break
            self._answer_calls(calling, budget)
            going = [e for e in episodes if e.ended is None]
            by_room: dict[int, list[_Running]] = {}
            for e in going:
                by_room.setdefault(min(params.max_new_tokens, budget - len(e.tokens)), []).append(e)
            for room, group in by_room.items():
                turn_params = dataclasses.replace(
                    params,
                    max_new_tokens=room,
                    seed=_turn_seed(params.seed, turn),
                    row_ids=tuple(e.row for e in group),
                    first_row=0,
                )
                outs = self.engine.generate([e.prompt_ids + e.tokens for e in group], 1, turn_params)
                for e, c in zip(group, outs, strict=True):
                    e.add_turn(c, budget, self.tools, last_turn=turn == last)
        return [e.completion(self.tokenizer) for e in episodes]

    def _answer_calls(self, calling: list[_Running], budget: int) -> None:
        """Run every pending call of ``calling`` in one batch (malformed ones answer their error without
        running) and append each episode's results."""
        runnable = [(c.name, c.arguments) for e in calling for c in e.pending if c.error is None]
        ran = iter(self.run_tools(runnable) if runnable else [])
        for e in calling:
            results: list[tuple[str, bool]] = []
            for call in e.pending:
                text, error = (None, call.error) if call.error is not None else next(ran)
                results.append((text, False) if text is not None else (f"error: {error}", True))
            e.add_results(results, self.turn_format.ids([t for t, _ in results]), budget)

    def sync_weights(self, model: Any) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        self.engine.close()


def sandbox_runner(source: str, max_result_chars: int) -> ToolRunner:
    """A ``ToolRunner`` over the grader sandbox: ``source``'s functions, each call with the python
    graders' limits (5 s, 1 GiB); the batch's wall-clock limit grows with its calls."""
    from trainer.graders.sandbox import DEFAULT_LIMITS, run_tools

    def run(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, str | None]]:
        worst = 10 + DEFAULT_LIMITS.call_seconds * len(calls)
        limits = dataclasses.replace(
            DEFAULT_LIMITS,
            wall_seconds=max(DEFAULT_LIMITS.wall_seconds, worst),
            cpu_seconds=max(DEFAULT_LIMITS.cpu_seconds, int(worst)),
        )
        return [(r.text, r.error) for r in run_tools(source, calls, limits, max_result_chars)]

    return run
