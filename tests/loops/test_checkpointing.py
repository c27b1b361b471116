"""Activation (gradient) checkpointing: the same losses and gradient norms as the plain path (1e-5) in
every run kind, with and without an adapter; it really checkpoints (the layers run twice per step)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PAIRS, PROMPTS, SFT, VOWEL_REWARD
from trainer.loops import LOOPS
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import GROUP_PRESETS, parse_spec

RL = {
    "prompts_per_step": 2,
    "samples_per_prompt": 4,
    "max_new_tokens": 4,
    "kl_coef": 0.05,
    "dynamic_sampling": False,
}
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], str]] = {
    "sft": ({}, SFT, {"batch_size": 4}, "loss"),
    "dpo": ({}, PAIRS, {"batch_size": 4}, "loss"),
    "reward_model": ({}, PAIRS, {"batch_size": 4}, "loss"),
    "grpo": ({"rewards": VOWEL_REWARD}, PROMPTS, RL, "loss/total"),
    "ppo": ({"rewards": VOWEL_REWARD}, PROMPTS, RL, "loss/value"),
}


def train(algorithm: str, checkpointing: bool, adapter: bool, tiny_cache: Path, out: Path) -> MemoryReporter:
    extra, rows, hp, _ = CASES[algorithm]
    spec = parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "adapter": {"r": 4, "alpha": 8} if adapter else None,
            **extra,
            "hyperparameters": {
                "max_steps": 2,
                "learning_rate": 1e-2,
                "gradient_checkpointing": checkpointing,
                **hp,
            },
        }
    )
    reporter = MemoryReporter()
    assert (
        LOOPS[spec.algorithm](spec, RunData(train=rows), reporter, loop_ctx(tiny_cache, out)).status
        == "succeeded"
    )
    return reporter


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_checkpointing_gives_the_plain_losses(
    algorithm: str, adapter: bool, tiny_cache: Path, tmp_path: Path
) -> None:
    plain = train(algorithm, False, adapter, tiny_cache, tmp_path / "plain")
    ckpt = train(algorithm, True, adapter, tiny_cache, tmp_path / "ckpt")
    key = CASES[algorithm][3]
    assert len(ckpt.series(key)) == 2
    assert ckpt.series(key) == pytest.approx(plain.series(key), abs=1e-5)
    assert ckpt.series("grad_norm") == pytest.approx(plain.series("grad_norm"), abs=1e-5)


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_checkpointing_recomputes_the_blocks_in_the_backward(
    algorithm: str, tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted on each block's MLP (inside the checkpointed layer; the layer's own ``forward`` carries
    transformers' checkpointing wrapper): twice per training forward with checkpointing, once without."""
    from transformers.models.llama import modeling_llama

    calls = {"n": 0}
    real = modeling_llama.LlamaMLP.forward

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", counting)
    counts = []
    for checkpointing in (False, True):
        calls["n"] = 0
        train(algorithm, checkpointing, False, tiny_cache, tmp_path / str(checkpointing))
        counts.append(calls["n"])
    plain, ckpt = counts
    # 2 layers x 2 steps x the training forwards of a step: SFT one; GRPO's preset ppo_epochs x minibatches
    # (2 x 2; dynamic sampling is off, so every step trains on its 8 completions). No-grad passes (final
    # metrics, generation, old log-probs) are never checkpointed, so they count the same.
    updates = (
        1
        if algorithm == "sft"
        else GROUP_PRESETS["grpo"]["ppo_epochs"] * GROUP_PRESETS["grpo"]["minibatches"]
    )
    assert ckpt - plain == 2 * 2 * updates


def test_completion_logits_are_the_full_logits_without_the_prompt_positions(tiny_cache: Path) -> None:
    import torch

    from trainer.completion_logps import completion_logits
    from trainer.data.preference import collate_pairs, tokenize_pair
    from trainer.models import load_causal_lm, tiny_model_dir

    model, tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    rows = [
        {
            "prompt": "the answer to this long question about numbers is " * 3 + f"{a}+{a}=",
            "chosen": str(2 * a),
            "rejected": "no",
        }
        for a in range(3)
    ]
    batch = collate_pairs(
        [tokenize_pair(r, tok, max_length=128, max_prompt_length=100) for r in rows], tok.pad_token_id
    )
    ids, attn, cmask = batch.input_ids, batch.attention_mask, batch.completion_mask
    full = model(input_ids=ids, attention_mask=attn).logits
    logits, targets, mask = completion_logits(model, ids, attn, cmask)
    first = ids.shape[1] - logits.shape[1]  # the earliest scored label position
    assert logits.shape[1] < ids.shape[1] // 2  # most positions are prompt: no LM head there
    torch.testing.assert_close(logits, full[:, first - 1 : -1], atol=1e-5, rtol=1e-5)
    assert torch.equal(targets, ids[:, first:]) and torch.equal(mask, cmask[:, first:])
    assert int(cmask[:, 1:first].sum()) == 0  # nothing scored was left out


def test_rl_log_probs_cover_the_completion_window_with_the_full_logits_values(tiny_cache: Path) -> None:
    import torch

    from trainer.algorithms.logprobs import token_logprobs
    from trainer.loops.rl_common import forward_logps, to_token_batch
    from trainer.models import load_causal_lm, tiny_model_dir
    from trainer.rollout.base import Completion

    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 75))]  # 20, 12, 15 tokens
    answers = [[5, 6, 7], [8, 9], [11, 12, 13, 14]]
    comps = [
        Completion(prompt_index=i, prompt_ids=p, token_ids=a, text="", finish_reason="eos")
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]
    batch = to_token_batch(comps, pad_id=0, device=torch.device("cpu"))
    length = batch.input_ids.shape[1]
    assert batch.offset == 11  # the shortest prompt's last token
    logits, logp = forward_logps(model, batch)
    assert logits.shape[:2] == logp.shape == batch.response_mask.shape == (3, length - 1 - 11)
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    full_logp = token_logprobs(full, batch.input_ids[:, 1:])
    torch.testing.assert_close(logp, full_logp[:, 11:], atol=1e-5, rtol=1e-5)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):  # every generated token is in the window
        cols = batch.response_mask[i].nonzero().flatten().tolist()
        assert [int(batch.input_ids[i, 11 + c + 1]) for c in cols] == a
        assert cols[0] == len(p) - 1 - 11
