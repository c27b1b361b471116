"""Group / leave-one-out online RL: GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE(++/baseline), ReMax.

One RL step, top to bottom: sample prompts -> G completions each (HF generate or vLLM) -> rewards from
the verifiers / reward model -> (DAPO) drop zero-variance groups and sample more -> old-policy and
reference log-probs -> outcome advantages from the registry -> ``ppo_epochs`` passes over minibatches
of the policy loss (+ KL to the reference in the loss, or folded into the reward; + entropy bonus),
aggregated per the spec -> metrics, samples, eval, checkpoint. The algorithm name only chose presets
(trainer/specs.py GROUP_PRESETS); the loop never branches on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.advantages import ADVANTAGES, OutcomeBatch
from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.kl import KL_ESTIMATORS
from trainer.algorithms.kl_control import KL_CONTROLLERS
from trainer.algorithms.logprobs import entropy_from_logits
from trainer.algorithms.policy_losses import POLICY_LOSSES, ClipParams
from trainer.checkpoints import Checkpointer, load_trainer_state
from trainer.loops.common import (
    EpochSampler,
    backward_and_step,
    is_due,
    make_optimizer,
    pick_device,
    seed_everything,
    set_lr,
    stop_requested,
    to_floats,
    warmup_constant_lr,
)
from trainer.loops.rl_common import (
    PromptSet,
    TokenBatch,
    build_reward,
    evaluate_greedy,
    forward_logps,
    frozen_logps,
    masked_mean,
    rollout_metrics,
    sample_records,
    sampling_params,
    score,
    to_token_batch,
    tokenize_prompts,
)
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.rewards.composite import CompositeReward, RewardResult
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.factory import make_engine
from trainer.specs import GroupRlSpec, OnlineRlHyperparameters


@dataclass
class StepRollouts:
    """The groups a step trains on: completions prompt-major, G per group."""

    completions: list[Completion] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0
    baseline: list[float] = field(default_factory=list)  # ReMax: greedy reward of each completion's prompt
    groups_sampled: int = 0
    zero_variance_groups: int = 0

    @property
    def rewards(self) -> RewardResult:
        return RewardResult(total=self.total, components=self.components, failures=self.failures)

    def add_group(
        self, comps: list[Completion], j: int, result: RewardResult, sl: slice, base: float | None
    ) -> None:
        self.completions += comps
        self.prompt_index += [j] * len(comps)
        self.total += result.total[sl]
        for name, values in result.components.items():
            self.components.setdefault(name, []).extend(values[sl])
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
) -> StepRollouts:
    """``prompts_per_step`` groups of G completions. With dynamic sampling a group whose rewards are all
    equal (no learning signal) is dropped and more prompts are sampled, up to ``max_refill_rounds`` extra
    rounds; the step may end with fewer groups, never with a zero-variance one."""
    G, out = hp.samples_per_prompt, StepRollouts()
    for round_ in range(1 + (hp.max_refill_rounds if hp.dynamic_sampling else 0)):
        idx = sampler.next_batch()
        comps = engine.generate(
            [prompts.ids[j] for j in idx], G, sampling_params(hp, seed=seed * 1009 + round_)
        )
        pidx = [idx[k // G] for k in range(len(comps))]
        result = score(comps, prompts, pidx, reward, hp.max_new_tokens)
        out.failures += result.failures
        baselines: list[float] | None = None
        if greedy_baseline:  # ReMax: one greedy rollout per prompt, its reward is the baseline
            greedy = engine.generate(
                [prompts.ids[j] for j in idx], 1, sampling_params(hp, seed=seed, greedy=True)
            )
            baselines = score(greedy, prompts, idx, reward, hp.max_new_tokens).total
        for g, j in enumerate(idx):
            sl = slice(g * G, (g + 1) * G)
            out.groups_sampled += 1
            flat = max(result.total[sl]) == min(result.total[sl])
            out.zero_variance_groups += int(flat)
            if (flat and hp.dynamic_sampling) or len(out.completions) >= hp.prompts_per_step * G:
                continue
            out.add_group(comps[sl], j, result, sl, baselines[g] if baselines is not None else None)
        if len(out.completions) >= hp.prompts_per_step * G:
            break
    return out


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
) -> dict[str, Tensor]:
    """``ppo_epochs`` passes over shuffled minibatches; returns the mean of each stat over updates."""
    policy_loss = POLICY_LOSSES[hp.policy_loss or "ppo_clip"]
    clip = ClipParams(low=hp.clip_low, high=hp.clip_high or hp.clip_low, dual_c=hp.dual_clip)
    n = len(adv)
    size = hp.minibatch_size or n
    sums: dict[str, Tensor] = {}
    updates = 0
    for _ in range(hp.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, size):
            mb = order[start : start + size].to(batch.input_ids.device)
            logits, logp = forward_logps(policy, batch.select(mb))
            old = logp.detach() if old_logp is None else old_logp[mb]  # None: on-policy, ratio 1
            out = policy_loss(logp, old, adv[mb], mask[mb], clip=clip)
            per_token = out.per_token
            stats = {f"policy/{k}": v for k, v in out.stats.items()}
            stats["loss/policy"] = aggregate(
                per_token, mask[mb], hp.loss_aggregation or "token_mean", max_len=hp.max_new_tokens
            ).detach()
            if ref_logp is not None:
                kl_tok = KL_ESTIMATORS[hp.kl_estimator](logp, ref_logp[mb])
                stats["kl/ref"] = masked_mean(kl_tok.detach(), mask[mb])
                stats["kl/seq"] = (kl_tok.detach() * mask[mb]).sum(-1).mean()
                if hp.kl_placement == "loss" and kl_coef > 0:
                    per_token = per_token + kl_coef * kl_tok
            entropy = entropy_from_logits(logits)
            stats["policy/entropy"] = masked_mean(entropy.detach(), mask[mb])
            if hp.entropy_coef > 0:
                per_token = per_token - hp.entropy_coef * entropy
            loss = aggregate(
                per_token, mask[mb], hp.loss_aggregation or "token_mean", max_len=hp.max_new_tokens
            )
            stats["loss/total"] = loss.detach()
            grad_norm = backward_and_step(
                policy, optimizer, loss, hp.max_grad_norm, skip_nonfinite=hp.on_nonfinite == "skip"
            )
            stats["skipped_updates"] = torch.tensor(float(grad_norm is None))
            stats["grad_norm"] = grad_norm if grad_norm is not None else torch.tensor(float("nan"))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
            updates += 1
    return {k: v / updates for k, v in sums.items()}


def run_group_rl(spec: GroupRlSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the group-family preset ``spec.algorithm`` on a prompts dataset."""
    hp = spec.hyperparameters
    # Resolve every model before seeding: building a tiny preset on first use draws from torch's RNG.
    model_path = str(ctx.resume_from) if ctx.resume_from else ctx.resolve_model(spec.model)
    kl_needed = (hp.kl_coef or 0) > 0 or hp.kl_controller == "adaptive"
    # The reference is always the original start, also when resuming.
    reference_path = ctx.resolve_model(spec.reference_model or spec.model) if kl_needed else None
    gen = seed_everything(hp.seed)
    device = pick_device()
    policy, tokenizer = load_causal_lm(model_path)
    policy.to(device)
    reference = None
    if reference_path is not None:
        reference, _ = load_causal_lm(reference_path)
        reference.to(device).eval().requires_grad_(False)
    engine = make_engine(hp.engine, model=policy, tokenizer=tokenizer, model_path=model_path)
    reward = build_reward(spec.rewards, ctx.resolve_model, device)
    eval_reward = build_reward(spec.eval_rewards, ctx.resolve_model, device) if spec.eval_rewards else reward
    prompts = tokenize_prompts(data.train, tokenizer, hp.max_prompt_length)
    val_prompts = tokenize_prompts(data.validation, tokenizer, hp.max_prompt_length)

    optimizer = make_optimizer(policy, hp.lr, hp.weight_decay)
    sampler = EpochSampler(len(prompts.ids), hp.prompts_per_step, gen)
    checkpointer = Checkpointer(
        ctx.checkpoint_dir,
        reporter,
        keep_last=hp.keep_last_checkpoints,
        best_metric=hp.best_metric,
        best_mode=hp.best_mode,
    )
    start, kl_init = 0, hp.kl_coef or 0.0
    if ctx.resume_from is not None:
        resumed = load_trainer_state(ctx.resume_from, optimizer=optimizer, sampler=sampler)
        start, kl_init = resumed.step, float(resumed.extra.get("kl_coef", kl_init))
        reporter.event("info", f"resumed from checkpoint at step {start}")
        if start >= hp.max_steps:
            return LoopResult(status="succeeded", output_path=ctx.resume_from)
    kl_ctl = KL_CONTROLLERS[hp.kl_controller](init_coef=kl_init, target=hp.kl_target, horizon=hp.kl_horizon)
    advantage = ADVANTAGES[hp.advantage or "grpo"]
    reporter.event(
        "info",
        f"{spec.algorithm}: {len(prompts.ids)} prompts ({len(val_prompts.ids)} held out), "
        f"G={hp.samples_per_prompt}, {hp.max_steps} steps on {device.type}",
    )

    last_eval: dict[str, float] = {}
    if val_prompts.ids and start == 0:  # the starting point, so a curve shows what RL added
        last_eval = evaluate_greedy(engine, val_prompts, eval_reward, hp, seed=hp.seed)
        reporter.log_metrics(0, last_eval)
    pad_id = tokenizer.pad_token_id

    def keep_work(s: int) -> object:  # a checkpoint of the steps done, when a cancel or pause stops us
        return checkpointer.save(
            s,
            model=policy,
            tokenizer=tokenizer,
            optimizer=optimizer,
            sampler=sampler,
            metrics=last_eval,
            extra={"kl_coef": kl_ctl.value},
        )

    for step in range(start + 1, hp.max_steps + 1):
        if stop_requested(reporter, step, start, checkpointer.saved, keep_work):
            return LoopResult(status="cancelled", output_path=None)
        set_lr(optimizer, warmup_constant_lr(step, base_lr=hp.lr, warmup_steps=hp.warmup_steps))

        t0 = time.perf_counter()  # ---- rollouts and rewards
        engine.sync_weights(policy)
        ro = collect_rollouts(
            engine,
            prompts,
            sampler,
            reward,
            hp,
            greedy_baseline=hp.advantage == "remax",
            seed=hp.seed * 100_003 + step,
        )
        t_gen = time.perf_counter() - t0
        metrics: dict[str, float] = {
            "groups/zero_variance_frac": ro.zero_variance_groups / ro.groups_sampled,
            "groups/trained": len(ro.completions) / hp.samples_per_prompt,
            "kl/coef": kl_ctl.value,
            "lr": optimizer.param_groups[0]["lr"],
        }
        if not ro.completions:  # dynamic sampling found no group with signal: nothing to learn from
            reporter.event("warning", f"step {step}: every sampled group had equal rewards; no update")
            reporter.log_metrics(step, metrics | {"perf/gen_s": t_gen})
            continue

        t1 = time.perf_counter()  # ---- log-probs, advantages, policy update
        batch = to_token_batch(ro.completions, pad_id, device)
        mask = batch.response_mask
        if hp.mask_truncated:
            keep = torch.tensor([c.finish_reason != "length" for c in ro.completions], device=device)
            mask = mask * keep[:, None].float()
        ref_logp = frozen_logps(reference, batch) if reference is not None else None
        # One epoch over one minibatch is on-policy: the old log-probs are the update's own forward pass
        # (detached), so the separate no-grad pass is skipped (as TRL does), unless KL-in-reward needs them.
        on_policy = hp.ppo_epochs == 1 and (hp.minibatch_size or len(ro.completions)) >= len(ro.completions)
        kl_in_reward = ref_logp is not None and hp.kl_placement == "reward"
        old_logp = frozen_logps(policy, batch) if not on_policy or kl_in_reward else None
        scores = torch.tensor(ro.total, dtype=torch.float32, device=device)
        if kl_in_reward:  # sequence KL folded into the reward
            assert old_logp is not None and ref_logp is not None
            seq_kl = (KL_ESTIMATORS[hp.kl_estimator](old_logp, ref_logp) * mask).sum(-1)
            scores = scores - kl_ctl.value * seq_kl
        group_ids = torch.tensor(ro.prompt_index, device=device)
        baseline = torch.tensor(ro.baseline, dtype=torch.float32, device=device) if ro.baseline else None
        adv = advantage(OutcomeBatch(scores=scores, group_ids=group_ids, baseline=baseline))
        stats = policy_update(policy, optimizer, batch, old_logp, ref_logp, adv, mask, hp, kl_ctl.value, gen)
        if "kl/seq" in stats:  # the controller's target (Ziegler et al. 2019) is a per-sequence KL
            kl_ctl.update(float(stats["kl/seq"]), len(ro.completions))
        t_train = time.perf_counter() - t1

        # ---- metrics, samples, eval, checkpoint
        if is_due(step, hp.log_every, hp.max_steps):
            n_tokens = int(mask.sum())
            metrics |= to_floats(stats) | rollout_metrics(ro.completions, ro.rewards)
            metrics |= {
                "adv/mean": float(adv.mean()),
                "adv/std": float(adv.std(unbiased=False)),
                "perf/gen_s": t_gen,
                "perf/train_s": t_train,
                "perf/tokens_per_s": n_tokens / max(t_gen + t_train, 1e-9),
            }
        if val_prompts.ids and is_due(step, hp.eval_every, hp.max_steps):
            engine.sync_weights(policy)
            last_eval = evaluate_greedy(engine, val_prompts, eval_reward, hp, seed=hp.seed)
            metrics |= last_eval
        if float(stats.get("skipped_updates", 0.0)) > 0:
            reporter.event("warning", f"step {step}: non-finite loss or gradient; those updates were skipped")
        reporter.log_metrics(step, metrics)
        if hp.sample_every and hp.samples_to_store and is_due(step, hp.sample_every, hp.max_steps):
            reporter.log_samples(
                step,
                sample_records(ro.completions, prompts, ro.prompt_index, ro.rewards, hp.samples_to_store),
            )
        if is_due(step, hp.checkpoint_every, hp.max_steps):
            path = checkpointer.save(
                step,
                model=policy,
                tokenizer=tokenizer,
                optimizer=optimizer,
                sampler=sampler,
                metrics=metrics | last_eval,
                extra={"kl_coef": kl_ctl.value},
            )
            if step == hp.max_steps:
                reporter.event("info", f"final model saved to {path}")
                return LoopResult(status="succeeded", output_path=path, final_metrics=metrics)
    # Only reachable when the last step made no update (dynamic sampling found no signal).
    path = checkpointer.save(
        hp.max_steps,
        model=policy,
        tokenizer=tokenizer,
        optimizer=optimizer,
        sampler=sampler,
        metrics=last_eval,
        extra={"kl_coef": kl_ctl.value},
    )
    return LoopResult(status="succeeded", output_path=path)
