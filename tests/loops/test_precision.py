"""Mixed precision, checked on CPU where it can be: half precision refused before anything loads on a worker
without CUDA; trained weights load in float32 whatever the checkpoint's dtype, an adapter's frozen base in
the half dtype on a GPU and float32 on a CPU; training forward passes on a CPU under bf16 use SDPA's math
kernel, with the flash kernel's gradients; fp16's dynamic loss scaling (the same update as no scaling,
an overflow skipped with the scale halved), on torch's CPU GradScaler.
The CUDA autocast runs are in tests/loops/test_gpu.py."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import SFT
from trainer.loops import LOOPS
from trainer.loops.session import accumulate_and_step, begin, load_trainable, make_optimizer
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.precision import (
    PrecisionUnsupported,
    autocast,
    cpu_bf16_is_fast,
    frozen_dtype,
    loss_scaler,
)
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import AdapterSpec, parse_spec

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@needs_cpu_only
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_is_refused_before_anything_loads(
    precision: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 on any CPU; bf16 on a CPU without bf16 in hardware (simulated: this one may have AMX)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    spec = parse_spec(
        {
            "algorithm": "sft",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "precision": precision},
        }
    )
    reporter = MemoryReporter()
    with pytest.raises(PrecisionUnsupported, match=rf"precision '{precision}' needs a CUDA GPU"):
        LOOPS["sft"](spec, RunData(train=SFT), reporter, loop_ctx(tiny_cache, tmp_path / "out"))
    assert reporter.phases == [] and reporter.events == []  # refused at start: no model load, no step
    assert not (tmp_path / "out").exists()


@needs_cpu_only
def test_bf16_on_a_cpu_with_bf16_in_hardware_trains_under_autocast_close_to_fp32(
    tiny_cache: Path, tmp_path: Path
) -> None:
    if not cpu_bf16_is_fast():
        pytest.skip("this CPU has neither AMX nor AVX512-BF16")
    losses: dict[str, list[float]] = {}
    for precision in ("fp32", "bf16"):
        spec = parse_spec(
            {
                "algorithm": "sft",
                "model": "tiny:llama-0.4m",
                "dataset_id": str(uuid.uuid4()),
                "hyperparameters": {"max_steps": 4, "batch_size": 4, "log_every": 1, "precision": precision},
            }
        )
        reporter = MemoryReporter()
        result = LOOPS["sft"](spec, RunData(train=SFT), reporter, loop_ctx(tiny_cache, tmp_path / precision))
        assert result.status == "succeeded"
        losses[precision] = [v for _, k, v in reporter.metrics if k == "loss"]
    assert len(losses["bf16"]) == len(losses["fp32"]) == 4
    # bf16 keeps 8 bits of mantissa: the losses differ (autocast ran), by well under 2% here
    assert losses["bf16"] != losses["fp32"]
    for half, full in zip(losses["bf16"], losses["fp32"], strict=True):
        assert abs(half - full) <= 0.02 * abs(full), (losses["bf16"], losses["fp32"])


def test_spec_refuses_an_unknown_precision() -> None:
    with pytest.raises(ValueError, match="precision"):
        parse_spec(
            {
                "algorithm": "sft",
                "model": "tiny:llama-0.4m",
                "dataset_id": str(uuid.uuid4()),
                "hyperparameters": {"precision": "fp8"},
            }
        )


def bf16_checkpoint(tiny_cache: Path, tmp_path: Path) -> Path:
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    folder = tmp_path / "bf16-model"
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_frozen_weights_take_the_half_dtype_on_a_gpu_and_float32_on_a_cpu() -> None:
    assert frozen_dtype("bf16", torch.device("cuda", 0)) == torch.bfloat16
    assert frozen_dtype("fp16", torch.device("cuda")) == torch.float16
    assert frozen_dtype("fp32", torch.device("cuda")) == torch.float32
    assert frozen_dtype("bf16", torch.device("cpu")) == torch.float32


def test_trained_weights_load_in_float32_and_a_cpu_frozen_base_too(tiny_cache: Path, tmp_path: Path) -> None:
    ref = f"run:{uuid.uuid4()}"  # a run's output saved in bf16, as transformers would keep it
    ctx = loop_ctx(tiny_cache, tmp_path / "out", runs={ref: bf16_checkpoint(tiny_cache, tmp_path)})
    full, _ = load_trainable(begin(ctx, MemoryReporter(), ref, 0), precision="bf16")
    assert {p.dtype for p in full.parameters()} == {torch.float32}  # the master copy

    adapter = AdapterSpec(r=4, alpha=8)
    lora, _ = load_trainable(begin(ctx, MemoryReporter(), ref, 0, adapter), precision="bf16")
    trained = {p.dtype for p in lora.parameters() if p.requires_grad}
    frozen = {p.dtype for p in lora.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.float32}  # autocast multiplies in bf16

    lora32, _ = load_trainable(begin(ctx, MemoryReporter(), ref, 0, adapter), precision="fp32")
    assert {p.dtype for p in lora32.parameters()} == {torch.float32}


def tiny_regression() -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1), torch.randn(8, 4), torch.randn(8, 1)


def test_loss_scaling_gives_the_unscaled_update() -> None:
    plain, x, y = tiny_regression()
    scaled = copy.deepcopy(plain)
    opt_plain = make_optimizer(plain, 1e-2, 0.0)
    opt_scaled = make_optimizer(scaled, 1e-2, 0.0, precision="fp16")
    assert loss_scaler(opt_plain) is None and loss_scaler(opt_scaled) is not None
    for _ in range(3):
        norm_plain = accumulate_and_step(plain, opt_plain, [((plain(x) - y) ** 2).mean()], 1.0)
        norm_scaled = accumulate_and_step(scaled, opt_scaled, [((scaled(x) - y) ** 2).mean()], 1.0)
        assert float(norm_scaled) == pytest.approx(float(norm_plain), rel=1e-6)  # unscaled before the clip
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_an_overflowing_gradient_skips_the_step_and_halves_the_scale() -> None:
    model, x, y = tiny_regression()
    optimizer = make_optimizer(model, 1e-2, 0.0, precision="fp16")
    scaler = loss_scaler(optimizer)
    assert scaler is not None
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    # 1e34 x the initial scale 65536 overflows float32 (3.4e38) in the backward: an fp16-style overflow.
    norm = accumulate_and_step(model, optimizer, [1e34 * ((model(x) - y) ** 2).mean()], 1.0)
    assert not torch.isfinite(norm)  # reported as a skipped update, not an error
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    accumulate_and_step(model, optimizer, [((model(x) - y) ** 2).mean()], 1.0)  # the next step applies
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def step_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Gradients of one accumulate_and_step's loss (no update: learning rate 0), and whether SDPA's flash
    kernel was allowed while each forward pass ran."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    flash_allowed: list[bool] = []

    def losses() -> Iterator[torch.Tensor]:
        flash_allowed.append(torch.backends.cuda.flash_sdp_enabled())
        yield model(input_ids=ids, labels=ids).loss

    accumulate_and_step(model, optimizer, losses(), max_grad_norm=1e9)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, flash_allowed


def flash_grads(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the same loss with SDPA's flash kernel, outside a training step."""
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not cpu_bf16_is_fast(), reason="bf16 autocast runs only on a CPU with bf16 in hardware")
def test_cpu_bf16_training_forward_uses_the_math_kernel_with_the_flash_kernels_gradients(
    tiny_cache: Path,
) -> None:
    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    ids = torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(0))
    with autocast("bf16", torch.device("cpu")):
        math, allowed = step_grads(model, ids)
        assert allowed == [False]  # the math kernel inside the step
        assert torch.backends.cuda.flash_sdp_enabled()  # and the default kernels again after it
        flash = flash_grads(model, ids)
    assert flash.keys() == math.keys() and math
    for name in math:  # the same attention in bf16: equal up to bf16 rounding
        torch.testing.assert_close(math[name], flash[name], rtol=0.05, atol=2e-3, msg=name)
    _, allowed32 = step_grads(model, ids)
    assert allowed32 == [True]  # float32 keeps the default kernels
