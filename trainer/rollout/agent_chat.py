"""One agent episode's chat completion calls as one token sequence: what the policy generates from at each
call, what it trains on afterwards, and the OpenAI-shaped answers. Pure but for the tokenizer.

An agent program (any framework over the ``openai`` client) plays an episode by calling
``chat.completions.create`` several times, each time sending the whole conversation again: its first
messages, the assistant's earlier replies as the endpoint returned them, and what it adds between calls
(tool results, a user's next turn). Re-rendering that conversation through the chat template and
tokenizing it again would not give back the tokens the policy sampled (a reply's text re-tokenizes
differently, a template rewrites tool calls), so the episode is kept as tokens instead (the
"token-in, token-out" bookkeeping of Agent Lightning, OpenPipe ART and verl's agent loop):

1. the first call's messages are rendered with the chat template (and the request's ``tools``) into the
   episode's prompt;
2. each reply's sampled tokens are appended as they are (trained: mask 1, with their log-probs);
3. a later call whose messages are the conversation so far (the earlier messages and every reply as
   returned, compared by role, content and tool calls) followed by new messages appends only those new
   messages, as the chat template writes them after a turn (trainer/rollout/turn_format.py; never
   trained: mask 0), then generates again;
4. a later call that does not extend the conversation (the agent rewrote or cut its history) starts it
   anew from that call: the earlier calls are not trained (``Conversation.rewrites`` counts them).

So the training sample of an episode is exactly the tokens its calls generated from and returned, in
order, with only the policy's own tokens trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trainer.data.prompts import render_prompt
from trainer.rollout.base import Completion, Episode, FinishReason
from trainer.rollout.tool_calls import TAGGED, parse_tool_calls
from trainer.rollout.turn_format import TurnFormat

ROLES = ("system", "user", "assistant", "tool")


class AgentRequestError(ValueError):
    """A chat completion request this episode cannot serve; ``param`` names the field, ``status`` the
    HTTP status (400: the request, 409: the episode's state)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, None, or OpenAI's list of ``{"type": "text", "text"}`` parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for p in value:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise AgentRequestError("only text content parts are supported", param=where)
            parts.append(p["text"])
        return "".join(parts)
    raise AgentRequestError("content must be a string or a list of text parts", param=where)


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``{"name", "arguments": dict}`` (arguments parsed)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise AgentRequestError("tool_calls must be a list", param=where)
    out = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise AgentRequestError("a tool call needs function.name", param=f"{where}[{k}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise AgentRequestError(
                    "function.arguments is not valid JSON", param=f"{where}[{k}]"
                ) from None
        out.append({"name": fn["name"], "arguments": args})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as ``{"role", "content", "tool_calls"?}`` (``developer`` read as
    ``system``), the form conversations are compared and rendered in.

    Raises:
        AgentRequestError: not a non-empty list of messages with known roles and text content.
    """
    if not isinstance(messages, list) or not messages:
        raise AgentRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise AgentRequestError("a message must be an object", param=where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise AgentRequestError(f"role must be one of {', '.join(ROLES)}, got {role!r}", param=where)
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        for key in ("name", "tool_call_id"):  # what templates may write beside a tool result
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "assistant":
            calls = _calls(m.get("tool_calls"), f"{where}.tool_calls")
            if calls:
                msg["tool_calls"] = calls
        out.append(msg)
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages in the shape chat templates take (tool calls as ``{"type": "function",
    "function": {name, arguments}}``)."""
    out = []
    for m in messages:
        t = {k: v for k, v in m.items() if k != "tool_calls"}
        if m.get("tool_calls"):
            t["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
        out.append(t)
    return out


def tool_names(tools: Any) -> list[str]:
    """The function names of a request's ``tools`` (OpenAI's shape).

    Raises:
        AgentRequestError: not a list of ``{"type": "function", "function": {"name": ...}}``.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise AgentRequestError("tools must be a list", param="tools")
    names = []
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise AgentRequestError(
                'a tool must be {"type": "function", "function": {"name": ...}}', f"tools[{k}]"
            )
        names.append(fn["name"])
    return names


@dataclass
class Conversation:
    """One episode's calls so far as tokens (module docstring). ``budget``: tokens after the prompt, at
    most; ``max_calls``: chat completion calls, at most."""

    tokenizer: Any
    turn_format: TurnFormat
    max_prompt_tokens: int
    budget: int
    max_calls: int
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalized, replies as returned
    transcript: list[dict[str, Any]] = field(default_factory=list)  # what the samples show
    calls: int = 0
    tool_calls: int = 0
    rewrites: int = 0
    answer: str = ""
    finish: FinishReason = "eos"
    limit_hit: str | None = None  # "length" or "max_turns": the last call was refused for the limits
    asked: list[dict[str, Any]] | None = None  # the last served call's messages
    answered: dict[str, Any] | None = None  # and its response: a retry of that call gets it again

    def snapshot(self) -> dict[str, Any]:
        """The state a call may change, to ``restore`` if the call fails."""
        return {
            k: (list(v) if isinstance(v, list) else v)
            for k, v in vars(self).items()
            if k not in ("tokenizer", "turn_format")
        }

    def restore(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def is_retry(self, messages: list[dict[str, Any]]) -> bool:
        """``messages`` are the last served call's again (a client retrying a lost response)."""
        return self.answered is not None and messages == self.asked

    def context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The token ids the policy answers this call from; the episode's tokens grow to them.

        Raises:
            AgentRequestError: past the episode's call limit or token budget, a first prompt longer than
                the run's ``max_prompt_length``, or messages the chat template cannot write.
        """
        if self.calls >= self.max_calls:
            self.limit_hit = "max_turns"
            raise AgentRequestError(
                f"the episode's call limit (agent.max_turns = {self.max_calls}) is reached; post its reward",
                param="messages",
                code="episode_limit",
            )
        n = len(self.messages)
        if self.calls and len(messages) > n and messages[:n] == self.messages:
            new = messages[n:]
            try:
                delta = self.turn_format.ids(new)
            except Exception as exc:  # noqa: BLE001 - templates raise their own errors (jinja, role checks)
                why = f"the chat template cannot write these messages: {exc}"[:500]
                raise AgentRequestError(why, param="messages") from None
            if self.finish == "length":  # the last reply was cut: close its turn first
                delta = self._end_of_turn() + delta
            if len(self.tokens) + len(delta) >= self.budget:
                self.limit_hit = "length"
                raise AgentRequestError(
                    f"the episode's token budget ({self.budget} tokens after its first prompt) is spent; "
                    "post its reward",
                    param="messages",
                    code="context_length_exceeded",
                )
            self._append(delta, trained=False)
            self.transcript += [_shown(m) for m in new]
        else:
            rewrite = self.calls > 0
            self._start(messages, tools)
            self.rewrites += int(rewrite)
        self.limit_hit = None
        self.messages = list(messages)
        return self.prompt_ids + self.tokens

    def _start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        try:
            text = render_prompt(template_messages(messages), self.tokenizer, tools)
        except Exception as exc:  # noqa: BLE001 - templates raise their own errors (jinja, role checks)
            why = f"the chat template cannot write these messages: {exc}"[:500]
            raise AgentRequestError(why, "messages") from None
        ids: list[int] = self.tokenizer(text).input_ids
        if len(ids) > self.max_prompt_tokens:
            raise AgentRequestError(
                f"the prompt is {len(ids)} tokens; this run's max_prompt_length is {self.max_prompt_tokens}",
                param="messages",
                code="context_length_exceeded",
            )
        self.prompt_ids, self.tokens, self.mask, self.logprobs = ids, [], [], []
        self.transcript = [_shown(m) for m in messages]
        self.finish = "eos"

    def room(self) -> int:
        """Tokens the next reply may take."""
        return self.budget - len(self.tokens)

    def _append(self, ids: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.mask += [int(trained)] * len(ids)
        if self.logprobs is not None and (logprobs is not None or not trained):
            self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        else:
            self.logprobs = None

    def _end_of_turn(self) -> list[int]:
        eot = self.turn_format.end_of_turn
        return [] if eot is None else self.tokenizer(eot, add_special_tokens=False).input_ids

    def reply(self, c: Completion, tools: list[str], logprobs: list[float] | None) -> dict[str, Any]:
        """Record the policy's reply ``c`` to the last ``context``; its message (tool calls read from the
        text when the request gave ``tools``)."""
        self.calls += 1
        self._append(list(c.token_ids), trained=True, logprobs=logprobs)
        self.finish = c.finish_reason
        found = [x for x in parse_tool_calls(c.text, tools) if x.error is None] if tools else []
        content = TAGGED.sub("", c.text).strip() if found else c.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if found:
            message["tool_calls"] = [{"name": x.name, "arguments": x.arguments} for x in found]
        self.tool_calls += len(found)
        self.answer = content
        self.messages.append(message)
        self.transcript.append(_shown(message))
        return message

    def completion(self, prompt_index: int, reward: float | None, ended: str) -> Completion:
        """The episode as one training sample (``token_mask``: the policy's tokens)."""
        return Completion(
            prompt_index=prompt_index,
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.tokens),
            text=self.tokenizer.decode(self.tokens, skip_special_tokens=True),
            finish_reason="length" if ended == "length" else self.finish,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            token_mask=list(self.mask),
            episode=Episode(
                messages=tuple(dict(m) for m in self.transcript),
                answer=self.answer,
                turns=self.calls,
                tool_calls=self.tool_calls,
                tool_errors=0,
                ended=ended,  # type: ignore[arg-type]
                env_return=reward,
                budget=self.budget,
            ),
        )


def _shown(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the dashboard's transcript shows it (tool calls as OpenAI's ``tool_calls``)."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = list(m["tool_calls"])
    return out


def openai_message(message: dict[str, Any], episode_id: str, call: int) -> dict[str, Any]:
    """A recorded reply as OpenAI's response message (tool call ids ``call_<episode>_<call>_<k>``,
    arguments as JSON text)."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": f"call_{episode_id[:8]}_{call}_{k}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for k, c in enumerate(message["tool_calls"])
        ]
    return out
