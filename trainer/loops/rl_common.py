"""Pieces every online-RL loop shares: the setup before step 1 (reference, rollout engine, rewards,
prompts, KL controller, the step-0 evaluation), token tensors and log-probs, the actor's minibatch step,
and the close of a step (eval, samples, checkpoint). The loops (group_rl.py, ppo.py) read top to bottom
and call these."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import adapter_off, has_adapter
from trainer.algorithms.aggregation import aggregate, batch_normaliser
from trainer.algorithms.kl import KL_ESTIMATORS
from trainer.algorithms.kl_control import KL_CONTROLLERS, KLController
from trainer.algorithms.logprobs import entropy_from_logits, token_logprobs
from trainer.algorithms.policy_losses import POLICY_LOSSES, ClipParams
from trainer.algorithms.sampler_correction import mismatch_stats, truncated_is_weights
from trainer.data.prompts import PromptSet, tokenize_prompts
from trainer.data.sampling import micro_batches
from trainer.distributed import Ranks, current, gather_rows, is_sharded, padded_share, sum_over_ranks, unwrap
from trainer.loops.async_rollouts import RolloutPrefetch
from trainer.loops.multi_turn import (
    agent_engine,
    engine_context,
    environment_openings,
    multi_turn_engine,
    tag_openings,
    tag_rows,
)
from trainer.loops.rollouts import (
    StepRollouts,
    build_reward,
    collect_rollouts,
    evaluate_greedy,
    sample_records,
    step_rollout_metrics,
)
from trainer.loops.session import Start, TrainingSession, accumulate_and_step, eval_rows, is_due
from trainer.models import load_causal_lm
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, RunData
from trainer.rewards.composite import CompositeReward
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.env_episodes import sandbox_env
from trainer.rollout.factory import make_engine
from trainer.rollout.rank_engine import start_rank_shared_engine
from trainer.specs import GroupRlSpec, OnlineRlHyperparameters, PpoSpec


def reference_path(spec: GroupRlSpec | PpoSpec, ctx: LoopContext) -> str | None:
    """The frozen reference's folder when the KL term needs one (always the original start, also when
    resuming), else None. Resolve it before seeding (``begin``): a tiny preset is built on first use."""
    hp = spec.hyperparameters
    if hp.kl_coef > 0 or hp.kl_controller == "adaptive":
        return ctx.resolve_model(spec.reference_model or spec.model)
    return None


@dataclass(frozen=True)
class RlParts:
    """What an online-RL run builds before its first step, besides the policy."""

    reference: Any | None  # frozen, eval mode; None without a KL term
    engine: RolloutEngine
    reward: CompositeReward
    eval_reward: CompositeReward
    prompts: PromptSet
    val_prompts: PromptSet
    prefetch: RolloutPrefetch | None = None  # async_rollouts: the next step's rollouts, generating


def prepare_rl(
    spec: GroupRlSpec | PpoSpec,
    data: RunData,
    ctx: LoopContext,
    start: Start,
    policy: Any,
    tokenizer: Any,
    ref_path: str | None,
) -> RlParts:
    """Load the reference, start the rollout engine, build the rewards and tokenize the prompts."""
    hp = spec.hyperparameters
    reference = None
    with start.reporter.phase("model_load"):
        same_reference = spec.reference_model is None or spec.reference_model == spec.model
        if ref_path is not None and same_reference and has_adapter(policy):
            reference = policy  # its adapter off is the start: no second copy (``reference_logps``)
        elif ref_path is not None:
            reference, _ = load_causal_lm(ref_path, dtype=frozen_dtype(hp.precision, start.device))
            reference.to(start.device).eval().requires_grad_(False)
        engine_threads = None
        if hp.async_rollouts:  # the engine generates while the trainer updates: they split the cores
            engine_threads = split_cores_for_overlap(ctx)
        # an adapter run's engine loads the frozen base and takes the adapter as a LoRA at each sync
        engine_path = start.start_path if has_adapter(policy) else start.model_path
        engine: RolloutEngine
        if ctx.ranks.active and hp.engine == "vllm_server":  # one engine process that every rank feeds
            engine = start_rank_shared_engine(
                engine_path,
                policy,
                ctx.ranks,
                max_model_len=engine_context(spec),
                on_restart=lambda message: start.reporter.event("warning", message),
                seed=hp.seed,
            )
        else:
            engine = make_engine(
                hp.engine,
                model=unwrap(policy),
                tokenizer=tokenizer,
                model_path=engine_path,
                synced_gpus=ctx.ranks.active and is_sharded(policy),
                max_model_len=engine_context(spec),
                on_restart=lambda message: start.reporter.event("warning", message),
                threads=engine_threads,
                seed=hp.seed,
            )
        ctx.cleanup.callback(engine.close)
        # an environment's step rewards, or the rewards an agent posts, are a component of the reward
        own = "environment" if spec.environment is not None else "agent" if spec.agent is not None else None
        reward = build_reward(spec.rewards, ctx.resolve_model, start.device, episode_reward=own)
        eval_reward = (
            build_reward(spec.eval_rewards, ctx.resolve_model, start.device, episode_reward=own)
            if spec.eval_rewards
            else reward
        )
    train = data.train
    held_out = [data.validation[i] for i in eval_rows(len(data.validation), hp.eval_max_rows, hp.seed)]
    tools = spec.tools.template_tools() if spec.tools is not None else None
    with start.reporter.phase("tokenize", len(train) + len(held_out)) as progress:
        openings: tuple[list[Any], list[Any]] | None = None
        if spec.environment is not None:  # each row's prompt is what the environment's reset opens with
            run_env = sandbox_env(spec.environment.code)
            train, train_open = environment_openings(train, run_env, start.reporter, "training", ctx.ranks)
            held_out, held_open = environment_openings(
                held_out, run_env, start.reporter, "held-out", ctx.ranks
            )
            openings = (train_open, held_open)
        prompts = tokenize_prompts(train, tokenizer, hp.max_prompt_length, tools)
        progress.advance(len(train))
        val_prompts = tokenize_prompts(held_out, tokenizer, hp.max_prompt_length, tools)
    if openings is not None:  # the prompts carry their rows and openings to the environment's step
        prompts, val_prompts = tag_openings(prompts, openings[0]), tag_openings(val_prompts, openings[1])
    if spec.agent is not None:  # the prompts carry their rows to the agent
        prompts, val_prompts = tag_rows(prompts), tag_rows(val_prompts)
        engine = agent_engine(spec, engine, tokenizer, start.reporter, ctx.cleanup)
    if spec.tools is not None or spec.environment is not None:
        engine = multi_turn_engine(spec, engine, tokenizer, data, start.reporter)
    parts = RlParts(
        reference=reference,
        engine=engine,
        reward=reward,
        eval_reward=eval_reward,
        prompts=prompts,
        val_prompts=val_prompts,
    )
    if hp.async_rollouts:
        prefetch = RolloutPrefetch(engine, prompts, reward, hp, seed_of=lambda step: rollout_seed(hp, step))
        ctx.cleanup.callback(prefetch.close)  # before the engine's close (the stack is last in, first out)
        parts = dataclasses.replace(parts, prefetch=prefetch)
    return parts


def split_cores_for_overlap(ctx: LoopContext) -> int:
    """With ``async_rollouts`` the engine generates while the trainer updates, so they share the run's
    threads instead of each taking all of them: the engine gets half (at least one), this process's torch
    the rest, until the run ends. Measured on 2 cores (bench/grpo_vs_trl.py --engine vllm_server --shape
    16x8 --new-tokens 16 --steps 12 --async-rollouts 1, tiny:llama-10m): both on both cores, 4.66 s/step
    steady (the update 1.57 -> 4.34 s beside the engine); split, 2.98 s/step. Without overlap, each on
    both cores in turn: 2.37 s/step. So on 2 cores the overlap costs more than it hides; it pays where
    the engine has cores or devices of its own (docs/benchmarks.md)."""
    n = torch.get_num_threads()
    engine = max(1, n // 2)
    if n > 1:
        torch.set_num_threads(n - engine)
        ctx.cleanup.callback(torch.set_num_threads, n)
    return engine


def evaluate_held_out(session: TrainingSession, parts: RlParts, hp: OnlineRlHyperparameters) -> None:
    """Greedy held-out accuracy of the current policy (the ``eval`` phase), kept as ``last_eval``."""
    with session.reporter.phase("eval", len(parts.val_prompts.ids)):
        if parts.prefetch is not None:  # the engine's weights change only between generations
            parts.prefetch.settle()
        parts.engine.sync_weights(unwrap(session.model))
        session.last_eval = evaluate_greedy(
            parts.engine, parts.val_prompts, parts.eval_reward, hp, hp.seed, session.ranks
        )


def kl_controller(hp: OnlineRlHyperparameters, session: TrainingSession) -> KLController:
    """The KL coefficient's controller, continuing from the checkpoint's value when resuming."""
    init = float(session.extra.get("kl_coef", hp.kl_coef))
    return KL_CONTROLLERS[hp.kl_controller](init_coef=init, target=hp.kl_target, horizon=hp.kl_horizon)


def evaluate_start(session: TrainingSession, parts: RlParts, hp: OnlineRlHyperparameters) -> None:
    """Held-out accuracy of the starting policy at step 0, so a curve shows what RL added."""
    if parts.val_prompts.ids and session.first == 0:
        evaluate_held_out(session, parts, hp)
        session.reporter.log_metrics(0, session.last_eval)


def rollout_seed(hp: OnlineRlHyperparameters, step: int) -> int:
    """The sampling seed of step ``step``'s rollouts."""
    return hp.seed * 100_003 + step


def sample_step(
    session: TrainingSession, parts: RlParts, hp: OnlineRlHyperparameters, *, greedy_baseline: bool
) -> tuple[StepRollouts, float]:
    """This step's rollouts from the current policy, and the seconds the step waited for them.

    With ``async_rollouts`` they were generated during the previous step (one update older than the
    policy; the first step's in the foreground), and the next step's start here from the weights before
    this step's update (trainer/loops/async_rollouts.py)."""
    t0 = time.perf_counter()
    with session.reporter.phase("rollouts"):
        if parts.prefetch is not None and session.step == session.first + 1:
            # The prompt sampler's generator now advances only with the prompts drawn (in the background,
            # adopted when taken); the minibatch shuffles get one of their own, seeded by this attempt's
            # first step, so neither stream depends on when the other thread drew.
            session.generator = torch.Generator(device=session.generator.device).manual_seed(
                rollout_seed(hp, session.step)
            )
        ready = parts.prefetch.take(session.step, session.sampler) if parts.prefetch is not None else None
        if ready is None:
            parts.engine.sync_weights(unwrap(session.model))
            ro = collect_rollouts(
                parts.engine,
                parts.prompts,
                session.sampler,
                parts.reward,
                hp,
                greedy_baseline=greedy_baseline,
                seed=rollout_seed(hp, session.step),
                ranks=session.ranks,
            )
        else:
            ro = ready.rollouts
            ro.generated_in_background_s = ready.seconds
        if parts.prefetch is not None and session.step < hp.max_steps:
            if ready is not None:  # the weights before this step's update (the foreground path synced them)
                parts.engine.sync_weights(unwrap(session.model))
            parts.prefetch.start(session.step + 1, session.sampler, greedy_baseline=greedy_baseline)
    return ro, time.perf_counter() - t0


def perf_metrics(t_gen: float, t_train: float, mask: Tensor) -> dict[str, float]:
    """Seconds spent generating and training this step, and the counted response tokens per second."""
    tokens = int(mask.sum())
    return {
        "perf/gen_s": t_gen,
        "perf/train_s": t_train,
        "perf/tokens_per_s": tokens / max(t_gen + t_train, 1e-9),
    }


def skip_step(
    session: TrainingSession,
    parts: RlParts,
    hp: OnlineRlHyperparameters,
    metrics: dict[str, float],
    ro: StepRollouts,
) -> None:
    """Close a step whose rollouts had no learning signal (dynamic sampling kept no group): no update,
    but the rollouts' metrics (over every completion sampled), samples and a due evaluation as any step,
    so the charts show the rewards exactly when every one was equal."""
    session.reporter.event(
        "warning", f"step {session.step}: every sampled group had equal rewards; no update"
    )
    if session.log_due:
        metrics |= step_rollout_metrics(ro)
    close_rl_step(session, parts, hp, metrics, ro, {})


def close_rl_step(
    session: TrainingSession,
    parts: RlParts,
    hp: OnlineRlHyperparameters,
    metrics: dict[str, float],
    ro: StepRollouts,
    stats: dict[str, Tensor],
    annotate: Callable[[list[dict[str, Any]]], None] | None = None,
) -> None:
    """Eval when due, a warning for skipped updates, stored samples when due (``annotate`` may add to each
    record), then the session's end of step (log, checkpoint, final save)."""
    if ro.generated_in_background_s is not None and session.log_due:
        metrics["perf/gen_background_s"] = ro.generated_in_background_s
    if parts.val_prompts.ids and session.eval_due:
        evaluate_held_out(session, parts, hp)
        metrics |= session.last_eval
    if float(stats.get("skipped_updates", 0.0)) > 0:
        session.skipped_updates += 1
        session.reporter.event(
            "warning", f"step {session.step}: non-finite loss or gradient; those updates were skipped"
        )
    if hp.sample_every and hp.samples_to_store and is_due(session.step, hp.sample_every, hp.max_steps):
        # the groups trained on; on a step that kept none, those it sampled
        shown, rewards = (ro, ro.rewards) if ro.completions else (ro.sampled, ro.sampled_rewards)
        records = sample_records(
            shown.completions, parts.prompts, shown.prompt_index, rewards, hp.samples_to_store
        )
        if annotate is not None:
            annotate(records)
        session.reporter.log_samples(session.step, records)
    session.end_step(metrics)


@dataclass(frozen=True)
class TokenBatch:
    """Prompt+completion sequences, right-padded: (N, L). Per-token tensors (log-probs, values, masks,
    advantages) cover only the *completion window*: W = L - 1 - ``offset`` columns, column k holding the
    label position ``offset + k`` (the prediction of ``input_ids[:, offset + k + 1]``). ``offset`` is the
    last prompt token of the batch's shortest prompt, so every generated token of every row is inside the
    window and no logits are computed for positions that only predict prompt tokens."""

    input_ids: Tensor
    attention_mask: Tensor
    # (N, W), float, 1 where input_ids[:, offset + k + 1] is a generated token (of a multi-turn episode: one
    # the model sampled, not a tool result or the template's markup between turns)
    response_mask: Tensor
    offset: int = 0

    @property
    def targets(self) -> Tensor:
        """(N, W) the token each window column predicts."""
        return self.input_ids[:, self.offset + 1 :]

    def select(self, idx: Tensor) -> TokenBatch:
        return TokenBatch(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx], self.offset)


def to_token_batch(completions: Sequence[Completion], pad_id: int, device: torch.device) -> TokenBatch:
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    offset = max(min(len(c.prompt_ids) for c in completions) - 1, 0)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(completions), width), dtype=torch.long)
    resp = torch.zeros((len(completions), width), dtype=torch.float32)
    for i, c in enumerate(completions):
        p, t = c.prompt_ids, c.token_ids
        ids[i, : len(p) + len(t)] = torch.tensor(p + t, dtype=torch.long)
        attn[i, : len(p) + len(t)] = 1
        # every generated token, or of a multi-turn episode only those the model produced
        resp[i, len(p) : len(p) + len(t)] = 1.0 if c.token_mask is None else torch.tensor(c.token_mask)
    return TokenBatch(ids.to(device), attn.to(device), resp[:, offset + 1 :].to(device), offset)


def forward_logps(model: Any, batch: TokenBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(logits, per-token log-probs of the next token) over the completion window, (N, W, V) and (N, W).

    The log-probs are those of the distribution the rollouts were sampled from: ``log softmax(z / T)`` at
    sampling temperature ``T > 0`` (TRL and verl divide the logits likewise; ``T = 0``, greedy, keeps
    them as they are), and the logits returned are the scaled ones (the entropy bonus is the sampling
    distribution's). The LM head runs only over the window (transformers' ``logits_to_keep``) and the
    logits stay in the model's dtype (no full-size float32 copy; ``token_logprobs`` and
    ``entropy_from_logits`` work a row at a time). Same values as slicing the full logits."""
    window = batch.response_mask.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=window + 1)
    logits = out.logits[:, :-1]
    if temperature > 0 and temperature != 1:
        logits = logits / temperature
    return logits, token_logprobs(logits, batch.targets).float()


@torch.no_grad()
def frozen_logps(
    model: Any, batch: TokenBatch, temperature: float = 1.0, chunk: int = 64, ranks: Ranks | None = None
) -> Tensor:
    """Per-token log-probs without grad at sampling ``temperature`` (``forward_logps``), in chunks (old
    policy, reference). On several ranks (``ranks``, default: the process group's) each computes its
    ``padded_share`` of the rows and the parts are gathered: every rank gets all rows' log-probs."""
    ranks = current() if ranks is None else ranks
    rows = torch.tensor(padded_share(len(batch.input_ids), ranks), dtype=torch.long)
    mine = batch.select(rows.to(batch.input_ids.device))
    was_training = model.training
    model.eval()
    out = [
        forward_logps(model, mine.select(torch.arange(i, min(i + chunk, len(rows)))), temperature)[1]
        for i in range(0, len(rows), chunk)
    ]
    model.train(was_training)
    return gather_rows(torch.cat(out), ranks)[: len(batch.input_ids)]


def reference_logps(parts: RlParts, batch: TokenBatch, temperature: float = 1.0) -> Tensor | None:
    """Per-token log-probs of the frozen reference at the sampling ``temperature`` (None without one);
    for an adapter run the policy with its adapter off. Split over the ranks (``frozen_logps``)."""
    if parts.reference is None:
        return None
    with adapter_off(parts.reference):
        return frozen_logps(parts.reference, batch, temperature)


def sampler_logps(completions: Sequence[Completion], batch: TokenBatch) -> Tensor | None:
    """(N, W) the engine's log-probs of the sampled tokens, placed on ``batch``'s completion window (0
    elsewhere); None when the engine reported none (the transformers engine samples with the trainer's
    own model)."""
    if not completions or any(c.logprobs is None for c in completions):
        return None
    out = torch.zeros_like(batch.response_mask, device="cpu")
    for i, c in enumerate(completions):
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        first = len(c.prompt_ids) - 1 - batch.offset  # the column predicting the first generated token
        out[i, first : first + len(c.token_ids)] = torch.tensor(c.logprobs, dtype=out.dtype)
    return out.to(batch.response_mask.device)


def needs_old_logps(sampler: Tensor | None, hp: OnlineRlHyperparameters, n: int, kl_in_reward: bool) -> bool:
    """Whether a step computes the old policy's log-probs in a separate no-grad pass: off-policy updates,
    KL folded into the reward, or an engine whose log-probs are compared with them (the mismatch metrics
    and truncated IS need them before any update, as TRL computes them). ``old_logps`` skips the pass
    whatever this says when the old log-probs are the sampler's."""
    return not hp.on_policy(n) or kl_in_reward or sampler is not None


@dataclass(frozen=True)
class OldLogps:
    """A step's old log-probs (the policy ratio's denominator) and the sampler correction that goes with
    them: ``logp`` None means on-policy (the update's own detached log-probs); ``from_sampler`` that they
    are the engine's (``old_logprobs`` 'sampler'), whose mismatch the first update measures instead."""

    logp: Tensor | None
    is_weight: Tensor | None
    mismatch: dict[str, Tensor]
    from_sampler: bool = False


def old_logps(
    policy: Any,
    batch: TokenBatch,
    sampler: Tensor | None,
    mask: Tensor,
    hp: OnlineRlHyperparameters,
    needed: bool,
) -> OldLogps:
    """The old log-probs of a step's rollouts: with ``old_logprobs`` 'recompute' the trainer's no-grad pass
    when ``needed`` (``needs_old_logps``), with the truncated-IS weights and mismatch stats against the
    sampler's (``sampler_correction``); with 'sampler' the engine's own log-probs, no pass (verl's bypass
    mode: the PPO ratio anchors on the sampling distribution, docs/algorithms.md).

    Raises:
        RuntimeError: ``old_logprobs`` is 'sampler' and the engine reported no log-probs.
    """
    if hp.old_logprobs == "sampler":
        if sampler is None:
            raise RuntimeError(
                "old_logprobs 'sampler': the engine reported no log-probs for this step's rollouts (engine "
                f"{hp.engine!r}); use old_logprobs 'recompute'"
            )
        return OldLogps(sampler, None, {}, from_sampler=True)
    old = frozen_logps(policy, batch, hp.temperature) if needed else None
    is_weight, mismatch = sampler_correction(old, sampler, mask, hp)
    return OldLogps(old, is_weight, mismatch)


UPDATE_MISMATCH_STATS = ("logp_abs_diff", "ratio_mean", "kl")


def update_mismatch(logp: Tensor, sampler: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The mismatch stats an update measures in its own forward pass when the old log-probs are the
    sampler's: the token means of ``mismatch_stats`` (which add up exactly over micro-batches and ranks,
    weighted by tokens), keyed ``mismatch/...`` as the recomputed ones are."""
    stats = mismatch_stats(logp.detach(), sampler, mask)
    return {key: stats[key] for key in (f"mismatch/{k}" for k in UPDATE_MISMATCH_STATS)}


def sampler_correction(
    old_logp: Tensor | None, sampler: Tensor | None, mask: Tensor, hp: OnlineRlHyperparameters
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The truncated-IS weights for the policy term (None: no correction) and the mismatch stats of this
    step's rollouts (empty without sampler log-probs). See trainer/algorithms/sampler_correction.py."""
    if sampler is None or old_logp is None:
        return None, {}
    cap = hp.importance_sampling_cap
    stats = mismatch_stats(old_logp, sampler, mask, cap)
    weights = None if cap is None else truncated_is_weights(old_logp, sampler, cap) * mask
    return weights, stats


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def response_mask(tokens: TokenBatch, completions: Sequence[Completion], mask_truncated: bool) -> Tensor:
    """(N, L-1) the response tokens that count: all generated tokens, or with ``mask_truncated`` none of a
    completion cut at ``max_new_tokens`` (DAPO's overlong filtering)."""
    if not mask_truncated:
        return tokens.response_mask
    keep = torch.tensor([c.finish_reason != "length" for c in completions], device=tokens.input_ids.device)
    return tokens.response_mask * keep[:, None].float()


def minibatches(n: int, hp: OnlineRlHyperparameters, gen: torch.Generator) -> Iterator[Tensor]:
    """``ppo_epochs`` passes over a fresh permutation of ``n`` rollouts, ``hp.minibatch_size_for(n)`` at a
    time."""
    size = hp.minibatch_size_for(n)
    for _ in range(hp.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, size):
            yield order[start : start + size]


class StatMeans:
    """Mean of each stat over the updates of a step that report it (on device: no host sync until
    logging)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, stats: dict[str, Tensor]) -> None:
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0) + v.detach().float()
            self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict[str, Tensor]:
        return {k: v / self.counts[k] for k, v in self.sums.items()}


class WeightedMeans:
    """Each stat's mean over the micro-batches of one update, weighted (by valid tokens, or rows for a
    per-sequence stat); loss stats, already scaled for the whole batch, are summed instead."""

    SUMMED = ("loss/policy", "loss/total", "loss/value")
    PER_ROW = ("kl/seq",)

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, stats: dict[str, Tensor], tokens: float, rows: float) -> None:
        for k, v in stats.items():
            w = 1.0 if k in self.SUMMED else rows if k in self.PER_ROW else tokens
            self.sums[k] = self.sums.get(k, 0) + v.detach().float() * w
            self.weights[k] = self.weights.get(k, 0.0) + w

    def means(self) -> dict[str, Tensor]:
        return {k: v if k in self.SUMMED else v / max(self.weights[k], 1e-12) for k, v in self.sums.items()}

    def add_up_ranks(self, ranks: Ranks) -> None:
        """Sum the sums and weights over the ranks (one collective), so ``means`` is the whole minibatch's
        on every rank."""
        if not ranks.active:
            return
        keys = sorted(self.sums)
        device = self.sums[keys[0]].device
        packed = torch.stack(
            [self.sums[k] for k in keys] + [torch.tensor(self.weights[k], device=device) for k in keys]
        )
        total = sum_over_ranks(packed, ranks)
        self.sums = {k: total[i] for i, k in enumerate(keys)}
        self.weights = {k: float(total[len(keys) + i]) for i, k in enumerate(keys)}


@dataclass(frozen=True)
class ActorBatch:
    """A minibatch for the actor: tokens, the mask of tokens that count, advantages, old and reference
    log-probs (None: on-policy, the update's own detached log-probs; no reference), which rows are real
    (``real``: 1, or 0 for a rank's filler row, whose mask is all zero; None: all), the truncated
    importance-sampling weights of the policy term (``is_weight``, None: no sampler correction), and
    whether the old log-probs are the sampler's and this update measures their mismatch with its own
    (``measure_mismatch``: a step's first update, before the policy moved)."""

    tokens: TokenBatch
    mask: Tensor
    adv: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None
    real: Tensor | None = None
    is_weight: Tensor | None = None
    measure_mismatch: bool = False

    def select(self, idx: Tensor) -> ActorBatch:
        return ActorBatch(
            self.tokens.select(idx),
            self.mask[idx],
            self.adv[idx],
            None if self.old_logp is None else self.old_logp[idx],
            None if self.ref_logp is None else self.ref_logp[idx],
            None if self.real is None else self.real[idx],
            None if self.is_weight is None else self.is_weight[idx],
            self.measure_mismatch,
        )

    @property
    def n_real(self) -> Tensor:
        """How many rows are real (not a rank's filler), as a float tensor."""
        if self.real is None:
            return torch.tensor(float(len(self.adv)), device=self.adv.device)
        return self.real.sum()

    def rank_share(self, ranks: Ranks) -> ActorBatch:
        """This rank's equal share of the rows (``padded_share``): the rows past the end wrap around as
        filler rows whose mask is zero, so they add nothing to a loss or a statistic, yet every rank runs
        as many micro-batches as the others (their backward passes are collectives)."""
        if not ranks.active:
            return self
        rows = padded_share(len(self.adv), ranks)
        first = ranks.rank * len(rows)  # the share's place before wrapping: past len(adv) is filler
        device = self.adv.device
        real = (torch.arange(first, first + len(rows), device=device) < len(self.adv)).float()
        part = self.select(torch.tensor(rows, dtype=torch.long, device=device))
        return dataclasses.replace(part, mask=part.mask * real[:, None], real=real)


def micro_slices(n: int, size: int | None, device: torch.device) -> list[Tensor]:
    """Row indices of each micro-batch of ``n`` rows (one slice of all of them when ``size`` is None)."""
    return [torch.as_tensor(list(rows), device=device) for rows in micro_batches(range(n), size)]


def actor_loss(
    policy: Any, mb: ActorBatch, hp: OnlineRlHyperparameters, kl_coef: float, normaliser: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss on (part of) a minibatch, aggregated with the whole minibatch's ``normaliser``,
    and its stats.

    Loss per token: the policy loss (``POLICY_LOSSES[hp.policy_loss]``: PPO's clipped surrogate, Schulman
    et al. 2017 eq. 7, or vanilla policy gradient), ``+ kl_coef * KL_t(pi || pi_ref)`` when the KL sits in
    the loss (GRPO, Shao et al. 2024 eq. 3), ``- entropy_coef * H_t``; aggregated over tokens and
    sequences by ``hp.loss_aggregation``. With sampler correction the policy term is first weighted by
    the truncated IS weight ``min(pi_old / pi_sampler, C)`` (Yao et al. 2025; the KL and entropy terms
    are not). The KL stats are logged whenever there is a reference.
    """
    clip = ClipParams(low=hp.clip_low, high=hp.clip_high, dual_c=hp.dual_clip)
    logits, logp = forward_logps(policy, mb.tokens, hp.temperature)
    old = logp.detach() if mb.old_logp is None else mb.old_logp  # on-policy: ratio 1
    out = POLICY_LOSSES[hp.policy_loss](logp, old, mb.adv, mb.mask, clip=clip)
    per_token = out.per_token if mb.is_weight is None else out.per_token * mb.is_weight
    stats = {f"policy/{k}": v for k, v in out.stats.items()}
    if mb.measure_mismatch and mb.old_logp is not None:
        stats |= update_mismatch(logp, mb.old_logp, mb.mask)
    mode, max_len = hp.loss_aggregation, hp.max_new_tokens
    stats["loss/policy"] = aggregate(
        per_token, mb.mask, mode, normaliser=normaliser, max_len=max_len
    ).detach()
    if mb.ref_logp is not None:
        kl_tok = KL_ESTIMATORS[hp.kl_estimator](logp, mb.ref_logp)
        stats["kl/ref"] = masked_mean(kl_tok.detach(), mb.mask)
        stats["kl/seq"] = (kl_tok.detach() * mb.mask).sum() / mb.n_real.clamp(min=1)
        if hp.kl_placement == "loss" and kl_coef > 0:
            per_token = per_token + kl_coef * kl_tok
    entropy = entropy_from_logits(logits)
    stats["policy/entropy"] = masked_mean(entropy.detach(), mb.mask)
    if hp.entropy_coef > 0:
        per_token = per_token - hp.entropy_coef * entropy
    loss = aggregate(per_token, mb.mask, mode, normaliser=normaliser, max_len=max_len)
    stats["loss/total"] = loss.detach()
    return loss, stats


@contextmanager
def checkpointed_training(model: Any, checkpointing: bool) -> Iterator[None]:
    """Train mode with every dropout off, while ``checkpointing`` (transformers checkpoints activations
    only in train mode; the RL loops otherwise train in eval mode so that old and new log-probs agree,
    which dropout off keeps true). Without checkpointing nothing changes."""
    if not checkpointing:
        yield
        return
    was_training = model.training
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    try:
        yield
    finally:
        model.train(was_training)


def actor_step(
    policy: Any, optimizer: torch.optim.Optimizer, mb: ActorBatch, hp: OnlineRlHyperparameters, kl_coef: float
) -> dict[str, Tensor]:
    """One optimizer step of the policy on a minibatch (``actor_loss``), in micro-batches of
    ``hp.micro_batch_size`` rows whose gradients add up to the minibatch's (each aggregated with the
    minibatch's ``batch_normaliser``); returns its stats. On several ranks each takes its share of the
    minibatch's rows (``ActorBatch.rank_share``) and the stats are summed over them: the update and the
    stats are the whole minibatch's."""
    normaliser = batch_normaliser(mb.mask, hp.loss_aggregation)
    ranks = current()
    mine = mb.rank_share(ranks)
    means = WeightedMeans()

    def losses() -> Iterator[Tensor]:
        for rows in micro_slices(len(mine.adv), hp.micro_batch_size, mine.adv.device):
            part = mine.select(rows)
            loss, stats = actor_loss(policy, part, hp, kl_coef, normaliser)
            means.add(stats, tokens=float(part.mask.sum()), rows=float(part.n_real))
            yield loss

    with checkpointed_training(policy, hp.gradient_checkpointing):
        grad_norm = accumulate_and_step(
            policy, optimizer, losses(), hp.max_grad_norm, skip_nonfinite=hp.on_nonfinite == "skip"
        )
    means.add_up_ranks(ranks)
    stats = means.means()
    stats["skipped_updates"] = torch.tensor(float(grad_norm is None))
    stats["grad_norm"] = grad_norm if grad_norm is not None else torch.tensor(float("nan"))
    return stats
