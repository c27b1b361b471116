"""LoRA adapters (peft) in every run kind on the tiny model: only the adapter (and a score head) trains,
the reference is the model with its adapter off, checkpoints hold the adapter and resume exactly, a
`run:` reference to an adapter run loads base + adapter, and QLoRA is refused on a worker without CUDA."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PAIRS, PROMPTS, SFT, VOWEL_REWARD
from trainer.adapters import BASE_FILE, is_adapter_folder, load_adapter
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, load_reward_model, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

RL = {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4, "kl_coef": 0.05}
ADAPTER = {"r": 4, "alpha": 8}

CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]] = {
    "sft": ({}, SFT, {"batch_size": 4}),
    "dpo": ({}, PAIRS, {"batch_size": 4}),
    "reward_model": ({}, PAIRS, {"batch_size": 4}),
    "grpo": ({"rewards": VOWEL_REWARD}, PROMPTS, RL),
    "ppo": ({"rewards": VOWEL_REWARD}, PROMPTS, RL),
}


def spec(algorithm: str, adapter: dict[str, Any] | None = ADAPTER, **hp: Any) -> Any:
    extra, _, base_hp = CASES[algorithm]
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "adapter": adapter,
            **extra,
            "hyperparameters": {"max_steps": 2, "learning_rate": 1e-2, **base_hp, **hp},
        }
    )


def run(s: Any, algorithm: str, tiny_cache: Path, out: Path, **ctx: Any) -> tuple[Any, MemoryReporter]:
    reporter = MemoryReporter()
    result = LOOPS[s.algorithm](
        s, RunData(train=CASES[algorithm][1]), reporter, loop_ctx(tiny_cache, out, **ctx)
    )
    return result, reporter


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_an_adapter_run_trains_only_the_adapter_and_saves_it(
    algorithm: str, tiny_cache: Path, tmp_path: Path
) -> None:
    result, reporter = run(spec(algorithm, micro_batch_size=2), algorithm, tiny_cache, tmp_path)
    assert result.status == "succeeded"
    folder = result.output_path
    assert is_adapter_folder(folder) and (folder / BASE_FILE).exists()
    assert not (folder / "model.safetensors").exists()  # the adapter only, not a copy of the model
    base_dir = tiny_model_dir("llama-0.4m", tiny_cache)
    loader = load_reward_model if algorithm == "reward_model" else load_causal_lm
    torch.manual_seed(0)
    base, _ = loader(str(base_dir))
    torch.manual_seed(0)
    tuned, _ = loader(str(folder))  # a run: reference: base + adapter, merged
    changed = [
        n
        for (n, a), (_, b) in zip(base.named_parameters(), tuned.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert changed, "the adapter learned nothing"
    # The merge touches only the adapted linear layers (and the trained score head): never embeddings/norms.
    assert all(("proj" in n) or n.startswith("score") for n in changed), changed
    assert all(math.isfinite(v) for v in reporter.series("grad_norm"))


def test_dpo_reference_is_the_model_with_its_adapter_off(tiny_cache: Path, tmp_path: Path) -> None:
    for mode in ("lazy", "precompute"):
        _, reporter = run(spec("dpo", reference_mode=mode), "dpo", tiny_cache, tmp_path / mode)
        # A fresh adapter is zero: the policy equals the reference, so the first loss is log 2.
        assert reporter.series("loss")[0] == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.parametrize("algorithm", ["dpo", "ppo"])
def test_adapter_resume_matches_an_uninterrupted_run(
    algorithm: str, tiny_cache: Path, tmp_path: Path
) -> None:
    s = spec(algorithm, max_steps=4, checkpoint_every=2, keep_last_checkpoints=5)
    straight, _ = run(s, algorithm, tiny_cache, tmp_path / "a")
    first = MemoryReporter(stop_after=3)
    LOOPS[s.algorithm](s, RunData(train=CASES[algorithm][1]), first, loop_ctx(tiny_cache, tmp_path / "b"))
    resumed, _ = run(s, algorithm, tiny_cache, tmp_path / "b", resume_from=first.checkpoints[2])
    base, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    a = load_adapter(base, straight.output_path, trainable=False)
    a_state = {n: p.clone() for n, p in a.named_parameters() if "lora" in n}
    base2, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    b = load_adapter(base2, resumed.output_path, trainable=False)
    b_state = {n: p for n, p in b.named_parameters() if "lora" in n}
    assert a_state.keys() == b_state.keys() and a_state
    for name, value in a_state.items():
        assert torch.equal(value, b_state[name]), name


def test_a_run_can_start_from_an_adapter_run(tiny_cache: Path, tmp_path: Path) -> None:
    first, _ = run(spec("sft"), "sft", tiny_cache, tmp_path / "sft")
    ref = f"run:{uuid.uuid4()}"
    chained = spec("dpo").model_copy(update={"model": ref})
    second, reporter = run(chained, "dpo", tiny_cache, tmp_path / "dpo", runs={ref: first.output_path})
    assert second.status == "succeeded"
    assert reporter.series("loss")[0] == pytest.approx(math.log(2), abs=1e-5)  # reference = the SFT model
    model, _ = load_causal_lm(str(second.output_path))  # base -> SFT adapter (merged) -> DPO adapter
    sft_model, _ = load_causal_lm(str(first.output_path))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), sft_model.parameters(), strict=True))


def test_qlora_is_refused_at_start_on_a_worker_without_cuda(tiny_cache: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this worker has CUDA")
    with pytest.raises(RuntimeError, match=r"quantize '4bit' \(QLoRA\) needs a CUDA GPU"):
        run(spec("sft", adapter={**ADAPTER, "quantize": "4bit"}), "sft", tiny_cache, tmp_path)


@pytest.mark.parametrize(
    ("tied", "targets"),
    [(False, "all-linear"), (True, "all-linear"), (False, ["embed_tokens", "q_proj"])],
    ids=["untied", "tied", "embedding"],
)
def test_the_merged_state_dict_is_peft_merge_and_unload_without_changing_the_model(
    tiny_cache: Path, tied: bool, targets: str | list[str]
) -> None:
    import copy

    from tests.factories import lora_policy
    from trainer.adapters import merged_state_dict

    base, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    if tied:
        base.config.tie_word_embeddings = True
        base.tie_weights()
    original = {n: v.clone() for n, v in base.state_dict().items()}
    policy = lora_policy(base, seed=0, std=0.2, params="lora_", targets=targets)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()  # peft's own merge
    if tied:
        reference.pop("lm_head.weight")  # one tensor under two names: written once
    got = merged_state_dict(policy)
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        assert torch.allclose(got[name], value, atol=1e-6), name
    moved = [n for n in got if "q_proj" in n or (targets != "all-linear" and "embed_tokens" in n)]
    assert all(not torch.equal(got[n], original[n]) for n in moved)  # the adapter is in
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
