"""Bring your own agent: a ``RolloutEngine`` whose samples are episodes played by an agent program outside
rlrun, against an OpenAI-compatible endpoint that the run's policy serves (trainer/rollout/agent_gateway.py
puts ``AgentBoard`` on HTTP; the API proxies it, docs/runs.md "Bring your own agent").

A rollout of ``n`` samples per prompt offers ``len(prompts) * n`` episodes (each its dataset row) on the
board and waits, up to ``agent.timeout_s``, until every one has its reward posted. Meanwhile the agent
takes episodes (``next_episode``), makes chat completion calls for them (``chat``) and posts rewards
(``report``). Calls are served on the rollout's own thread, the thread that owns the policy: the calls
waiting at that moment are generated together, in one ``engine.generate`` per sampling shape, each on
its own sampling stream (row ``episode row x 64 + call``), so concurrent agents batch as the rollouts of
one call would. Each episode's calls become one ``Completion`` (trainer/rollout/agent_chat.py) whose
reward is the one posted (``Episode.env_return``, the ``agent`` reward component).

An episode with no reward when the time is up is ``timeout``: it trains nothing and its group is left out
of the step (trainer/loops/rollouts.py; a group's advantages need every member's reward), counted in
``episode/timeout_frac``. A cancel or pause reaches a waiting rollout as any long phase's does (the
worker's phase watcher raises ``RunStopped`` in it: trainer/stop_watch.py); the episodes are retired on
the way out.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.agent_chat import (
    AgentRequestError,
    Conversation,
    normalize_messages,
    openai_message,
    tool_names,
)
from trainer.rollout.base import Completion, RolloutEngine, SamplingParams
from trainer.rollout.turn_format import TurnFormat

CALL_ROWS = 64  # sampling rows per episode: one per call (agent.max_turns <= 64)
RETIRED_KEPT = 10_000  # ids of past episodes remembered, so a late call gets a clear answer


class BoardClosed(RuntimeError):
    """The run is over: no more episodes."""


@dataclass
class AgentEpisode:
    id: str
    row: dict[str, Any]  # the prompts dataset row the agent plays
    row_index: int  # the episode's global sampling row
    prompt_index: int
    fallback_prompt: list[int]  # the row's prompt ids: the sample of an episode that made no call
    params: SamplingParams
    conversation: Conversation
    evaluation: bool = False
    taken: bool = False
    busy: bool = False  # a call of this episode is being served (calls of one episode go one at a time)
    reward: float | None = None

    def offer(self) -> dict[str, Any]:
        """What ``next_episode`` hands the agent."""
        return {"id": self.id, "row": self.row, "evaluation": self.evaluation}


@dataclass(eq=False)
class CallRequest:
    """One chat completion call waiting for the rollout thread, which generates its reply
    (``completion``), records it in the episode's conversation and sets ``response`` (or ``error``)."""

    episode: AgentEpisode
    messages: list[dict[str, Any]]
    tools: list[str]
    context: list[int]
    max_new_tokens: int
    logprobs: bool
    saved: dict[str, Any]  # the conversation before this call, restored if it fails
    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None
    token_logprobs: list[float] | None = None
    response: dict[str, Any] | None = None
    error: str | None = None
    abandoned: bool = False  # its HTTP caller stopped waiting: nothing is recorded

    def answer(self, error: str | None = None) -> None:
        """Wake the caller (with ``error`` unless a response or an error is there already)."""
        if self.response is None and self.error is None:
            self.error = error or "the call was not served"
        self.done.set()


class AgentBoard:
    """The episodes on offer and the calls waiting to be served; thread-safe. The HTTP side calls
    ``next_episode``, ``chat`` and ``report``; the rollout thread calls ``play``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.offered: deque[AgentEpisode] = deque()
        self.live: dict[str, AgentEpisode] = {}
        self.retired: OrderedDict[str, str] = OrderedDict()  # id -> why it takes no more calls
        self.requests: list[CallRequest] = []  # waiting for the rollout thread
        self.outstanding: set[CallRequest] = set()  # every call whose caller is still waiting
        self.closed = False

    # The agent's side (HTTP threads)

    def next_episode(self, wait: float) -> dict[str, Any] | None:
        """An episode not yet taken, waiting up to ``wait`` seconds for one (None: none came).

        Raises:
            BoardClosed: the run is over.
        """
        deadline = time.monotonic() + wait
        with self.cond:
            while True:
                if self.closed:
                    raise BoardClosed("the run is over; it offers no more episodes")
                if self.offered:
                    episode = self.offered.popleft()
                    episode.taken = True
                    return episode.offer()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def _episode(self, episode_id: str) -> AgentEpisode:
        episode = self.live.get(episode_id)
        if episode is not None:
            return episode
        why = self.retired.get(episode_id)
        if why is not None:
            raise AgentRequestError(f"episode {episode_id} {why}", status=409, code="episode_closed")
        raise AgentRequestError(f"no episode {episode_id}", status=404, code="episode_not_found")

    def chat(self, episode_id: str, body: Any, wait: float = 3600.0) -> dict[str, Any]:
        """Serve one chat completion call of an episode: its OpenAI response, with the token ids it was
        generated from and returned (``prompt_token_ids``, ``choices[0].token_ids``, as vLLM's
        ``return_token_ids`` answers) and, when asked (``logprobs: true``), the reply's log-probs. The
        same call again (a client retrying a lost response) gets the same response; a call that fails
        leaves the episode as it was.

        Raises:
            AgentRequestError: a bad request, an unknown or closed episode, or a call past its limits.
        """
        if not isinstance(body, dict):
            raise AgentRequestError("the body must be a JSON object")
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools")
        names = tool_names(tools)
        if body.get("n", 1) != 1:
            raise AgentRequestError("n must be 1: each call is one turn of the episode", param="n")
        if body.get("stream"):
            raise AgentRequestError("stream is not supported on an agent endpoint", param="stream")
        wanted = body.get("max_completion_tokens", body.get("max_tokens"))
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1):
            raise AgentRequestError("max_tokens must be a positive integer", param="max_tokens")
        with self.cond:
            episode = self._episode(episode_id)
            _open(episode, episode_id)
            conversation = episode.conversation
            if conversation.is_retry(messages):
                assert conversation.answered is not None
                return conversation.answered
            saved = conversation.snapshot()
            context = conversation.context(messages, tools or None)
            room = min(episode.params.max_new_tokens, conversation.room(), wanted or math.inf)
            request = CallRequest(
                episode, messages, names, context, int(room), bool(body.get("logprobs")), saved
            )
            episode.busy = True
            self.requests.append(request)
            self.outstanding.add(request)
            self.cond.notify_all()
        served = request.done.wait(wait)
        with self.cond:
            episode.busy = False
            self.outstanding.discard(request)
            if not served:
                request.abandoned = True
                if request in self.requests:
                    self.requests.remove(request)
                request.error = request.error or "the call was not served in time"
            if request.response is None:
                conversation.restore(request.saved)
                raise AgentRequestError(request.error or "the call failed", status=409, code="call_failed")
            return request.response

    def report(self, episode_id: str, reward: Any) -> None:
        """Post an episode's reward: its calls are done.

        Raises:
            AgentRequestError: not a finite number within ±1e6, an unknown or closed episode, one
                reported already, or one with a call in progress.
        """
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not abs(reward) <= 1e6:
            raise AgentRequestError(f"reward must be a number within ±1e6, got {reward!r}"[:200], "reward")
        with self.cond:
            episode = self._episode(episode_id)
            _open(episode, episode_id)
            episode.reward = float(reward)
            self.cond.notify_all()

    # The rollout's side

    def play(
        self,
        episodes: list[AgentEpisode],
        timeout: float,
        serve: Callable[[list[CallRequest]], None],
    ) -> None:
        """Offer ``episodes`` and serve their calls until every one is reported or ``timeout`` seconds
        pass; then retire them (their later calls are refused, a call still waiting is answered)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            for e in episodes:
                self.live[e.id] = e
                self.offered.append(e)
            self.cond.notify_all()
        try:
            while time.monotonic() < deadline:
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.requests or all(e.reward is not None for e in episodes),
                        timeout=max(0.0, min(1.0, deadline - time.monotonic())),
                    )
                    batch, self.requests = self.requests, []
                    finished = all(e.reward is not None for e in episodes)
                if batch:
                    self._serve(batch, serve)
                elif finished:
                    return
        finally:
            self._retire(episodes)

    def _serve(self, batch: list[CallRequest], serve: Callable[[list[CallRequest]], None]) -> None:
        """``serve(batch)`` generates the replies; each is recorded in its episode's conversation here
        (the rollout's thread, under the lock), so a sample is never built while a reply is half in."""
        try:
            serve(batch)
        finally:
            with self.cond:
                for r in batch:
                    if r.completion is not None and not r.abandoned:
                        r.response = record(r)
            for r in batch:
                r.answer("generation failed; see the run's events")

    def _retire(self, episodes: list[AgentEpisode]) -> None:
        with self.cond:
            ids = {e.id for e in episodes}
            self.offered = deque(e for e in self.offered if e.id not in ids)
            for e in episodes:
                self.live.pop(e.id, None)
                self.retired[e.id] = "is closed: its reward is in" if e.reward is not None else "timed out"
            while len(self.retired) > RETIRED_KEPT:
                self.retired.popitem(last=False)
            self.requests = [r for r in self.requests if r.episode.id not in ids]
            pending = [r for r in self.outstanding if r.episode.id in ids]
        for r in pending:
            r.answer(f"episode {r.episode.id} timed out")

    def close(self) -> None:
        """The run is over: long polls answer ``BoardClosed``, waiting calls an error."""
        with self.cond:
            self.closed = True
            self.requests = []
            pending = list(self.outstanding)
            self.cond.notify_all()
        for r in pending:
            r.answer("the run is over")


def _open(episode: AgentEpisode, episode_id: str) -> None:
    """Refuse a call or a reward for an episode whose reward is in, or that has a call in progress."""
    if episode.reward is not None:
        raise AgentRequestError(
            f"episode {episode_id} has its reward already", status=409, code="episode_closed"
        )
    if episode.busy:
        raise AgentRequestError(
            f"episode {episode_id} has a call in progress; its calls go one at a time",
            status=409,
            code="call_in_progress",
        )


def record(request: CallRequest) -> dict[str, Any]:
    """Record a generated reply in its episode's conversation; the call's OpenAI response."""
    c = request.completion
    assert c is not None
    conversation = request.episode.conversation
    message = conversation.reply(c, request.tools, c.logprobs or request.token_logprobs)
    out = response(request.episode, conversation.calls, message, request)
    conversation.asked, conversation.answered = request.messages, out
    return out


def response(
    episode: AgentEpisode, call: int, message: dict[str, Any], request: CallRequest
) -> dict[str, Any]:
    """OpenAI's chat completion object for a served call, with the token ids (vLLM's field names)."""
    c = request.completion
    assert c is not None
    reason = (
        "tool_calls" if message.get("tool_calls") else "length" if c.finish_reason == "length" else "stop"
    )
    choice: dict[str, Any] = {
        "index": 0,
        "message": openai_message(message, episode.id, call),
        "finish_reason": reason,
        "token_ids": list(c.token_ids),
    }
    logprobs = c.logprobs or request.token_logprobs
    if request.logprobs and logprobs is not None:
        tok = episode.conversation.tokenizer
        choice["logprobs"] = {
            "content": [
                {"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(c.token_ids, logprobs, strict=True)
            ]
        }
    return {
        "id": f"chatcmpl-{episode.id[:8]}-{call}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "policy",
        "choices": [choice],
        "prompt_token_ids": list(request.context),
        "usage": {
            "prompt_tokens": len(request.context),
            "completion_tokens": len(c.token_ids),
            "total_tokens": len(request.context) + len(c.token_ids),
        },
    }


class AgentEpisodes:
    """A ``RolloutEngine`` whose samples are episodes an agent plays on ``board`` (module docstring).

    Args:
        engine: generates each call (hf, vllm, vllm_server); its weights are the policy's.
        tokenizer: renders and decodes conversations.
        board: where the episodes are offered (the run's gateway serves it).
        turn_format: how messages added between calls become tokens.
        timeout: seconds a batch of episodes may take.
        max_calls, budget: an episode's calls and tokens after its first prompt, at most.
        max_prompt_tokens: an episode's first prompt, at most (the run's ``max_prompt_length``).
        logprobs_of: the policy's log-probs of a reply (context, tokens, temperature), for an engine that
            reports none (the transformers engine); None: not computed.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        board: AgentBoard,
        turn_format: TurnFormat,
        *,
        timeout: float,
        max_calls: int,
        budget: int,
        max_prompt_tokens: int,
        logprobs_of: Callable[[list[int], list[int], float], list[float]] | None = None,
    ):
        if max_calls > CALL_ROWS:
            raise ValueError(f"max_calls must be <= {CALL_ROWS}, got {max_calls}")
        self.engine, self.tokenizer, self.board, self.turn_format = engine, tokenizer, board, turn_format
        self.timeout, self.max_calls, self.budget = timeout, max_calls, budget
        self.max_prompt_tokens = max_prompt_tokens
        self.logprobs_of = logprobs_of

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` agent episodes per prompt, prompt-major; each prompt's ``tag`` is its dataset row."""
        rows = range(params.first_row, params.first_row + len(prompts) * n)
        if params.row_ids is not None:
            rows = params.row_ids  # type: ignore[assignment]
        episodes = [
            AgentEpisode(
                id=uuid.uuid4().hex,
                row=dict(getattr(prompts[k // n], "tag", None) or {}),
                row_index=row,
                prompt_index=k // n,
                fallback_prompt=list(prompts[k // n]),
                params=params,
                evaluation=params.is_greedy,
                conversation=Conversation(
                    self.tokenizer, self.turn_format, self.max_prompt_tokens, self.budget, self.max_calls
                ),
            )
            for k, row in enumerate(rows)
        ]
        self.board.play(episodes, self.timeout, self.serve)
        return [self._sample(e) for e in episodes]

    def serve(self, batch: list[CallRequest]) -> None:
        """Generate the replies of ``batch``: one engine call per sampling shape, each call on its own row."""
        shapes: dict[tuple[int, bool, int | None], list[CallRequest]] = {}
        for r in batch:
            p = r.episode.params
            shapes.setdefault((r.max_new_tokens, p.is_greedy, p.seed), []).append(r)
        for group in shapes.values():
            p = group[0].episode.params
            params = dataclasses.replace(
                p,
                max_new_tokens=group[0].max_new_tokens,
                first_row=0,
                row_ids=tuple(r.episode.row_index * CALL_ROWS + r.episode.conversation.calls for r in group),
            )
            outs = self.engine.generate([r.context for r in group], 1, params)
            for r, c in zip(group, outs, strict=True):
                if r.logprobs and c.logprobs is None and self.logprobs_of is not None:
                    r.token_logprobs = self.logprobs_of(r.context, list(c.token_ids), p.temperature)
                r.completion = c

    def _sample(self, e: AgentEpisode) -> Completion:
        conv = e.conversation
        if e.reward is not None and conv.calls:
            return conv.completion(e.prompt_index, e.reward, conv.limit_hit or "answer")
        # no reward in time, or no call made: the sample trains nothing
        ended = "timeout" if e.reward is None else "error"
        eos = self.tokenizer.eos_token_id
        empty = Conversation(self.tokenizer, self.turn_format, self.max_prompt_tokens, self.budget, 0)
        empty.prompt_ids, empty.tokens, empty.mask, empty.logprobs = e.fallback_prompt, [eos], [0], None
        if conv.calls:  # what it did before time ran out, for the samples
            empty.transcript, empty.calls, empty.tool_calls = conv.transcript, conv.calls, conv.tool_calls
        elif e.reward is not None:
            empty.transcript = [
                {"role": "environment", "content": "error: the agent made no call", "error": True}
            ]
        return empty.completion(e.prompt_index, e.reward, ended)

    def sync_weights(self, model: Any) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        self.engine.close()
