"""Rollouts and their rewards, shared by the online-RL loops: sample G completions per prompt, score them
with the verifiers / reward model, refill groups without signal (DAPO), summarise, store samples, and
evaluate greedily on held-out prompts.

On several ranks each rank generates and scores its share of the prompts, then the ranks' completions and
rewards are gathered, so every rank holds the whole step's rollouts (as one process would, row for row:
sampling is keyed by the global row, trainer/rollout/row_sampling.py) and takes the same decisions
(which groups to keep, advantages) before training on its share."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainer.data.prompts import PromptSet
from trainer.data.sampling import EpochSampler
from trainer.distributed import ONE, Ranks, gather_objects, padded_share
from trainer.graders.judges import Judges
from trainer.rewards.composite import CompositeReward, RewardComponent, RewardResult
from trainer.rewards.grader_reward import GraderReward
from trainer.rewards.reward_model_scorer import RewardModelScorer
from trainer.rewards.verifiers import Sample
from trainer.rollout.base import Completion, RolloutEngine, SamplingParams
from trainer.specs import OnlineRlHyperparameters, RewardSpec


def environment_return(samples: Sequence[Sample]) -> tuple[list[float], list[bool], str | None]:
    """The ``environment`` (or ``agent``) reward component: each episode's sum of step rewards, or the
    reward its agent posted (0 for a sample without one: an agent's episode that timed out, whose group
    is not trained); an episode the environment failed on keeps what it had earned (its failure is in
    its transcript and ``episode/error_frac``)."""
    return [s.env_return or 0.0 for s in samples], [False] * len(samples), None


def build_reward(
    specs: Sequence[RewardSpec], resolve_model: Any, device: torch.device, episode_reward: str | None = None
) -> CompositeReward:
    """A CompositeReward for the spec's components (one reward-model scorer at most, loaded once), and with
    ``episode_reward`` (``environment`` or ``agent``) the episodes' own rewards as one more component of
    that name (weight 1)."""
    scorer = None
    for r in specs:
        if r.name == "reward_model":
            if scorer is not None:
                raise ValueError("at most one reward_model component per reward")
            scorer = RewardModelScorer(resolve_model(r.model), normalize=r.normalize, device=device)
    judges = Judges(resolve_model, device)  # score_model graders' judge models, loaded when first used
    components = [
        RewardComponent(name=r.grader.name, weight=r.weight, batch=GraderReward(r.grader, judges=judges))
        if r.grader is not None
        else RewardComponent(name=r.name, weight=r.weight, params=r.params)
        for r in specs
    ]
    if episode_reward is not None:
        components.append(RewardComponent(name=episode_reward, batch=environment_return))
    return CompositeReward(components, reward_model=scorer)


class SamplingFields(Protocol):
    """The sampling knobs an online-RL or eval spec's hyperparameters carry (frozen: read-only)."""

    @property
    def max_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...


def sampling_params(
    hp: SamplingFields, *, seed: int, greedy: bool = False, first_row: int = 0
) -> SamplingParams:
    """``hp``'s sampling with ``seed``; ``first_row``: the global index of the call's first sample (the HF
    engine keys each sample's draws by it, trainer/rollout/row_sampling.py)."""
    return SamplingParams(
        max_new_tokens=hp.max_new_tokens,
        temperature=hp.temperature,
        top_p=hp.top_p,
        top_k=hp.top_k,
        greedy=greedy or hp.temperature == 0,
        seed=seed,
        first_row=first_row,
    )


def score(
    completions: list[Completion],
    prompts: PromptSet,
    prompt_index: list[int],
    reward: CompositeReward,
    max_new_tokens: int,
) -> RewardResult:
    """Rewards of completions; ``prompt_index[i]`` is the PromptSet row of completion i."""
    samples = [
        Sample(
            prompt=prompts.texts[j],
            completion=c.answer,  # an episode's final answer; else the whole completion
            row=prompts.rows[j],
            n_tokens=c.model_tokens,
            env_return=c.episode.env_return if c.episode is not None else None,
            # an episode's length is measured against its whole budget, not one turn's
            max_new_tokens=(c.episode.budget if c.episode is not None else None) or max_new_tokens,
            truncated=c.finish_reason == "length",
        )
        for c, j in zip(completions, prompt_index, strict=True)
    ]
    return reward(samples)


def generate_scored(
    engine: RolloutEngine,
    prompts: PromptSet,
    idx: Sequence[int],
    n: int,
    params: SamplingParams,
    reward: CompositeReward,
    max_new_tokens: int,
    ranks: Ranks,
) -> tuple[list[Completion], RewardResult]:
    """``n`` completions of each PromptSet row in ``idx`` (prompt-major) and their rewards.

    On several ranks each generates and scores its ``padded_share`` of ``idx`` (equal counts, so a sharded
    model's collective forwards line up), passing the global index of its first row so its samples are
    those one process would draw; the parts are gathered in rank order and cut back to ``len(idx) * n``:
    every rank returns the whole batch's completions and rewards."""
    mine = [idx[k] for k in padded_share(len(idx), ranks)]
    first_row = ranks.rank * len(mine) * n if ranks.active else 0
    comps = engine.generate(
        [prompts.ids[j] for j in mine], n, dataclasses.replace(params, first_row=first_row)
    )
    result = score(comps, prompts, [mine[k // n] for k in range(len(comps))], reward, max_new_tokens)
    if not ranks.active:
        return comps, result
    parts = gather_objects((comps, result), ranks)
    rows = len(idx) * n
    everyone = [c for part, _ in parts for c in part][:rows]
    comps = [dataclasses.replace(c, prompt_index=k // n) for k, c in enumerate(everyone)]
    names = parts[0][1].components
    result = RewardResult(
        total=[v for _, r in parts for v in r.total][:rows],
        components={name: [v for _, r in parts for v in r.components[name]][:rows] for name in names},
        failures=sum(r.failures for _, r in parts),
    )
    return comps, result


@dataclass
class SampledGroups:
    """Completions prompt-major with their prompts' indices and rewards."""

    completions: list[Completion] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)

    def add(self, comps: list[Completion], j: int, result: RewardResult, sl: slice) -> None:
        self.completions += comps
        self.prompt_index += [j] * len(comps)
        self.total += result.total[sl]
        for name, values in result.components.items():
            self.components.setdefault(name, []).extend(values[sl])


@dataclass
class StepRollouts(SampledGroups):
    """The groups a step trains on: completions prompt-major, G per group; ``sampled``: every group the
    step generated, kept for the update or not (dynamic sampling drops those whose rewards are all equal,
    and a refill round's groups beyond ``prompts_per_step``)."""

    failures: int = 0
    baseline: list[float] = field(default_factory=list)  # ReMax: greedy reward of each completion's prompt
    groups_sampled: int = 0
    zero_variance_groups: int = 0
    sampled: SampledGroups = field(default_factory=SampledGroups)
    # async_rollouts: the seconds they took to generate and score while the previous step trained
    generated_in_background_s: float | None = None

    @property
    def rewards(self) -> RewardResult:
        return RewardResult(total=self.total, components=self.components, failures=self.failures)

    @property
    def sampled_rewards(self) -> RewardResult:
        s = self.sampled
        return RewardResult(total=s.total, components=s.components, failures=self.failures)

    def add_group(
        self, comps: list[Completion], j: int, result: RewardResult, sl: slice, base: float | None
    ) -> None:
        self.add(comps, j, result, sl)
        if base is not None:
            self.baseline += [base] * len(comps)


def collect_rollouts(
    engine: RolloutEngine,
    prompts: PromptSet,
    sampler: EpochSampler,
    reward: CompositeReward,
    hp: OnlineRlHyperparameters,
    *,
    greedy_baseline: bool,
    seed: int,
    ranks: Ranks = ONE,
) -> StepRollouts:
    """``prompts_per_step`` groups of G completions. With dynamic sampling a group whose rewards are all
    equal (no learning signal) is dropped and more prompts are sampled, up to ``max_refill_rounds`` extra
    rounds; the step may end with fewer groups, never with a zero-variance one. A group with an agent's
    episode that timed out is not trained either (its advantages need every member's reward). On several
    ranks the prompts are split among them and the rollouts gathered (``generate_scored``): every rank
    returns the whole step's."""
    G, out = hp.samples_per_prompt, StepRollouts()
    for round_ in range(1 + (hp.max_refill_rounds if hp.dynamic_sampling else 0)):
        idx = sampler.next_batch()
        params = sampling_params(hp, seed=seed * 1009 + round_)
        comps, result = generate_scored(engine, prompts, idx, G, params, reward, hp.max_new_tokens, ranks)
        out.failures += result.failures
        baselines: list[float] | None = None
        if greedy_baseline:  # ReMax: one greedy rollout per prompt, its reward is the baseline
            greedy = sampling_params(hp, seed=seed, greedy=True)
            baselines = generate_scored(engine, prompts, idx, 1, greedy, reward, hp.max_new_tokens, ranks)[
                1
            ].total
        for g, j in enumerate(idx):
            sl = slice(g * G, (g + 1) * G)
            out.groups_sampled += 1
            out.sampled.add(comps[sl], j, result, sl)
            flat = max(result.total[sl]) == min(result.total[sl])
            out.zero_variance_groups += int(flat)
            if (flat and hp.dynamic_sampling) or len(out.completions) >= hp.prompts_per_step * G:
                continue
            if any(c.episode is not None and c.episode.ended == "timeout" for c in comps[sl]):
                continue  # an agent's episode never reported: the group's advantages cannot be formed
            out.add_group(comps[sl], j, result, sl, baselines[g] if baselines is not None else None)
        if len(out.completions) >= hp.prompts_per_step * G:
            break
    return out


def step_rollout_metrics(ro: StepRollouts) -> dict[str, float]:
    """A step's ``rollout_metrics`` over every completion it sampled (how the policy does, whatever
    dynamic sampling then kept), and ``reward/trained_mean``: the mean over the groups kept for the update
    (absent when none was)."""
    out = rollout_metrics(ro.sampled.completions, ro.sampled_rewards)
    if ro.total:
        out["reward/trained_mean"] = float(torch.tensor(ro.total, dtype=torch.float64).mean())
    return out


def rollout_metrics(completions: Sequence[Completion], rewards: RewardResult) -> dict[str, float]:
    """reward/*, response/* (and episode/* for multi-turn rollouts) for one step's rollouts (plain floats:
    called at log time). A response's length counts the tokens the model produced."""
    total = torch.tensor(rewards.total, dtype=torch.float64)
    lengths = torch.tensor([c.model_tokens for c in completions], dtype=torch.float64)
    out = {
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std(unbiased=False)),
        "reward/min": float(total.min()),
        "reward/max": float(total.max()),
        "reward/failures": float(rewards.failures),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
    }
    for name, values in rewards.components.items():
        out[f"reward/{name}/mean"] = float(torch.tensor(values, dtype=torch.float64).mean())
    return out | episode_metrics(completions)


def episode_metrics(completions: Sequence[Completion], prefix: str = "episode") -> dict[str, float]:
    """Multi-turn episodes' turns, tool calls and endings, as means over the episodes (none: {}):
    ``turns_mean``, ``tool_calls_mean``, ``tool_call_rate`` (the fraction that called a tool at least once),
    ``tool_errors`` (calls that failed, summed), ``tool_error_rate`` (failed / made), ``max_turns_frac`` and
    ``length_frac`` (episodes cut by the turn or token limit), ``done_frac`` (ended by the environment),
    ``error_frac`` (ended by the environment failing) and ``timeout_frac`` (an agent's episodes that
    never reported)."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    n, calls = len(episodes), sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    return {
        f"{prefix}/turns_mean": sum(e.turns for e in episodes) / n,
        f"{prefix}/tool_calls_mean": calls / n,
        f"{prefix}/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        f"{prefix}/tool_errors": float(errors),
        f"{prefix}/tool_error_rate": errors / calls if calls else 0.0,
        f"{prefix}/max_turns_frac": sum(e.ended == "max_turns" for e in episodes) / n,
        f"{prefix}/length_frac": sum(e.ended == "length" for e in episodes) / n,
        f"{prefix}/done_frac": sum(e.ended == "done" for e in episodes) / n,
        f"{prefix}/error_frac": sum(e.ended == "error" for e in episodes) / n,
        f"{prefix}/timeout_frac": sum(e.ended == "timeout" for e in episodes) / n,
    }


def sample_records(
    completions: Sequence[Completion],
    prompts: PromptSet,
    prompt_index: list[int],
    rewards: RewardResult,
    limit: int,
) -> list[dict[str, Any]]:
    """A few completions with their rewards, for ``GET /v1/runs/{id}/samples``; ``reference``: the prompt
    row's reference answer (its ``answer``) where it has one, so a reader can judge the reward."""
    out = []
    for i, (c, j) in enumerate(zip(completions, prompt_index, strict=True)):
        if i >= limit:
            break
        record = {
            "prompt": prompts.texts[j],
            "completion": c.text,
            "reward": rewards.total[i],
            "components": {k: v[i] for k, v in rewards.components.items()},
            "finish_reason": c.finish_reason,
        }
        if prompts.rows[j].get("answer") is not None:
            record["reference"] = prompts.rows[j]["answer"]
        if c.episode is not None:  # the whole exchange: turns, tool calls, tool results; what was scored
            record["transcript"] = list(c.episode.messages)
            record["answer"] = c.episode.answer
            record["ended"] = c.episode.ended
        out.append(record)
    return out


def evaluate_greedy(
    engine: RolloutEngine,
    prompts: PromptSet,
    reward: CompositeReward,
    hp: OnlineRlHyperparameters,
    seed: int,
    ranks: Ranks = ONE,
) -> dict[str, float]:
    """Greedy completions of held-out prompts scored by ``reward``: ``eval/accuracy`` is its mean
    (the fraction correct for a 0/1 verifier such as exact_match); split over the ranks."""
    if not prompts.ids:
        return {}
    params = sampling_params(hp, seed=seed, greedy=True)
    every = range(len(prompts.ids))
    completions, result = generate_scored(engine, prompts, every, 1, params, reward, hp.max_new_tokens, ranks)
    lengths = [c.model_tokens for c in completions]
    return {
        "eval/accuracy": sum(result.total) / len(result.total),
        "eval/response_length": sum(lengths) / len(lengths),
    } | {k: v for k, v in episode_metrics(completions, "eval").items() if "frac" not in k}
