"""The inference decode loop (trainer/inference/decode.py) against independent references: transformers'
own greedy ``generate``, a full forward pass for the reported log-probs, the softmax for sampled
frequencies, and hand-worked nucleus and stop-string cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.inference.decode import DecodeParams, decode, held_back, top_p_filter
from trainer.models import load_causal_lm, tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tiny_cache: Path) -> tuple[Any, Any]:
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))


def finished(
    model: Any, tokenizer: Any, prompt: list[int], n: int, params: DecodeParams
) -> list[dict[str, Any]]:
    """Every row's concatenated deltas, tokens, log-probs and finish reason."""
    rows = [{"text": "", "tokens": [], "logprobs": [], "finish": None} for _ in range(n)]
    for step in decode(model, tokenizer, prompt, n, params):
        for d in step:
            row = rows[d.index]
            assert row["finish"] is None, "a finished row got another delta"
            row["text"] += d.text
            row["tokens"] += d.token_ids
            row["logprobs"] += d.logprobs
            row["finish"] = d.finish_reason
    return rows


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    # Sorted 0.5, 0.3, 0.15, 0.05: 0.5 + 0.3 = 0.8 reaches 0.8, so two tokens stay, renormalised.
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    # 0.81 needs the third: 0.95 in all.
    assert torch.allclose(top_p_filter(probs, 0.81), torch.tensor([[0.15, 0.5, 0.0, 0.3]]) / 0.95)
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    assert torch.allclose(top_p_filter(probs, 0.01), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_held_back_is_the_longest_tail_that_could_start_a_stop() -> None:
    assert held_back("answer: 4\n", ["\n\n"]) == 1
    assert held_back("answer: 4", ["\n\n"]) == 0
    assert held_back("the EN", ["END", "ENOUGH"]) == 2
    assert held_back("x", []) == 0


def test_greedy_matches_transformers_generate(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = tokenizer("12+30=").input_ids
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )[0, len(prompt) :].tolist()
    expected = out[: out.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in out else out
    (row,) = finished(model, tokenizer, prompt, 1, DecodeParams(max_new_tokens=12, temperature=0))
    assert row["tokens"] == expected
    assert row["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert row["finish"] == ("length" if len(expected) == 12 else "stop")


def test_logprobs_are_the_models_own_for_each_chosen_token(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = tokenizer("7+8=").input_ids
    (row,) = finished(model, tokenizer, prompt, 1, DecodeParams(max_new_tokens=10, temperature=1.3, seed=3))
    assert row["tokens"], "nothing generated"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + row["tokens"]])).logits[0].float()
    full = torch.log_softmax(logits, dim=-1)  # one forward over the whole text, no cache
    expected = [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(row["tokens"])]
    assert row["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_sampled_first_tokens_follow_the_tempered_softmax(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = tokenizer("hello").input_ids
    n, temperature = 4000, 0.7
    rows = finished(
        model, tokenizer, prompt, n, DecodeParams(max_new_tokens=1, temperature=temperature, seed=0)
    )
    firsts = torch.tensor([r["tokens"][0] if r["tokens"] else tokenizer.eos_token_id for r in rows])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, dim=-1)
    counts = torch.bincount(firsts, minlength=probs.numel()).float() / n
    top = probs.topk(5).indices
    # Binomial standard error at n = 4000 is at most 0.008; 4 of them is a loose but failing-capable bound.
    assert torch.allclose(counts[top], probs[top], atol=0.032), (counts[top], probs[top])


def test_a_seed_repeats_and_another_differs(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = tokenizer("abc").input_ids
    params = DecodeParams(max_new_tokens=8, temperature=1.0, seed=11)
    first = finished(model, tokenizer, prompt, 3, params)
    assert finished(model, tokenizer, prompt, 3, params) == first
    other = finished(model, tokenizer, prompt, 3, DecodeParams(max_new_tokens=8, temperature=1.0, seed=12))
    assert [r["tokens"] for r in other] != [r["tokens"] for r in first]


def test_a_stop_string_cuts_the_text_and_is_never_streamed(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = tokenizer("12+30=").input_ids
    (free,) = finished(model, tokenizer, prompt, 1, DecodeParams(max_new_tokens=16, temperature=0))
    assert len(free["text"]) >= 4, free
    stop = free["text"][2:4]  # two characters from the middle of the greedy answer
    cut = free["text"].index(stop)
    deltas = [
        d for step in decode(model, tokenizer, prompt, 1, DecodeParams(16, 0, stop=(stop,))) for d in step
    ]
    text = "".join(d.text for d in deltas)
    assert text == free["text"][:cut]
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"


def test_refusals() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        DecodeParams(top_p=0)
