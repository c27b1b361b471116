"""LoRA and QLoRA adapters with peft: train a few low-rank matrices beside frozen weights instead of the
whole model, and use the same model with the adapter switched off as the frozen reference.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a linear layer's
output ``W x`` becomes ``W x + (alpha / r) B A x`` with ``A`` (r x in) random and ``B`` (out x r) zero at
the start, so a fresh adapter leaves the model unchanged; only A and B train. QLoRA (Dettmers et al. 2023)
keeps ``W`` in 4-bit NF4 (or 8-bit) on a CUDA device through bitsandbytes.

An adapter checkpoint holds the adapter (and trained heads, ``modules_to_save``) and a ``rlrun_base.json``
naming the folder of the model it was trained on (``BASE_FILE``). Loading such a folder loads that base
(recursively: a chain of adapter runs), applies the adapter and merges it, so ``run:<id>`` of an adapter
run is a plain model to anything that loads it (a next run, a reward-model scorer, a critic).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.adapter_folders import ADAPTER_CONFIG, BASE_FILE, base_of, is_adapter_folder, root_base
from trainer.specs import AdapterSpec

__all__ = ["ADAPTER_CONFIG", "BASE_FILE", "base_of", "is_adapter_folder", "root_base"]  # re-exported

Task = Literal["causal", "score"]


def base_file(base: str) -> dict[str, str]:
    """The file an adapter checkpoint carries next to the adapter (``Checkpointer.save(files=...)``)."""
    return {BASE_FILE: json.dumps({"base": base})}


def check_adapter_supported(adapter: AdapterSpec | None) -> None:
    """Refuse, at the start of a run, what this worker cannot do: quantized (QLoRA) bases need a CUDA
    device and bitsandbytes."""
    if adapter is None or adapter.quantize is None:
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"adapter.quantize {adapter.quantize!r} (QLoRA) needs a CUDA GPU and bitsandbytes; this worker "
            "has no CUDA device (run it on a GPU worker queue, or set quantize to null for plain LoRA)"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"adapter.quantize {adapter.quantize!r} (QLoRA) needs bitsandbytes on the worker: "
            "pip install 'rlrun[qlora]'"
        ) from exc


def quantization_config(adapter: AdapterSpec | None) -> Any:
    """transformers' BitsAndBytesConfig for a QLoRA base (NF4 with double quantization and bf16 compute,
    the QLoRA paper's recipe; or 8-bit), or None."""
    if adapter is None or adapter.quantize is None:
        return None
    from transformers import BitsAndBytesConfig

    if adapter.quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)  # type: ignore[no-untyped-call]
    return BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def lora_config(adapter: AdapterSpec, task: Task) -> Any:
    """peft's LoraConfig for the spec; a scalar-head model (reward model, critic) trains its ``score``
    head in full beside the adapter (peft's SEQ_CLS task adds it to ``modules_to_save``)."""
    from peft import LoraConfig, TaskType

    targets = (
        adapter.target_modules if isinstance(adapter.target_modules, str) else list(adapter.target_modules)
    )
    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=targets,
        task_type=TaskType.SEQ_CLS if task == "score" else TaskType.CAUSAL_LM,
    )


def add_adapter(model: Any, adapter: AdapterSpec, task: Task) -> Any:
    """``model`` with a fresh trainable adapter (everything else frozen)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    if adapter.quantize is not None:
        model = prepare_model_for_kbit_training(model)  # type: ignore[no-untyped-call]
    try:
        return get_peft_model(model, lora_config(adapter, task))
    except ValueError as exc:  # e.g. a target module name the model does not have
        raise ValueError(f"adapter: {str(exc).splitlines()[0]}") from exc


def load_adapter(model: Any, folder: str | Path, *, trainable: bool) -> Any:
    """``model`` (the adapter's base, loaded) with the adapter saved in ``folder`` applied."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)


def merged(model: Any) -> Any:
    """An adapter folded into its base's weights: a plain model again."""
    return model.merge_and_unload()


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights ``merged(model)`` would have, under the base model's own names, leaving ``model`` as it
    is (``merge_and_unload`` changes the model in place, and unmerging after it does not give the base
    weights back bit for bit). Each LoRA layer's weight is ``W + scale * B @ A`` (peft's
    ``get_delta_weight``, Hu et al. 2021 eq. 3); every other tensor is the base's, shared, not copied. Tied
    weights (an LM head tied to the embedding) appear once, as ``save_pretrained`` writes them."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = getattr(model, "active_adapter", "default")
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in base.state_dict(keep_vars=False).items():
            if ".lora_" not in name:
                state[name.replace(".base_layer.", ".")] = value
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and holds_adapter(module, adapter):
                weight = module.get_base_layer().weight
                delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined]  # on every LoRA layer type
                state[f"{name}.weight"] = weight + delta.to(weight.dtype)
    if getattr(base.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def holds_adapter(layer: Any, adapter: str) -> bool:
    """A peft LoRA layer carries ``adapter``'s weights: ``lora_A`` on linear and convolution layers,
    ``lora_embedding_A`` on an embedding (whose ``lora_A`` stays empty)."""
    return adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {})


def has_adapter(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextmanager
def adapter_off(model: Any) -> Iterator[None]:
    """The base model under ``model``'s adapter (the frozen reference of an adapter run: no second copy)."""
    with model.disable_adapter() if has_adapter(model) else nullcontext():
        yield


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint must keep of a model that trains only some parameters (an adapter run's critic):
    the trainable tensors by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"checkpoint holds parameters the model does not have: {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
