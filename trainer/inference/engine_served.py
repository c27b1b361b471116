"""The inference process's engine backend: each model served by a vLLM engine process of its own (any
machine with the engine environment, `make engine`; CPU included).

``RLRUN_INFERENCE_BACKEND=vllm_server`` serves the same OpenAI routes as the HF backend
(trainer/inference/loaded.py), but every request goes to vLLM's own OpenAI server running from the engine
environment (trainer/rollout/engine_process.py, the process the rollouts use), so concurrent requests share
every forward pass (vLLM's scheduler: continuous batching, paged KV cache) instead of waiting for each other.
The inference process keeps what is its own: the API's trust header and model roots, chat rendering
(``render_prompt``), the context-length and parameter checks, usage counts and OpenAI's answer shapes; the
engine gets token ids and sends token ids back (``/v1/completions``, ``return_token_ids``,
``return_tokens_as_token_ids``), streamed.

One engine process per base model, an LRU of ``RLRUN_INFERENCE_MAX_MODELS`` (the oldest is stopped when
another must start; a start takes ~30 s here). Each engine's OpenMP pool is bound to every core
(``EngineOptions.threads``): vLLM's default keeps one core for its front end, which on 2 cores left 32
streamed requests at ~240 tokens/s; bound to both, 750-960 (tiny:llama-10m, after a warm-up round; the
front ends, ours and vLLM's, are mostly waiting on the engine).

An adapter run's folder is served as a LoRA on its base's engine (loaded at run time through
``/v1/load_lora_adapter``); a chain of adapters is refused (serve a merge of it: ``algorithm: merge``). A
closed stream (the client went away) closes the engine request, which vLLM aborts.

Differences from the HF backend, said in docs/settings.md: a request's ``seed`` is not passed on (a
per-request seed crashes vLLM's CPU sampler; the engine is seeded once); greedy ``n > 1`` asks the engine
for one sample and repeats it (vLLM refuses ``n > 1`` without sampling; greedy samples are equal anyway).
Reported log-probs are the model's own distribution (``--logprobs-mode raw_logprobs``), as OpenAI's are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from trainer.adapter_folders import base_of, is_adapter_folder
from trainer.inference.decode import DecodeParams, Delta
from trainer.inference.loaded import LoadError, is_scorer
from trainer.inference.vllm_served import deltas_from_output
from trainer.rollout.engine_process import (
    SERVED_NAME,
    EngineError,
    EngineOptions,
    EngineProcess,
    EngineStartError,
    EngineUnavailable,
    engine_message,
    engine_python,
)

_TOKEN_PREFIX = "token_id:"  # how ``return_tokens_as_token_ids`` writes a token
MAX_LORAS = 4  # adapters an engine holds at once (vLLM's --max-loras); more are swapped in by vLLM


def completion_body(prompt_ids: list[int], n: int, params: DecodeParams, model: str) -> dict[str, Any]:
    """The engine's ``/v1/completions`` body for ``n`` samples of one prompt, streamed (greedy: one)."""
    greedy = params.temperature == 0
    return {
        "model": model,
        "prompt": list(prompt_ids),
        "n": 1 if greedy else n,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "stop": list(params.stop),
        "include_stop_str_in_output": False,
        "logprobs": params.top_logprobs,  # the sampled token's log-prob, and the k most likely
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
        "stream": True,
    }


def _token(text: str) -> int:
    if not text.startswith(_TOKEN_PREFIX):
        raise EngineError(f"the engine sent a token as {text!r}, not as its id", 502)
    return int(text.removeprefix(_TOKEN_PREFIX))


def choice_output(choice: dict[str, Any]) -> SimpleNamespace:
    """One streamed ``/v1/completions`` choice as the sample object ``deltas_from_output`` reads (vLLM's
    in-process shape): ``token_ids``, ``text``, ``finish_reason``, ``index`` and per token a dict ``token id
    -> (logprob, rank)``, the sampled token first, then the engine's top entries ranked by log-prob (the
    sampled token gets a rank only when it is among them)."""
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs = choice.get("logprobs") or {}
    sampled = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    per_token = []
    for k, token in enumerate(token_ids):
        if k >= len(sampled):
            raise EngineError(f"the engine sent no log-prob for token {token}", 502)
        entry = {token: SimpleNamespace(logprob=float(sampled[k]), rank=None)}
        ranked = sorted(
            ((_token(t), float(v)) for t, v in (tops[k] if k < len(tops) else {}).items()),
            key=lambda e: -e[1],
        )
        for rank, (top_token, value) in enumerate(ranked, start=1):
            entry[top_token] = SimpleNamespace(logprob=value, rank=rank)
        per_token.append(entry)
    return SimpleNamespace(
        index=int(choice["index"]),
        text=choice.get("text") or "",
        token_ids=token_ids,
        logprobs=per_token,
        finish_reason=choice.get("finish_reason"),
    )


def deltas_from_chunk(chunk: dict[str, Any], top_logprobs: int, eos_id: int | None) -> list[Delta]:
    """The ``Delta`` of each choice in one streamed chunk (an EOS token dropped as ``decode`` does)."""
    outputs = [choice_output(c) for c in chunk.get("choices") or []]
    return deltas_from_output(SimpleNamespace(outputs=outputs), top_logprobs, eos_id)


@dataclass
class EngineEntry:
    """A base model's engine: its process, an HTTP client to it, the tokenizer, and its adapters' names."""

    process: EngineProcess
    client: httpx.Client
    tokenizer: Any
    max_context: int
    loras: OrderedDict[str, str] = field(default_factory=OrderedDict)
    next_lora: int = 1

    def close(self) -> None:
        self.client.close()
        self.process.stop()


@dataclass(frozen=True)
class EngineServed:
    """A model the engine backend serves: its base's engine and the name to ask for (base or LoRA)."""

    entry: EngineEntry
    model: str

    @property
    def tokenizer(self) -> Any:
        return self.entry.tokenizer

    @property
    def max_context(self) -> int:
        return self.entry.max_context

    def stream(self, prompt_ids: list[int], n: int, params: DecodeParams) -> Iterator[list[Delta]]:
        """``n`` continuations of one prompt as the engine streams them.

        Raises:
            EngineError: the engine refused the request (its message), broke off or is gone.
        """
        body = completion_body(prompt_ids, n, params, self.model)
        repeat = n if body["n"] == 1 and n > 1 else 1  # greedy n > 1: one sample, n identical choices
        eos = self.tokenizer.eos_token_id
        try:
            with self.entry.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise EngineError(engine_message(resp), resp.status_code)
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:  # vLLM reports a failure mid-stream as a data line
                        raise EngineError(str(chunk["error"].get("message", chunk["error"])), 500)
                    deltas = deltas_from_chunk(chunk, params.top_logprobs, eos)
                    if repeat > 1:
                        deltas = [dataclasses.replace(d, index=j) for d in deltas for j in range(repeat)]
                    yield deltas
        except httpx.TransportError as exc:
            raise EngineError(f"the engine at {self.entry.process.base_url} broke off: {exc}") from exc
        raise EngineError("the engine's stream ended without [DONE]", 502)


def model_config(folder: str) -> dict[str, Any]:
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def max_context_of(folder: str, cap: int) -> int:
    """The longest prompt + completion an engine for ``folder`` holds: the model's own limit (its config's
    ``max_position_embeddings``), at most ``cap``."""
    config = model_config(folder)
    own = config.get("max_position_embeddings") or config.get("n_positions")
    return min(int(own), cap) if isinstance(own, int) and own > 0 else cap


def dtype_of(folder: str) -> str:
    """The dtype the model was saved in (its config's), so the engine answers as the HF backend does;
    ``auto`` without one. vLLM's own ``auto`` turns a float32 model into bfloat16 on a CPU with bf16
    instructions (and the tiny presets' 4-dim heads crash its bf16 kernels)."""
    config = model_config(folder)
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if isinstance(dtype, str) else "auto"


class EngineModels:
    """The engine backend: an engine process per base folder (an LRU of ``size``), adapters as LoRAs.

    Requests run concurrently (``serial`` False: the engine batches them). Starting an engine holds this
    backend's lock (one start at a time; a request for a model already running does not wait for it).

    Args:
        size: engines kept running at once.
        python: the engine environment's python (default: ``RLRUN_ENGINE_PYTHON`` or ``.venv-engine``).
        max_context: the longest prompt + completion an engine holds (the model's own limit if lower).
        max_lora_rank: the largest LoRA rank an adapter may have.
        kv_cache_gib: each engine's KV cache on CPU (``VLLM_CPU_KVCACHE_SPACE``).

    Raises:
        LoadError: at start, when there is no engine environment (the setting and the install are named).
    """

    name = "vllm_server"
    serial = False

    def __init__(
        self,
        size: int,
        *,
        python: str | None = None,
        max_context: int = 4096,
        max_lora_rank: int = 64,
        kv_cache_gib: int = 1,
    ) -> None:
        try:
            self.python = engine_python(python)
        except EngineUnavailable as exc:
            raise LoadError(str(exc)) from None
        self.size, self.max_context, self.max_lora_rank, self.kv_cache_gib = (
            size,
            max_context,
            max_lora_rank,
            kv_cache_gib,
        )
        self.engines: OrderedDict[str, EngineEntry] = OrderedDict()
        self.lock = threading.Lock()

    def describe(self) -> list[dict[str, Any]]:
        return [{"folder": base, "adapters": list(e.loras)} for base, e in list(self.engines.items())]

    def get(self, folder: str) -> EngineServed:
        if is_scorer(folder):
            raise LoadError(
                "this model is a reward model (a score head): it scores, it cannot generate", generative=False
            )
        if not is_adapter_folder(folder):
            return EngineServed(self._engine(folder), SERVED_NAME)
        base = base_of(folder)
        if is_adapter_folder(base):
            raise LoadError(
                "an adapter on an adapter: the vllm_server backend serves one LoRA over a plain base; serve "
                "a merge of this run (algorithm: merge)"
            )
        entry = self._engine(base)
        with self.lock:
            if folder not in entry.loras:
                self._load_lora(entry, folder)
            entry.loras.move_to_end(folder)
            return EngineServed(entry, entry.loras[folder])

    def _load_lora(self, entry: EngineEntry, folder: str) -> None:
        name = f"adapter{entry.next_lora}"
        try:
            resp = entry.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder})
        except httpx.TransportError as exc:  # a dead engine: a named error, not a bare 500
            raise LoadError(f"the engine at {entry.process.base_url} did not answer: {exc}") from None
        if resp.status_code != 200:
            raise LoadError(f"the engine could not load adapter {folder!r}: {engine_message(resp)}")
        entry.next_lora += 1
        entry.loras[folder] = name
        while len(entry.loras) > MAX_LORAS * 4:  # names the engine no longer needs to keep
            old, old_name = entry.loras.popitem(last=False)
            entry.client.post("/v1/unload_lora_adapter", json={"lora_name": old_name})

    def _engine(self, base: str) -> EngineEntry:
        with self.lock:
            if base in self.engines:
                self.engines.move_to_end(base)
                return self.engines[base]
            while len(self.engines) >= self.size:
                _, old = self.engines.popitem(last=False)
                old.close()
            entry = self._start(base)
            self.engines[base] = entry
            return entry

    def _start(self, base: str) -> EngineEntry:
        from transformers import AutoTokenizer

        max_context = max_context_of(base, self.max_context)
        options = EngineOptions(
            model_dir=Path(base),
            dtype=dtype_of(base),
            max_model_len=max_context,
            kv_cache_gib=self.kv_cache_gib,
            logprobs_mode="raw_logprobs",
            max_lora_rank=self.max_lora_rank,
            max_loras=MAX_LORAS,
            threads=os.cpu_count() or 1,
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError) as exc:
            raise LoadError(f"could not load the tokenizer of {base!r}: {exc}") from None
        process = EngineProcess(options, python=self.python)
        try:
            url = process.start()
        except EngineStartError as exc:
            raise LoadError(f"the engine could not serve {base!r}: {exc}") from None
        client = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=600.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        return EngineEntry(process, client, tokenizer, max_context)

    def close(self) -> None:
        """Stop every engine (the inference process's shutdown)."""
        with self.lock:
            while self.engines:
                _, entry = self.engines.popitem(last=False)
                entry.close()
