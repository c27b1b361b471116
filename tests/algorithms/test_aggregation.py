"""Aggregation modes: hand values, degenerate rows and micro-batch gradient accumulation."""

import pytest
import torch

from trainer.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate,
    batch_normaliser,
    get_aggregation,
    masked_mean,
    masked_whiten,
)

F64 = torch.float64

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=F64)
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 10.0 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq_mean_token_mean", (2.0 + 4.0) / 2),  # row means 2 and 4; empty row not counted
        ("seq_mean_token_sum", (6.0 + 4.0) / 2),
        ("seq_mean_token_sum_norm", (6.0 + 4.0) / 3 / 3),  # / B rows / T
    ],
)
def test_hand_values(mode: str, expected: float) -> None:
    torch.testing.assert_close(aggregate(X, M, mode), torch.tensor(expected, dtype=F64))


def test_sum_norm_uses_max_len_and_normaliser() -> None:
    out = aggregate(X, M, "seq_mean_token_sum_norm", max_len=10, normaliser=4.0)
    torch.testing.assert_close(out, torch.tensor(10.0 / 10 / 4, dtype=F64))


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_fully_masked_gives_zero_not_nan(mode: str) -> None:
    x = torch.full((2, 3), float("nan"), dtype=F64, requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    (g,) = torch.autograd.grad(out, x)
    assert (g == 0).all()


def test_masked_positions_do_not_leak() -> None:
    x = X.clone()
    x[2] = float("inf")
    x[1, 1:] = float("nan")
    for mode in AGGREGATIONS:
        torch.testing.assert_close(aggregate(x, M, mode), aggregate(X, M, mode))


def split_grads(
    mode: str, normaliser: float | None, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of the full-batch loss and the sum of micro-batch gradients, w.r.t. a shared weight."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 5, generator=g, dtype=F64)
    lengths = torch.tensor([5, 1, 3, 0, 2, 4])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    w = torch.tensor(0.7, dtype=F64, requires_grad=True)

    def loss(rows: slice, norm: float | None) -> torch.Tensor:
        per_token = (w * feats[rows]) ** 2
        return aggregate(per_token, mask[rows], mode, normaliser=norm, max_len=max_len)

    (full,) = torch.autograd.grad(loss(slice(0, 6), None), w)
    accumulated = torch.zeros((), dtype=F64)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches
        (gm,) = torch.autograd.grad(loss(rows, normaliser), w)
        accumulated += gm
    return full, accumulated


def test_token_mean_microbatch_accumulation_equals_full_batch() -> None:
    total_tokens = 5 + 1 + 3 + 0 + 2 + 4
    full, acc = split_grads("token_mean", float(total_tokens))
    torch.testing.assert_close(acc, full)
    # Local normalisers (then averaging) would be wrong here: micro-batches hold 5, 4 and 6 tokens.
    full, acc_local = split_grads("token_mean", None)
    assert not torch.isclose(acc_local / 3, full)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_seq_modes_microbatch_accumulation(mode: str) -> None:
    full, acc = split_grads(mode, 5.0)  # 5 non-empty sequences in the minibatch
    torch.testing.assert_close(acc, full)


def test_sum_norm_microbatch_accumulation() -> None:
    full, acc = split_grads("seq_mean_token_sum_norm", 6.0, max_len=8)  # all 6 rows count
    torch.testing.assert_close(acc, full)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_batch_normaliser_makes_micro_batches_add_up_to_the_batch_per_token(mode: str) -> None:
    """Every token's gradient, not only a shared weight's: the normaliser is the whole batch's (valid
    tokens; non-empty rows for the seq means, fully masked rows excluded; all B rows for the sum-norm)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=F64, requires_grad=True)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 0, 3, 0, 2, 4]).unsqueeze(1)  # 2 empty rows
    hand = {"token_mean": 14.0, "seq_mean_token_mean": 4.0, "seq_mean_token_sum": 4.0}
    norm = batch_normaliser(mask, mode)
    assert float(norm) == hand.get(mode, 6.0)  # seq_mean_token_sum_norm: B = 6
    full = aggregate(x**2, mask, mode, max_len=7)
    (g_full,) = torch.autograd.grad(full, x)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    total = sum(aggregate(x[r] ** 2, mask[r], mode, normaliser=norm, max_len=7) for r in parts)
    (g_acc,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=0)


def test_registry() -> None:
    assert set(AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    }
    with pytest.raises(ValueError, match="seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm"):
        aggregate(X, M, "token-mean")
    assert get_aggregation("token_mean") is AGGREGATIONS["token_mean"]


def test_masked_mean_and_whiten() -> None:
    torch.testing.assert_close(masked_mean(X, M), torch.tensor(2.5, dtype=F64))
    assert masked_mean(X, torch.zeros(3, 3)).item() == 0.0
    out = masked_whiten(X, M, eps=0.0)
    # valid {1, 2, 3, 4}: mean 2.5, population std sqrt(1.25)
    s = 1.25**0.5
    expected = torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected)
    kept = masked_whiten(X, M, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept[0], torch.tensor([1 / s, 2 / s, 3 / s], dtype=F64))
    assert masked_whiten(X, torch.zeros(3, 3)).abs().sum().item() == 0.0
