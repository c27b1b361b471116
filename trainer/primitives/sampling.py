"""Sampling in a training session (issue 40): the SDK's ``save_weights_for_sampler`` snapshots the adapter
(in memory, and a named one also as a peft folder under the run's checkpoints), and ``sample`` generates
from a snapshot: the worker swaps the snapshot's adapter weights in, generates with the transformers
engine (trainer/rollout/hf_engine.py: per-row seeded sampling, temperature / top-p / top-k), computes the
log-probs and swaps the current weights back, all on the loop's thread between training calls.

Log-probs are ``log softmax(z)`` of the model's raw logits (temperature 1), as ``forward_backward``
reports them, so an ``importance_sampling`` ratio ``exp(lp - q)`` is 1 on the policy that sampled
whatever temperature it sampled at (the cookbook's recipes sample at 1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from trainer.adapters import load_trainable_state, trainable_state
from trainer.completion_logps import reply_logprobs
from trainer.primitives.wire import Sampled, WireError, sample_response
from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine

SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_SAMPLES = 64


@dataclass(frozen=True)
class SampleCall:
    snapshot: str
    prompt: list[int]
    n: int
    params: SamplingParams
    prompt_logprobs: bool


def parse_snapshot(raw: bytes) -> str:
    """A ``save_sampler`` call's snapshot name.

    Raises:
        WireError: not JSON, or a name other than 1-64 letters, digits and ``_ . -``.
    """
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise WireError("not JSON", "body") from None
    name = body.get("name")
    if not isinstance(name, str) or not SNAPSHOT_NAME.match(name):
        raise WireError("a name of 1-64 letters, digits and _ . -", "path")
    return name


def parse_sample(raw: bytes, vocab: int, max_length: int) -> SampleCall:
    """An ``asample`` body (with the snapshot the API resolved) as a ``SampleCall``.

    Raises:
        WireError: naming the field: no text prompt, token ids out of range, more than 64 samples,
            sampling params out of range, or stop sequences (not supported yet: EOS ends a sample).
    """
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise WireError("not JSON", "body") from None
    chunks = (body.get("prompt") or {}).get("chunks") or []
    prompt: list[int] = []
    for k, chunk in enumerate(chunks):
        tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise WireError(f"a text chunk of token ids in [0, {vocab})", f"prompt.chunks[{k}]")
        prompt += tokens
    if not prompt:
        raise WireError("the prompt has no tokens", "prompt")
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise WireError(f"must be 1-{MAX_SAMPLES}", "num_samples")
    sp = body.get("sampling_params") or {}
    if sp.get("stop") not in (None, [], ()):
        raise WireError(
            "stop sequences are not supported yet; a sample ends at EOS or max_tokens", "sampling_params.stop"
        )
    max_tokens = sp.get("max_tokens") or 64
    if not isinstance(max_tokens, int) or max_tokens < 1 or len(prompt) + max_tokens > max_length:
        raise WireError(
            f"must be >= 1, and prompt + max_tokens <= {max_length}", "sampling_params.max_tokens"
        )
    top_k = sp.get("top_k", -1)
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=0 if top_k in (-1, None) else int(top_k),
            seed=sp.get("seed"),
        )
    except (TypeError, ValueError) as exc:
        raise WireError(str(exc), "sampling_params") from None
    return SampleCall(str(body["snapshot"]), prompt, n, params, bool(body.get("prompt_logprobs")))


class Snapshots:
    """The adapter weights saved for sampling, by name, and sampling from them."""

    def __init__(self, model: Any, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.saved: dict[str, dict[str, torch.Tensor]] = {}
        self.engine = HFEngine(model, tokenizer)

    def save(self, name: str) -> None:
        self.saved[name] = {k: v.cpu() for k, v in trainable_state(self.model).items()}

    @contextmanager
    def weights(self, name: str) -> Iterator[None]:
        """The model with snapshot ``name``'s adapter weights, the current ones back afterwards.

        Raises:
            WireError: no such snapshot.
        """
        if name not in self.saved:
            raise WireError(f"no sampler weights {name!r} in this session", "sampling_session_id")
        current = trainable_state(self.model)
        load_trainable_state(self.model, self.saved[name])
        try:
            yield
        finally:
            load_trainable_state(self.model, current)

    @torch.no_grad()
    def sample(self, call: SampleCall) -> bytes:
        """``call``'s samples as the SDK's ``SampleResponse``."""
        with self.weights(call.snapshot):
            outs = self.engine.generate([call.prompt], call.n, call.params)
            sequences = [
                Sampled(
                    list(c.token_ids),
                    reply_logprobs(self.model, call.prompt, list(c.token_ids), 1.0),
                    c.finish_reason == "eos",
                )
                for c in outs
            ]
            prompt_lp = (
                reply_logprobs(self.model, call.prompt[:1], call.prompt[1:], 1.0)
                if call.prompt_logprobs
                else None
            )
        return sample_response(sequences, prompt_lp)
