"""Group-family online RL: every preset trains end to end on the tiny model; dynamic sampling and the
ReMax baseline checked with a scripted engine and reward."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.data.prompts import PromptSet
from trainer.data.sampling import EpochSampler
from trainer.loops.group_rl import run_group_rl
from trainer.loops.rollouts import collect_rollouts, step_rollout_metrics
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.rewards.composite import CompositeReward, RewardComponent
from trainer.rewards.verifiers import Sample
from trainer.rollout.base import Completion, SamplingParams
from trainer.specs import GROUP_PRESETS, parse_spec

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(4) for b in range(4)]


_ctx = loop_ctx


def _spec(algorithm: str, **hp: Any) -> Any:
    rewards = [{"name": "numeric"}, {"name": "length_penalty", "weight": 0.5, "params": {"target_tokens": 2}}]
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": rewards,
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                "sample_every": 1,
                "samples_to_store": 3,
                "ppo_epochs": 2,
                "minibatch_size": 8,
                **hp,
            },
        }
    )


@pytest.mark.parametrize("algorithm", sorted(GROUP_PRESETS))
def test_every_preset_trains_every_parameter(algorithm: str, tiny_cache: Path, tmp_path: Path) -> None:
    # dynamic sampling off here: random-init completions rarely differ in reward, and this test is about
    # every parameter moving (DAPO's sampling has its own test below).
    extra = {"kl_coef": 0.05} if algorithm == "grpo" else {}
    spec = _spec(algorithm, dynamic_sampling=False, entropy_coef=0.01, **extra)
    start, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    reporter = MemoryReporter()
    result = run_group_rl(
        spec, RunData(train=ROWS, validation=ROWS[:3]), reporter, _ctx(tiny_cache, tmp_path)
    )
    assert result.status == "succeeded" and result.output_path is not None
    trained, _ = load_causal_lm(str(result.output_path))
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    assert [n for n, p in before.items() if torch.equal(p, after[n])] == []
    keys = {k for _, k, _ in reporter.metrics}
    expected = {
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "reward/numeric/mean",
        "reward/length_penalty/mean",
        "policy/entropy",
        "policy/clipfrac",
        "policy/approx_kl",
        "loss/policy",
        "loss/total",
        "adv/mean",
        "adv/std",
        "groups/zero_variance_frac",
        "response/length_mean",
        "response/length_max",
        "response/truncated_frac",
        "perf/gen_s",
        "perf/train_s",
        "perf/tokens_per_s",
        "eval/accuracy",
        "lr",
        "grad_norm",
    }
    assert expected <= keys, expected - keys
    if algorithm == "grpo":
        assert "kl/ref" in keys
    assert {s for s, _ in reporter.samples} == {1, 2} and len(reporter.samples) == 6
    for _, record in reporter.samples:  # each stored sample carries its prompt's reference answer
        row = next(r for r in ROWS if record["prompt"].endswith(r["prompt"]))
        assert record["reference"] == row["answer"]


class ScriptedEngine:
    """Returns completions whose text is scripted per prompt; greedy returns the prompt's `greedy` text."""

    def __init__(self, texts: dict[int, list[str]], greedy: dict[int, str]):
        self.texts, self.greedy, self.calls = texts, greedy, 0

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        self.calls += 1
        out = []
        for i, p in enumerate(prompts):
            key = p[0]
            texts = [self.greedy[key]] if params.greedy else self.texts[key]
            out += [
                Completion(prompt_index=i, prompt_ids=p, token_ids=[1], text=t, finish_reason="eos")
                for t in texts[:n]
            ]
        return out

    def sync_weights(self, model: Any) -> None:
        pass


def test_dynamic_sampling_never_keeps_a_zero_variance_group() -> None:
    # Prompt k's completions: groups 0 and 2 are all-correct or all-wrong (no signal), 1 and 3 mixed.
    texts = {0: ["1"] * 4, 1: ["1", "0", "1", "0"], 2: ["0"] * 4, 3: ["0", "0", "0", "1"]}
    prompts = PromptSet(
        rows=[{"prompt": str(k), "answer": "1", "meta": {}} for k in range(4)],
        texts=[str(k) for k in range(4)],
        ids=[[k] for k in range(4)],
    )
    spec = _spec("dapo", prompts_per_step=2, samples_per_prompt=4, max_refill_rounds=5)
    reward = CompositeReward([RewardComponent("exact_match")])
    sampler = EpochSampler(4, 2, torch.Generator().manual_seed(0))
    ro = collect_rollouts(
        ScriptedEngine(texts, {}),
        prompts,
        sampler,
        reward,
        spec.hyperparameters,
        greedy_baseline=False,
        seed=0,
    )
    assert sorted(set(ro.prompt_index)) == [1, 3]
    assert len(ro.completions) == 8 and ro.zero_variance_groups >= 1
    for k in set(ro.prompt_index):
        group = [r for r, j in zip(ro.total, ro.prompt_index, strict=True) if j == k]
        assert max(group) > min(group)

    # every group generated is kept aside for the step's metrics, dropped or not (issue 41 item 3)
    assert len(ro.sampled.completions) == 4 * ro.groups_sampled
    sampled_groups = ro.sampled.prompt_index[::4]
    assert {0, 2} & set(sampled_groups) and sorted(set(ro.prompt_index)) == [1, 3]
    right = {0: 4, 1: 2, 2: 0, 3: 1}  # of each prompt's 4 scripted answers, those equal to "1"
    metrics = step_rollout_metrics(ro)
    assert metrics["reward/mean"] == pytest.approx(
        sum(right[k] for k in sampled_groups) / (4 * len(sampled_groups))
    )
    assert metrics["reward/trained_mean"] == pytest.approx((2 + 1) / 8)
    assert metrics["reward/mean"] != metrics["reward/trained_mean"]


def test_a_step_whose_groups_all_score_alike_still_logs_its_rewards_samples_and_eval(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """Dynamic sampling keeps no group when every answer is wrong (the untrained tiny model never writes
    the sum): no update, but the charts still show the rewards (0) and the samples are stored."""
    spec = parse_spec(
        {
            "algorithm": "dapo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "exact_match"}],
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_refill_rounds": 1,
                "max_new_tokens": 4,
                "sample_every": 1,
                "samples_to_store": 3,
                "eval_every": 1,
            },
        }
    )
    reporter = MemoryReporter()
    result = run_group_rl(
        spec, RunData(train=ROWS, validation=ROWS[:3]), reporter, _ctx(tiny_cache, tmp_path)
    )
    assert result.status == "succeeded"
    logged = {(step, key): value for step, key, value in reporter.metrics}
    for step in (1, 2):
        assert logged[(step, "groups/zero_variance_frac")] == 1.0
        assert logged[(step, "reward/mean")] == 0.0 and logged[(step, "reward/max")] == 0.0
        assert logged[(step, "response/length_mean")] > 0
        assert (step, "reward/trained_mean") not in logged  # nothing was trained on
        assert (step, "eval/accuracy") in logged
    assert sorted({step for step, _ in reporter.samples}) == [1, 2]
    assert all(sample["reward"] == 0.0 for _, sample in reporter.samples)
    assert sum("no update" in message for _, message, _ in reporter.events) == 2


def test_remax_baseline_is_the_greedy_completions_reward() -> None:
    texts = {0: ["1", "0"], 1: ["0", "0"]}
    greedy = {0: "0", 1: "1"}
    prompts = PromptSet(
        rows=[{"prompt": str(k), "answer": "1", "meta": {}} for k in range(2)],
        texts=["0", "1"],
        ids=[[0], [1]],
    )
    spec = _spec("remax", prompts_per_step=2, samples_per_prompt=2)
    sampler = EpochSampler(2, 2, torch.Generator().manual_seed(0))
    ro = collect_rollouts(
        ScriptedEngine(texts, greedy),
        prompts,
        sampler,
        CompositeReward([RewardComponent("exact_match")]),
        spec.hyperparameters,
        greedy_baseline=True,
        seed=0,
    )
    expected = {0: 0.0, 1: 1.0}  # exact_match of the greedy text against "1"
    assert ro.baseline == [expected[j] for j in ro.prompt_index]


def test_presets_fill_only_unset_fields() -> None:
    spec = _spec("dapo", clip_high=0.5)
    hp = spec.hyperparameters
    assert (hp.advantage, hp.loss_aggregation, hp.dynamic_sampling, hp.clip_high) == (
        "grpo",
        "token_mean",
        True,
        0.5,
    )
    assert _spec("dr_grpo").hyperparameters.loss_aggregation == "seq_mean_token_sum_norm"


def test_sample_type_is_what_verifiers_get() -> None:
    s = Sample(
        prompt="1+1=",
        completion="2",
        row={"prompt": "1+1=", "answer": "2", "meta": {}},
        n_tokens=1,
        max_new_tokens=4,
        truncated=False,
    )
    assert CompositeReward([RewardComponent("exact_match")])([s]).total == [1.0]


def test_a_group_with_an_agent_episode_that_never_reported_is_not_trained(tiny_cache: Path) -> None:
    """Issue 39 item 3: the agent plays prompt 0's episodes (rewards 0, 1) and never reports prompt 1's;
    after the timeout only group 0 trains, with the posted rewards, and the timeouts are counted."""
    from trainer.loops.multi_turn import tag_rows
    from trainer.loops.rollouts import build_reward
    from trainer.rollout.agent_episodes import AgentBoard, AgentEpisodes, BoardClosed
    from trainer.rollout.turn_format import TurnFormat

    tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[1]
    prompts = tag_rows(
        PromptSet(
            rows=[{"prompt": str(k), "answer": "1", "meta": {}} for k in range(2)],
            texts=[str(k) for k in range(2)],
            ids=[[k + 5] for k in range(2)],
        )
    )
    board = AgentBoard()
    engine = AgentEpisodes(
        ScriptedEngine({}, {}),  # never called: the agent makes no chat call
        tokenizer,
        board,
        TurnFormat(tokenizer),
        timeout=1.5,
        max_calls=2,
        budget=32,
        max_prompt_tokens=32,
    )
    engine.generate = _with_one_call(engine.generate, board)  # type: ignore[method-assign]
    spec = _spec("grpo", prompts_per_step=2, samples_per_prompt=2, dynamic_sampling=False)
    ro = collect_rollouts(
        engine,
        prompts,
        EpochSampler(2, 2, torch.Generator().manual_seed(0)),
        build_reward([], str, torch.device("cpu"), episode_reward="agent"),
        spec.hyperparameters,
        greedy_baseline=False,
        seed=0,
    )
    assert set(ro.prompt_index) == {0} and sorted(ro.total) == [0.0, 1.0]
    metrics = step_rollout_metrics(ro)
    assert metrics["episode/timeout_frac"] == 0.5 and metrics["reward/agent/mean"] == 0.25
    board.close()
    with pytest.raises(BoardClosed):
        board.next_episode(0)


def _with_one_call(generate: Any, board: Any) -> Any:
    """``generate`` with an agent beside it: one scripted call per prompt-0 episode, rewards 0 then 1."""
    import threading

    def agent() -> None:
        rewards = iter([0.0, 1.0])
        while True:
            try:
                offer = board.next_episode(0.5)
            except Exception:  # noqa: BLE001 - the board closed
                return
            if offer is None:
                return
            if offer["row"]["prompt"] == "0":
                episode = board.live[offer["id"]]
                conv = episode.conversation
                conv.context([{"role": "user", "content": "0"}], None)
                conv.reply(Completion(0, conv.prompt_ids, [3, 2], "ok", "eos"), [], None)
                board.report(offer["id"], next(rewards))

    def run(*args: Any) -> Any:
        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        out = generate(*args)
        thread.join(5)
        return out

    return run
