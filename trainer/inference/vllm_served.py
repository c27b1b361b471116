"""The inference process's vLLM backend (GPU only): continuous batching of concurrent requests.

``RLRUN_INFERENCE_BACKEND=vllm`` serves the same OpenAI routes as the HF backend
(trainer/inference/loaded.py) from vLLM engines. vLLM pins its own torch, transformers and fastapi, so this
backend runs in its own environment (docs/settings.md, "The vLLM inference backend"): ``rlrun inference``
started there, with the API's ``RLRUN_INFERENCE_URL`` pointing at it. Importing this module never imports
vLLM; ``VllmModels`` does.

One ``vllm.LLMEngine`` per base model (an LRU of ``RLRUN_INFERENCE_MAX_MODELS``), each stepped by one thread
(``EngineLoop``): a request is added to the engine the moment it arrives and streams its outputs from a queue
of its own, so concurrent requests share every forward pass (vLLM's scheduler: continuous batching, paged KV
cache) instead of waiting for each other as they do on the HF backend. An adapter run's folder is served as a
``LoRARequest`` on its base's engine (``enable_lora``); a chain of adapters is refused (serve a merge of it:
``algorithm: merge``). A closed stream (the client went away) aborts its request.

The conversions between rlrun's decode shapes and vLLM's (``sampling_kwargs``, ``deltas_from_output``) are
pure and tested on CPU with objects of vLLM's shape (tests/inference/test_vllm_served.py);
``scripts/gpu_vllm_inference.sh`` checks the backend itself on a GPU where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import itertools
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainer.adapter_folders import base_of, is_adapter_folder
from trainer.inference.decode import DecodeParams, Delta, FinishReason
from trainer.inference.loaded import LoadError, is_scorer

INSTALL_HINT = (
    "the vllm inference backend needs vLLM and a CUDA GPU: run `rlrun inference` from an environment with "
    "`pip install 'rlrun[vllm]'` (vLLM pins its own torch; docs/settings.md, 'The vLLM inference backend')"
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}


def sampling_kwargs(params: DecodeParams, n: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` giving what the HF backend's ``decode`` gives.

    ``logprobs=k`` makes vLLM report the ``k`` most likely tokens and the sampled one at each position, under
    the model's own distribution (vLLM's default ``raw_logprobs``, before temperature and top-p), which is
    what ``decode`` and OpenAI report. Stop strings are cut from the text (``include_stop_str_in_output``
    False) and held back while they may still match; the output kind is set by the caller (DELTA).
    """
    return {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "seed": params.seed,
        "stop": list(params.stop),
        "include_stop_str_in_output": False,
        "logprobs": params.top_logprobs,
        "skip_special_tokens": True,
    }


def deltas_from_output(output: Any, top_logprobs: int, eos_id: int | None) -> list[Delta]:
    """The ``Delta`` of each sample in one streamed ``RequestOutput`` (output kind DELTA).

    Reads only plain attributes: ``output.outputs``, each with ``index``, ``text`` (new text), ``token_ids``
    (new tokens), ``logprobs`` (per new token a dict ``token id -> obj with .logprob and .rank``, or None)
    and ``finish_reason``. An EOS token is dropped from ``token_ids`` as ``decode`` does (it has no text;
    the usage count adds it back). ``top_logprobs`` keeps the entries ranked 1..k, most likely first.

    Raises:
        ValueError: a finish reason other than stop/length (vLLM's "abort"), or a logprob entry missing.
    """
    deltas = []
    for sample in output.outputs:
        finish = sample.finish_reason
        if finish is not None and finish not in _FINISH:
            raise ValueError(f"vLLM finished sample {sample.index} with {finish!r}")
        token_ids = list(sample.token_ids)
        entries = list(sample.logprobs) if sample.logprobs is not None else [None] * len(token_ids)
        if len(entries) != len(token_ids):
            raise ValueError(f"{len(entries)} logprob entries for {len(token_ids)} tokens")
        if finish == "stop" and token_ids and token_ids[-1] == eos_id:
            token_ids, entries = token_ids[:-1], entries[:-1]
        logprobs, top = [], []
        for token, entry in zip(token_ids, entries, strict=True):
            if entry is None or token not in entry:
                raise ValueError(f"vLLM sent no logprob for token {token}")
            logprobs.append(float(entry[token].logprob))
            ranked = [
                (int(t), float(e.logprob)) for t, e in entry.items() if 0 < (e.rank or 0) <= top_logprobs
            ]
            top.append(sorted(ranked, key=lambda pair: -pair[1]))
        deltas.append(
            Delta(
                index=int(sample.index),
                text=sample.text or "",
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=_FINISH[finish] if finish else None,
                top_logprobs=top if top_logprobs else [],
            )
        )
    return deltas


class EngineLoop:
    """One vLLM engine and the thread that steps it: requests join at any step and leave when done."""

    _ids = itertools.count()

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.streams: dict[str, queue.Queue[Any]] = {}
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], sampling: Any, lora: Any) -> tuple[str, queue.Queue[Any]]:
        if self.failed is not None:
            raise RuntimeError(f"the vLLM engine stopped: {self.failed}")
        request_id = f"rlrun-{next(self._ids)}"
        out: queue.Queue[Any] = queue.Queue()
        self.streams[request_id] = out
        self.inbox.put(("add", (request_id, {"prompt_token_ids": prompt_ids}, sampling, lora)))
        return request_id, out

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def close(self) -> None:
        self.inbox.put(("close", None))

    def _take(self, block: bool) -> bool:
        """Apply the waiting adds and aborts; False once closed."""
        while True:
            try:
                kind, item = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "close":
                return False
            if kind == "add":
                request_id, prompt, sampling, lora = item
                self.engine.add_request(request_id, prompt, sampling, lora_request=lora)
            elif item in self.streams:
                self.engine.abort_request([item])
                self.streams.pop(item)

    def _run(self) -> None:
        try:
            while self._take(block=not self.engine.has_unfinished_requests()):
                for output in self.engine.step():
                    stream = self.streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                        if output.finished:
                            self.streams.pop(output.request_id)
        except BaseException as exc:  # the engine died: every waiting request hears why
            self.failed = exc
            for stream in list(self.streams.values()):
                stream.put(exc)


@dataclass(frozen=True)
class VllmServed:
    """A model the vLLM backend serves: its base's engine loop, tokenizer, and LoRA request (or None)."""

    loop: EngineLoop
    tokenizer: Any
    max_context: int | None
    lora: Any
    vllm: Any

    def stream(self, prompt_ids: list[int], n: int, params: DecodeParams) -> Iterator[list[Delta]]:
        sampling = self.vllm.SamplingParams(
            **sampling_kwargs(params, n), output_kind=self.vllm.sampling_params.RequestOutputKind.DELTA
        )
        request_id, outputs = self.loop.submit(prompt_ids, sampling, self.lora)
        finished = False
        try:
            while not finished:
                output = outputs.get()
                if isinstance(output, BaseException):
                    raise RuntimeError(f"the vLLM engine failed: {output}") from output
                finished = bool(output.finished)
                yield deltas_from_output(output, params.top_logprobs, self.tokenizer.eos_token_id)
        finally:
            if not finished:
                self.loop.abort(request_id)


class VllmModels:
    """The vLLM backend: engines by base folder (an LRU of ``size``), adapters as LoRA requests.

    Requests decode concurrently (``serial`` False: the engine batches them); loading is the server's to
    serialise. Each engine takes ``gpu_memory_utilization / size`` of the GPU, so ``size`` engines fit.

    Raises:
        LoadError: at start, when vLLM or CUDA is missing (the message says what to install).
    """

    name = "vllm"
    serial = False

    def __init__(
        self, size: int, *, gpu_memory_utilization: float, max_lora_rank: int, dtype: str = "auto"
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise LoadError(INSTALL_HINT)
        import torch

        if not torch.cuda.is_available():
            raise LoadError(f"no CUDA device here: {INSTALL_HINT}")
        import vllm

        self.vllm = vllm
        self.size, self.dtype = size, dtype
        self.share = gpu_memory_utilization / size
        self.max_lora_rank = max_lora_rank
        self.engines: OrderedDict[str, tuple[EngineLoop, Any]] = OrderedDict()
        self.loras: dict[str, Any] = {}
        self.next_lora = 1

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"folder": base, "adapters": [f for f, r in self.loras.items() if base_of(f) == base]}
            for base in self.engines
        ]

    def get(self, folder: str) -> VllmServed:
        if is_scorer(folder):
            raise LoadError(
                "this model is a reward model (a score head): it scores, it cannot generate", generative=False
            )
        lora = None
        base = folder
        if is_adapter_folder(folder):
            base = base_of(folder)
            if is_adapter_folder(base):
                raise LoadError(
                    "an adapter on an adapter: the vllm backend serves one LoRA over a plain base; "
                    "serve a merge of this run (algorithm: merge)"
                )
            if folder not in self.loras:
                from vllm.lora.request import LoRARequest

                self.loras[folder] = LoRARequest(f"adapter{self.next_lora}", self.next_lora, folder)
                self.next_lora += 1
            lora = self.loras[folder]
        loop, tokenizer = self._engine(base)
        config = loop.engine.get_model_config()
        return VllmServed(loop, tokenizer, getattr(config, "max_model_len", None), lora, self.vllm)

    def _engine(self, base: str) -> tuple[EngineLoop, Any]:
        if base in self.engines:
            self.engines.move_to_end(base)
            return self.engines[base]
        from transformers import AutoTokenizer

        while len(self.engines) >= self.size:
            _, (old, _) = self.engines.popitem(last=False)
            old.close()
        try:
            engine = self.vllm.LLMEngine.from_engine_args(
                self.vllm.EngineArgs(
                    model=base,
                    dtype=self.dtype,
                    gpu_memory_utilization=self.share,
                    enable_lora=True,
                    max_lora_rank=self.max_lora_rank,
                    disable_log_stats=True,
                )
            )
            tokenizer = AutoTokenizer.from_pretrained(base)
        except (ValueError, OSError, RuntimeError) as exc:
            raise LoadError(f"vLLM could not load {base!r}: {exc}") from None
        self.engines[base] = (EngineLoop(engine), tokenizer)
        return self.engines[base]
