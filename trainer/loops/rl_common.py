"""Pieces every online-RL loop shares: prompts -> rollouts -> rewards -> token tensors -> log-probs,
rollout metrics, held-out evaluation and stored samples. The loops (group_rl.py, ppo.py) read top to
bottom and call these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.logprobs import token_logprobs
from trainer.loops.preference_data import render_prompt
from trainer.rewards.composite import CompositeReward, RewardComponent, RewardResult
from trainer.rewards.reward_model_scorer import RewardModelScorer
from trainer.rewards.verifiers import Sample
from trainer.rollout.base import Completion, RolloutEngine, SamplingParams
from trainer.specs import OnlineRlHyperparameters, RewardSpec


@dataclass(frozen=True)
class PromptSet:
    """Rendered prompt texts and their token ids (cut from the left to the prompt budget)."""

    rows: list[dict[str, Any]]
    texts: list[str]
    ids: list[list[int]]


def tokenize_prompts(rows: list[dict[str, Any]], tokenizer: Any, max_prompt_length: int) -> PromptSet:
    texts = [render_prompt(r["prompt"], tokenizer) for r in rows]
    ids = [tokenizer(t).input_ids[-max_prompt_length:] for t in texts]
    return PromptSet(rows=rows, texts=texts, ids=ids)


def build_reward(specs: Sequence[RewardSpec], resolve_model: Any, device: torch.device) -> CompositeReward:
    """A CompositeReward for the spec's components (one reward-model scorer at most, loaded once)."""
    scorer = None
    for r in specs:
        if r.name == "reward_model":
            if scorer is not None:
                raise ValueError("at most one reward_model component per reward")
            scorer = RewardModelScorer(resolve_model(r.model), normalize=r.normalize, device=device)
    components = [RewardComponent(name=r.name, weight=r.weight, params=r.params) for r in specs]
    return CompositeReward(components, reward_model=scorer)


def sampling_params(hp: OnlineRlHyperparameters, *, seed: int, greedy: bool = False) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=hp.max_new_tokens,
        temperature=hp.temperature,
        top_p=hp.top_p,
        top_k=hp.top_k,
        greedy=greedy or hp.temperature == 0,
        seed=seed,
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
            completion=c.text,
            row=prompts.rows[j],
            n_tokens=len(c.token_ids),
            max_new_tokens=max_new_tokens,
            truncated=c.finish_reason == "length",
        )
        for c, j in zip(completions, prompt_index, strict=True)
    ]
    return reward(samples)


@dataclass(frozen=True)
class TokenBatch:
    """Prompt+completion sequences, right-padded: (N, L). ``response_mask`` marks generated tokens (the
    only ones scored); log-prob tensors are (N, L-1) aligned with ``input_ids[:, 1:]``."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor  # (N, L-1), float, 1 where input_ids[:, t+1] is a generated token

    def select(self, idx: Tensor) -> TokenBatch:
        return TokenBatch(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx])


def to_token_batch(completions: Sequence[Completion], pad_id: int, device: torch.device) -> TokenBatch:
    seqs = [(c.prompt_ids, c.token_ids) for c in completions]
    width = max(len(p) + len(t) for p, t in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (p, t) in enumerate(seqs):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t, dtype=torch.long)
        attn[i, : len(p) + len(t)] = 1
        resp[i, len(p) : len(p) + len(t)] = 1.0
    return TokenBatch(ids.to(device), attn.to(device), resp[:, 1:].to(device))


def forward_logps(model: Any, batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """(logits[:, :-1], per-token log-probs of the next token) for every position, (N, L-1)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    return logits, token_logprobs(logits, batch.input_ids[:, 1:])


@torch.no_grad()
def frozen_logps(model: Any, batch: TokenBatch, chunk: int = 64) -> Tensor:
    """Per-token log-probs without grad, in chunks (old policy, reference)."""
    was_training = model.training
    model.eval()
    out = [
        forward_logps(model, batch.select(torch.arange(i, min(i + chunk, len(batch.input_ids)))))[1]
        for i in range(0, len(batch.input_ids), chunk)
    ]
    model.train(was_training)
    return torch.cat(out)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def rollout_metrics(completions: Sequence[Completion], rewards: RewardResult) -> dict[str, float]:
    """reward/*, response/* for one step's rollouts (plain floats: called at log time)."""
    total = torch.tensor(rewards.total, dtype=torch.float64)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
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
    return out


def sample_records(
    completions: Sequence[Completion],
    prompts: PromptSet,
    prompt_index: list[int],
    rewards: RewardResult,
    limit: int,
) -> list[dict[str, Any]]:
    """A few completions with their rewards, for ``GET /v1/runs/{id}/samples``."""
    out = []
    for i, (c, j) in enumerate(zip(completions, prompt_index, strict=True)):
        if i >= limit:
            break
        out.append(
            {
                "prompt": prompts.texts[j],
                "completion": c.text,
                "reward": rewards.total[i],
                "components": {k: v[i] for k, v in rewards.components.items()},
                "finish_reason": c.finish_reason,
            }
        )
    return out


def evaluate_greedy(
    engine: RolloutEngine, prompts: PromptSet, reward: CompositeReward, hp: OnlineRlHyperparameters, seed: int
) -> dict[str, float]:
    """Greedy completions of held-out prompts scored by ``reward``: ``eval/accuracy`` is its mean
    (the fraction correct for a 0/1 verifier such as exact_match)."""
    if not prompts.ids:
        return {}
    completions = engine.generate(prompts.ids, 1, sampling_params(hp, seed=seed, greedy=True))
    result = score(completions, prompts, list(range(len(prompts.ids))), reward, hp.max_new_tokens)
    lengths = [len(c.token_ids) for c in completions]
    return {
        "eval/accuracy": sum(result.total) / len(result.total),
        "eval/response_length": sum(lengths) / len(lengths),
    }
