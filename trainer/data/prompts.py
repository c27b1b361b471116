"""Prompts -> text and token ids: chat prompts through the tokenizer's template, cut from the left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def render_prompt(
    prompt: str | list[dict[str, str]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> str:
    """A chat prompt goes through the tokenizer's chat template (or a plain role: content fallback);
    ``tools`` (OpenAI's shape) go to the template, which lists them to the model where it knows how."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        text: str = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **extra)
        return text
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


@dataclass(frozen=True)
class PromptSet:
    """Rendered prompt texts and their token ids (cut from the left to the prompt budget)."""

    rows: list[dict[str, Any]]
    texts: list[str]
    ids: list[list[int]]


def tokenize_prompts(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    max_prompt_length: int,
    tools: list[dict[str, Any]] | None = None,
) -> PromptSet:
    texts = [render_prompt(r["prompt"], tokenizer, tools) for r in rows]
    ids = [tokenizer(t).input_ids[-max_prompt_length:] for t in texts]
    return PromptSet(rows=rows, texts=texts, ids=ids)
