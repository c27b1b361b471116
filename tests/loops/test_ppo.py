"""PPO / VC-PPO: both presets train every parameter of the policy and the critic; advantages, returns and
the length-adaptive lambda checked against hand loops; value pretraining, a reward-model critic, the value
alignment and an exact resume checked on the tiny model."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.checkpoints import STATE_FILE
from trainer.loops.ppo import run_ppo, token_advantages, token_values
from trainer.loops.reward_model import run_reward_model
from trainer.loops.rl_common import to_token_batch
from trainer.loops.session import seed_everything
from trainer.models import load_causal_lm, load_reward_model, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import Completion
from trainer.specs import parse_spec

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(4) for b in range(4)]
PRESET = "llama-0.4m"
EXPECTED_KEYS = {
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "reward/numeric/mean",
    "reward/length_penalty/mean",
    "response/length_mean",
    "response/length_max",
    "response/truncated_frac",
    "policy/entropy",
    "policy/clipfrac",
    "policy/approx_kl",
    "kl/ref",
    "kl/coef",
    "loss/policy",
    "loss/value",
    "loss/total",
    "adv/mean",
    "adv/std",
    "value/mean",
    "value/explained_variance",
    "value/clipfrac",
    "lam/actor_mean",
    "perf/gen_s",
    "perf/train_s",
    "perf/tokens_per_s",
    "eval/accuracy",
    "lr",
    "grad_norm",
}


_ctx = loop_ctx


def _spec(algorithm: str, critic_model: str | None = None, **hp: Any) -> Any:
    rewards = [{"name": "numeric"}, {"name": "length_penalty", "weight": 0.5, "params": {"target_tokens": 2}}]
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": f"tiny:{PRESET}",
            "critic_model": critic_model,
            "dataset_id": str(uuid.uuid4()),
            "rewards": rewards,
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                "sample_every": 1,
                "samples_to_store": 4,
                "ppo_epochs": 2,
                "minibatch_size": 4,
                **hp,
            },
        }
    )


def _start_critic(tiny_cache: Path, seed: int = 0) -> Any:
    """The loop's starting critic: the tiny LM with a value head drawn right after seeding."""
    path = str(tiny_model_dir(PRESET, tiny_cache))  # may build the preset, which draws from the RNG
    seed_everything(seed)
    return load_reward_model(path)[0]


def _trainer_state(folder: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(folder / STATE_FILE, weights_only=False)
    return state


@torch.no_grad()
def _score_alone(critic: Any, ids: list[int]) -> float:
    """One unpadded sequence through the classifier's own forward: the head at its last token."""
    return float(critic(input_ids=torch.tensor([ids])).logits[0, 0])


def _prompt_value(critic: Any, tokenizer: Any, prompt: str, max_prompt_length: int = 128) -> float:
    """V(prompt): the score of the prompt alone, tokenized as the loop does (cut from the left)."""
    return _score_alone(critic, tokenizer(prompt).input_ids[-max_prompt_length:])


def _unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    assert before.keys() == after.keys()
    return [n for n, p in before.items() if torch.equal(p, after[n])]


@pytest.mark.parametrize(
    ("algorithm", "extra", "actor_start_events"),
    [
        ("ppo", {"max_steps": 2}, []),
        (  # one critic-only step, then the actor trains for two
            "vc_ppo",
            {"max_steps": 3, "value_pretrain_steps": 1},
            ["actor updates start at step 2, after 1 critic-only step(s)"],
        ),
    ],
)
def test_every_parameter_of_actor_and_critic_trains(
    algorithm: str, extra: dict[str, Any], actor_start_events: list[str], tiny_cache: Path, tmp_path: Path
) -> None:
    spec = _spec(algorithm, entropy_coef=0.01, **extra)
    start, _ = load_causal_lm(str(tiny_model_dir(PRESET, tiny_cache)))
    start_critic = _start_critic(tiny_cache)
    reporter = MemoryReporter()
    result = run_ppo(spec, RunData(train=ROWS, validation=ROWS[:3]), reporter, _ctx(tiny_cache, tmp_path))
    last = spec.hyperparameters.max_steps
    assert result.status == "succeeded" and result.output_path == tmp_path / f"step-{last:08d}"

    trained, _ = load_causal_lm(str(result.output_path))  # the final checkpoint is a loadable policy
    assert _unchanged(dict(start.named_parameters()), dict(trained.named_parameters())) == []
    critic_state = _trainer_state(result.output_path)["extra"]["critic"]
    assert _unchanged(start_critic.state_dict(), critic_state) == []
    start_critic.load_state_dict(critic_state)  # and a loadable critic

    keys = {k for _, k, _ in reporter.metrics}
    assert EXPECTED_KEYS <= keys, EXPECTED_KEYS - keys
    assert sorted(s for s, k, _ in reporter.metrics if k == "eval/accuracy") == [0, last]
    assert {s for s, _ in reporter.samples} == set(range(1, last + 1))
    assert [m for _, m, _ in reporter.events if "actor updates start" in m] == actor_start_events


def test_value_pretraining_moves_only_the_critic(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec("vc_ppo", max_steps=2, value_pretrain_steps=2)
    start, tokenizer = load_causal_lm(str(tiny_model_dir(PRESET, tiny_cache)))
    start_critic = _start_critic(tiny_cache)
    reporter = MemoryReporter()
    result = run_ppo(spec, RunData(train=ROWS), reporter, _ctx(tiny_cache, tmp_path))
    assert result.output_path is not None

    trained, _ = load_causal_lm(str(result.output_path))
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    assert sorted(_unchanged(before, after)) == sorted(before)  # the actor did not move at all
    critic_state = _trainer_state(result.output_path)["extra"]["critic"]
    assert _unchanged(start_critic.state_dict(), critic_state) == []
    # The critic the loop started from is the one compared against: its V(prompt) at step 1.
    step1 = [s for step, s in reporter.samples if step == 1]
    assert len(step1) == 4
    for s in step1:
        assert s["value"] == pytest.approx(_prompt_value(start_critic, tokenizer, s["prompt"]), abs=1e-5)
    assert reporter.series("lr") == [0.0, 0.0] and reporter.series("value/lr") == [1e-2, 1e-2]
    assert not {k for _, k, _ in reporter.metrics if k.startswith("policy/") or k == "grad_norm"}
    assert not [m for _, m, _ in reporter.events if "actor updates start" in m]


def _toy_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Three rows of T = 9 with a prompt prefix and right padding; responses of 3, 5 and 8 tokens."""
    mask = torch.zeros(3, 9)
    mask[0, 2:5] = 1
    mask[1, 4:9] = 1
    mask[2, 1:9] = 1
    g = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(3, 9, generator=g) * 3
    ref_logp = -torch.rand(3, 9, generator=g) * 3
    values = torch.randn(3, 9, generator=g)
    scores = torch.tensor([1.0, -0.5, 2.0])
    return scores, old_logp, ref_logp, values, mask


def _token_rewards(
    scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, coef: float
) -> list[dict[int, float]]:
    """Per-token rewards by hand: -coef * KL on every response token, the score added on the last one."""
    out = []
    for i in range(len(scores)):
        valid = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        row = {t: (-coef * float(kl[i, t]) if kl is not None else 0.0) for t in valid}
        row[valid[-1]] += float(scores[i])
        out.append(row)
    return out


def _hand_gae(
    rewards: list[dict[int, float]], values: torch.Tensor, gamma: float, lams: list[float]
) -> list[dict[int, float]]:
    """GAE over each row's valid positions, a plain backwards loop (V = 0 after the last token)."""
    out = []
    for i, row in enumerate(rewards):
        adv: dict[int, float] = {}
        next_v, next_a = 0.0, 0.0
        for t in sorted(row, reverse=True):
            v = float(values[i, t])
            delta = row[t] + gamma * next_v - v
            next_a = delta + gamma * lams[i] * next_a
            adv[t], next_v = next_a, v
        out.append(adv)
    return out


@pytest.mark.parametrize(("placement", "with_ref"), [("reward", True), ("loss", True), ("reward", False)])
def test_with_lambda_one_advantages_are_reward_to_go_minus_values(placement: str, with_ref: bool) -> None:
    scores, old_logp, ref_logp, values, mask = _toy_batch()
    hp = _spec(
        "ppo", lam=1.0, critic_lam=1.0, gamma=1.0, whiten_advantages=False, kl_placement=placement
    ).hyperparameters
    adv, returns, lam = token_advantages(
        scores, old_logp, ref_logp if with_ref else None, values, mask, mask.sum(-1), hp, kl_coef=0.3
    )
    kl = old_logp - ref_logp if with_ref and placement == "reward" else None  # k1, the PPO preset default
    for i, row in enumerate(_token_rewards(scores, kl, mask, 0.3)):
        to_go = 0.0
        for t in reversed(range(mask.shape[1])):
            if t not in row:
                assert adv[i, t] == 0 and returns[i, t] == 0
                continue
            to_go += row[t]
            assert float(returns[i, t]) == pytest.approx(to_go, abs=1e-5)
            assert float(adv[i, t]) == pytest.approx(to_go - float(values[i, t]), abs=1e-5)
    assert lam.tolist() == [1.0, 1.0, 1.0]


def test_vc_ppo_lambda_per_sequence_is_the_one_gae_uses() -> None:
    scores, old_logp, ref_logp, values, mask = _toy_batch(seed=1)
    hp = _spec("vc_ppo", length_adaptive_alpha=0.5, gamma=0.9, whiten_advantages=False).hyperparameters
    assert (hp.lam, hp.critic_lam) == (0.95, 1.0)
    lengths = mask.sum(-1)
    assert lengths.tolist() == [3, 5, 8]
    adv, returns, lam = token_advantages(scores, old_logp, ref_logp, values, mask, lengths, hp, kl_coef=0.1)
    by_hand = [1 - 1 / (0.5 * 3), 1 - 1 / (0.5 * 5), 1 - 1 / (0.5 * 8)]  # 1/3, 0.6, 0.75
    assert lam.tolist() == pytest.approx(by_hand)

    rewards = _token_rewards(scores, old_logp - ref_logp, mask, 0.1)
    actor = _hand_gae(rewards, values, 0.9, by_hand)
    critic = _hand_gae(rewards, values, 0.9, [1.0, 1.0, 1.0])  # decoupled: critic lambda 1
    for i in range(3):
        for t in range(mask.shape[1]):
            if t in actor[i]:
                assert float(adv[i, t]) == pytest.approx(actor[i][t], abs=1e-5)
                assert float(returns[i, t]) == pytest.approx(critic[i][t] + float(values[i, t]), abs=1e-5)
            else:
                assert adv[i, t] == 0 and returns[i, t] == 0

    whitened, _, _ = token_advantages(
        scores,
        old_logp,
        ref_logp,
        values,
        mask,
        lengths,
        hp.model_copy(update={"whiten_advantages": True}),
        0.1,
    )
    flat = torch.tensor([actor[i][t] for i in range(3) for t in sorted(actor[i])], dtype=torch.float64)
    expected = (flat - flat.mean()) / flat.std(correction=0)
    assert whitened[mask > 0].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_token_values_align_with_log_prob_positions(tiny_cache: Path) -> None:
    critic = _start_critic(tiny_cache)
    with torch.no_grad():
        critic.score.weight.mul_(30.0)  # spread the values so a shift by one position is far off
    comps = [
        Completion(
            prompt_index=0, prompt_ids=[1, 40, 41], token_ids=[50, 51, 52, 2], text="", finish_reason="eos"
        ),
        Completion(prompt_index=1, prompt_ids=[1, 60], token_ids=[70, 71], text="", finish_reason="length"),
    ]
    batch = to_token_batch(comps, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        values = token_values(critic, batch)
    # The window starts at the shortest prompt's last token (position 1): 7 - 1 - 1 columns.
    assert batch.offset == 1
    assert values.shape == batch.response_mask.shape == (2, 5)
    for i, c in enumerate(comps):
        seq = c.prompt_ids + c.token_ids
        for t in range(1, len(seq) - 1):  # position t: the state input_ids[:t+1], which chooses token t+1
            assert float(values[i, t - 1]) == pytest.approx(_score_alone(critic, seq[: t + 1]), abs=1e-4)
        first = len(c.prompt_ids) - 1  # the first response position holds V(prompt)
        assert batch.response_mask[i, first - 1] == 1
        assert batch.response_mask[i, : first - 1].sum() == 0


def test_critic_from_a_reward_model_run_keeps_its_head(tiny_cache: Path, tmp_path: Path) -> None:
    pairs = [
        {"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": " bad answer"}
        for a in range(3)
        for b in range(3)
    ]
    rm_spec: Any = parse_spec(
        {
            "algorithm": "reward_model",
            "model": f"tiny:{PRESET}",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-2, "max_length": 32},
        }
    )
    rm = run_reward_model(rm_spec, RunData(train=pairs), MemoryReporter(), _ctx(tiny_cache, tmp_path / "rm"))
    assert rm.output_path is not None
    ref = f"run:{uuid.uuid4()}"
    reporter = MemoryReporter()
    run_ppo(
        _spec("ppo", critic_model=ref, max_steps=1),
        RunData(train=ROWS),
        reporter,
        _ctx(tiny_cache, tmp_path / "ppo", runs={ref: rm.output_path}),
    )
    reward_model, tokenizer = load_reward_model(str(rm.output_path))
    fresh = _start_critic(tiny_cache)
    assert len(reporter.samples) == 4
    for _, s in reporter.samples:  # step 1's values come from the critic before any update
        expected = _prompt_value(reward_model, tokenizer, s["prompt"])
        assert s["value"] == pytest.approx(expected, abs=1e-5)
        assert abs(_prompt_value(fresh, tokenizer, s["prompt"]) - expected) > 1e-3  # a fresh head differs


def test_resume_matches_an_uninterrupted_run_bit_for_bit(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec(
        "vc_ppo",
        max_steps=3,
        value_pretrain_steps=1,
        checkpoint_every=2,
        keep_last_checkpoints=5,
        kl_controller="adaptive",
        kl_horizon=10,  # a visible coefficient change per step, so restoring it matters
        sample_every=0,
    )
    straight_rep = MemoryReporter()
    straight = run_ppo(spec, RunData(train=ROWS), straight_rep, _ctx(tiny_cache, tmp_path / "a"))
    first = MemoryReporter(stop_after=2)  # steps 1-2 run (checkpoint at 2), the cancel comes before step 3
    assert run_ppo(spec, RunData(train=ROWS), first, _ctx(tiny_cache, tmp_path / "b")).status == "cancelled"
    assert list(first.checkpoints) == [2]
    resumed_rep = MemoryReporter()
    resumed = run_ppo(
        spec,
        RunData(train=ROWS),
        resumed_rep,
        _ctx(tiny_cache, tmp_path / "b", resume_from=first.checkpoints[2]),
    )
    assert straight.output_path is not None and resumed.output_path is not None

    a, _ = load_causal_lm(str(straight.output_path))
    b, _ = load_causal_lm(str(resumed.output_path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = _trainer_state(straight.output_path)["extra"], _trainer_state(resumed.output_path)["extra"]
    assert sa["kl_coef"] == sb["kl_coef"] and sa["kl_coef"] < 0.05  # the adaptive controller moved it
    for name, t in sa["critic"].items():
        assert torch.equal(t, sb["critic"][name]), name

    def later(rep: MemoryReporter) -> dict[tuple[int, str], float]:
        return {(s, k): v for s, k, v in rep.metrics if s > 2 and not k.startswith("perf/")}

    assert sorted({s for s, _, _ in resumed_rep.metrics}) == [3]
    assert later(resumed_rep) == later(straight_rep)
    done = run_ppo(
        spec, RunData(train=ROWS), MemoryReporter(), _ctx(tiny_cache, tmp_path / "b", resumed.output_path)
    )
    assert done.status == "succeeded" and done.output_path == resumed.output_path
