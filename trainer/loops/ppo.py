"""PPO with a learned critic and GAE (Schulman et al. 2017; InstructGPT, Ouyang et al. 2022), and VC-PPO
(Yuan et al. 2025: value pretraining, decoupled critic lambda, length-adaptive actor lambda).

One RL step, top to bottom: sample prompts -> G completions each (HF generate or vLLM) -> rewards from the
verifiers / reward model -> old-policy log-probs, reference log-probs and per-token values (no grad) ->
per-token rewards (the score on the last response token, minus beta * KL on every token when the KL is
placed in the reward) -> GAE advantages for the actor (lambda fixed, or 1 - 1/(alpha * length) per
sequence) and GAE returns for the critic (its own lambda) -> optional whitening -> ``ppo_epochs`` passes
over minibatches: clipped policy loss (+ KL in the loss, - entropy bonus) and clipped value loss, each model
with its own optimizer -> metrics, samples, eval, checkpoint. For the first ``value_pretrain_steps`` steps
only the critic trains. The algorithm name only chose presets (trainer/specs/online.py PPO_PRESETS); the
loop never branches on it.

The critic is a value head on an LM: ``AutoModelForSequenceClassification(num_labels=1)``, loaded from the
policy's starting model (fresh head) or from a reward-model run (its trained head: the InstructGPT recipe).
Its per-token values come from the head applied to every hidden state, not only the last one
(``token_values``). Models stay in eval mode (dropout off), so the first minibatch's ratio is exactly 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import add_adapter, has_adapter, load_trainable_state, trainable_state
from trainer.algorithms.advantages import gae, length_adaptive_lam
from trainer.algorithms.aggregation import aggregate, batch_normaliser, masked_whiten
from trainer.algorithms.kl import KL_ESTIMATORS, kl_penalized_rewards
from trainer.algorithms.value_losses import value_loss
from trainer.loops.rl_common import (
    ActorBatch,
    StatMeans,
    TokenBatch,
    WeightedMeans,
    actor_step,
    checkpointed_training,
    close_rl_step,
    evaluate_start,
    kl_controller,
    masked_mean,
    micro_slices,
    minibatches,
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
from trainer.loops.session import (
    Start,
    TrainingSession,
    accumulate_and_step,
    begin,
    enable_checkpointing,
    load_policy,
    make_optimizer,
    set_lr,
    to_floats,
    warmup_constant_lr,
)
from trainer.models import load_reward_model
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.rollout.base import Completion
from trainer.specs import PpoHyperparameters, PpoSpec


def token_values(critic: Any, batch: TokenBatch) -> Tensor:
    """(N, W) per-token values, aligned with the log-prob positions of ``forward_logps`` (the batch's
    completion window: column k is position ``batch.offset + k``).

    ``values[:, t]`` is the value head applied to the backbone's hidden state at position t. A causal model
    sees ``input_ids[:, :t+1]`` there: the state in which token t+1 is chosen, the action whose log-prob
    sits at position t. So ``values[:, t] = V(s_t)`` pairs with ``logp[:, t]``, and the first response
    position (last prompt token) holds V(prompt). The last position (after the final token) is dropped:
    it would be the value of a finished sequence.
    """
    model = critic.get_base_model() if has_adapter(critic) else critic  # adapter layers sit inside it
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    values: Tensor = model.score(hidden[:, batch.offset : -1]).squeeze(-1).float()
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
    is_weight: Tensor | None = None  # truncated IS weights of the policy term (sampler correction)

    def select(self, idx: Tensor) -> PpoBatch:
        return PpoBatch(
            self.tokens.select(idx),
            self.mask[idx],
            self.old_logp[idx],
            None if self.ref_logp is None else self.ref_logp[idx],
            self.old_values[idx],
            self.adv[idx],
            self.returns[idx],
            None if self.is_weight is None else self.is_weight[idx],
        )


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of ``x`` over valid positions."""
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)


def value_clipfrac(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Fraction of valid tokens where the clipped value error is the larger, active one (verl vf_clipfrac)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).float(), mask)


def critic_step(
    critic: Any, optimizer: torch.optim.Optimizer, mb: PpoBatch, hp: PpoHyperparameters
) -> dict[str, Tensor]:
    """One optimizer step of the critic: the clipped value loss around the rollout-time values
    (``value_loss``), aggregated like the policy loss (``hp.loss_aggregation``), weighted by ``vf_coef``;
    in micro-batches of ``hp.micro_batch_size`` rows whose gradients add up to the minibatch's."""
    normaliser = batch_normaliser(mb.mask, hp.loss_aggregation)
    means = WeightedMeans()

    def losses() -> Iterator[Tensor]:
        for rows in micro_slices(len(mb.adv), hp.micro_batch_size, mb.adv.device):
            part = mb.select(rows)
            values = token_values(critic, part.tokens)
            v_loss = aggregate(
                value_loss(values, part.old_values, part.returns, part.mask, clip_range=hp.value_clip),
                part.mask,
                hp.loss_aggregation,
                normaliser=normaliser,
                max_len=hp.max_new_tokens,
            )
            stats = {"loss/value": v_loss.detach()}
            if hp.value_clip is not None:
                stats["value/clipfrac"] = value_clipfrac(
                    values.detach(), part.old_values, part.returns, part.mask, hp.value_clip
                )
            means.add(stats, tokens=float(part.mask.sum()), rows=float(len(rows)))
            yield hp.vf_coef * v_loss

    with checkpointed_training(critic, hp.gradient_checkpointing):
        norm = accumulate_and_step(
            critic, optimizer, losses(), hp.max_grad_norm, skip_nonfinite=hp.on_nonfinite == "skip"
        )
    stats = means.means()
    stats["value/grad_norm"] = norm if norm is not None else torch.tensor(float("nan"))
    stats["skipped_updates"] = torch.tensor(float(norm is None))
    return stats


def ppo_update(
    session: TrainingSession,
    critic: Any,
    critic_opt: torch.optim.Optimizer,
    b: PpoBatch,
    hp: PpoHyperparameters,
    kl_coef: float,
    *,
    train_actor: bool,
    measure_mismatch: bool = False,
) -> dict[str, Tensor]:
    """``ppo_epochs`` passes over shuffled minibatches, each a critic step then an ``actor_step``; returns
    the mean of each stat over updates. With ``measure_mismatch`` (the old log-probs are the sampler's)
    the first actor update logs their mismatch with its own log-probs.

    Critic and actor share no parameters, so one backward over ``actor loss + vf_coef * value loss`` gives
    the same gradients as the two separate steps here; separate steps let each model clip its own gradient
    norm (a joint clip would let the value loss shrink the policy's step). With ``train_actor`` False
    (value pretraining) the policy is not even run.
    """
    means = StatMeans()
    for i, idx in enumerate(minibatches(len(b.adv), hp, session.generator)):
        mb = b.select(idx.to(b.adv.device))
        stats = critic_step(critic, critic_opt, mb, hp)
        total = hp.vf_coef * stats["loss/value"]
        if train_actor:
            actor = actor_step(
                session.model,
                session.optimizer,
                ActorBatch(
                    mb.tokens,
                    mb.mask,
                    mb.adv,
                    mb.old_logp,
                    mb.ref_logp,
                    is_weight=mb.is_weight,
                    measure_mismatch=measure_mismatch and i == 0,
                ),
                hp,
                kl_coef,
            )
            total = total + actor.pop("loss/total")
            skipped = stats["skipped_updates"] + actor.pop("skipped_updates")
            stats |= actor | {"skipped_updates": skipped}
        stats["loss/total"] = total
        means.add(stats)
    return means.means()


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


def rollout_kl(old_logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> dict[str, Tensor]:
    """``kl/ref`` (mean per valid token) and ``kl/seq`` (mean per sequence of the summed token KL) of the
    rollouts to the reference, with the estimator the reward penalty uses (Schulman 2020's k1/k2/k3)."""
    kl_tok = KL_ESTIMATORS[estimator](old_logp, ref_logp)
    kl_tok = torch.where(mask > 0, kl_tok, torch.zeros_like(kl_tok))
    return {"kl/ref": kl_tok.sum() / mask.sum().clamp(min=1), "kl/seq": kl_tok.sum(-1).mean()}


def prompt_values(
    old_values: Tensor, completions: list[Completion], offset: int
) -> Callable[[list[dict[str, Any]]], None]:
    """Adds to stored sample i the critic's V(prompt) at rollout time, next to its reward (``old_values``
    covers the completion window starting at position ``offset``)."""

    def annotate(records: list[dict[str, Any]]) -> None:
        for i, record in enumerate(records):
            record["value"] = float(old_values[i, len(completions[i].prompt_ids) - 1 - offset])

    return annotate


def load_actor_critic(start: Start, critic_path: str, hp: PpoHyperparameters) -> tuple[Any, Any, Any]:
    """Policy, its tokenizer and the critic, in eval mode on the run's device (eval: no dropout, so old and
    new log-probs agree before any update). The critic loads first, so a fresh value head is drawn from the
    freshly seeded RNG (as in the reward-model loop); when resuming, its trained weights come later from
    the checkpoint."""
    with start.reporter.phase("model_load"):
        critic, critic_tok = load_reward_model(critic_path)
        if hp.gradient_checkpointing:
            enable_checkpointing(critic)
        if start.adapter is not None:  # the critic trains an adapter and its value head too
            critic = add_adapter(critic, start.adapter, "score")
    policy, tokenizer = load_policy(start, hp)
    if critic_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the critic {critic_path!r} has a different tokenizer from the policy")
    return policy.to(start.device).eval(), tokenizer, critic.to(start.device).eval()


def actor_schedule(hp: PpoHyperparameters) -> Callable[[int], float]:
    """The actor's learning rate by step: 0 during value pretraining, then its own warmup (so value
    pretraining does not eat it), then constant."""
    pretrain = hp.value_pretrain_steps
    return lambda step: (
        warmup_constant_lr(step - pretrain, base_lr=hp.lr, warmup_steps=hp.warmup_steps)
        if step > pretrain
        else 0.0
    )


def run_ppo(spec: PpoSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with PPO / VC-PPO (preset ``spec.algorithm``) on a prompts dataset."""
    hp = spec.hyperparameters
    # Resolve every model before seeding (``begin``): building a tiny preset draws from torch's RNG.
    critic_path = ctx.resolve_model(spec.critic_model or spec.model)
    ref_path = reference_path(spec, ctx)
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    policy, tokenizer, critic = load_actor_critic(start, critic_path, hp)
    parts = prepare_rl(spec, data, ctx, start, policy, tokenizer, ref_path)
    pretrain, critic_lr = hp.value_pretrain_steps, hp.critic_learning_rate or hp.lr
    critic_opt = make_optimizer(critic, critic_lr, hp.weight_decay, hp.precision)
    session = TrainingSession(
        start,
        hp,
        policy,
        tokenizer,
        len(parts.prompts.ids),
        batch_size=hp.prompts_per_step,
        schedule=actor_schedule(hp),
    )
    if session.finished_before:
        return session.result
    # An adapter run keeps the critic's trainable tensors only (adapter + value head), not a full copy.
    critic_state = trainable_state if spec.adapter is not None else (lambda m: m.state_dict())
    if session.resumed:
        if spec.adapter is not None:
            load_trainable_state(critic, session.extra["critic"])
        else:
            critic.load_state_dict(session.extra["critic"])
        critic_opt.load_state_dict(session.extra["critic_optimizer"])
    kl_ctl = kl_controller(hp, session)
    # The policy is the run's model (its folder is the output); the critic, its optimizer and the KL
    # coefficient ride in trainer_state.pt so a resume continues exactly.
    session.extra_state = lambda: {
        "kl_coef": kl_ctl.value,
        "critic": critic_state(critic),
        "critic_optimizer": critic_opt.state_dict(),
    }
    reporter.event(
        "info",
        f"{spec.algorithm}: {len(parts.prompts.ids)} prompts ({len(parts.val_prompts.ids)} held out), "
        f"G={hp.samples_per_prompt}, {hp.max_steps} steps ({pretrain} critic-only) on {start.device.type}",
    )
    evaluate_start(session, parts, hp)

    for step in session.steps():
        train_actor = step > pretrain
        if pretrain > 0 and step == pretrain + 1:
            reporter.event(
                "info", f"actor updates start at step {step}, after {pretrain} critic-only step(s)"
            )
        set_lr(critic_opt, warmup_constant_lr(step, base_lr=critic_lr, warmup_steps=hp.warmup_steps))
        ro, t_gen = sample_step(session, parts, hp, greedy_baseline=False)  # ---- rollouts and rewards
        metrics = {"kl/coef": kl_ctl.value, "lr": session.lr, "value/lr": critic_opt.param_groups[0]["lr"]}
        if not ro.completions:  # dynamic sampling found no group with signal: nothing to learn from
            skip_step(session, parts, hp, metrics | {"perf/gen_s": t_gen}, ro)
            continue

        t1 = time.perf_counter()  # ---- log-probs, values, advantages, updates
        tokens = to_token_batch(ro.completions, tokenizer.pad_token_id, start.device)
        mask = response_mask(tokens, ro.completions, hp.mask_truncated)
        old = old_logps(policy, tokens, sampler_logps(ro.completions, tokens), mask, hp, needed=True)
        assert old.logp is not None  # PPO always has old log-probs: recomputed, or the sampler's
        old_logp, is_weight = old.logp, old.is_weight
        ref_logp = reference_logps(parts, tokens, hp.temperature)
        old_values = frozen_values(critic, tokens)
        scores = torch.tensor(ro.total, dtype=torch.float32, device=start.device)
        adv, returns, actor_lam = token_advantages(
            scores, old_logp, ref_logp, old_values, mask, tokens.response_mask.sum(-1), hp, kl_ctl.value
        )
        batch = PpoBatch(tokens, mask, old_logp, ref_logp, old_values, adv, returns, is_weight)
        stats = ppo_update(
            session,
            critic,
            critic_opt,
            batch,
            hp,
            kl_ctl.value,
            train_actor=train_actor,
            measure_mismatch=old.from_sampler,
        )
        stats |= old.mismatch
        if ref_logp is not None:  # KL of this step's rollouts to the reference (what the reward penalises)
            stats |= rollout_kl(old_logp, ref_logp, mask, hp.kl_estimator)
            if train_actor:  # while the actor is frozen its KL says nothing about the coefficient
                kl_ctl.update(float(stats["kl/seq"]), len(ro.completions))  # per sequence: Ziegler's unit
        t_train = time.perf_counter() - t1

        if session.log_due:  # ---- metrics, samples, eval, checkpoint
            metrics |= to_floats(stats) | step_rollout_metrics(ro) | value_metrics(batch, actor_lam)
            metrics |= perf_metrics(t_gen, t_train, mask)
        annotate = prompt_values(old_values, ro.completions, tokens.offset)
        close_rl_step(session, parts, hp, metrics, ro, stats, annotate=annotate)
    return session.result
