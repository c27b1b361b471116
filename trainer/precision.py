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
the half dtype: no master copy is needed for them, and a 7B base then takes 14 GB instead of 28.

On a worker without CUDA a half precision is refused when the run starts (``check_precision``): CPU
autocast exists but is slower than float32 on most CPUs and its bf16 numerics differ from the GPU's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal
from weakref import WeakKeyDictionary

import torch

Precision = Literal["fp32", "bf16", "fp16"]
HALF_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

_LOSS_SCALERS: WeakKeyDictionary[torch.optim.Optimizer, torch.amp.GradScaler] = WeakKeyDictionary()


class PrecisionUnsupported(ValueError):
    """The run asks for a precision this worker cannot give; raised before anything is loaded."""


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a half precision on a device without CUDA (or bf16 on a GPU without bf16), with the reason."""
    if precision == "fp32":
        return
    if device.type != "cuda":
        raise PrecisionUnsupported(
            f"precision {precision!r} needs a CUDA GPU and this worker has none "
            "(torch.cuda.is_available() is False); mixed precision is a GPU feature here: use "
            "precision 'fp32' or send the run to a GPU worker's queue"
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
    with torch.autocast(device_type=device.type, dtype=HALF_DTYPES[precision]):
        yield


def frozen_dtype(precision: str) -> torch.dtype:
    """The dtype a model that never trains loads in: the half dtype under mixed precision, else float32."""
    return HALF_DTYPES.get(precision, torch.float32)


def enable_loss_scaling(optimizer: torch.optim.Optimizer, precision: str, device: torch.device) -> None:
    """Give ``optimizer`` a dynamic loss scaler when ``precision`` is fp16 (``loss_scaler`` finds it)."""
    if precision == "fp16":
        _LOSS_SCALERS[optimizer] = torch.amp.GradScaler(device.type)


def loss_scaler(optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler | None:
    """The loss scaler of ``optimizer`` (fp16 runs), else None."""
    return _LOSS_SCALERS.get(optimizer)
