"""What the bench scripts share besides the clock (bench/clock.py), torch-free: ``quiet`` (the
datasets/transformers/accelerate chatter off before TRL runs), ``throwaway_postgres`` (a new, empty
database dropped afterwards), ``engine_python_or_none`` (the engine environment, or why a bench
skips) and ``rlrun_serve`` (`rlrun serve` in a fresh home, until it answers). A
sibling module (``python bench/x.py`` puts bench/ first on sys.path); running it does nothing (``make
bench`` runs every file in bench/)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text


def engine_python_or_none() -> Path | None:
    """The engine environment's python (``make engine``), or None after printing why a bench that needs it
    is skipped."""
    from trainer.rollout.engine_process import EngineUnavailable, engine_python

    try:
        return engine_python()
    except EngineUnavailable as exc:
        print(f"skipped: {exc}")
        return None


def quiet() -> None:
    """datasets, transformers and accelerate logging and progress bars off; warnings ignored."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def trl_grpo_settings(
    hp: Any, *, steps: int, prompts: int, group: int, max_new_tokens: int
) -> dict[str, Any]:
    """``GRPOConfig`` keywords for TRL to train as an rlrun group-RL run with hyperparameters ``hp`` does:
    the same completions per step, updates per step (TRL counts optimizer steps: a generation batch is
    ``steps_per_generation`` minibatches, each seen ``num_iterations`` times, as rlrun's minibatches x
    ppo_epochs), sampling, clip, KL, loss type (``grpo``), learning rate and clipping; HF generate, fp32
    unless the caller adds ``bf16``."""
    assert hp.minibatch_size is None, "TRL's minibatch is the batch / steps_per_generation"
    return {
        "max_steps": steps * hp.ppo_epochs * hp.minibatches,
        "num_generations": group,
        "per_device_train_batch_size": hp.minibatch_size_for(prompts * group),
        "gradient_accumulation_steps": 1,
        "steps_per_generation": hp.minibatches,
        "num_iterations": hp.ppo_epochs,
        "max_completion_length": max_new_tokens,
        "temperature": hp.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "use_vllm": False,
        "beta": hp.kl_coef,
        "epsilon": hp.clip_low,
        "epsilon_high": hp.clip_high,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "learning_rate": hp.learning_rate,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": hp.weight_decay,
        "max_grad_norm": hp.max_grad_norm,
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "log_level": "error",
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
    }


@contextmanager
def throwaway_postgres(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url``; dropped afterwards (the tests' pattern)."""
    name = f"rlrun_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def rlrun_serve(
    home: Path, flags: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``rlrun serve <flags>`` on a free port with ``home`` as its home (no other RLRUN_* setting but
    ``env``); the process and its URL once ``/healthz`` answers (2 minutes at most)."""
    from trainer.ports import free_port

    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLRUN_")}
    environ |= {"RLRUN_HOME": str(home), "RLRUN_PORT": str(port)} | (env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlrun.cli", "serve", *flags],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=(home / "serve.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("rlrun serve did not come up: " + (home / "serve.log").read_text()[-2000:])
