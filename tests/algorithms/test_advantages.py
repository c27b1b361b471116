"""Outcome advantages and GAE: hand values, loop oracles, properties and degenerate cases."""

import math

import pytest
import torch

from trainer.algorithms.advantages import (
    ADVANTAGES,
    OutcomeBatch,
    gae,
    get_advantage,
    grpo,
    length_adaptive_lam,
    reinforce,
    reinforce_baseline,
    reinforce_pp,
    remax,
    rloo,
)

F64 = torch.float64


def batch(scores: list[float], ids: list[int], baseline: list[float] | None = None) -> OutcomeBatch:
    return OutcomeBatch(
        torch.tensor(scores, dtype=F64),
        torch.tensor(ids, dtype=torch.int64),
        None if baseline is None else torch.tensor(baseline, dtype=F64),
    )


def random_batch(seed: int, n_groups: int, size: int, binary: bool = False) -> OutcomeBatch:
    g = torch.Generator().manual_seed(seed)
    B = n_groups * size
    scores = (torch.rand(B, generator=g) > 0.5).to(F64) if binary else torch.randn(B, generator=g, dtype=F64)
    ids = torch.arange(n_groups).repeat_interleave(size) * 7 + 3  # non-contiguous ids
    perm = torch.randperm(B, generator=g)  # groups interleaved, not sorted
    return OutcomeBatch(scores[perm], ids[perm])


# ---- oracles: plain Python loops over groups -------------------------------------------------------


def groups_of(b: OutcomeBatch) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(b.group_ids.tolist()):
        out.setdefault(gid, []).append(i)
    return out


def grpo_oracle(b: OutcomeBatch, scale: bool, eps: float) -> torch.Tensor:
    s = b.scores.tolist()
    out = [0.0] * len(s)
    for idx in groups_of(b).values():
        vals = [s[i] for i in idx]
        if max(vals) == min(vals):
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i in idx:
            out[i] = (s[i] - mean) / (std + eps) if scale else s[i] - mean
    return torch.tensor(out, dtype=F64)


def rloo_oracle(b: OutcomeBatch) -> torch.Tensor:
    s = b.scores.tolist()
    out = [0.0] * len(s)
    for idx in groups_of(b).values():
        if len(idx) < 2 or len({s[i] for i in idx}) == 1:
            continue
        for i in idx:
            others = [s[j] for j in idx if j != i]
            out[i] = s[i] - sum(others) / len(others)
    return torch.tensor(out, dtype=F64)


CASES = [(0, 1, 2), (1, 3, 4), (2, 5, 8), (3, 2, 16), (4, 8, 3)]


@pytest.mark.parametrize(("seed", "n_groups", "size"), CASES)
def test_grpo_matches_loop(seed: int, n_groups: int, size: int) -> None:
    b = random_batch(seed, n_groups, size)
    torch.testing.assert_close(grpo(b), grpo_oracle(b, True, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ADVANTAGES["dr_grpo"](b), grpo_oracle(b, False, 0.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("seed", "n_groups", "size"), CASES)
def test_rloo_matches_loop(seed: int, n_groups: int, size: int) -> None:
    b = random_batch(seed, n_groups, size)
    torch.testing.assert_close(rloo(b), rloo_oracle(b), rtol=1e-6, atol=1e-6)


def test_unequal_group_sizes_match_loops() -> None:
    b = batch([1.0, 4.0, 2.0, 0.5, 3.0, 3.5, 9.0], [5, 5, 1, 1, 1, 8, 2])
    torch.testing.assert_close(grpo(b), grpo_oracle(b, True, 1e-6))
    torch.testing.assert_close(rloo(b), rloo_oracle(b))


def test_grpo_hand_values() -> None:
    # Group {1, 0, 0, 0}: mean 1/4, population std sqrt(3)/4.
    out = grpo(batch([1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0]), eps=0.0)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(out, torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3], dtype=F64))


def test_rloo_hand_values() -> None:
    out = rloo(batch([3.0, 1.0, 2.0], [0, 0, 0]))
    torch.testing.assert_close(out, torch.tensor([1.5, -1.5, 0.0], dtype=F64))


@pytest.mark.parametrize(("seed", "n_groups", "size"), CASES)
def test_grpo_sums_to_zero_per_group(seed: int, n_groups: int, size: int) -> None:
    b = random_batch(seed, n_groups, size)
    adv = grpo(b)
    for idx in groups_of(b).values():
        assert abs(adv[idx].sum().item()) < 1e-9


@pytest.mark.parametrize(("seed", "n_groups", "size"), CASES)
def test_dr_grpo_is_rloo_times_n_minus_1_over_n(seed: int, n_groups: int, size: int) -> None:
    b = random_batch(seed, n_groups, size)
    torch.testing.assert_close(ADVANTAGES["dr_grpo"](b), rloo(b) * (size - 1) / size)


@pytest.mark.parametrize(("n", "k"), [(2, 1), (4, 1), (5, 2), (8, 3), (16, 15)])
def test_grpo_binary_rewards_closed_form(n: int, k: int) -> None:
    # Mroueh 2025: with success rate p and population std, A+ = sqrt((1-p)/p), A- = -sqrt(p/(1-p)).
    p = k / n
    b = batch([1.0] * k + [0.0] * (n - k), [0] * n)
    expected = [math.sqrt((1 - p) / p)] * k + [-math.sqrt(p / (1 - p))] * (n - k)
    torch.testing.assert_close(grpo(b, eps=0.0), torch.tensor(expected, dtype=F64))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_all_equal_group_is_exactly_zero(name: str) -> None:
    # 0.1 * 3 / 3 != 0.1 in floats: the mean residue must not survive std scaling.
    b = batch([0.1, 0.1, 0.1, 1.0, 0.0], [0, 0, 0, 1, 1])
    out = ADVANTAGES[name](b)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert out[3].item() > 0 > out[4].item()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_singleton_group_is_zero(name: str) -> None:
    out = ADVANTAGES[name](batch([5.0, 1.0, 0.0], [9, 1, 1]))
    assert out[0].item() == 0.0
    assert not torch.isnan(out).any()


def test_all_groups_degenerate_no_nan() -> None:
    for name, fn in ADVANTAGES.items():
        if name in ("reinforce", "reinforce_pp", "remax"):
            continue
        assert fn(batch([2.0, 2.0, 7.0], [0, 0, 1])).tolist() == [0.0, 0.0, 0.0]


def test_reinforce_is_the_score() -> None:
    b = batch([1.0, -2.0], [0, 0])
    torch.testing.assert_close(reinforce(b), b.scores)


def test_reinforce_pp_whitens_over_the_batch() -> None:
    # Scores {0, 2, 4}: mean 2, population std sqrt(8/3); groups ignored.
    out = reinforce_pp(batch([0.0, 2.0, 4.0], [0, 1, 1]), eps=0.0)
    s = math.sqrt(8.0 / 3.0)
    torch.testing.assert_close(out, torch.tensor([-2 / s, 0.0, 2 / s], dtype=F64))
    assert reinforce_pp(batch([3.0, 3.0], [0, 1])).tolist() == [0.0, 0.0]


def test_reinforce_baseline_hand_values() -> None:
    # Group 0 {1, 3} -> centred {-1, 1}; group 1 {0, 0, 6} -> {-2, -2, 4}.
    # Batch population std of {-1, 1, -2, -2, 4} = sqrt(26 / 5).
    out = reinforce_baseline(batch([1.0, 3.0, 0.0, 0.0, 6.0], [0, 0, 1, 1, 1]), eps=0.0)
    s = math.sqrt(26.0 / 5.0)
    torch.testing.assert_close(out, torch.tensor([-1 / s, 1 / s, -2 / s, -2 / s, 4 / s], dtype=F64))


def test_remax() -> None:
    out = remax(batch([1.0, 0.0, 0.5], [0, 0, 1], baseline=[0.5, 0.5, 0.5]))
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="baseline"):
        ADVANTAGES["remax"](batch([1.0], [0]))


def test_registry_keys_and_lookup() -> None:
    assert set(ADVANTAGES) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce",
        "reinforce_pp",
        "reinforce_baseline",
        "remax",
    }
    assert get_advantage("rloo") is rloo
    with pytest.raises(ValueError, match="dr_grpo, grpo, reinforce, reinforce_baseline"):
        get_advantage("ppo")


# ---- GAE --------------------------------------------------------------------------------------------


def gae_oracle(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lams: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.zeros_like(rewards)
    ret = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        a, next_v = 0.0, 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[b, t]]):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            a = delta + gamma * lams[b] * a
            adv[b, t], ret[b, t] = a, a + values[b, t].item()
            next_v = values[b, t].item()
    return adv, ret


def test_gae_hand_value() -> None:
    # gamma 0.9, lam 0.5, r = [1, 2], V = [3, 4]:
    # delta_1 = 2 - 4 = -2, A_1 = -2; delta_0 = 1 + 0.9 * 4 - 3 = 1.6, A_0 = 1.6 + 0.45 * -2 = 0.7.
    adv, ret = gae(
        torch.tensor([[1.0, 2.0]], dtype=F64),
        torch.tensor([[3.0, 4.0]], dtype=F64),
        torch.ones(1, 2),
        gamma=0.9,
        lam=0.5,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.7, -2.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[3.7, 2.0]], dtype=F64))


def random_gae_inputs(
    seed: int, B: int, T: int, holes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)  # right padding, some rows empty
    if holes:
        mask &= torch.rand(B, T, generator=g) > 0.25  # multi-turn: observation tokens inside
    return rewards, values, mask


@pytest.mark.parametrize(("seed", "B", "T"), [(0, 1, 1), (1, 3, 5), (2, 4, 17), (3, 8, 9)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop(seed: int, B: int, T: int, holes: bool) -> None:
    rewards, values, mask = random_gae_inputs(seed, B, T, holes)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    oracle_adv, oracle_ret = gae_oracle(rewards, values, mask, 0.97, [0.9] * B)
    torch.testing.assert_close(adv, oracle_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, oracle_ret, rtol=1e-6, atol=1e-6)


def test_gae_per_sequence_lambda_matches_loop() -> None:
    rewards, values, mask = random_gae_inputs(5, 4, 7, holes=False)
    lams = [0.0, 0.5, 0.95, 1.0]
    adv, _ = gae(rewards, values, mask, gamma=0.99, lam=torch.tensor(lams, dtype=F64))
    torch.testing.assert_close(adv, gae_oracle(rewards, values, mask, 0.99, lams)[0], rtol=1e-6, atol=1e-6)


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value() -> None:
    rewards, values, mask = random_gae_inputs(6, 5, 8, holes=False)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask.to(F64)
    to_go = (rewards * m).flip(-1).cumsum(-1).flip(-1)  # sum_{t' >= t} r_t'
    torch.testing.assert_close(adv, (to_go - values) * m)
    torch.testing.assert_close(ret, to_go * m)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_mask_invariance(holes: bool) -> None:
    rewards, values, mask = random_gae_inputs(7, 6, 10, holes)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    noise = torch.randn(6, 10, dtype=F64, generator=torch.Generator().manual_seed(1)) * 100
    r2 = torch.where(mask, rewards, noise)
    v2 = torch.where(mask, values, -noise)
    adv2, ret2 = gae(r2, v2, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_fully_masked_row() -> None:
    adv, ret = gae(
        torch.ones(2, 3), torch.ones(2, 3), torch.tensor([[0, 0, 0], [1, 1, 0]]), gamma=1.0, lam=1.0
    )
    assert adv[0].tolist() == [0.0, 0.0, 0.0] and ret[0].tolist() == [0.0, 0.0, 0.0]
    # row 1: r = [1, 1], V = [1, 1] -> to-go [2, 1] -> A = [1, 0]
    assert adv[1].tolist() == [1.0, 0.0, 0.0]


def test_length_adaptive_lam() -> None:
    out = length_adaptive_lam(torch.tensor([0, 10, 20, 100, 1000]), alpha=0.05)
    # 1 - 1/(0.05 L): L=10 -> -1 -> clamp 0; L=20 -> 0; L=100 -> 0.8; L=1000 -> 0.98
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 0.8, 0.98]))
    lf = length_adaptive_lam(torch.tensor([50.0], dtype=F64), alpha=1.0)
    torch.testing.assert_close(lf, torch.tensor([0.98], dtype=F64))
