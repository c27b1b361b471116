"""pass@k (Chen et al. 2021) against brute force: every k-subset of n labelled samples enumerated."""

from __future__ import annotations

import itertools
import math

import pytest

from trainer.algorithms.pass_at_k import pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """The fraction of all k-subsets of n samples (the first c correct) holding a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_every_subset_enumerated(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_matches_the_binomial_form_at_sizes_too_big_to_enumerate() -> None:
    for n, c, k in [(200, 3, 10), (200, 150, 100), (1000, 1, 1), (64, 0, 8), (50, 47, 4)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9, abs=1e-12)


def test_hand_values() -> None:
    assert pass_at_k(4, 1, 1) == 0.25  # one correct of four: pass@1 is c / n
    assert pass_at_k(4, 1, 2) == 0.5  # C(3,2)/C(4,2) = 3/6 all wrong
    assert pass_at_k(4, 2, 3) == 1.0  # only 2 wrong: any 3 hold a correct one
    assert pass_at_k(5, 0, 5) == 0.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_out_of_range_is_refused(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="need"):
        pass_at_k(n, c, k)
