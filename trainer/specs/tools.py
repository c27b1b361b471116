"""An online-RL run's tools: Python functions the policy may call over several turns of one rollout
(trainer/rollout/tool_episodes.py). Torch-free (the API validates them).

The functions are described in OpenAI's tool shape (``{"type": "function", "function": {name,
description, parameters}}``, the shape chat templates take as ``tools=``), and their code is one Python
source run in the python graders' sandbox (no network, no host files, time and memory limits).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.specs.base import _Frozen
from trainer.specs.graders import MAX_SOURCE_CHARS, refuse_without_sandbox, top_level_functions
from trainer.specs.refs import refuse_nul

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class ToolFunction(_Frozen):
    name: str = Field(
        min_length=1, max_length=64, description="The function's name in `source` (a Python identifier)."
    )
    description: str = Field(default="", max_length=4096, description="What it does, for the model.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="A JSON Schema object of its keyword arguments (shown to the model; the call passes "
        "the model's arguments as they are).",
    )

    @field_validator("name")
    @classmethod
    def _identifier(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError(f"{v!r} is not a Python identifier")
        return v

    @field_validator("description", "parameters")
    @classmethod
    def _without_nul(cls, v: Any) -> Any:
        return refuse_nul(v)


class ToolDefinition(_Frozen):
    type: Literal["function"] = "function"
    function: ToolFunction


class ToolsSpec(_Frozen):
    """Multi-turn tool rollouts: each sample is an episode of up to ``max_turns`` model turns; a turn
    whose text holds tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or the whole
    turn one such JSON object) gets the results back as tool messages and the model goes on; a turn
    without calls is the final answer, which the rewards score. Loss, KL and entropy cover only the
    tokens the model produced (docs/algorithms.md, "Multi-turn tool rollouts")."""

    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="Python defining one top-level function per tool; each call runs `name(**arguments)` "
        "in the sandbox of python graders (no network, no host files, 5 s and 1 GiB per call) and its "
        "return value (a string, else JSON) is the result the model reads.",
    )
    definitions: list[ToolDefinition] = Field(
        min_length=1,
        max_length=32,
        description='The tools, in OpenAI\'s shape: [{"type": "function", "function": {"name", '
        '"description", "parameters"}}]; passed to the chat template as `tools` (templates that list '
        "tools show them to the model; write the calling convention in the prompt for the others).",
    )
    max_turns: int = Field(default=4, ge=2, le=32, description="Model turns per episode, at most.")
    max_episode_tokens: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Tokens after the prompt per episode: the model's turns and the tool results together. "
        "Default: max_turns x hyperparameters.max_new_tokens (the budget of each turn).",
    )
    max_result_chars: int = Field(
        default=2000, ge=1, le=65_536, description="A tool result is cut to this many characters."
    )

    @field_validator("source")
    @classmethod
    def _compiles(cls, v: str) -> str:
        refuse_nul(v, "source")
        top_level_functions(v)  # it parses
        refuse_without_sandbox("tools")
        return v

    @model_validator(mode="after")
    def _defines_each_tool(self) -> ToolsSpec:
        names = [d.function.name for d in self.definitions]
        if len(set(names)) != len(names):
            raise ValueError("definitions: each tool needs its own name")
        defined = top_level_functions(self.source)
        missing = [n for n in names if n not in defined]
        if missing:
            raise ValueError(f"source: defines no top-level function {', '.join(map(repr, missing))}")
        return self

    @property
    def names(self) -> list[str]:
        return [d.function.name for d in self.definitions]

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The episode's token budget after the prompt."""
        return self.max_episode_tokens or self.max_turns * max_new_tokens

    def template_tools(self) -> list[dict[str, Any]]:
        """The definitions as chat templates take them (``apply_chat_template(tools=...)``)."""
        return [d.model_dump() for d in self.definitions]
