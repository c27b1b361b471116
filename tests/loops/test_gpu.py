"""GPU checks (skipped without CUDA): a GRPO step with the HF engine in bf16, QLoRA DPO, and bf16/fp16
autocast runs of SFT and DPO against fp32."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from trainer.algorithms.advantages import ADVANTAGES, OutcomeBatch
from trainer.data.prompts import tokenize_prompts
from trainer.data.sampling import EpochSampler
from trainer.loops.group_rl import policy_update
from trainer.loops.rl_common import frozen_logps, to_token_batch
from trainer.loops.rollouts import build_reward, collect_rollouts
from trainer.loops.session import make_optimizer
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.hf_engine import HFEngine
from trainer.specs import parse_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_grpo_step_in_bf16_on_cuda(tiny_cache: Path) -> None:
    device = torch.device("cuda")
    policy, tokenizer = load_causal_lm(str(tiny_model_dir("llama-10m", tiny_cache)))
    policy.to(device, dtype=torch.bfloat16)
    spec = parse_spec(
        {
            "algorithm": "grpo",
            "model": "tiny:llama-10m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "numeric"}],
            "hyperparameters": {
                "prompts_per_step": 8,
                "samples_per_prompt": 8,
                "max_new_tokens": 32,
                "kl_coef": 0.0,
                "learning_rate": 1e-4,
            },
        }
    )
    hp = spec.hyperparameters
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(8) for b in range(8)]
    prompts = tokenize_prompts(rows, tokenizer, hp.max_prompt_length)
    engine = HFEngine(policy, tokenizer, device=device)
    optimizer = make_optimizer(policy, hp.learning_rate, hp.weight_decay)
    gen = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in policy.parameters()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ro = collect_rollouts(
        engine,
        prompts,
        EpochSampler(len(rows), hp.prompts_per_step, gen),
        build_reward(spec.rewards, str, device),
        hp,
        greedy_baseline=False,
        seed=0,
    )
    t_gen = time.perf_counter() - t0
    batch = to_token_batch(ro.completions, tokenizer.pad_token_id, device)
    old = frozen_logps(policy, batch)
    adv = ADVANTAGES["grpo"](
        OutcomeBatch(
            scores=torch.tensor(ro.total, device=device),
            group_ids=torch.tensor(ro.prompt_index, device=device),
        )
    )
    stats = policy_update(policy, optimizer, batch, old, None, adv, batch.response_mask, hp, 0.0, gen)
    torch.cuda.synchronize()
    t_step = time.perf_counter() - t0
    print(  # noqa: T201 - the step time is what a GPU run of this test is for
        f"GPU GRPO step (bf16, 10m model, 64 completions x {hp.max_new_tokens} tokens): "
        f"{t_step:.3f} s ({t_gen:.3f} s generation)"
    )
    assert torch.isfinite(stats["loss/total"])
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_qlora_dpo_steps_on_cuda(tiny_cache: Path, tmp_path: Path) -> None:
    """QLoRA: a DPO run on a 4-bit NF4 base with a LoRA adapter (bitsandbytes), two steps, adapter saved;
    the reference is the quantized base with the adapter off, so the first loss is log 2."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs the qlora extra: pip install -e '.[qlora]'")
    import math

    from tests.loop_context import loop_ctx
    from trainer.adapters import is_adapter_folder
    from trainer.loops.dpo import run_dpo
    from trainer.reporting import MemoryReporter, RunData

    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-10m",
            "dataset_id": str(uuid.uuid4()),
            "adapter": {"r": 8, "alpha": 16, "quantize": "4bit"},
            "hyperparameters": {
                "max_steps": 2,
                "batch_size": 8,
                "micro_batch_size": 4,
                "learning_rate": 1e-4,
            },
        }
    )
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(6)
        for b in range(6)
    ]
    reporter = MemoryReporter()
    t0 = time.perf_counter()
    result = run_dpo(spec, RunData(train=rows), reporter, loop_ctx(tiny_cache, tmp_path))
    print(f"GPU QLoRA DPO, 2 steps on tiny:llama-10m (4-bit base): {time.perf_counter() - t0:.2f} s")  # noqa: T201
    assert result.status == "succeeded" and is_adapter_folder(result.output_path)
    assert reporter.series("loss")[0] == pytest.approx(math.log(2), abs=1e-2)  # 4-bit compute: looser
    assert all(math.isfinite(v) for v in reporter.series("grad_norm"))


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_track_fp32_on_cuda(
    algorithm: str, precision: str, tiny_cache: Path, tmp_path: Path
) -> None:
    """Autocast runs (float32 master weights; fp16 with loss scaling) follow the fp32 run's losses, and an
    adapter trains over a base loaded in the half dtype (the dtypes are checked on CPU, test_precision.py)."""
    from tests.loop_context import loop_ctx
    from tests.loops.addition_rows import PAIRS, SFT
    from trainer.loops import LOOPS
    from trainer.reporting import MemoryReporter, RunData

    def run(prec: str, adapter: dict[str, int] | None) -> MemoryReporter:
        spec = parse_spec(
            {
                "algorithm": algorithm,
                "model": "tiny:llama-10m",
                "dataset_id": str(uuid.uuid4()),
                "adapter": adapter,
                "hyperparameters": {
                    "max_steps": 5,
                    "batch_size": 8,
                    "learning_rate": 1e-4,
                    "precision": prec,
                },
            }
        )
        reporter = MemoryReporter()
        rows = SFT if algorithm == "sft" else PAIRS
        ctx = loop_ctx(tiny_cache, tmp_path / f"{prec}-{adapter}")
        result = LOOPS[algorithm](spec, RunData(train=rows), reporter, ctx)
        assert result.status == "succeeded"
        return reporter

    fp32, half = run("fp32", None), run(precision, None)
    assert half.series("loss") == pytest.approx(fp32.series("loss"), rel=5e-2, abs=5e-2)
    lora = run(precision, {"r": 8, "alpha": 16})
    assert all(v == v for v in lora.series("loss"))  # finite: the adapter trains over a half base


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_nccl_ranks_make_the_one_gpu_updates(
    algorithm: str, sharding: str, tiny_cache: Path, tmp_path: Path
) -> None:
    """The multi-rank path on GPUs: 2 ranks with NCCL, one GPU each, follow the one-GPU run of the same
    global batch (the CPU gloo version, to 1e-5, is tests/loops/test_distributed.py). GRPO's rollouts are
    the one GPU's at step 1; later a sampled token may flip on kernel-level float noise (GPU matmuls
    depend on the batch shape), so only the first step is held to the one-GPU value."""
    import functools

    from tests.loop_context import loop_ctx
    from tests.loops.addition_rows import PAIRS, PROMPTS, VOWEL_REWARD
    from tests.loops.rank_helpers import memory_reporter, metrics_and_result, rank_context
    from trainer.loops import LOOPS
    from trainer.rank_launch import RankJob, launch
    from trainer.reporting import MemoryReporter, RunData

    online = algorithm == "grpo"
    hp = (
        {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 6} if online else {"batch_size": 8}
    )
    spec = {
        "algorithm": algorithm,
        "model": "tiny:llama-10m",
        "dataset_id": str(uuid.uuid4()),
        **({"rewards": VOWEL_REWARD} if online else {}),
        "hyperparameters": {"max_steps": 10, "learning_rate": 1e-4, **hp},
    }
    data = RunData(train=PROMPTS if online else PAIRS)
    one = MemoryReporter()
    LOOPS[algorithm](parse_spec(spec), data, one, loop_ctx(tiny_cache, tmp_path / "one"))
    job = RankJob(
        spec=spec,
        data=data,
        context=functools.partial(rank_context, str(tiny_cache), str(tmp_path / "two")),
        reporter=memory_reporter,
        collect=metrics_and_result,
        sharding=sharding,  # type: ignore[arg-type]
    )
    t0 = time.perf_counter()
    two = launch(job, 2)
    seconds = time.perf_counter() - t0
    print(f"2 NCCL ranks ({sharding}), 10 {algorithm} steps on tiny:llama-10m: {seconds:.1f} s")  # noqa: T201
    key = "loss/total" if online else "loss"
    losses = [v for _, k, v in two["metrics"] if k == key]
    assert two["status"] == "succeeded" and len(losses) == 10
    if online:
        assert losses[0] == pytest.approx(one.series(key)[0], abs=1e-4)
        assert all(v == v for v in losses)
    else:
        assert losses == pytest.approx(one.series(key), abs=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_model_sharded_over_two_gpus_streams_to_the_engine_a_parameter_at_a_time(tmp_path: Path) -> None:
    """The engine sync of an FSDP2 policy with NCCL (the gloo version: tests/rollout/
    test_safetensors_stream.py): each parameter gathered on the GPUs when the stream reaches it, the bytes
    those of ``save_model`` on the unsharded model, one host or two, and a send cut short."""
    from tests.rollout.sharded_stream_ranks import stream_on_rank
    from tests.rollout.test_safetensors_stream import on_two_ranks

    on_two_ranks(stream_on_rank, tmp_path, "nccl")
    expected = (tmp_path / "expected.safetensors").read_bytes()
    for name in ("rank0-one-host", "rank0-two-hosts", "rank1-two-hosts"):
        assert (tmp_path / f"{name}.safetensors").read_bytes() == expected, name
