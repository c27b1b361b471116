"""PPO with a learned critic and GAE (Schulman et al. 2017; InstructGPT, Ouyang et al. 2022), and VC-PPO
(Yuan et al. 2025: value pretraining, decoupled critic lambda, length-adaptive actor lambda).

One RL step, top to bottom: sample prompts -> G completions each (HF generate or vLLM) -> rewards from the
verifiers / reward model -> old-policy log-probs, reference log-probs and per-token values (no grad) ->
per-token rewards (the score on the last response token, minus beta * KL on every token when the KL is
placed in the reward) -> GAE advantages for the actor (lambda fixed, or 1 - 1/(alpha * length) per
sequence) and GAE returns for the critic (its own lambda) -> optional whitening -> ``ppo_epochs`` passes
over minibatches: clipped policy loss (+ KL in the loss, - entropy bonus) and clipped value loss, each model
with its own optimizer -> metrics, samples, eval, checkpoint. For the first ``value_pretrain_steps`` steps
only the critic trains. The algorithm name only chose presets (trainer/specs.py PPO_PRESETS); the loop never
branches on it.

The critic is a value head on an LM: ``AutoModelForSequenceClassification(num_labels=1)``, loaded from the
policy's starting model (fresh head) or from a reward-model run (its trained head: the InstructGPT recipe).
Its per-token values come from the head applied to every hidden state, not only the last one
(``token_values``). Models stay in eval mode (dropout off), so the first minibatch's ratio is exactly 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.advantages import gae, length_adaptive_lam
from trainer.algorithms.aggregation import aggregate, masked_whiten
from trainer.algorithms.kl import KL_ESTIMATORS, kl_penalized_rewards
from trainer.algorithms.kl_control import KL_CONTROLLERS
from trainer.algorithms.logprobs import entropy_from_logits
from trainer.algorithms.policy_losses import POLICY_LOSSES, ClipParams
from trainer.algorithms.value_losses import value_loss
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
from trainer.loops.group_rl import collect_rollouts
from trainer.loops.reward_model import load_reward_model
from trainer.loops.rl_common import (
    TokenBatch,
    build_reward,
    evaluate_greedy,
    forward_logps,
    frozen_logps,
    masked_mean,
    rollout_metrics,
    sample_records,
    to_token_batch,
    tokenize_prompts,
)
from trainer.models import load_causal_lm
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.rollout.factory import make_engine
from trainer.specs import PpoHyperparameters, PpoSpec


def token_values(critic: Any, batch: TokenBatch) -> Tensor:
    """(N, L-1) per-token values, aligned with the log-prob positions of ``forward_logps``.

    ``values[:, t]`` is the value head applied to the backbone's hidden state at position t. A causal model
    sees ``input_ids[:, :t+1]`` there: the state in which token t+1 is chosen, the action whose log-prob
    sits at position t. So ``values[:, t] = V(s_t)`` pairs with ``logp[:, t]``, and the first response
    position (last prompt token) holds V(prompt). The last position (after the final token) is dropped:
    it would be the value of a finished sequence.
    """
    backbone = getattr(critic, critic.base_model_prefix)
    hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    values: Tensor = critic.score(hidden).squeeze(-1)[:, :-1].float()
    return values


@torch.no_grad()
def frozen_values(critic: Any, batch: TokenBatch, chunk: int = 64) -> Tensor:
    """``token_values`` without grad, in chunks (the rollout-time values GAE and value clipping use)."""
    n = len(batch.input_ids)
    return torch.cat(
        [token_values(critic, batch.select(torch.arange(i, min(i + chunk, n)))) for i in range(0, n, chunk)]
    )


def token_advantages(
    scores: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    values: Tensor,
    mask: Tensor,
    lengths: Tensor,
    hp: PpoHyperparameters,
    kl_coef: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The actor's advantages, the critic's targets and the actor's per-sequence lambda.

    Args:
        scores: (N,) sequence rewards.
        old_logp: (N, T) rollout-policy log-probs of the sampled tokens.
        ref_logp: (N, T) reference log-probs, or None when there is no reference (no KL).
        values: (N, T) rollout-time values (``frozen_values``).
        mask: (N, T) 1 on response tokens that count.
        lengths: (N,) response lengths in tokens (for the length-adaptive lambda).
        hp: gamma, lam, critic_lam, length_adaptive_alpha, kl_placement, kl_estimator, whiten_advantages.
        kl_coef: the KL coefficient this step (the controller's value).

    Returns:
        ``(adv, returns, actor_lam)``: (N, T) advantages as the policy loss uses them (whitened over valid
        tokens when ``whiten_advantages``), (N, T) value targets, (N,) the lambda the actor's GAE used.

    Per-token rewards: the score on the last valid token, and with ``kl_placement == "reward"`` (and a
    reference) ``-kl_coef * KL_t`` on every valid token (``kl_penalized_rewards``); with ``"loss"`` the KL
    goes into the loss instead. Actor: ``gae(lam=actor_lam)``. Critic: ``gae(lam=critic_lam)[1]``, the
    VC-PPO decoupling (critic_lam = 1 gives unbiased Monte-Carlo targets); one GAE call when both are equal.
    """
    if hp.lam is None or hp.critic_lam is None:
        raise ValueError("lam and critic_lam are filled by the preset: build hyperparameters via PpoSpec")
    in_reward = ref_logp is not None and hp.kl_placement == "reward"
    rewards = kl_penalized_rewards(
        scores,
        old_logp,
        ref_logp if ref_logp is not None and in_reward else old_logp,  # no KL term: KL(p, p) = 0
        mask,
        kl_coef=kl_coef if in_reward else 0.0,
        estimator=hp.kl_estimator,
    )
    if hp.length_adaptive_alpha is not None:
        actor_lam = length_adaptive_lam(lengths.to(rewards.dtype), hp.length_adaptive_alpha)
    else:
        actor_lam = torch.full_like(scores, hp.lam, dtype=rewards.dtype)
    adv, returns = gae(rewards, values, mask, gamma=hp.gamma, lam=actor_lam)
    if hp.length_adaptive_alpha is not None or hp.critic_lam != hp.lam:
        returns = gae(rewards, values, mask, gamma=hp.gamma, lam=hp.critic_lam)[1]
    if hp.whiten_advantages:
        adv = masked_whiten(adv, mask)
    return adv, returns, actor_lam


@dataclass(frozen=True)
class PpoBatch:
    """One step's rollouts as tensors; every (N, T) tensor is aligned with ``tokens.response_mask``."""

    tokens: TokenBatch
    mask: Tensor  # response tokens that count (rows of truncated completions zeroed with mask_truncated)
    old_logp: Tensor
    ref_logp: Tensor | None
    old_values: Tensor
    adv: Tensor
    returns: Tensor

    def select(self, idx: Tensor) -> PpoBatch:
        return PpoBatch(
            self.tokens.select(idx),
            self.mask[idx],
            self.old_logp[idx],
            None if self.ref_logp is None else self.ref_logp[idx],
            self.old_values[idx],
            self.adv[idx],
            self.returns[idx],
        )


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of ``x`` over valid positions."""
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)


def value_clipfrac(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Fraction of valid tokens where the clipped value error is the larger, active one (verl vf_clipfrac)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).float(), mask)


def ppo_update(
    policy: Any,
    critic: Any,
    policy_opt: torch.optim.Optimizer,
    critic_opt: torch.optim.Optimizer,
    b: PpoBatch,
    hp: PpoHyperparameters,
    kl_coef: float,
    gen: torch.Generator,
    *,
    train_actor: bool,
) -> dict[str, Tensor]:
    """``ppo_epochs`` passes over shuffled minibatches; returns the mean of each stat over updates.

    Critic and actor share no parameters, so one backward over ``actor loss + vf_coef * value loss`` gives
    the same gradients as the two separate ``backward_and_step`` calls here; separate calls let each model
    clip its own gradient norm (a joint clip would let the value loss shrink the policy's step). With
    ``train_actor`` False (value pretraining) the policy is not even run.
    """
    policy_loss = POLICY_LOSSES[hp.policy_loss or "ppo_clip"]
    clip = ClipParams(low=hp.clip_low, high=hp.clip_high or hp.clip_low, dual_c=hp.dual_clip)
    mode = hp.loss_aggregation or "token_mean"
    n = len(b.adv)
    size = hp.minibatch_size or n
    sums: dict[str, Tensor] = {}
    updates = 0
    for _ in range(hp.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, size):
            mb = b.select(order[start : start + size].to(b.adv.device))
            # ---- critic: clipped value loss around the rollout-time values, token mean
            values = token_values(critic, mb.tokens)
            v_loss = aggregate(
                value_loss(values, mb.old_values, mb.returns, mb.mask, clip_range=hp.value_clip),
                mb.mask,
                "token_mean",
            )
            stats = {"loss/value": v_loss.detach()}
            if hp.value_clip is not None:
                stats["value/clipfrac"] = value_clipfrac(
                    values.detach(), mb.old_values, mb.returns, mb.mask, hp.value_clip
                )
            skip = hp.on_nonfinite == "skip"
            v_norm = backward_and_step(
                critic, critic_opt, hp.vf_coef * v_loss, hp.max_grad_norm, skip_nonfinite=skip
            )
            stats["value/grad_norm"] = v_norm if v_norm is not None else torch.tensor(float("nan"))
            stats["skipped_updates"] = torch.tensor(float(v_norm is None))
            total = hp.vf_coef * v_loss.detach()
            # ---- actor: clipped surrogate (+ KL to the reference in the loss) - entropy bonus
            if train_actor:
                logits, logp = forward_logps(policy, mb.tokens)
                out = policy_loss(logp, mb.old_logp, mb.adv, mb.mask, clip=clip)
                per_token = out.per_token
                stats |= {f"policy/{k}": v for k, v in out.stats.items()}
                stats["loss/policy"] = aggregate(per_token, mb.mask, mode, max_len=hp.max_new_tokens).detach()
                if mb.ref_logp is not None and hp.kl_placement == "loss" and kl_coef > 0:
                    per_token = per_token + kl_coef * KL_ESTIMATORS[hp.kl_estimator](logp, mb.ref_logp)
                entropy = entropy_from_logits(logits)
                stats["policy/entropy"] = masked_mean(entropy.detach(), mb.mask)
                if hp.entropy_coef > 0:
                    per_token = per_token - hp.entropy_coef * entropy
                loss = aggregate(per_token, mb.mask, mode, max_len=hp.max_new_tokens)
                p_norm = backward_and_step(policy, policy_opt, loss, hp.max_grad_norm, skip_nonfinite=skip)
                stats["grad_norm"] = p_norm if p_norm is not None else torch.tensor(float("nan"))
                stats["skipped_updates"] = stats["skipped_updates"] + float(p_norm is None)
                total = total + loss.detach()
            stats["loss/total"] = total
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
            updates += 1
    return {k: v / updates for k, v in sums.items()}


def value_metrics(b: PpoBatch, actor_lam: Tensor) -> dict[str, float]:
    """value/mean, value/explained_variance (omitted when the returns are constant), adv/*, lam/*."""
    res_var, ret_var = masked_var(b.returns - b.old_values, b.mask), masked_var(b.returns, b.mask)
    out = {
        "value/mean": float(masked_mean(b.old_values, b.mask)),
        "value/return_mean": float(masked_mean(b.returns, b.mask)),
        "adv/mean": float(masked_mean(b.adv, b.mask)),
        "adv/std": float(masked_var(b.adv, b.mask).sqrt()),
        "lam/actor_mean": float(actor_lam.mean()),
    }
    # 1 - Var[R - V] / Var[R]: 1 is a perfect critic, 0 no better than a constant. Omitted for (nearly)
    # constant returns, where it is 0/0 blown up by float rounding.
    if float(ret_var) > 1e-8:
        out["value/explained_variance"] = float(1 - res_var / ret_var)
    return out


def run_ppo(spec: PpoSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with PPO / VC-PPO (preset ``spec.algorithm``) on a prompts dataset."""
    hp = spec.hyperparameters
    if hp.dynamic_sampling and hp.samples_per_prompt < 2:
        raise ValueError("dynamic_sampling drops groups with equal rewards: it needs samples_per_prompt >= 2")
    # Resolve every reference before seeding: building a tiny preset draws from torch's RNG.
    start_path = ctx.resolve_model(spec.model)
    model_path = str(ctx.resume_from) if ctx.resume_from else start_path
    critic_path = ctx.resolve_model(spec.critic_model) if spec.critic_model else start_path
    kl_needed = (hp.kl_coef or 0) > 0 or hp.kl_controller == "adaptive"
    ref_path = ctx.resolve_model(spec.reference_model or spec.model) if kl_needed else None
    gen = seed_everything(hp.seed)
    device = pick_device()
    # The critic first, so a fresh value head is drawn from the freshly seeded RNG (as in the reward-model
    # loop); when resuming, its trained weights come from the checkpoint below.
    critic, critic_tok = load_reward_model(critic_path)
    policy, tokenizer = load_causal_lm(model_path)
    if critic_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the critic {critic_path!r} has a different tokenizer from the policy")
    policy.to(device).eval()  # eval: no dropout, so old and new log-probs agree before any update
    critic.to(device).eval()
    reference = None
    if ref_path is not None:  # the reference is always the original start, also when resuming
        reference, _ = load_causal_lm(ref_path)
        reference.to(device).eval().requires_grad_(False)
    engine = make_engine(hp.engine, model=policy, tokenizer=tokenizer, model_path=model_path)
    reward = build_reward(spec.rewards, ctx.resolve_model, device)
    eval_reward = build_reward(spec.eval_rewards, ctx.resolve_model, device) if spec.eval_rewards else reward
    prompts = tokenize_prompts(data.train, tokenizer, hp.max_prompt_length)
    val_prompts = tokenize_prompts(data.validation, tokenizer, hp.max_prompt_length)

    policy_opt = make_optimizer(policy, hp.lr, hp.weight_decay)
    critic_lr = hp.critic_learning_rate or hp.lr
    critic_opt = make_optimizer(critic, critic_lr, hp.weight_decay)
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
        resumed = load_trainer_state(ctx.resume_from, optimizer=policy_opt, sampler=sampler)
        start, kl_init = resumed.step, float(resumed.extra.get("kl_coef", kl_init))
        critic.load_state_dict(resumed.extra["critic"])
        critic_opt.load_state_dict(resumed.extra["critic_optimizer"])
        reporter.event("info", f"resumed from checkpoint at step {start}")
        if start >= hp.max_steps:
            return LoopResult(status="succeeded", output_path=ctx.resume_from)
    kl_ctl = KL_CONTROLLERS[hp.kl_controller](init_coef=kl_init, target=hp.kl_target, horizon=hp.kl_horizon)
    pretrain = hp.value_pretrain_steps or 0
    reporter.event(
        "info",
        f"{spec.algorithm}: {len(prompts.ids)} prompts ({len(val_prompts.ids)} held out), "
        f"G={hp.samples_per_prompt}, {hp.max_steps} steps ({pretrain} critic-only) on {device.type}",
    )

    def save(step: int, metrics: dict[str, float]) -> Path:
        # The policy is the run's model (its folder is the output); the critic, its optimizer and the KL
        # coefficient ride in trainer_state.pt so a resume continues exactly.
        return checkpointer.save(
            step,
            model=policy,
            tokenizer=tokenizer,
            optimizer=policy_opt,
            sampler=sampler,
            metrics=metrics,
            extra={
                "kl_coef": kl_ctl.value,
                "critic": critic.state_dict(),
                "critic_optimizer": critic_opt.state_dict(),
            },
        )

    last_eval: dict[str, float] = {}
    if val_prompts.ids and start == 0:  # the starting point, so a curve shows what RL added
        last_eval = evaluate_greedy(engine, val_prompts, eval_reward, hp, seed=hp.seed)
        reporter.log_metrics(0, last_eval)
    pad_id = tokenizer.pad_token_id

    def keep_work(s: int) -> object:  # a checkpoint of the steps done, when a cancel or pause stops us
        return save(s, last_eval)

    for step in range(start + 1, hp.max_steps + 1):
        if stop_requested(reporter, step, start, checkpointer.saved, keep_work):
            return LoopResult(status="cancelled", output_path=None)
        train_actor = step > pretrain
        if pretrain > 0 and step == pretrain + 1:
            reporter.event(
                "info", f"actor updates start at step {step}, after {pretrain} critic-only step(s)"
            )
        # The actor's warmup counts its own steps, so value pretraining does not eat it; 0 while frozen.
        actor_lr = warmup_constant_lr(step - pretrain, base_lr=hp.lr, warmup_steps=hp.warmup_steps)
        set_lr(policy_opt, actor_lr if train_actor else 0.0)
        set_lr(critic_opt, warmup_constant_lr(step, base_lr=critic_lr, warmup_steps=hp.warmup_steps))

        t0 = time.perf_counter()  # ---- rollouts and rewards
        engine.sync_weights(policy)
        ro = collect_rollouts(
            engine, prompts, sampler, reward, hp, greedy_baseline=False, seed=hp.seed * 100_003 + step
        )
        t_gen = time.perf_counter() - t0
        metrics: dict[str, float] = {
            "kl/coef": kl_ctl.value,
            "lr": policy_opt.param_groups[0]["lr"],
            "value/lr": critic_opt.param_groups[0]["lr"],
        }
        if not ro.completions:  # dynamic sampling found no group with signal: nothing to learn from
            reporter.event("warning", f"step {step}: every sampled group had equal rewards; no update")
            reporter.log_metrics(step, metrics | {"perf/gen_s": t_gen})
            continue

        t1 = time.perf_counter()  # ---- log-probs, values, advantages, updates
        tokens = to_token_batch(ro.completions, pad_id, device)
        mask = tokens.response_mask
        if hp.mask_truncated:
            keep = torch.tensor([c.finish_reason != "length" for c in ro.completions], device=device)
            mask = mask * keep[:, None].float()
        old_logp = frozen_logps(policy, tokens)
        ref_logp = frozen_logps(reference, tokens) if reference is not None else None
        old_values = frozen_values(critic, tokens)
        scores = torch.tensor(ro.total, dtype=torch.float32, device=device)
        lengths = tokens.response_mask.sum(-1)
        adv, returns, actor_lam = token_advantages(
            scores, old_logp, ref_logp, old_values, mask, lengths, hp, kl_ctl.value
        )
        batch = PpoBatch(tokens, mask, old_logp, ref_logp, old_values, adv, returns)
        stats = ppo_update(
            policy, critic, policy_opt, critic_opt, batch, hp, kl_ctl.value, gen, train_actor=train_actor
        )
        if ref_logp is not None:  # KL of this step's rollouts to the reference (what the reward penalises)
            kl_tok = KL_ESTIMATORS[hp.kl_estimator](old_logp, ref_logp)
            kl_tok = torch.where(mask > 0, kl_tok, torch.zeros_like(kl_tok))
            stats["kl/ref"] = kl_tok.sum() / mask.sum().clamp(min=1)
            stats["kl/seq"] = kl_tok.sum(-1).mean()
            if train_actor:  # while the actor is frozen its KL says nothing about the coefficient
                # Per-sequence KL, the unit of Ziegler et al.'s target (kl_target 6 nats).
                kl_ctl.update(float(stats["kl/seq"]), len(ro.completions))
        t_train = time.perf_counter() - t1

        # ---- metrics, samples, eval, checkpoint
        if is_due(step, hp.log_every, hp.max_steps):
            n_tokens = int(mask.sum())
            metrics |= (
                to_floats(stats)
                | rollout_metrics(ro.completions, ro.rewards)
                | value_metrics(batch, actor_lam)
            )
            metrics |= {
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
            records = sample_records(
                ro.completions, prompts, ro.prompt_index, ro.rewards, hp.samples_to_store
            )
            for i, record in enumerate(records):  # the critic's V(prompt) at rollout time, next to the reward
                record["value"] = float(old_values[i, len(ro.completions[i].prompt_ids) - 1])
            reporter.log_samples(step, records)
        if is_due(step, hp.checkpoint_every, hp.max_steps):
            path = save(step, metrics | last_eval)
            if step == hp.max_steps:
                reporter.event("info", f"final model saved to {path}")
                return LoopResult(status="succeeded", output_path=path, final_metrics=metrics)
    # Only reachable when the last step made no update (dynamic sampling found no signal).
    return LoopResult(status="succeeded", output_path=save(hp.max_steps, last_eval))
