"""Mixed precision: the dtype forward passes compute in, the dtype models load in, fp16's loss scaling.

``precision: "bf16" | "fp16"`` runs every forward pass of a run under ``torch.autocast`` on CUDA: matmuls
and attention in half precision, softmax, norms and reductions in float32 (torch's autocast op lists),
while the weights being trained and the optimizer state stay float32 (master weights). Half-precision
matmuls run several times faster on tensor cores and halve activation memory; the float32 master copy
keeps small updates from rounding away (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.1).

fp16's narrow exponent range underflows small gradients, so its losses are scaled before the backward and
the gradients unscaled before clipping (``torch.amp.GradScaler``: a dynamic scale, halved and the step
skipped when a gradient overflows, doubled after 2000 clean steps; Micikevicius et al. sec. 3.2). bf16 has
float32's exponent range and needs no scaling.

Weights that never train (the frozen base under an adapter, a DPO or RL reference model) load directly in
the half dtype on a GPU: no master copy is needed for them, and a 7B base then takes 14 GB instead of 28.

On a worker without CUDA, bf16 runs under CPU autocast where the CPU computes bf16 in hardware (Intel AMX
or AVX512-BF16: ``cpu_bf16_is_fast``), and is refused elsewhere, as fp16 is on every CPU
(``check_precision``, when the run starts): emulated half precision is slower than float32. Measured on
this machine's AMX (2026-12-05, ``bench/real_model.py``'s model): 2048x2048 matmuls at 2.69 TFLOPS in bf16
against 0.35 in float32; SmolLM2-135M's forward and backward over 32 x 110 tokens 7.1 s against 13.3 s.
Two CPU exceptions, both measured there (SmolLM2-135M + LoRA r16, 16-32 rows x 140 tokens, 2 cores):

- frozen weights stay float32 on a CPU (``frozen_dtype``): with a bf16 base every elementwise op (norms,
  activations, the adapter's sum) runs in bf16, which the CPU does not vectorise as it does float32 (the
  matmuls run in bf16 under autocast either way). No-grad forward 4.2 s (bf16 base) against 1.9 s (float32
  base); forward + backward 6.4 s against 4.0 s.
- forward passes that will be backpropagated use SDPA's math kernel (``training_attention``): torch's CPU
  flash-attention kernel is fast forward but its bf16 backward took 31% of a training step (1.1 s of 3.5 s
  against 0.08 s forward); forward + backward 3.9 s with it against 3.2 s with the math kernel. A GRPO step
  of ``bench/real_model.py`` (8 x 4 completions, 2 epochs x 2 minibatches, KL to the adapter-off
  reference): its update 27.4 s -> 14.1 s with both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal
from weakref import WeakKeyDictionary

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

Precision = Literal["fp32", "bf16", "fp16"]
HALF_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

_LOSS_SCALERS: WeakKeyDictionary[torch.optim.Optimizer, torch.amp.GradScaler] = WeakKeyDictionary()


class PrecisionUnsupported(ValueError):
    """The run asks for a precision this worker cannot give; raised before anything is loaded."""


def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), so that bf16 autocast is
    faster than float32 here (torch's own CPU capability checks)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a half precision this worker would run slower than float32 (fp16 without CUDA, bf16 on a CPU
    without AMX or AVX512-BF16, bf16 on a GPU without bf16), with the reason."""
    if precision == "fp32":
        return
    if device.type != "cuda":
        if precision == "bf16" and cpu_bf16_is_fast():
            return
        needs = (
            "a CUDA GPU or a CPU with AMX or AVX512-BF16 (bf16 in hardware), and this worker has neither"
            if precision == "bf16"
            else "a CUDA GPU, and this worker has none"
        )
        raise PrecisionUnsupported(
            f"precision {precision!r} needs {needs} (torch.cuda.is_available() is False): use precision "
            "'fp32' or send the run to a GPU worker's queue"
        )
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise PrecisionUnsupported(
            f"precision 'bf16' needs a GPU with bfloat16 support (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none: use precision 'fp16'"
        )


@contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Forward passes inside compute in ``precision`` (nothing changes for fp32)."""
    if precision not in HALF_DTYPES:
        yield
        return
    # No weight-cast cache: the whole run is one autocast region, and torch keeps a cached half copy of
    # each trainable weight until the outermost region exits, so after an optimizer step the forward
    # passes would still see the step-0 weights (measured: a bf16 SFT run's loss stuck near its start).
    with torch.autocast(device_type=device.type, dtype=HALF_DTYPES[precision], cache_enabled=False):
        yield


def frozen_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype a model that never trains loads in: the half dtype under mixed precision on a GPU, else
    float32 (on a CPU autocast still multiplies in bf16, and float32 elementwise ops are faster there:
    module docstring)."""
    if device.type == "cpu":
        return torch.float32
    return HALF_DTYPES.get(precision, torch.float32)


@contextmanager
def training_attention(device: torch.device) -> Iterator[None]:
    """Inside: forward passes to be backpropagated on a CPU under half-precision autocast use SDPA's math
    kernel, whose backward is faster there than the flash kernel's (module docstring). Elsewhere (a GPU,
    float32) nothing changes. The choice is process-wide while inside (torch's ``sdpa_kernel``), so keep
    only training forward passes in it."""
    if device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        yield
        return
    with sdpa_kernel([SDPBackend.MATH]):
        yield


def enable_loss_scaling(optimizer: torch.optim.Optimizer, precision: str, device: torch.device) -> None:
    """Give ``optimizer`` a dynamic loss scaler when ``precision`` is fp16 (``loss_scaler`` finds it)."""
    if precision == "fp16":
        _LOSS_SCALERS[optimizer] = torch.amp.GradScaler(device.type)


def loss_scaler(optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler | None:
    """The loss scaler of ``optimizer`` (fp16 runs), else None."""
    return _LOSS_SCALERS.get(optimizer)
