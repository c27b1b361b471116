"""token_logprobs / entropy_from_logits against hand values and the naive log_softmax."""

import math

import pytest
import torch

from trainer.algorithms.logprobs import entropy_from_logits, token_logprobs


def test_token_logprobs_hand_case() -> None:
    # Row softmax of [0, ln 3] is [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0]]], dtype=torch.float64)
    labels = torch.tensor([[1, 1]])
    out = token_logprobs(logits, labels)
    expected = torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("shape", [(1, 1, 3), (2, 5, 7), (4, 3, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_matches_naive(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    B, T, V = shape
    logits = torch.randn(B, T, V, generator=g, dtype=dtype) * 5
    labels = torch.randint(0, V, (B, T), generator=g)
    naive = torch.stack(
        [
            torch.stack([logits[b, t, labels[b, t]] - torch.logsumexp(logits[b, t], 0) for t in range(T)])
            for b in range(B)
        ]
    )
    torch.testing.assert_close(token_logprobs(logits, labels), naive)


def test_token_logprobs_bfloat16_close_to_float32() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 16, generator=g)
    labels = torch.randint(0, 16, (2, 4), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = token_logprobs(logits.bfloat16(), labels)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)


def test_token_logprobs_gradient_is_onehot_minus_softmax() -> None:
    logits = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(token_logprobs(logits, torch.tensor([[0]])).sum(), logits)
    p = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(grad, torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64) - p)


def test_token_logprobs_empty_batch() -> None:
    assert token_logprobs(torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)


def test_entropy_hand_cases() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, torch.tensor([[math.log(4.0), 0.0]], dtype=torch.float64))
    # Two-way [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4).
    two = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(two), torch.tensor([[h]], dtype=torch.float64))


def test_entropy_matches_naive_random() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 9, generator=g, dtype=torch.float64) * 3
    p = torch.softmax(logits, -1)
    naive = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), naive)


@pytest.mark.parametrize("chunk_elements", [1, 2 * 4 * 9, 3 * 4 * 9, 1 << 24])
def test_row_chunks_of_any_size_give_the_naive_values(
    chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CHUNK_ELEMENTS`` of one element (a row a chunk), 2 rows (5 rows: chunks of 2, 2, 1), 3 rows and all
    rows: log-probabilities (float64, bfloat16) and entropies equal the naive formulas, and so do their
    gradients."""
    from trainer.algorithms import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(5, 4, 9, generator=g, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.randint(0, 9, (5, 4), generator=g)
    rows = len(logprobs._row_chunks(logits)[0])
    assert rows == {1: 1, 72: 2, 108: 3}.get(chunk_elements, 5)

    naive = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(logits, labels)
    torch.testing.assert_close(got, naive)
    weights = torch.randn(5, 4, generator=g, dtype=torch.float64)
    (want_grad,) = torch.autograd.grad((naive * weights).sum(), logits)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(got_grad, want_grad)

    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1))
    half = logits.detach().bfloat16()
    reference = torch.log_softmax(half.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(half, labels).float(), reference, atol=0.05, rtol=0.02)
