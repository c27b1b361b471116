"""Build a rollout engine by name; vLLM's module is imported only when it is asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

from trainer.rollout.base import RolloutEngine
from trainer.specs.base import EngineName


def make_engine(
    name: EngineName,
    *,
    model: Any,
    tokenizer: Any,
    model_path: str,
    synced_gpus: bool = False,
    max_model_len: int = 512,
    on_restart: Callable[[str], None] | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> RolloutEngine:
    """A rollout engine that generates with ``model``'s current weights; the one place that reads ``name``.

    Args:
        name: ``"hf"`` (``model.generate`` in place, any device), ``"vllm"`` (GPU, needs the vllm extra)
            or ``"vllm_server"`` (vLLM's server started from the engine environment, any machine; or the one
            already running at ``RLRUN_ENGINE_URL``).
        model: the policy being trained.
        tokenizer: its tokenizer (HF engine; vLLM loads its own from ``model_path``).
        model_path: folder or hub id the policy was loaded from (vLLM builds its copy from it).
        synced_gpus: the model is sharded over ranks that generate together (HF: ``HFEngine``'s).
        max_model_len: the longest prompt + completion the engine process must hold (``vllm_server``).
        on_restart: told when an engine process that had died was started again (``vllm_server``).
        threads: the engine process's cores (``vllm_server``; default: as many as this process's torch).
        seed: the engine's sampling seed (``vllm``, ``vllm_server``: their requests carry none; the HF engine
            takes each call's own seed).

    Raises:
        ValueError: unknown ``name``, listing the valid ones.
        ImportError: ``"vllm"`` without vLLM installed, naming the extra.
        EngineUnavailable: ``"vllm_server"`` without an engine environment, naming the setting and install.
        EngineStartError: the engine process would not start (with its own last lines).
    """
    if name == "hf":
        from trainer.rollout.hf_engine import HFEngine

        return HFEngine(model, tokenizer, synced_gpus=synced_gpus)
    if name == "vllm":
        from trainer.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(model_path, seed=seed)
        # vLLM loaded model_path from disk, but the policy may already differ from it (resumed from a
        # checkpoint), so the engine starts from the policy's weights rather than trusting the folder.
        engine.sync_weights(model)
        return engine
    if name == "vllm_server":
        from trainer.rollout.served_engine import open_served_engine

        served = open_served_engine(
            model_path, model, max_model_len=max_model_len, on_restart=on_restart, threads=threads, seed=seed
        )
        try:
            served.sync_weights(model)  # as for vllm: the policy may already differ from its folder
        except BaseException:
            served.close()
            raise
        return served
    raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(get_args(EngineName))}")
