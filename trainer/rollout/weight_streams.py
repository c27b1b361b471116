"""What a sync sends the engine as a safetensors stream (trainer/rollout/safetensors_stream.py), for a model
on one process or sharded over its ranks (FSDP2). Each tensor is made only when the stream reaches it; a
sharded one is gathered then (every rank joins each gather in the stream's order, the host's first rank
writes or uploads what it gathers: trainer/rollout/rank_engine.py), so no rank holds more than one whole
parameter beyond its own.

- A whole model: its state dict under its own names, tied names from its structure (``model_stream``).
- An adapter, merged (the engine runs no LoRA: the default on CPU; ``merged_stream``): the base's state
  under the base's own names (``.base_layer.`` dropped, the adapter's own tensors left out), each LoRA
  layer's weight replaced by ``W + scale * B @ A`` (Hu et al. 2021, eq. 3; peft's ``get_delta_weight``),
  made when the stream reaches that layer: one merged layer in memory at a time, where merging first held a
  merged copy of every adapted layer (with ``all-linear``, nearly a second model). The same bytes as one
  process's ``merged_state_dict`` gives for a model without tied weights
  (tests/rollout/test_safetensors_stream.py). Sharded, the layer's ``W``, ``A`` and ``B`` are gathered and
  multiplied as peft's ``Linear.get_delta_weight`` does (fp16/bf16 factors in fp32 on CPU).
- An adapter synced as a LoRA from sharded ranks (the engine runs LoRA: the default on a GPU): only the
  adapter's tensors, few and small, gathered whole on every rank (``gathered_adapter_state``); the host's
  first rank saves them with peft's ``save_pretrained(state_dict=...)`` (``ServedEngine.sync_adapter``).

Sharded, only linear LoRA layers (peft's ``Linear``) without DoRA or a LoRA bias are merged; any other is
refused naming the layer (it merges from unsharded ranks: sharding ``ddp``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.adapters import holds_adapter
from trainer.distributed import whole
from trainer.rollout.safetensors_stream import Deferred, SafetensorsStream, tied_names


def weights_stream(model: Any) -> SafetensorsStream:
    """The stream of what the engine serves for ``model``: its weights, with its adapter merged if any."""
    return merged_stream(model) if hasattr(model, "peft_config") else model_stream(model)


def model_stream(model: Any) -> SafetensorsStream:
    """The stream of a whole model's weights (no adapter)."""
    return SafetensorsStream(model.state_dict(), shared=tied_names(model))


def merged_stream(model: Any) -> SafetensorsStream:
    """The stream of an adapter model's weights with its adapter merged (see the module doc).

    Raises:
        NotImplementedError: a sharded LoRA layer this cannot merge (not linear, DoRA, a LoRA bias).
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = getattr(model, "active_adapter", "default")

    def plain(name: str) -> str:
        return name.replace(".base_layer.", ".")

    state: dict[str, torch.Tensor | Deferred] = {
        plain(name): value for name, value in base.state_dict().items() if ".lora_" not in name
    }
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or not holds_adapter(module, adapter):
            continue
        weight: torch.Tensor = module.get_base_layer().weight  # type: ignore[assignment]  # a layer's
        merge = _merged_shards if isinstance(weight, DTensor) else _merged
        if merge is _merged_shards:
            dora = getattr(module, "use_dora", {}).get(adapter, False)
            bias = getattr(module, "lora_bias", {}).get(adapter, False)
            if not isinstance(module, LoraLinear) or dora or bias:
                raise NotImplementedError(
                    f"the adapter's layer {name} ({type(module).__name__}{', DoRA' if dora else ''}"
                    f"{', LoRA bias' if bias else ''}) cannot be merged from sharded ranks for the engine: "
                    "use sharding 'ddp' or engine 'hf'"
                )
        state[f"{name}.weight"] = Deferred(
            tuple(weight.shape), weight.dtype, functools.partial(merge, module, weight, adapter)
        )
    shared = {plain(dropped): plain(kept) for dropped, kept in tied_names(base).items()}
    return SafetensorsStream(state, shared=shared)


def _merged(module: Any, weight: torch.Tensor, adapter: str) -> torch.Tensor:
    """``W + scale * B @ A`` of a layer on one process (peft's ``get_delta_weight``: any LoRA layer type),
    as ``merged_state_dict`` computes it."""
    with torch.no_grad():
        merged: torch.Tensor = weight + module.get_delta_weight(adapter).to(weight.dtype)
    return merged


def _merged_shards(module: Any, weight: torch.Tensor, adapter: str) -> torch.Tensor:
    """``W + scale * B @ A`` from the layer's gathered tensors (in this order on every rank: W, A, B)."""
    from peft.utils.other import transpose

    w, a, b = (
        whole(weight.detach()),
        whole(module.lora_A[adapter].weight.detach()),
        whole(module.lora_B[adapter].weight.detach()),
    )
    cast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    delta = transpose(b @ a, module.fan_in_fan_out) * module.scaling[adapter]
    if cast:
        delta = delta.to(b.dtype)
    merged: torch.Tensor = w + delta.to(w.dtype)
    return merged


def gathered_adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's LoRA tensors under the model's own names (what peft's ``save_pretrained(state_dict=...)``
    takes and filters to the adapter's), gathered whole on every rank (each rank must call it: the gathers
    are collectives).

    Raises:
        NotImplementedError: an adapter that also trains biases (they would be left out).
    """
    config = model.peft_config[getattr(model, "active_adapter", "default")]
    if getattr(config, "bias", "none") != "none":
        raise NotImplementedError(
            f"an adapter that trains biases (bias {config.bias!r}) cannot be synced as a LoRA from sharded "
            "ranks: use sharding 'ddp' or engine 'hf'"
        )
    return {name: whole(t.detach()) for name, t in model.state_dict().items() if ".lora_" in name}
