"""Multi-turn rollouts: a ``RolloutEngine`` that plays each sample as an episode of several model turns over
another engine, with a ``Responder`` deciding what follows each turn (tools: trainer/rollout/tool_episodes.py;
an environment's ``step``: trainer/rollout/env_episodes.py).

An episode, for one prompt (verl's multi-turn rollout, TRL's tool-calling GRPO; the loss mask of Qwen's
and SkyRL's agent trainers):

1. the model generates a turn (at most ``max_new_tokens``, and no more than the episode budget left);
2. the responder reads it and either ends the episode or answers with messages (tool results, an
   environment's observation), which are appended as the chat template writes them, followed by the
   opening of the model's next turn (trainer/rollout/turn_format.py); back to 1;
3. it also ends after ``max_turns`` model turns, or when the budget of ``max_tokens`` tokens after the
   prompt (the model's and the appended ones alike) runs out.

The episode comes back as one ``Completion``: ``token_ids`` the whole transcript after the prompt,
``token_mask`` 1 on the tokens the model sampled and 0 on every appended token (the loss, the KL and the
entropy cover only the model's tokens), ``logprobs`` the engine's for the model's tokens (0.0 on the
appended ones, which the mask drops), and ``episode`` the transcript and its counts.

Each turn after the first generates only the episodes still going, in one call (each then cut to its
own budget left), and with the transformers engine each episode keeps its own sampling stream
(``SamplingParams.row_ids``: its global row), so an episode's tokens do not depend on which others are
still going (vLLM's engines take no per-request seeds on CPU: trainer/rollout/served_engine.py).

A prompt may carry what a responder needs about its row (``TaggedPrompt``: an environment's dataset row
and opening messages), so identical prompt tokens of different rows stay apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from trainer.rollout.base import Completion, Episode, FinishReason, RolloutEngine, SamplingParams
from trainer.rollout.turn_format import TurnFormat

Ended = Literal["answer", "done", "max_turns", "length", "error"]


class TaggedPrompt(list[int]):
    """A prompt's token ids with ``tag``, what a responder needs about its row; a list like any prompt."""

    def __init__(self, ids: Sequence[int], tag: Any):
        super().__init__(ids)
        self.tag = tag


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` model turns, ``max_tokens`` tokens after the prompt (all turns and appended messages)."""

    max_turns: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(
                f"max_turns and max_tokens must be >= 1, got {self.max_turns}, {self.max_tokens}"
            )


@dataclass
class Running:
    """One episode being played; a ``Responder`` reads ``answer`` (the last turn's text) and sets
    ``ended`` or ``reply``."""

    row: int  # the episode's global row (its sampling stream)
    prompt_index: int
    prompt_ids: list[int]
    tag: Any = None  # the prompt's ``TaggedPrompt.tag``
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_return: float | None = None
    finish: FinishReason = "eos"
    ended: Ended | None = None
    cut: bool = False  # the last turn ran out of tokens (per turn or the episode's budget)
    reply: list[dict[str, Any]] = field(default_factory=list)

    def add_turn(self, c: Completion, budget: int) -> None:
        """Append the model's turn, cut to the budget left."""
        room = budget - len(self.tokens)
        tokens, logprobs = c.token_ids[:room], (c.logprobs or [])[:room]
        self.cut = len(tokens) < len(c.token_ids) or c.finish_reason == "length"
        self.tokens += tokens
        self.mask += [1] * len(tokens)
        if self.logprobs is not None and c.logprobs is not None:
            self.logprobs += logprobs
        else:
            self.logprobs = None
        self.turns += 1
        self.answer = c.text
        self.messages.append({"role": "assistant", "content": c.text})

    def end(self, how: Ended) -> None:
        self.ended = how
        self.finish = "length" if how == "length" else "eos"

    def add_reply(self, ids: list[int], budget: int) -> None:
        """Append the responder's messages (their rendered ``ids``, not trained); the budget may end it."""
        self.messages += self.reply
        self.reply = []
        if len(self.tokens) + len(ids) >= budget:  # no room left for the model to answer
            self.end("length")
            return
        self.tokens += ids
        self.mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)

    def fail(self, why: str) -> None:
        """End the episode on an error of its own: the reason is the transcript's last message."""
        self.messages.append({"role": "environment", "content": f"error: {why}", "error": True})
        self.end("error")

    def completion(self, tokenizer: Any, budget: int) -> Completion:
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
                env_return=self.env_return,
                budget=budget,
            ),
        )


class Responder(Protocol):
    """What follows the model's turns: for each episode of ``played`` (every one that has just taken a
    turn; ``cut`` says it ran out of tokens), either ``end(...)`` it or set ``reply`` to the messages
    that come next. ``last``: that was the last turn the episode may take. Called once per turn for the
    whole batch, so a responder runs its work (tools, an environment) in one sandbox per turn."""

    def respond(self, played: list[Running], last: bool) -> None: ...


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """Turn ``turn``'s sampling seed (turn 1 keeps the call's)."""
    return None if seed is None or turn == 1 else (seed * 1_000_003 + turn) % (1 << 62)


class MultiTurnEngine:
    """A ``RolloutEngine`` whose samples are multi-turn episodes over ``engine`` (module docstring).

    Args:
        engine: generates each turn (hf, vllm, vllm_server); its weights are the policy's.
        tokenizer: decodes the transcripts; renders replies through ``turn_format``.
        responder: decides what follows each turn.
        turn_format: how replies become tokens.
        limits: turns and tokens per episode.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        responder: Responder,
        turn_format: TurnFormat,
        limits: EpisodeLimits,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.responder = responder
        self.turn_format = turn_format
        self.limits = limits

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` episodes per prompt, prompt-major; see ``RolloutEngine.generate``."""
        budget, last = self.limits.max_tokens, self.limits.max_turns
        first = self.engine.generate(
            prompts, n, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget))
        )
        episodes = [
            Running(
                row=params.first_row + k,
                prompt_index=c.prompt_index,
                prompt_ids=list(c.prompt_ids),
                tag=getattr(prompts[k // n], "tag", None),
            )
            for k, c in enumerate(first)
        ]
        if params.row_ids is not None:  # one sample per prompt, each on its own named row
            for e, row in zip(episodes, params.row_ids, strict=True):
                e.row = row
        for e, c in zip(episodes, first, strict=True):
            e.add_turn(c, budget)
        for turn in range(1, last + 1):
            played = [e for e in episodes if e.ended is None]
            if not played:
                break
            self.responder.respond(played, last=turn == last)
            for e in played:
                if e.ended is None and e.cut:  # a turn out of tokens cannot go on
                    e.end("length")
                if e.ended is None and (turn == last or not e.reply):
                    e.end("max_turns" if e.reply else "answer")
                if e.ended is None:
                    try:
                        ids = self.turn_format.ids(e.reply)
                    except Exception as exc:  # noqa: BLE001 - a template's own error ends this episode only
                        e.fail(f"the reply could not be written in the chat template: {exc}"[:500])
                        continue
                    e.add_reply(ids, budget)
            self._next_turn([e for e in episodes if e.ended is None], turn + 1, params, budget)
        return [e.completion(self.tokenizer, budget) for e in episodes]

    def _next_turn(self, going: list[Running], turn: int, params: SamplingParams, budget: int) -> None:
        """One generate call for every episode still going, with the largest room any has left (at most
        ``max_new_tokens``); ``add_turn`` cuts each to its own."""
        if not going:
            return
        room = min(params.max_new_tokens, max(budget - len(e.tokens) for e in going))
        turn_params = dataclasses.replace(
            params,
            max_new_tokens=room,
            seed=_turn_seed(params.seed, turn),
            row_ids=tuple(e.row for e in going),
            first_row=0,
        )
        outs = self.engine.generate([e.prompt_ids + e.tokens for e in going], 1, turn_params)
        for e, c in zip(going, outs, strict=True):
            e.add_turn(c, budget)

    def sync_weights(self, model: Any) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        self.engine.close()
