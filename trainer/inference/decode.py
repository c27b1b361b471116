"""Token-by-token sampling of ``n`` continuations of one prompt, with the KV cache, for streaming.

Each step feeds the last token of every row, reads the next-token logits, and picks a token per row:
greedy (``temperature == 0``: argmax) or sampled from ``softmax(logits / T)`` restricted to the top-p
nucleus (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", Sec. 3.1: the smallest set
of tokens whose probability sums to at least ``p``). The log-probability reported for a token is under
the model's own distribution (``log_softmax(logits)``, before temperature and top-p), which is what
OpenAI's ``logprobs`` report. A row stops at its EOS token, at a stop string, or after ``max_new_tokens``.

All rows share one prompt, so no padding or attention mask is needed: the prompt is run once for all
``n`` rows and each step adds one column. The generator is seeded per call, so the same ``seed`` gives
the same text. Torch and the model only; no HTTP here (trainer/inference/server.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from trainer.rollout.base import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class DecodeParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # the k most likely tokens reported beside each chosen one

    def __post_init__(self) -> None:
        # The rollout engines' checks of the same three knobs (ValueError naming the one at fault).
        SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)


@dataclass
class Row:
    """One continuation as it grows: its tokens and their log-probs, the text so far (cut at a stop
    string), and how much of that text has been handed out (``emitted``)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Delta:
    """What one step added to one row: new text (possibly empty while a possible stop string is held
    back), the tokens behind it, and ``finish_reason`` once the row is done."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probabilities sum to >= ``top_p`` (each row),
    renormalised. The most likely token is always kept."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (they are not
    handed out until the next tokens show whether the stop string follows)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def decode(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    n: int,
    params: DecodeParams,
) -> Iterator[list[Delta]]:
    """Yield, after each step, the deltas of the rows that changed; the last yield finishes every row.

    Raises ValueError for an empty prompt or ``n < 1``."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: nothing to continue")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    eos_id = tokenizer.eos_token_id
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(62))
    rows = [Row() for _ in range(n)]
    inputs = torch.tensor([prompt_ids] * n, dtype=torch.long, device=device)
    cache = None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(params.max_new_tokens):
                out = model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1)
                cache = out.cache
                logits = out.logits[:, -1, :].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                if params.temperature == 0:
                    chosen = logits.argmax(dim=-1)
                else:
                    probs = top_p_filter(torch.softmax(logits / params.temperature, dim=-1), params.top_p)
                    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                last = step == params.max_new_tokens - 1
                top = _top(logprobs, params.top_logprobs)
                deltas: list[Delta] = []
                for i, row in enumerate(rows):
                    if row.finish_reason is None:
                        token = int(chosen[i])
                        delta = _advance(
                            i, row, token, float(logprobs[i, token]), tokenizer, eos_id, params, last
                        )
                        deltas.append(
                            replace(delta, top_logprobs=[top[i]]) if top and delta.token_ids else delta
                        )
                yield deltas
                if all(r.finish_reason is not None for r in rows):
                    return
                inputs = chosen.unsqueeze(-1)
    finally:
        model.train(was_training)


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    if k == 0:
        return []
    values, ids = logprobs.topk(k, dim=-1)
    return [
        list(zip(r_ids, r_values, strict=True))
        for r_ids, r_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def _advance(
    index: int,
    row: Row,
    token: int,
    logprob: float,
    tokenizer: Any,
    eos_id: int | None,
    params: DecodeParams,
    last: bool,
) -> Delta:
    """Append one token to a row and work out what may be handed out now."""
    if token == eos_id:
        row.finish_reason = "stop"
        tail = row.text[row.emitted :]
        row.emitted = len(row.text)
        return Delta(index, tail, [], [], "stop")
    row.token_ids.append(token)
    row.logprobs.append(logprob)
    text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
    if text.endswith("\ufffd") and not last:  # half of a multi-byte character: wait for the rest
        return Delta(index, "", [token], [logprob], None)
    cut = min((i for s in params.stop if (i := text.find(s)) >= 0), default=-1)
    if cut >= 0:
        text, row.finish_reason = text[:cut], "stop"
    elif last:
        row.finish_reason = "length"
    row.text = text
    keep = 0 if row.finish_reason else held_back(text, params.stop)
    start, row.emitted = row.emitted, max(row.emitted, len(text) - keep)
    return Delta(index, text[start : row.emitted], [token], [logprob], row.finish_reason)
