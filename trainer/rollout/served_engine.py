"""``RolloutEngine`` over the engine process (trainer/rollout/engine_process.py): vLLM's OpenAI-compatible
server, reached over loopback HTTP, or from another host through ``rlrun engine --remote``'s front
(trainer/rollout/engine_front.py: a token on every request, weights uploaded rather than named as a folder).

Generation is one ``POST /v1/completions`` per call: all prompts as token-id lists, ``n`` samples each, with
the sampled tokens' ids (``return_token_ids``) and log-probabilities (``logprobs: 0``) back; vLLM batches
them continuously. The answer is read by ``completions_from_vllm``, the reader of in-process ``LLM.generate``
results, so both paths share one set of checks (prompt echoed back, finish reason, one log-prob per token).

Weights are synced in place: the policy's state dict is written as ``model.safetensors`` into a folder in
shared memory (``/dev/shm`` where it exists), a tensor at a time (trainer/rollout/safetensors_stream.py:
the bytes ``save_model`` writes; a sharded model's parameters each gathered only when reached), then
``/collective_rpc`` runs ``reload_weights`` on that folder and ``/reset_prefix_cache`` drops KV blocks
computed with the old weights. Measured on
tiny:llama-0.4m: 3 ms to write, 38 ms to reload; greedy tokens then equal the trainer's. Behind a front the
weights are streamed to it as a safetensors file made from the tensors a block at a time
(``PUT /rlrun/weights``, trainer/rollout/safetensors_stream.py: nothing written on this host), and the
front reloads them from its own folder.

What differs from the transformers engine, on purpose or for now:
- Greedy decoding asks vLLM for one sample per prompt (it refuses ``n > 1`` without sampling) and repeats
  it ``n`` times: greedy samples are identical anyway.
- Sampling is seeded once per engine (``EngineOptions.seed``), not per row: a per-request seed crashes
  vLLM's CPU sampler (``CPU Generator does not use offset``), so ``SamplingParams.seed`` is not sent.

A call waits for the engine in short slices: a run's cancel (raised into the loop's thread by its stop
watch) lands within a fraction of a second, and the engine is told to abort what it was generating. An
engine process that died (a crash, the OOM killer) is started again on the next call, given the weights
last synced (they stay in shared memory), and the call is made again: the run goes on at the same step, and
its events say so (``on_restart``).

An adapter (LoRA) policy syncs one of two ways (``adapter_sync``):

- ``lora`` (on a GPU): only its adapter. The engine runs the frozen base with LoRA on
  (``EngineOptions.max_lora_rank``), and each sync saves the adapter (peft's ``save_pretrained``, a few MB in
  shared memory) and loads it under a new name through ``/v1/load_lora_adapter``, the previous one
  unloaded; generation then asks for that name (vLLM's ``LoRARequest``). The base is never reloaded. An
  adapter with fully trained modules beside it (``modules_to_save``) is refused: vLLM's LoRA has none.
- ``merged`` (on CPU): the adapter folded into the base a layer at a time as the weights are written
  (``merged_stream``, trainer/rollout/weight_streams.py; the training model left as
  it is), reloaded like a full model's weights. vLLM's CPU LoRA path computes the adapter beside every
  layer at every token: on SmolLM2-135M with a rank-16 adapter a step's 32 completions took 25-29 s with
  LoRA and 7 s merged (plus 0.6 s to reload 538 MB), measured 2026-12-05 with bench/real_model.py's
  settings.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import ssl
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import httpx

from trainer.rollout.base import Completion, SamplingParams, check_generate_args
from trainer.rollout.engine_process import (
    ADAPTERS_ROUTE,
    ENGINE_TOKEN_VARIABLE,
    ENGINE_URL_VARIABLE,
    FRONT_ROUTE,
    SERVED_NAME,
    WEIGHTS_ROUTE,
    EngineError,
    EngineOptions,
    EngineProcess,
    EngineStartError,
    attached_engine_token,
    attached_engine_url,
    certificate_failure,
    certificate_refusal,
    engine_message,
    engine_tls_verify,
    token_headers,
)
from trainer.rollout.safetensors_stream import SafetensorsStream
from trainer.rollout.vllm_engine import completions_from_vllm
from trainer.rollout.weight_streams import weights_stream

__all__ = ["EngineError", "ServedEngine", "attach_served_engine", "open_served_engine", "start_served_engine"]


def in_daemon_thread(call: Callable[[], httpx.Response]) -> Future[httpx.Response]:
    """``call()`` in a thread of its own, its outcome in the future returned. The thread is a daemon: a
    request left waiting on an engine that will not answer (one whose work was aborted on a cancel answers
    nothing until it stops, or the request's timeout, 10 minutes) must not hold up the process's exit, as a
    ``ThreadPoolExecutor``'s worker did (Python joins those at exit: a worker, or pytest, that had cancelled a
    generation waited up to those 10 minutes to end)."""
    future: Future[httpx.Response] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the waiting thread, which raises it
            future.set_exception(exc)

    threading.Thread(target=run, name="engine-request", daemon=True).start()
    return future


def completion_request(
    prompts: Sequence[list[int]], n: int, params: SamplingParams, model: str = SERVED_NAME
) -> dict[str, Any]:
    """The ``/v1/completions`` body for ``n`` samples of each prompt (greedy: one, see the module doc), from
    ``model`` (the base, or the synced adapter's name)."""
    greedy = params.is_greedy
    body: dict[str, Any] = {
        "model": model,
        "prompt": [list(ids) for ids in prompts],
        "n": 1 if greedy else n,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "logprobs": 0,  # the sampled token's log-probability only
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
    }
    if not greedy and params.top_k > 0:
        body["top_k"] = params.top_k
    return body


def request_outputs(choices: Sequence[dict[str, Any]], prompts: Sequence[list[int]], n: int) -> list[Any]:
    """The server's choices regrouped as ``LLM.generate`` returns them: one object per prompt with
    ``prompt_token_ids`` and ``outputs`` (``token_ids``, ``text``, ``finish_reason``, ``index`` and
    ``logprobs`` as one ``{token: obj with .logprob}`` per position).

    vLLM numbers the choices prompt-major: choice ``index`` is sample ``index % n`` of prompt ``index // n``.
    """
    grouped: list[list[SimpleNamespace]] = [[] for _ in prompts]
    echoed: list[list[int] | None] = [None for _ in prompts]
    for choice in choices:
        prompt, sample = divmod(int(choice["index"]), n)
        if not 0 <= prompt < len(prompts):
            count = f"{len(prompts)} prompts x {n}"
            raise EngineError(f"the engine answered choice {choice['index']} for {count}")
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        per_position = (
            None
            if token_logprobs is None
            else [
                {token: SimpleNamespace(logprob=lp)}
                for token, lp in zip(token_ids, token_logprobs, strict=False)
            ]
        )
        grouped[prompt].append(
            SimpleNamespace(
                index=sample,
                token_ids=token_ids,
                text=choice.get("text"),
                finish_reason=choice.get("finish_reason"),
                logprobs=per_position,
            )
        )
        echoed[prompt] = choice.get("prompt_token_ids") or echoed[prompt]
    return [
        SimpleNamespace(prompt_token_ids=echoed[i] if echoed[i] is not None else [], outputs=grouped[i])
        for i in range(len(prompts))
    ]


class ServedEngine:
    """A ``RolloutEngine`` backed by an engine process at ``base_url``.

    Args:
        base_url: the engine server (``EngineProcess.start()``'s answer).
        max_model_len: the engine's limit on prompt + completion tokens (``EngineOptions.max_model_len``):
            a longer prompt is refused here with the limit named, before anything is sent.
        weights_dir: where ``sync_weights`` writes (default: a fresh folder in ``/dev/shm``).
        timeout: seconds to wait for one generation call.
        adapter_sync: how an adapter policy reaches the engine: ``lora`` (its adapter alone, the engine
            running LoRA) or ``merged`` (folded into the base's weights, the engine running none).
        token: sent as ``Authorization: Bearer`` with every request (a remote engine's front asks for it).
        upload: the engine is behind ``rlrun engine --remote``'s front (trainer/rollout/engine_front.py),
            maybe on another host: weights and adapters are uploaded to it rather than named as folders.
        verify: how an https front's certificate is checked (default: ``engine_tls_verify(base_url)``,
            which reads ``RLRUN_ENGINE_CA``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_model_len: int,
        weights_dir: Path | None = None,
        timeout: float = 600,
        process: EngineProcess | None = None,
        on_restart: Callable[[str], None] | None = None,
        adapter_sync: Literal["lora", "merged"] = "lora",
        token: str | None = None,
        upload: bool = False,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        self.adapter_sync = adapter_sync
        self._verify = engine_tls_verify(base_url) if verify is None else verify
        self.upload = upload
        self._headers = token_headers(token)
        self.process = process  # stopped by close(), when this engine started it
        self.on_restart = on_restart  # told (a sentence) when a dead engine process was started again
        self._timeout = timeout
        self.base_url = base_url.rstrip("/")
        self.max_model_len = max_model_len
        self._own_weights_dir = weights_dir is None
        shm = Path("/dev/shm")
        self.weights_dir = weights_dir or Path(
            tempfile.mkdtemp(prefix="rlrun-engine-weights-", dir=shm if shm.is_dir() else None)
        )
        self._http = self._client()
        self.model_name = SERVED_NAME  # what generation asks for: the base, or the last synced adapter
        self._syncs = 0
        self._closed = False
        # adapters are loaded as <prefix>-<sync>: unique to this object, as a kept engine (RLRUN_ENGINE_URL)
        # still holds the adapters of the runs before
        self._lora_prefix = f"policy-lora-{uuid.uuid4().hex[:8]}"

    def _client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, timeout=self._timeout, headers=self._headers, verify=self._verify
        )

    def _new_client(self) -> None:
        old, self._http = self._http, self._client()
        old.close()

    def _call(self, path: str, body: dict[str, Any]) -> Any:
        """``_post``; when the engine process this object started has died, start it again once, give it
        the last synced weights back, and post again (the run goes on; no step is lost or run twice)."""
        try:
            return self._post(path, body)
        except EngineError:
            proc = None if self.process is None else self.process.proc
            if proc is None or proc.poll() is None:
                raise  # a refusal, or an engine that is still running: not ours to restart
            code = proc.returncode
        began = time.monotonic()
        self._restart()
        if self.on_restart is not None:
            self.on_restart(
                f"the engine process had exited (code {code}); started it again with the last synced weights "
                f"in {time.monotonic() - began:.0f} s"
            )
        return self._post(path, body)

    def _restart(self) -> None:
        assert self.process is not None
        self.process.stop()
        self.base_url = self.process.start().rstrip("/")
        self._new_client()
        if self.model_name != SERVED_NAME:  # the adapter last synced, from its folder
            folder = self.weights_dir / f"adapter-{self._syncs}"
            self._post("/v1/load_lora_adapter", {"lora_name": self.model_name, "lora_path": str(folder)})
        elif (self.weights_dir / "model.safetensors").is_file():  # the full weights last synced
            reload = {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}}
            self._post("/collective_rpc", reload)

    def _post(
        self, path: str, body: dict[str, Any] | None = None, send: Callable[[], httpx.Response] | None = None
    ) -> Any:
        """POST ``body`` (or make the request ``send`` makes) and wait for the answer in short slices, so
        that a cancel raised into this thread (the run's stop watch) lands within a fraction of a second
        even while the engine generates for minutes; the engine is then told to abort what it runs
        (``/abort_requests``: this engine serves this run only) and the connection is dropped. The answer's
        JSON, or its text when it is not JSON (LoRA routes)."""
        pending = in_daemon_thread(send or (lambda: self._http.post(path, json=body)))
        try:
            while True:
                try:
                    resp = pending.result(timeout=0.2)
                    break
                except TimeoutError:
                    continue
        except httpx.TransportError as exc:
            raise EngineError(f"the engine at {self.base_url} did not answer {path}: {exc}") from exc
        except BaseException:
            self._abort_all()
            raise
        if resp.status_code != 200:
            message = engine_message(resp)
            raise EngineError(f"the engine refused {path} ({resp.status_code}): {message}", resp.status_code)
        if resp.headers.get("content-type", "").startswith("application/json"):
            return resp.json()
        return resp.text

    def _abort_all(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{self.base_url}/abort_requests",
                json={},
                headers=self._headers,
                timeout=5,
                verify=self._verify,
            )
        self._new_client()

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """n completions per prompt, prompt-major, with the sampled tokens' log-probabilities.

        Raises:
            ValueError: ``n < 1``, an empty prompt, or a prompt of ``max_model_len`` tokens or more (the
                engine's limit is named).
            EngineError: the engine refused the request or is unreachable (its message).
        """
        check_generate_args(prompts, n)
        for i, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; the engine's max_model_len is {self.max_model_len} "
                    "(prompt and completion together)"
                )
        if not prompts:
            return []
        asked = 1 if params.is_greedy else n
        answer = self._call("/v1/completions", completion_request(prompts, n, params, self.model_name))
        outputs = request_outputs(answer["choices"], prompts, asked)
        completions = completions_from_vllm(outputs, list(prompts), tokenizer=None)
        if asked == n:
            return completions
        return [c for c in completions for _ in range(n)]  # greedy: the one sample, n times

    def sync_weights(self, model: Any) -> None:
        """Make the engine generate with ``model``'s current weights (written to shared memory, reloaded
        in place, prefix cache dropped); for an adapter model its adapter only (``sync_adapter``), or
        with ``adapter_sync="merged"`` the adapter folded into the base.

        Raises:
            EngineError: the engine refused the reload.
        """
        if hasattr(model, "peft_config") and self.adapter_sync == "lora":
            self.sync_adapter(model)
            return
        # each tensor (each merged layer) made as the stream reaches it (trainer/rollout/weight_streams.py)
        self.sync_stream(weights_stream(model))

    def sync_stream(self, stream: SafetensorsStream) -> None:
        """``sync_weights`` from the safetensors file ``stream`` makes (e.g. of a sharded model's state,
        each parameter gathered as the stream reaches it): uploaded to a front, or written to shared memory
        a block at a time and reloaded. A collective stream is left part-read where the engine failed: the
        caller's ``gather_rest()`` joins the remaining gathers.

        Raises:
            EngineError: the engine refused the reload.
        """
        if self.upload:
            self._put(WEIGHTS_ROUTE, stream)
            self._post("/reset_prefix_cache", {})
            return
        # written beside, then renamed: a restarted engine (``_restart``) reloads whole weights, never a
        # file a failed sync left half-written
        partial = self.weights_dir / ".model.safetensors.partial"
        try:
            with partial.open("wb") as out:
                for block in stream:
                    out.write(block)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(self.weights_dir / "model.safetensors")
        self._reload()

    def _reload(self) -> None:
        """The engine reloads the weights written to ``weights_dir``, and drops its prefix cache."""
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}}
        self._call("/collective_rpc", reload)
        self._post("/reset_prefix_cache", {})

    def _put(self, path: str, body: bytes | SafetensorsStream) -> Any:
        """PUT ``body`` (bytes, or a stream of known length sent a block at a time) to a front's upload
        route."""

        def send() -> httpx.Response:
            if isinstance(body, bytes):
                return self._http.put(path, content=body)
            return self._http.put(path, content=iter(body), headers={"content-length": str(len(body))})

        return self._post(path, send=send)

    def follow(self, base_url: str, model_name: str) -> None:
        """Generate from the engine at ``base_url`` under ``model_name`` (the base, or an adapter another
        process synced): a rank that shares the engine another rank started and syncs."""
        if base_url.rstrip("/") != self.base_url:
            self.base_url = base_url.rstrip("/")
            self._new_client()
        self.model_name = model_name

    def sync_adapter(self, model: Any, state: dict[str, Any] | None = None) -> None:
        """Load ``model``'s adapter into the engine under a new name (the previous one unloaded, its folder
        removed); generation asks for it from then on. The engine must have been started with LoRA on.
        ``state``: the model's LoRA tensors gathered whole, for a model sharded over ranks (peft's
        ``save_pretrained`` takes the adapter's tensors from it instead of from the model).

        Raises:
            NotImplementedError: the adapter trains whole modules too (``modules_to_save``).
            EngineError: the engine refused the adapter.
        """
        check_engine_adapter(model)
        self._syncs += 1
        name, folder = f"{self._lora_prefix}-{self._syncs}", self.weights_dir / f"adapter-{self._syncs}"
        model.save_pretrained(str(folder), **({} if state is None else {"state_dict": state}))
        try:
            if self.upload:  # the front unpacks it on its host and loads it from there
                self._put(f"{ADAPTERS_ROUTE}/{name}", folder_tar(folder))
            else:
                self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except EngineError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self.model_name = self.model_name, name
        if previous != SERVED_NAME:
            self._post("/v1/unload_lora_adapter", {"lora_name": previous})
            shutil.rmtree(self.weights_dir / f"adapter-{previous.rsplit('-', 1)[1]}", ignore_errors=True)

    def close(self) -> None:
        """Stop the engine this object started; a kept engine (``RLRUN_ENGINE_URL``), which outlives the
        run, is left without the adapter this object loaded (it would hold one of the engine's LoRA slots).
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.process is None and self.model_name.startswith(self._lora_prefix):
                with contextlib.suppress(httpx.HTTPError):
                    self._http.post(
                        "/v1/unload_lora_adapter", json={"lora_name": self.model_name}, timeout=10
                    )
        finally:  # an unload cut short (a cancel) still leaves nothing behind
            self._http.close()
            if self.process is not None:
                self.process.stop()
            if self._own_weights_dir:
                shutil.rmtree(self.weights_dir, ignore_errors=True)


def folder_tar(folder: Path) -> bytes:
    """``folder``'s files as an uncompressed tar (names relative to it): an adapter's upload body."""
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w:") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(folder)))
    return body.getvalue()


def engine_adapter_sync(
    model: Any, adapter_sync: Literal["lora", "merged"] | None
) -> Literal["lora", "merged"]:
    """How ``model``'s adapter reaches the engine: ``adapter_sync``, by default ``lora`` on a GPU and
    ``merged`` on CPU (vLLM's CPU LoRA is slow: the module doc); a LoRA sync the engine cannot take is
    refused (``check_engine_adapter``)."""
    if adapter_sync is None:
        adapter_sync = "lora" if next(model.parameters()).is_cuda else "merged"
    if hasattr(model, "peft_config") and adapter_sync == "lora":
        check_engine_adapter(model)
    return adapter_sync


def check_engine_adapter(model: Any) -> None:
    """Refuse an adapter the engine cannot take as a LoRA: one that also trains whole modules."""
    config = model.peft_config[getattr(model, "active_adapter", "default")]
    if getattr(config, "modules_to_save", None):
        raise NotImplementedError(
            f"the engine serves LoRA weights only; this adapter also trains {sorted(config.modules_to_save)} "
            "in full: use engine 'hf'"
        )


def start_served_engine(
    model_path: str,
    model: Any,
    *,
    max_model_len: int,
    on_restart: Callable[[str], None] | None = None,
    threads: int | None = None,
    adapter_sync: Literal["lora", "merged"] | None = None,
    seed: int = 0,
) -> ServedEngine:
    """An engine process for the policy ``model`` loaded from the folder ``model_path`` (same dtype;
    ``threads`` cores, default as many as this process: generation and training take turns), and a
    ``ServedEngine`` that stops it on ``close()``. For an adapter policy ``model_path`` is its base's folder
    and the engine runs LoRA, or, with ``adapter_sync="merged"`` (the default for a policy on CPU, where
    vLLM's LoRA is slow), none: each sync reloads the merged weights. ``seed`` seeds its sampling (the run's
    seed: requests carry none). A failed or interrupted start stops the
    engine; a failed one carries its last lines.

    Raises:
        ValueError: ``model_path`` is not a plain model folder (the engine loads it itself).
        NotImplementedError: an adapter the engine cannot take (``check_engine_adapter``).
        EngineUnavailable: no engine environment (the setting and the install are named).
        EngineStartError: the engine would not start.
    """
    import torch

    folder = Path(model_path)
    if (folder / "adapter_config.json").is_file():
        raise ValueError(
            "engine 'vllm_server' needs a full model under the adapter it syncs, and this run starts from an "
            f"adapter run ({model_path}): start from a `merge` run of it, or use engine 'hf'"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"engine 'vllm_server' loads a full model from a local folder; {model_path} is not one"
        )
    lora_rank = None
    adapter_sync = engine_adapter_sync(model, adapter_sync)
    if hasattr(model, "peft_config") and adapter_sync == "lora":
        lora_rank = max(int(c.r) for c in model.peft_config.values())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    options = EngineOptions(
        model_dir=folder,
        dtype=dtype,
        max_model_len=max_model_len,
        threads=threads or torch.get_num_threads(),
        max_lora_rank=lora_rank,
        max_loras=1,
        seed=seed,
    )
    process = EngineProcess(options)
    base_url = process.start()
    return ServedEngine(
        base_url,
        max_model_len=max_model_len,
        process=process,
        on_restart=on_restart,
        adapter_sync=adapter_sync,
    )


def attach_served_engine(
    base_url: str,
    model: Any,
    *,
    max_model_len: int,
    adapter_sync: Literal["lora", "merged"] | None = None,
) -> ServedEngine:
    """A ``ServedEngine`` on the engine already running at ``base_url`` (``RLRUN_ENGINE_URL``, e.g. started by
    ``rlrun engine``) instead of one of its own: ``close()`` leaves it running, and one that dies is not
    started again (the run fails saying so). A plain engine must run on this host, as weights reach it as
    files in ``/dev/shm``; behind ``rlrun engine --remote``'s front (which answers ``/rlrun/front``) it may
    run anywhere, weights and adapters uploaded over HTTP (or https, its certificate checked against
    ``RLRUN_ENGINE_CA`` when set) with ``RLRUN_ENGINE_TOKEN``. It serves one run at
    a time: each run's first sync replaces its weights. Its seed, threads
    and dtype are its own (``rlrun engine``'s options); an adapter policy syncs as ``start_served_engine``'s
    (``lora`` needs an engine started with ``--max-lora-rank``).

    Raises:
        EngineStartError: nothing answers at ``base_url``, its front refuses this worker's token or
            presents a certificate this worker does not trust (the setting named), it serves no model
            ``policy``, its
            ``max_model_len`` is below the run's (both named), or it was not started as ``rlrun engine``
            starts one (``check_sampling_options``).
        NotImplementedError: an adapter the engine cannot take (``check_engine_adapter``).
    """
    where = f"{ENGINE_URL_VARIABLE}={base_url}"
    token = attached_engine_token()
    verify = engine_tls_verify(base_url)
    # one connection (one TLS handshake) for the probes
    with httpx.Client(base_url=base_url, headers=token_headers(token), timeout=10, verify=verify) as probe:
        adapter_sync, upload = probe_attached_engine(probe, where, model, max_model_len, adapter_sync, verify)
    return ServedEngine(
        base_url,
        max_model_len=max_model_len,
        adapter_sync=adapter_sync,
        token=token,
        upload=upload,
        verify=verify,
    )


def probe_attached_engine(
    probe: httpx.Client,
    where: str,
    model: Any,
    max_model_len: int,
    adapter_sync: Literal["lora", "merged"] | None,
    verify: ssl.SSLContext | bool,
) -> tuple[Literal["lora", "merged"], bool]:
    """``attach_served_engine``'s checks of the engine ``probe`` reaches (what it raises); the adapter sync
    the run will use, and whether the engine is behind a front (weights go by upload)."""
    token_given = "Authorization" in probe.headers
    try:
        resp = probe.get("/v1/models")
        if resp.status_code == 401:
            given = f"the token in {ENGINE_TOKEN_VARIABLE}" if token_given else f"no {ENGINE_TOKEN_VARIABLE}"
            raise EngineStartError(
                f"the engine at {where} refused this worker ({given}): {engine_message(resp)}"
            )
        resp.raise_for_status()
        models = resp.json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        failed = certificate_failure(exc)
        if failed is not None:
            raise EngineStartError(certificate_refusal(where, failed, verify)) from None
        raise EngineStartError(f"no engine answers at {where}: {exc}") from None
    served = next((m for m in models if isinstance(m, dict) and m.get("id") == SERVED_NAME), None)
    if served is None:
        raise EngineStartError(
            f"the engine at {where} serves no model named {SERVED_NAME!r}: start it with `rlrun engine`"
        )
    limit = served.get("max_model_len")
    if isinstance(limit, int) and limit < max_model_len:
        raise EngineStartError(
            f"the engine at {where} holds {limit} tokens per sequence (its max_model_len); this run needs "
            f"{max_model_len}: start it with `rlrun engine --max-model-len {max_model_len}` or more"
        )
    check_sampling_options(probe, where)
    adapter_sync = engine_adapter_sync(model, adapter_sync)
    try:
        front = probe.get(FRONT_ROUTE).status_code == 200
    except httpx.HTTPError as exc:
        raise EngineStartError(f"the engine at {where} did not answer {FRONT_ROUTE}: {exc}") from None
    return adapter_sync, front


# What a rollout engine must have been started with (``EngineOptions.command``), read off its configuration
REQUIRED_OPTIONS = {"logprobs_mode": "processed_logprobs", "generation_config": "vllm"}


def check_sampling_options(probe: httpx.Client, where: str) -> None:
    """Refuse an engine whose samples or log-probs are not what the trainer assumes: one without the
    dev-mode routes a sync needs (``/server_info`` among them), or started with other log-probs
    (``--logprobs-mode``) or with the checkpoint's sampling defaults (``--generation-config``), as a plain
    ``vllm serve`` is.

    Raises:
        EngineStartError: naming what differs and ``rlrun engine``.
    """
    try:
        resp = probe.get("/server_info", params={"config_format": "json"}, timeout=120)
    except httpx.HTTPError as exc:
        raise EngineStartError(f"the engine at {where} did not answer /server_info: {exc}") from None
    if resp.status_code != 200:
        raise EngineStartError(
            f"the engine at {where} has no /server_info ({resp.status_code}): it was not started with "
            "VLLM_SERVER_DEV_MODE=1, whose routes sync the weights; start it with `rlrun engine`"
        )
    try:
        config = resp.json()["vllm_config"]["model_config"]
    except (ValueError, KeyError, TypeError):
        raise EngineStartError(
            f"the engine at {where} answered /server_info without its model_config"
        ) from None
    wrong = [
        f"--{name.replace('_', '-')} {config.get(name)} (needs {value})"
        for name, value in REQUIRED_OPTIONS.items()
        if config.get(name) != value
    ]
    if wrong:
        raise EngineStartError(
            f"the engine at {where} was started with {', '.join(wrong)}: its samples are not the ones the "
            "trainer's log-probs assume; start it with `rlrun engine`"
        )


def open_served_engine(
    model_path: str,
    model: Any,
    *,
    max_model_len: int,
    on_restart: Callable[[str], None] | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> ServedEngine:
    """The engine a run generates with: the running one ``RLRUN_ENGINE_URL`` names (``attach_served_engine``;
    ``on_restart``, ``threads`` and ``seed`` are then the engine's own business), else a process of the
    run's own (``start_served_engine``). Raises what those raise."""
    url = attached_engine_url()
    if url is not None:
        return attach_served_engine(url, model, max_model_len=max_model_len)
    return start_served_engine(
        model_path, model, max_model_len=max_model_len, on_restart=on_restart, threads=threads, seed=seed
    )
