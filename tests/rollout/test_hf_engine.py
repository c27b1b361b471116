"""HFEngine on the tiny model: output invariants, left-padding correctness, seeding, greedy vs a hand loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.factory import make_engine
from trainer.rollout.hf_engine import HFEngine

MAX_NEW = 10


def assert_well_formed(
    completions: list[Completion], prompts: list[list[int]], n: int, tokenizer: Any, *, pad_free: bool = True
) -> None:
    """The Completion contract. ``pad_free``: the pad id may also be sampled as a real token (p ~ 1/512 here),
    so "no padding leaked" is checked by value only where the seed is known not to sample it (CPU)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert [c.prompt_index for c in completions] == [i for i in range(len(prompts)) for _ in range(n)]
    for c in completions:
        assert c.prompt_ids == prompts[c.prompt_index]
        assert 1 <= len(c.token_ids) <= MAX_NEW
        assert not pad_free or pad not in c.token_ids
        assert eos not in c.token_ids[:-1]
        if c.finish_reason == "eos":
            assert c.token_ids[-1] == eos
        else:
            assert c.finish_reason == "length"
            assert len(c.token_ids) == MAX_NEW and c.token_ids[-1] != eos
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is None


@pytest.mark.parametrize("batch_size", [64, 4, 2])
def test_sampled_completions_are_well_formed_and_prompt_major(
    eos_prone: tuple[Any, Any], prompts: list[list[int]], batch_size: int
) -> None:
    model, tokenizer = eos_prone
    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    out = engine.generate(prompts, 3, SamplingParams(max_new_tokens=MAX_NEW, seed=0))
    assert len(out) == 3 * len(prompts)
    assert_well_formed(out, prompts, 3, tokenizer)
    # both endings occur, at several lengths, so the checks above exercised both branches
    assert {c.finish_reason for c in out} == {"eos", "length"}
    assert len({len(c.token_ids) for c in out if c.finish_reason == "eos"}) >= 2


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_left_padded_batch_gives_each_prompt_its_own_greedy_completion(
    eos_prone: tuple[Any, Any], prompts: list[list[int]], pad_is_eos: bool
) -> None:
    model, tokenizer = eos_prone
    if pad_is_eos:  # load_causal_lm's fallback for tokenizers without a pad token; generate cannot infer
        tokenizer = copy.deepcopy(
            tokenizer
        )  # the attention mask from the ids then, so the engine's must be used
        tokenizer.pad_token = tokenizer.eos_token
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    batched = engine.generate(prompts, 1, params)
    alone = [engine.generate([p], 1, params)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert {c.finish_reason for c in batched} == {"eos", "length"}


def test_greedy_matches_argmax_loop_by_hand(tiny: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tokenizer = tiny
    steps = 6
    expected: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts[:3]:
            ids = list(prompt)
            for _ in range(steps):  # full forward each step: no cache, no padding, no generate()
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] == tokenizer.eos_token_id:
                    break
            expected.append(ids[len(prompt) :])
    engine = HFEngine(model, tokenizer)
    for params in (
        SamplingParams(max_new_tokens=steps, greedy=True),
        SamplingParams(max_new_tokens=steps, temperature=0),
    ):
        assert [c.token_ids for c in engine.generate(prompts[:3], 1, params)] == expected


def test_greedy_ignores_distribution_settings_from_the_checkpoint(
    tiny: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    # generate() fills unset options from model.generation_config; a checkpoint's repetition penalty would
    # change greedy output (this random model repeats tokens) unless the engine sets it back explicitly.
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    plain = engine.generate(prompts, 1, params)
    assert any(len(set(c.token_ids)) < len(c.token_ids) for c in plain)
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.repetition_penalty = 100.0
        model.generation_config.no_repeat_ngram_size = 1
        assert [c.token_ids for c in engine.generate(prompts, 1, params)] == [c.token_ids for c in plain]
    finally:
        model.generation_config = saved


def test_same_seed_same_samples_and_global_rng_untouched(
    eos_prone: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    model, tokenizer = eos_prone
    engine = HFEngine(model, tokenizer)
    rng_before = torch.get_rng_state()
    first = engine.generate(prompts, 4, SamplingParams(max_new_tokens=MAX_NEW, seed=7))
    again = engine.generate(prompts, 4, SamplingParams(max_new_tokens=MAX_NEW, seed=7))
    other = engine.generate(prompts, 4, SamplingParams(max_new_tokens=MAX_NEW, seed=8))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    # samples of one prompt differ from each other (temperature 1), not just across seeds
    assert len({tuple(c.token_ids) for c in first if c.prompt_index == 1}) > 1


def test_unseeded_call_draws_from_the_global_rng(tiny: tuple[Any, Any], prompts: list[list[int]]) -> None:
    engine = HFEngine(*tiny)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    torch.manual_seed(3)
    first = engine.generate(prompts, 2, params)
    torch.manual_seed(3)
    assert [c.token_ids for c in engine.generate(prompts, 2, params)] == [c.token_ids for c in first]
    assert [c.token_ids for c in engine.generate(prompts, 2, params)] != [c.token_ids for c in first]


@pytest.mark.parametrize("training", [True, False])
def test_training_flag_is_restored(tiny: tuple[Any, Any], prompts: list[list[int]], training: bool) -> None:
    model, tokenizer = tiny
    model.train(training)
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        HFEngine(model, tokenizer).generate(prompts[:2], 2, SamplingParams(max_new_tokens=3, seed=0))
    finally:
        hook.remove()
        flags_after = {m.training for m in model.modules()}
        model.eval()
    assert seen and not any(seen)  # every forward pass ran in eval mode
    assert flags_after == {training}  # the model and all its submodules are back as they were


def test_argument_checks(tiny: tuple[Any, Any]) -> None:
    engine = HFEngine(*tiny)
    assert engine.generate([], 3, SamplingParams()) == []
    with pytest.raises(ValueError, match="n must be"):
        engine.generate([[5]], 0, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(*tiny, batch_size=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_sync_weights_keeps_or_replaces_the_model(tiny: tuple[Any, Any], eos_prone: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    engine = make_engine("hf", model=model, tokenizer=tokenizer, model_path="unused")
    assert isinstance(engine, HFEngine)
    engine.sync_weights(model)
    assert engine.model is model
    engine.sync_weights(eos_prone[0])
    assert engine.model is eos_prone[0]


def test_make_engine_rejects_unknown_names(tiny: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="known: hf, vllm"):
        make_engine("sglang", model=tiny[0], tokenizer=tiny[1], model_path="x")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_cuda(tiny: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tokenizer = tiny
    gpu_model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    engine = HFEngine(gpu_model, tokenizer)
    assert engine.device.type == "cuda"
    cuda_rng = torch.cuda.get_rng_state()
    first = engine.generate(prompts, 3, SamplingParams(max_new_tokens=MAX_NEW, seed=1))
    again = engine.generate(prompts, 3, SamplingParams(max_new_tokens=MAX_NEW, seed=1))
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert_well_formed(first, prompts, 3, tokenizer, pad_free=False)
    greedy = engine.generate(prompts, 1, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))
    assert_well_formed(greedy, prompts, 1, tokenizer, pad_free=False)


def llama_on_meta(layers: int, heads: int, kv_heads: int, hidden: int, vocab: int, **config: Any) -> Any:
    """A Llama of that shape with no weights behind it (the meta device): its shape and dtype only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    with torch.device("meta"):
        return LlamaForCausalLM(
            LlamaConfig(**shape, hidden_size=hidden, vocab_size=vocab, intermediate_size=64, **config)
        )


def test_chunks_grow_past_64_rows_only_while_they_fit_1_gib() -> None:
    """``chunk_rows`` by hand: a row costs its KV cache, 2 (keys, values) x layers x kv heads x head dim x
    dtype size a token, plus a decode step's 4 float32 vocabulary-sized tensors; rows = 2**30 // that,
    within [64, 512]."""
    from trainer.rollout.hf_engine import chunk_rows

    # the demo's model (tiny:llama-char-0.4m's shape): 2 x 2 x 4 x 32 x 4 = 2,048 B a token, 12-token rows:
    # 2**30 // (24,576 + 1,600) = 41,020 rows, capped at 512
    demo = llama_on_meta(2, 4, 4, 128, 100)
    assert 2**30 // (2_048 * 12 + 4 * 100 * 4) == 41_020 and chunk_rows(demo, 12) == 512
    # SmolLM2-135M's shape (grouped queries: 3 kv heads of 64): 2 x 30 x 3 x 64 x 4 = 46,080 B a token,
    # 124-token rows, a 49,152-token vocabulary
    smol = llama_on_meta(30, 9, 3, 576, 49_152)
    assert chunk_rows(smol, 124) == 2**30 // (46_080 * 124 + 16 * 49_152) == 165
    # a small cache and a large vocabulary (262,144): the decode step's tensors halve the rows
    wide = llama_on_meta(18, 4, 1, 640, 262_144, head_dim=256)
    assert chunk_rows(wide, 128) == 2**30 // (2 * 18 * 256 * 4 * 128 + 16 * 262_144) == 120
    # Llama-2-7B's shape in bf16, 1,536-token rows: 768 MiB of cache a row, so the floor of 64 rows holds
    big = llama_on_meta(32, 32, 32, 4096, 64).to(torch.bfloat16)
    assert 2 * 32 * 32 * 128 * 2 * 1_536 == 768 * 2**20
    assert chunk_rows(big, 1_536) == 64
    assert chunk_rows(torch.nn.Linear(2, 2), 12) == 64  # no config to size the cache by

    # a 4-bit base's packed uint8 weights do not size its cache: its floating-point layers' dtype does
    class Packed(torch.nn.Module):  # SmolLM2's shape in bf16 behind a first weight packed in uint8
        def __init__(self) -> None:
            super().__init__()
            self.packed = torch.nn.Parameter(torch.empty(8, dtype=torch.uint8), requires_grad=False)
            self.inner = llama_on_meta(30, 9, 3, 576, 49_152).to(torch.bfloat16)
            self.config = self.inner.config

    packed = Packed()
    assert next(packed.parameters()).dtype == torch.uint8
    assert chunk_rows(packed, 124) == 2**30 // (23_040 * 124 + 16 * 49_152) == 294  # 484 if sized by uint8


def test_default_chunks_give_the_completions_of_small_ones(
    eos_prone: tuple[Any, Any], prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """90 rows in one call (the default for the tiny model; 64 rows a call before) sample what calls of 2
    rows sample: each row draws from its own seeded stream, and padding to a longer prompt changes nothing.
    Sharded ranks generating in step (``synced_gpus``) keep 64 rows a call whatever their prompts."""
    model, tokenizer = eos_prone
    many = prompts * 6  # 30 prompts x 3 samples
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=0)
    calls: list[int] = []
    chunk = HFEngine._generate_chunk

    def counted(self: HFEngine, prompts: list[list[int]], n: int, *args: Any) -> list[Completion]:
        calls.append(len(prompts) * n)
        return chunk(self, prompts, n, *args)

    monkeypatch.setattr(HFEngine, "_generate_chunk", counted)
    default = HFEngine(model, tokenizer).generate(many, 3, params)
    assert calls == [90]
    small = HFEngine(model, tokenizer, batch_size=2).generate(many, 3, params)
    assert [(c.token_ids, c.finish_reason) for c in default] == [
        (c.token_ids, c.finish_reason) for c in small
    ]

    calls.clear()
    monkeypatch.setattr(HFEngine, "_generate_chunk", lambda self, p, n, *a: calls.append(len(p) * n) or [])
    HFEngine(model, tokenizer, synced_gpus=True).generate(many, 3, params)
    assert calls == [63, 27]  # 21 prompts of 3 rows, then the rest
