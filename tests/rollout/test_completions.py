"""The pure pieces of the HF engine on hand-made tensors: padding, cutting at EOS, generate's kwargs."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import completions_from_generate, generate_kwargs, left_pad

PAD, EOS = 0, 2


class StubTokenizer:
    """Decodes ids to "a.b.c", dropping special ids when asked, so tests can see what was decoded."""

    def batch_decode(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        special = {PAD, EOS} if skip_special_tokens else set()
        return [".".join(str(t) for t in seq if t not in special) for seq in seqs]


def test_left_pad_right_aligns_prompts() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_cuts_at_first_eos_keeps_it_and_strips_padding() -> None:
    prompts = [[5, 6, 7], [8, 9]]
    sequences = torch.tensor(
        [
            [5, 6, 7, 10, EOS, PAD, PAD],  # p0s0: stops after one token
            [5, 6, 7, 11, 12, 13, 14],  # p0s1: no EOS -> all 4 tokens, "length"
            [PAD, 8, 9, EOS, PAD, PAD, PAD],  # p1s0: EOS first
            [
                PAD,
                8,
                9,
                PAD,
                15,
                EOS,
                EOS,
            ],  # p1s1: a sampled pad id before EOS is a real token; cut at 1st EOS
        ]
    )
    out = completions_from_generate(sequences, prompts, 2, 3, EOS, PAD, StubTokenizer())
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]
    assert [c.prompt_ids for c in out] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert [c.token_ids for c in out] == [[10, EOS], [11, 12, 13, 14], [EOS], [PAD, 15, EOS]]
    assert [c.finish_reason for c in out] == ["eos", "length", "eos", "eos"]
    assert [c.text for c in out] == ["10", "11.12.13.14", "", "15"]
    assert all(c.logprobs is None for c in out)


def test_pad_equal_to_eos_is_handled_by_position() -> None:
    # tokenizers without a pad token pad with EOS (load_causal_lm's fallback)
    sequences = torch.tensor([[EOS, 5, 9, EOS, EOS], [6, 7, EOS, EOS, EOS], [6, 7, 3, 4, 1]])
    out = completions_from_generate(sequences, [[5], [6, 7], [6, 7]], 1, 2, EOS, EOS, StubTokenizer())
    assert [c.token_ids for c in out] == [[9, EOS], [EOS], [3, 4, 1]]
    assert [c.finish_reason for c in out] == ["eos", "eos", "length"]


def test_rejects_misaligned_rows() -> None:
    tok = StubTokenizer()
    right_padded = torch.tensor([[5, 6, 7, 10], [8, PAD, PAD, 11]])
    with pytest.raises(ValueError, match="row 1 does not start with prompt 1"):
        completions_from_generate(right_padded, [[5, 6, 7], [8]], 1, 3, EOS, PAD, tok)
    with pytest.raises(ValueError, match="expected 2 prompts x 2 = 4 rows, got 2"):
        completions_from_generate(right_padded, [[5, 6, 7], [8]], 2, 3, EOS, PAD, tok)


def test_generate_kwargs_decode_greedily_with_neutral_settings() -> None:
    """generate's own sampling is off for a sampled call too (HFEngine adds the row-keyed processors), and
    every setting that would reshape the distribution is given neutral, over the checkpoint's config."""
    for params in (SamplingParams(max_new_tokens=5, temperature=0.0, top_k=7), SamplingParams(top_p=0.9)):
        kwargs = generate_kwargs(params, eos_id=EOS, pad_id=PAD)
        assert kwargs["do_sample"] is False
        assert {"temperature", "top_p", "top_k"}.isdisjoint(kwargs)  # unused by greedy; setting them warns
        assert kwargs["eos_token_id"] == EOS and kwargs["pad_token_id"] == PAD
        assert kwargs["repetition_penalty"] == 1.0 and kwargs["num_beams"] == 1
    assert generate_kwargs(SamplingParams(max_new_tokens=5), eos_id=EOS, pad_id=PAD)["max_new_tokens"] == 5
