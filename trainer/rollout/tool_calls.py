"""Reading the tool calls in one assistant turn's text. Pure: no tokenizer, no model.

Two formats, tried in this order:

1. **Tagged** (Hermes, Qwen 2.5/3, SmolLM3 templates): each call is a JSON object between ``<tool_call>``
   and ``</tool_call>``, ``{"name": ..., "arguments": {...}}``; a turn may hold several.
2. **Bare JSON** (Llama 3.1's JSON function calls; any template without a tool-call format): the whole
   turn, stripped, is one JSON object with ``name`` and ``arguments`` (or ``parameters``).

Anything else is a final answer. A turn that opens a ``<tool_call>`` whose contents are not a valid call
(bad JSON, no name, an unknown tool, arguments that are not an object) still counts as a call: it gets an
error back as its result (``ToolCall.error``), so the model sees what it did wrong and the run counts it
as a tool error, as a real tool runtime would answer.

Only the model's own turns are read: a tool result that contains ``<tool_call>`` text is never parsed
(trainer/rollout/tool_episodes.py never passes one here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its keyword arguments, or why it cannot run."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_message(self) -> dict[str, Any]:
        """The call as an OpenAI-shaped ``tool_calls`` entry's ``function`` (transcripts)."""
        return {"name": self.name, "arguments": self.arguments}


def parse_tool_calls(text: str, tools: Collection[str]) -> list[ToolCall]:
    """The calls in an assistant turn's ``text`` to the tools named ``tools`` (empty: a final answer)."""
    tagged = TAGGED.findall(text)
    if tagged:
        return [_call(body.strip(), tools) for body in tagged]
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            obj = json.loads(stripped)
        except ValueError:
            return []  # a JSON-looking answer, not a call
        if isinstance(obj, dict) and "name" in obj and ("arguments" in obj or "parameters" in obj):
            return [_from_object(obj, tools)]
    return []


def _call(body: str, tools: Collection[str]) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(name="", error=f"the tool call is not valid JSON: {exc.msg} (char {exc.pos})")
    if not isinstance(obj, dict):
        return ToolCall(name="", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    return _from_object(obj, tools)


def _from_object(obj: dict[str, Any], tools: Collection[str]) -> ToolCall:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", error='a tool call needs a "name" (a string)')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire shape: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return ToolCall(name=name, error="the tool call's arguments are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(name=name, error="the tool call's arguments must be a JSON object")
    if name not in tools:
        known = ", ".join(sorted(tools))
        return ToolCall(name=name, arguments=args, error=f"unknown tool {name!r}; the tools are: {known}")
    return ToolCall(name=name, arguments=args)
