"""Group / leave-one-out online RL: GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE(++/baseline), ReMax.

One RL step, top to bottom: sample prompts -> G completions each (HF generate or vLLM) -> rewards from
the verifiers / reward model -> (DAPO) drop zero-variance groups and sample more -> old-policy and
reference log-probs -> outcome advantages from the registry -> ``ppo_epochs`` passes over minibatches
of the policy loss (+ KL to the reference in the loss, or folded into the reward; + entropy bonus),
aggregated per the spec -> metrics, samples, eval, checkpoint. The algorithm name only chose presets
(trainer/specs/online.py GROUP_PRESETS); the loop never branches on it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.advantages import ADVANTAGES, OutcomeBatch
from trainer.algorithms.kl import KL_ESTIMATORS
from trainer.loops.rl_common import (
    ActorBatch,
    StatMeans,
    TokenBatch,
    actor_step,
    close_rl_step,
    evaluate_start,
    kl_controller,
    minibatches,
    needs_old_logps,
    old_logps,
    perf_metrics,
    prepare_rl,
    reference_logps,
    reference_path,
    response_mask,
    sample_step,
    sampler_logps,
    skip_step,
    to_token_batch,
)
from trainer.loops.rollouts import step_rollout_metrics
from trainer.loops.session import TrainingSession, begin, load_policy, to_floats
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import GroupRlSpec, OnlineRlHyperparameters


def policy_update(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    hp: OnlineRlHyperparameters,
    kl_coef: float,
    gen: torch.Generator,
    is_weight: Tensor | None = None,
    *,
    measure_mismatch: bool = False,
) -> dict[str, Tensor]:
    """``ppo_epochs`` passes over shuffled minibatches of ``actor_step``; the mean of each stat. With
    ``measure_mismatch`` (the old log-probs are the sampler's) the first update, before the policy moves,
    logs their mismatch with its own log-probs."""
    full = ActorBatch(batch, mask, adv, old_logp, ref_logp, is_weight=is_weight)
    means = StatMeans()
    for i, idx in enumerate(minibatches(len(adv), hp, gen)):
        mb = dataclasses.replace(
            full.select(idx.to(batch.input_ids.device)), measure_mismatch=measure_mismatch and i == 0
        )
        means.add(actor_step(policy, optimizer, mb, hp, kl_coef))
    return means.means()


def run_group_rl(spec: GroupRlSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the group-family preset ``spec.algorithm`` on a prompts dataset."""
    hp = spec.hyperparameters
    ref_path = reference_path(spec, ctx)
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    policy, tokenizer = load_policy(start, hp)
    parts = prepare_rl(spec, data, ctx, start, policy, tokenizer, ref_path)
    prompts, device = parts.prompts, start.device
    session = TrainingSession(start, hp, policy, tokenizer, len(prompts.ids), batch_size=hp.prompts_per_step)
    if session.finished_before:
        return session.result
    kl_ctl = kl_controller(hp, session)
    session.extra_state = lambda: {"kl_coef": kl_ctl.value}
    advantage = ADVANTAGES[hp.advantage]
    reporter.event(
        "info",
        f"{spec.algorithm}: {len(prompts.ids)} prompts ({len(parts.val_prompts.ids)} held out), "
        f"G={hp.samples_per_prompt}, {hp.max_steps} steps on {device.type}",
    )
    evaluate_start(session, parts, hp)

    for _ in session.steps():
        ro, t_gen = sample_step(session, parts, hp, greedy_baseline=hp.advantage == "remax")
        metrics: dict[str, float] = {
            "groups/zero_variance_frac": ro.zero_variance_groups / ro.groups_sampled,
            "groups/trained": len(ro.completions) / hp.samples_per_prompt,
            "kl/coef": kl_ctl.value,
            "lr": session.lr,
        }
        if not ro.completions:  # dynamic sampling found no group with signal: nothing to learn from
            skip_step(session, parts, hp, metrics | {"perf/gen_s": t_gen}, ro)
            continue

        t1 = time.perf_counter()  # ---- log-probs, advantages, policy update
        batch = to_token_batch(ro.completions, tokenizer.pad_token_id, device)
        mask = response_mask(batch, ro.completions, hp.mask_truncated)
        ref_logp = reference_logps(parts, batch, hp.temperature)
        sampler = sampler_logps(ro.completions, batch)
        # One epoch over one minibatch is on-policy: the old log-probs are the update's own forward pass
        # (detached), so the separate no-grad pass is skipped (as TRL does), unless KL-in-reward or the
        # engine's log-probs (mismatch, truncated IS) need them.
        # With old_logprobs 'sampler' the engine's log-probs are the old ones and no pass runs at all.
        kl_in_reward = ref_logp is not None and hp.kl_placement == "reward"
        needed = needs_old_logps(sampler, hp, len(ro.completions), kl_in_reward)
        old = old_logps(policy, batch, sampler, mask, hp, needed)
        old_logp = old.logp
        scores = torch.tensor(ro.total, dtype=torch.float32, device=device)
        if kl_in_reward:  # sequence KL folded into the reward
            assert old_logp is not None and ref_logp is not None
            seq_kl = (KL_ESTIMATORS[hp.kl_estimator](old_logp, ref_logp) * mask).sum(-1)
            scores = scores - kl_ctl.value * seq_kl
        group_ids = torch.tensor(ro.prompt_index, device=device)
        baseline = torch.tensor(ro.baseline, dtype=torch.float32, device=device) if ro.baseline else None
        adv = advantage(OutcomeBatch(scores=scores, group_ids=group_ids, baseline=baseline))
        stats = policy_update(
            policy,
            session.optimizer,
            batch,
            old_logp,
            ref_logp,
            adv,
            mask,
            hp,
            kl_ctl.value,
            session.generator,
            old.is_weight,
            measure_mismatch=old.from_sampler,
        )
        stats |= old.mismatch
        if "kl/seq" in stats:  # the controller's target (Ziegler et al. 2019) is a per-sequence KL
            kl_ctl.update(float(stats["kl/seq"]), len(ro.completions))
        t_train = time.perf_counter() - t1

        if session.log_due:  # ---- metrics, samples, eval, checkpoint
            metrics |= to_floats(stats) | step_rollout_metrics(ro)
            metrics |= {"adv/mean": float(adv.mean()), "adv/std": float(adv.std(unbiased=False))}
            metrics |= perf_metrics(t_gen, t_train, mask)
        close_rl_step(session, parts, hp, metrics, ro, stats)
    return session.result
