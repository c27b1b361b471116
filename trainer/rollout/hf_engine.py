"""Rollouts with Hugging Face ``model.generate``: the default engine, on whatever device the policy lives.

The policy generates in place (no copy of the weights), so ``sync_weights`` has nothing to move. Each call
left-pads a chunk of prompts, repeats every prompt ``n`` times (prompt-major, as ``num_return_sequences``
would), runs ``generate`` with the KV cache under ``no_grad`` in eval mode, and cuts each row back to what
was really generated with ``completions_from_generate``. Sampling draws from each row's own seeded stream
(trainer/rollout/row_sampling.py), so the chunk size, or the ranks a step's prompts are split over, do not
change what a prompt samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import LogitsProcessorList

from trainer.rollout.base import Completion, SamplingParams, check_generate_args
from trainer.rollout.row_sampling import row_processors


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts in one batch.

    Returns ``(input_ids, attention_mask)``, both ``(B, P)`` int64 with ``P = max(len)``; padding sits on the
    left so every row's last real token is at column ``P - 1``, where generation continues.
    """
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids) :] = 1
    return input_ids, mask


def completions_from_generate(
    sequences: torch.Tensor,
    prompt_ids: list[list[int]],
    n: int,
    prompt_width: int,
    eos_id: int,
    pad_id: int,
    tokenizer: Any,
) -> list[Completion]:
    """Turn ``generate``'s output into completions.

    Args:
        sequences: ``(B*n, P+T)`` token ids, rows prompt-major (row ``r`` belongs to prompt ``r // n``); the
            first ``P = prompt_width`` columns are the left-padded prompt, the rest what was generated, with
            ``pad_id`` after a row's EOS (``generate`` pads finished rows until the whole batch stops).
        prompt_ids: the ``B`` unpadded prompts, in order.
        n: completions per prompt.
        prompt_width: ``P``.
        eos_id: the token that ends a completion.
        pad_id: the padding id, used to check that each row starts with its own left-padded prompt.
        tokenizer: decodes ``token_ids`` to ``text`` (special tokens skipped).

    Returns:
        ``B*n`` completions in row order, ``prompt_index = r // n``. Each keeps the tokens up to and including
        the first EOS (``"eos"``), or all ``T`` generated tokens when there is none (``"length"``). Columns
        are found by position, not by value, so a pad id equal to EOS (tokenizers without a pad token) or a
        generated token that happens to equal the pad id are both handled.

    Raises:
        ValueError: the row count is not ``len(prompt_ids) * n``, or a row's first ``P`` columns are not its
            prompt left-padded with ``pad_id`` (e.g. right padding, or rows out of order).
    """
    rows = sequences.tolist()
    if len(rows) != len(prompt_ids) * n:
        raise ValueError(
            f"expected {len(prompt_ids)} prompts x {n} = {len(prompt_ids) * n} rows, got {len(rows)}"
        )
    token_lists: list[list[int]] = []
    reasons: list[bool] = []
    for r, row in enumerate(rows):
        prompt = prompt_ids[r // n]
        if row[:prompt_width] != [pad_id] * (prompt_width - len(prompt)) + prompt:
            raise ValueError(
                f"row {r} does not start with prompt {r // n} left-padded to width {prompt_width}"
            )
        generated = row[prompt_width:]
        stopped = eos_id in generated
        token_lists.append(generated[: generated.index(eos_id) + 1] if stopped else generated)
        reasons.append(stopped)
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
    return [
        Completion(
            prompt_index=r // n,
            prompt_ids=list(prompt_ids[r // n]),
            token_ids=tokens,
            text=text,
            finish_reason="eos" if stopped else "length",
        )
        for r, (tokens, text, stopped) in enumerate(zip(token_lists, texts, reasons, strict=True))
    ]


MIN_CHUNK_ROWS = 64
MAX_CHUNK_ROWS = 512
CHUNK_BUDGET = 1 << 30  # bytes: a chunk holds more than MIN_CHUNK_ROWS rows only within this much
STEP_VOCAB_COPIES = 4  # float32 (rows, vocab) tensors a decode step holds: logits, noise, its log, scores


def chunk_rows(model: Any, row_tokens: int) -> int:
    """Rows per ``generate`` call when the caller sets none: ``MIN_CHUNK_ROWS``, or more (up to
    ``MAX_CHUNK_ROWS``) while the chunk's memory stays within ``CHUNK_BUDGET``. A row costs its KV cache
    (``2 x layers x kv_heads x head_dim x dtype bytes`` a token, ``row_tokens`` tokens: the longest prompt
    and the new tokens) and the float32 vocabulary-sized tensors of a decode step (``STEP_VOCAB_COPIES x
    vocab x 4`` bytes). Each call has a fixed cost (a forward pass per new token whatever the rows, the
    sampling per step), so a small model's many short rows run faster in fewer calls (the demo's GRPO, 128
    rows of 12 tokens: 64 -> 128 rows a call, ~13% less time over 100 steps on a 2-core CPU); a large
    model's rows are never fewer than 64, as before (7B, 1,536 tokens a row: 768 MB of cache each). A model
    whose config does not give the cache's shape gets ``MIN_CHUNK_ROWS``."""
    config = getattr(model, "config", None)
    get = functools.partial(getattr, config)
    try:
        layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
        kv_heads = int(get("num_key_value_heads", None) or heads)
        head_dim = int(get("head_dim", None) or int(get("hidden_size")) // heads)
        vocab = int(get("vocab_size"))
        # the first floating-point weight's: a 4-bit (QLoRA) base packs its linear weights into uint8, while
        # its cache is kept in the compute dtype of its floating-point layers
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    except (AttributeError, TypeError, ValueError, StopIteration):
        return MIN_CHUNK_ROWS
    per_row = (
        2 * layers * kv_heads * head_dim * dtype.itemsize * max(1, row_tokens) + STEP_VOCAB_COPIES * vocab * 4
    )
    return min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, int(CHUNK_BUDGET // per_row)))


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the block; the caller's training flag comes back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class HFEngine:
    """``RolloutEngine`` over ``model.generate``.

    Args:
        model: a causal LM (``GenerationMixin``); it generates in place, on its own device.
        tokenizer: supplies ``eos_token_id`` (stop token) and ``pad_token_id`` (left padding; falls back to
            EOS when missing) and decodes ``text``.
        device: where inputs go; defaults to the device of the model's first parameter.
        batch_size: rows (prompt x sample) per ``generate`` call; a chunk holds ``max(1, batch_size // n)``
            whole prompts, so with ``n > batch_size`` one prompt's ``n`` rows go together. Default
            (``None``): ``chunk_rows``, 64 rows or more while the chunk's KV cache stays small (64 with
            ``synced_gpus``).
        synced_gpus: every rank of a sharded (FSDP) model runs this engine at once: each forward pass is
            a collective, so a rank whose rows have all stopped keeps stepping until every rank's have
            (transformers' ``synced_gpus``).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
        synced_gpus: bool = False,
    ):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; generation could never stop on EOS")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.batch_size = batch_size
        self.synced_gpus = synced_gpus
        self.eos_id: int = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """n completions per prompt, prompt-major; see ``RolloutEngine.generate``.

        Row ``k`` of the call (``k = prompt * n + sample``) samples from the stream of global row
        ``params.first_row + k`` of ``params.seed``: the same seed gives the same samples whatever
        ``batch_size``, and the global torch RNG is neither read nor moved (without a seed, one draw from it
        seeds the call). Greedy with ``n > 1`` returns ``n`` identical copies.
        """
        check_generate_args(prompts, n, params)
        if params.seed is None and not params.is_greedy:
            params = dataclasses.replace(params, seed=int(torch.randint(0, 2**62, ()).item()))
        chunk_size = self.batch_size or (
            # sharded ranks generate in step, so they make the same calls whatever their prompts' lengths
            MIN_CHUNK_ROWS
            if self.synced_gpus
            else chunk_rows(self.model, max(map(len, prompts), default=0) + params.max_new_tokens)
        )
        per_chunk = max(1, chunk_size // n)
        out: list[Completion] = []
        with _eval_mode(self.model):
            for start in range(0, len(prompts), per_chunk):
                chunk = [list(p) for p in prompts[start : start + per_chunk]]
                first = params.first_row + start * n
                rows: Sequence[int] = range(first, first + len(chunk) * n)
                if params.row_ids is not None:
                    rows = params.row_ids[start : start + len(chunk)]
                done = self._generate_chunk(chunk, n, params, rows)
                out += [dataclasses.replace(c, prompt_index=c.prompt_index + start) for c in done]
        return out

    def _generate_chunk(
        self, chunk: list[list[int]], n: int, params: SamplingParams, rows: Sequence[int]
    ) -> list[Completion]:
        # Repeating rows ourselves (rather than num_return_sequences) gives the same prompt-major order and
        # also works for greedy decoding, where generate refuses num_return_sequences > 1.
        input_ids, mask = left_pad([p for p in chunk for _ in range(n)], self.pad_id)
        kwargs = generate_kwargs(params, eos_id=self.eos_id, pad_id=self.pad_id)
        if not params.is_greedy:
            kwargs["logits_processor"] = LogitsProcessorList(row_processors(params, rows, self.device))
        sequences = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            synced_gpus=self.synced_gpus,
            **kwargs,
        )
        return completions_from_generate(
            sequences, chunk, n, input_ids.shape[1], self.eos_id, self.pad_id, self.tokenizer
        )

    def sync_weights(self, model: Any) -> None:
        """No copy needed: HF generates with the policy module itself, so updates are already visible. A
        different module object (e.g. a re-wrapped or reloaded policy) replaces the one held."""
        if model is not self.model:
            self.model = model

    def close(self) -> None:
        """Nothing to release: the policy is the caller's."""


def generate_kwargs(params: SamplingParams, *, eos_id: int, pad_id: int) -> dict[str, Any]:
    """Keyword arguments for ``generate`` that decode greedily from exactly the policy's distribution; a
    sampled call adds ``row_processors`` (temperature, top-k, top-p, then each row's noise), so generate's
    own sampling is off in both cases.

    Transformers fills every setting left unset from the checkpoint's ``generation_config.json`` (which may
    carry e.g. ``repetition_penalty=1.05``, ``top_k=20`` or ``do_sample=True``) and then from global
    defaults (``top_k=50``), so each setting that reshapes the distribution is given explicitly here,
    neutral; the sampling knobs are left out (greedy decoding ignores them; setting them makes it warn).
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": 0,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "num_beams": 1,
        "num_return_sequences": 1,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
    }
    return kwargs | {"do_sample": False}
