"""Row-keyed sampling: it draws from the tempered, truncated distribution (frequencies against probabilities
worked out by hand), and a prompt's samples do not depend on the batch around it (chunk size, or a split of
the prompts with their first global row, as ranks do)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.row_sampling import RowNoise, row_processors, row_seed

MAX_NEW = 10


def test_draws_follow_the_tempered_top_k_top_p_distribution() -> None:
    """Logits T*log(w) give probabilities w after temperature T. w = (.40 .25 .15 .10 .06 .04): top_k=4
    keeps the first four (sum .90); top_p=0.8 then keeps the smallest head reaching 0.8 of those,
    .40+.25+.15 = .80 of .90 (the first three, 0.889), so the draws follow (.40 .25 .15)/.80 =
    (.5, .3125, .1875) and tokens 3, 4, 5 never come."""
    temperature, w = 0.7, torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    rows, steps = 3000, 4
    params = SamplingParams(temperature=temperature, top_k=4, top_p=0.8, seed=11)
    processors = row_processors(params, range(rows), torch.device("cpu"))
    logits = (temperature * w.log()).expand(rows, -1)
    counts = torch.zeros(6)
    for _ in range(steps):  # each call is one decoding step of every row's stream
        scores = logits.clone()
        for p in processors:
            scores = p(torch.zeros(rows, 1, dtype=torch.long), scores)
        counts += torch.bincount(scores.argmax(-1), minlength=6)
    n = rows * steps
    expected = torch.tensor([0.5, 0.3125, 0.1875, 0, 0, 0])
    assert counts[3:].sum() == 0
    for k in range(3):  # within 4 standard deviations of a binomial count
        sd = math.sqrt(n * expected[k] * (1 - expected[k]))
        assert abs(counts[k] - n * expected[k]) < 4 * sd, (k, counts.tolist())


def test_a_rows_stream_is_its_own() -> None:
    """The noise of row r depends on (seed, r) only: the same row in two different batches gets the same
    vectors, step after step; other rows and other seeds get others."""
    scores = torch.zeros(3, 50)
    ids = torch.zeros(3, 1, dtype=torch.long)
    big = RowNoise([row_seed(5, r) for r in (0, 1, 2)], torch.device("cpu"))
    alone = RowNoise([row_seed(5, 2)], torch.device("cpu"))
    for _ in range(3):
        a, b = big(ids, scores), alone(ids[:1], scores[:1])
        assert torch.equal(a[2], b[0])
        assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])
    seeds = {row_seed(s, r) for s in range(20) for r in range(200)}
    assert len(seeds) == 20 * 200 and all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError, match="2 rows of scores for 1 row streams"):
        alone(ids[:2], scores[:2])


def test_a_prompts_samples_do_not_depend_on_the_batch(
    eos_prone: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    """All prompts in one call, in chunks of 2 rows, or split in two calls that each pass their first
    global row (what two ranks do): the same completions, row for row."""
    model, tokenizer = eos_prone
    n, params = 3, SamplingParams(max_new_tokens=MAX_NEW, seed=4, temperature=0.9, top_p=0.95)
    whole = HFEngine(model, tokenizer).generate(prompts, n, params)
    chunked = HFEngine(model, tokenizer, batch_size=2).generate(prompts, n, params)
    cut = 2
    first = HFEngine(model, tokenizer).generate(prompts[:cut], n, params)
    second = HFEngine(model, tokenizer).generate(
        prompts[cut:],
        n,
        SamplingParams(max_new_tokens=MAX_NEW, seed=4, temperature=0.9, top_p=0.95, first_row=cut * n),
    )
    tokens = [c.token_ids for c in whole]
    assert [c.token_ids for c in chunked] == tokens
    assert [c.token_ids for c in first + second] == tokens
    assert len({tuple(t) for t in tokens}) > len(prompts)  # real samples, not copies of a greedy answer
    shifted = HFEngine(model, tokenizer).generate(
        prompts[cut:], n, SamplingParams(max_new_tokens=MAX_NEW, seed=4, temperature=0.9, top_p=0.95)
    )
    assert [c.token_ids for c in shifted] != tokens[cut * n :]  # the row's index is part of its key
