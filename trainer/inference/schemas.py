"""Request bodies of the OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (torch-free:
the API documents them in its OpenAPI schema and the inference process validates them).

Parameters that would change the answer and that rlrun does not implement (tools, JSON response formats,
logit bias, presence/frequency penalties, ``echo``, ``suffix``, ``best_of``) are refused with 400 naming
the parameter, never silently ignored; parameters without effect on the text (``user``, ``metadata``,
``store``, ``service_tier``) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_STOPS = 4
MAX_NEW_TOKENS = 4096


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or a list of text parts (joined).")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both routes share."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="A name `GET /v1/models` lists: `run:<id>`, `run:<id>@<step>`, a preset.")
    n: int = Field(default=1, ge=1, le=MAX_N, description="Choices to sample.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling (Holtzman et al. 2020).")
    stop: str | list[str] | None = Field(default=None, description=f"Up to {MAX_STOPS} stop strings.")
    seed: int | None = Field(default=None, description="The same seed gives the same text.")
    stream: bool = Field(default=False, description="Server-sent events, OpenAI's chunk objects.")
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and data[name] not in neutral:
                    raise ValueError(f"{name}: not supported by rlrun's inference (send it unset)")
        return data

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings")
        return tuple(stops)


# Parameter -> the values that mean "off" (accepted).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=MAX_NEW_TOKENS, description="Wins over the older `max_tokens`."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] = Field(description="One prompt, or a list (choices are prompt-major).")
    max_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS, description="OpenAI's default: 16.")
    logprobs: int | None = Field(
        default=None, ge=0, le=5, description="Top log-probs per token (legacy shape)."
    )

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt: must be a non-empty string or a list of non-empty strings")
        return prompts
