"""What every rollout engine takes and returns; torch-free so specs, tests and loops share it cheaply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

FinishReason = Literal["eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one object per ``generate`` call.

    ``temperature == 0`` or ``greedy=True`` means greedy decoding (``top_p``/``top_k`` are then ignored).
    ``seed`` makes a call reproducible; ``None`` draws from the engine's own random state (for HF the
    global torch RNG, which the loop seeds once per run). The HF engine keys each row's draws by ``seed``
    and the row's global index, ``first_row`` + its index in the call (trainer/rollout/row_sampling.py):
    a prompt's samples do not depend on the batch around it, so ranks that each generate a share of a
    step's prompts (passing their share's first row) sample what one process sampling them all would.
    ``row_ids``, when given, names each prompt's global row instead (rows that are not consecutive: the
    episodes of a multi-turn rollout still going at a later turn); it needs ``n == 1``.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    greedy: bool = False
    seed: int | None = None
    first_row: int = 0
    row_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {self.first_row}")
        if self.row_ids is not None and any(r < 0 for r in self.row_ids):
            raise ValueError("row_ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt.

    ``token_ids`` are the generated tokens only: no prompt, no padding, and the EOS token kept as the last
    token when generation stopped on it (``finish_reason == "eos"``); otherwise ``len(token_ids) ==
    max_new_tokens`` and ``finish_reason == "length"``. ``logprobs`` (one per token) come from engines that
    report them (vLLM); ``None`` means the trainer recomputes them.
    """

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    # Multi-turn episodes (trainer/rollout/tool_episodes.py): 1 where the model produced the token, 0 for
    # tool results and template markup between its turns (None: every token is the model's)
    token_mask: list[int] | None = None
    episode: Episode | None = None

    @property
    def answer(self) -> str:
        """The text the rewards score: an episode's final answer, else the whole completion."""
        return self.episode.answer if self.episode is not None else self.text

    @property
    def model_tokens(self) -> int:
        """How many of ``token_ids`` the model produced."""
        return len(self.token_ids) if self.token_mask is None else sum(self.token_mask)


@dataclass(frozen=True)
class Episode:
    """What a multi-turn rollout did: its transcript after the prompt (assistant turns with their tool
    calls, tool results, an environment's messages), the final answer (the last assistant turn's text),
    and counts. ``ended``: ``answer`` (a turn without tool calls), ``done`` (the environment said so),
    ``max_turns`` (still going at the last turn), ``length`` (out of tokens), ``error`` (the
    environment failed) or ``timeout`` (an agent's episode that never reported its reward).
    ``env_return``: the sum of the rewards an environment gave, or the reward an agent posted (None:
    neither)."""

    messages: tuple[dict[str, Any], ...]
    answer: str
    turns: int
    tool_calls: int
    tool_errors: int
    ended: Literal["answer", "done", "max_turns", "length", "error", "timeout"]
    env_return: float | None = None
    budget: int | None = None  # the episode's token budget after the prompt (what length rewards compare)


class RolloutEngine(Protocol):
    """A generation backend for online RL."""

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """n completions per prompt; result ordered prompt-major: [p0s0, p0s1, ..., p1s0, ...]."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Make the engine generate with the policy's current weights."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this process (an engine process); idempotent."""
        ...


def check_generate_args(prompts: Sequence[list[int]], n: int, params: SamplingParams | None = None) -> None:
    """The argument checks every engine shares: ``n >= 1``, no empty prompt (nothing to condition on), and
    one ``row_ids`` entry per prompt (with ``n == 1``) where given."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if params is not None and params.row_ids is not None and (n != 1 or len(params.row_ids) != len(prompts)):
        raise ValueError(f"row_ids needs n == 1 and one row per prompt ({len(prompts)}), got n={n}")
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
