"""The skeleton every training loop shares, written once: start, resume, stop, schedule, cadence, save.

A loop file keeps only what is its own (its data, its step body, its final metrics) and reads like this::

    start = begin(ctx, reporter, spec.model, hp.seed)  # resolve the model, then seed (in that order)
    model, tokenizer = load(start.model_path)
    rows = prepare(data)
    session = TrainingSession(start, hp, model, tokenizer, len(rows))  # optimizer, sampler, resume
    if session.finished_before:
        return session.result
    for step in session.steps():                       # stops (keeping the work) on cancel or pause
        loss = ...                                     # the loop's own step body
        session.update(loss)
        session.end_step(metrics, final=...)           # log; checkpoint when due; final save at the end
    return session.result

A new run phase that every loop goes through (before the first step, between steps, at the end) is one
change here; a phase of one run kind is one change in that loop's file. Everything the skeleton calls for
seeding, the learning-rate schedule, the stop checks and the optimizer step (gradient accumulation,
non-finite guards, fp16 loss scaling) is in this file too; a loop that steps its own optimizer (PPO's
critic) uses the same functions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.adapters import (
    Task,
    add_adapter,
    base_file,
    check_adapter_supported,
    load_adapter,
    quantization_config,
)
from trainer.checkpoints import Checkpointer, load_trainer_state
from trainer.data.sampling import EpochSampler, micro_batches
from trainer.distributed import (
    Ranks,
    all_true,
    current,
    from_main,
    full_model_state,
    grad_sum_factor,
    is_sharded,
    load_optimizer_shards,
    load_optimizer_state,
    local_norm,
    save_optimizer_shards,
    unwrap,
    wrap,
)
from trainer.models import load_causal_lm, load_reward_model, pick_device
from trainer.phases import Phase
from trainer.precision import enable_loss_scaling, frozen_dtype, loss_scaler, training_attention
from trainer.reporting import LoopContext, LoopResult, Reporter
from trainer.run_health import RunHealth
from trainer.specs import AdapterSpec, TrainingHyperparameters

T = TypeVar("T")
TRAINED_TOKENS = "tokens/trained"  # metric: non-padding tokens of the rows trained on so far (cumulative)


# Seeding, the learning-rate schedule, cadence and stop checks, the optimizer and its step.


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python and torch; return a generator for data order so sampling never shifts init RNG."""
    random.seed(seed)
    torch.manual_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def warmup_constant_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup from 0 to ``base_lr`` over ``warmup_steps`` (1-based step), then constant."""
    if warmup_steps <= 0 or step > warmup_steps:
        return base_lr
    return base_lr * step / warmup_steps


def is_due(step: int, every: int, last_step: int) -> bool:
    """True at every ``every``-th step (``every`` > 0) and always at the last step."""
    return step == last_step or (every > 0 and step % every == 0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the loss or the gradients: the update is refused and the run stops."""


def backward_and_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    max_grad_norm: float,
    *,
    step: int | None = None,
    skip_nonfinite: bool = False,
) -> Any:
    """zero_grad -> backward -> clip -> step on one loss; ``accumulate_and_step`` with one micro-batch."""
    return accumulate_and_step(
        model, optimizer, [loss], max_grad_norm, step=step, skip_nonfinite=skip_nonfinite
    )


def accumulate_and_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    losses: Iterable[torch.Tensor],
    max_grad_norm: float,
    *,
    step: int | None = None,
    skip_nonfinite: bool = False,
) -> Any:
    """zero_grad -> backward of each micro-batch loss as it comes -> clip -> step; returns the pre-clip
    gradient norm. Gradients add up over backward calls, so when each micro-batch loss is already scaled
    for the whole batch (their sum is the batch loss) the step is the whole batch's (gradient
    accumulation); ``losses`` may be a generator that runs each micro-batch's forward pass when asked,
    so only one micro-batch's activations are alive at a time.

    Never trains on NaN: a non-finite micro-batch loss or gradient norm raises NonFiniteError naming the
    step and the tensor, before the optimizer touches the weights; with ``skip_nonfinite`` it returns None
    instead (the batch is skipped, the weights unchanged). The check is one host sync per micro-batch.
    An fp16 run's optimizer has a loss scaler (trainer/precision.py): each loss is scaled before its
    backward and the gradients unscaled before clipping; a gradient that overflows skips the step and
    lowers the scale (the norm returned is then inf), as dynamic loss scaling means to.
    """
    where = f" at step {step}" if step is not None else ""
    scaler = loss_scaler(optimizer)  # fp16: losses scaled up for the backward, gradients unscaled below
    ranks, factor = current(), grad_sum_factor()  # DDP/FSDP average the ranks' gradients: undo it
    optimizer.zero_grad(set_to_none=True)
    micro = iter(losses)
    # the forward passes run as ``micro`` yields each loss: on a CPU in bf16 with the attention kernel whose
    # backward is fast there (trainer/precision.py)
    with training_attention(next(iter(model.parameters())).device):
        for loss in micro:
            if not all_true(bool(torch.isfinite(loss.detach()).all()), ranks):  # every rank skips, or none
                optimizer.zero_grad(set_to_none=True)
                if skip_nonfinite:
                    for _ in micro:  # the rest still run (no backward), so the step's statistics are whole
                        pass
                    return None
                raise NonFiniteError(
                    f"loss is {float(loss.detach().float().sum())}{where}; no update applied"
                )
            if factor != 1:
                loss = loss * factor
            with torch.autocast(loss.device.type, enabled=False):  # backward outside autocast, as torch asks
                (loss if scaler is None else scaler.scale(loss)).backward()  # type: ignore[no-untyped-call]
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = local_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if scaler is not None:
        # An overflow at this scale is expected now and then: the scaler skips the step and lowers the
        # scale (the returned norm is inf, counted as a skipped update), it is not a diverging run.
        scaler.step(optimizer)
        scaler.update()
        return grad_norm
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        if skip_nonfinite:
            return None
        raise NonFiniteError(f"gradient norm is {float(grad_norm)}{where}; no update applied")
    optimizer.step()
    return grad_norm


def to_floats(stats: dict[str, Any]) -> dict[str, float]:
    """Tensors -> floats, at log interval only: each ``.item()`` is a device sync point."""
    return {k: float(v.item()) if isinstance(v, torch.Tensor) else float(v) for k, v in stats.items()}


def make_optimizer(
    model: Any, lr: float, weight_decay: float, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, fused (one kernel for all tensors) where torch supports it
    for the parameters' device: it is the same update, computed with fewer passes over memory. With
    ``precision`` fp16 it gets a dynamic loss scaler (trainer/precision.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    enable_loss_scaling(optimizer, precision, params[0].device if params else torch.device("cpu"))
    return optimizer


def stop_requested(
    reporter: Any,
    step: int,
    start: int,
    saved_steps: Container[int],
    save: Callable[[int], object],
    ranks: Ranks | None = None,
) -> bool:
    """True if a cancel or pause asks the loop to stop before ``step``. The work done is kept first:
    ``save(step - 1)`` writes a checkpoint unless nothing new was trained or it exists already. In a
    multi-rank run rank 0's answer is every rank's (``from_main``), so all stop at the same step."""
    if not from_main(reporter.should_stop(), ranks or Ranks()):
        return False
    reporter.event("info", f"stopping before step {step}: cancel or pause requested")
    if step - 1 > start and step - 1 not in saved_steps:
        save(step - 1)
    return True


def update_or_skip(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor | Iterable[torch.Tensor],
    *,
    max_grad_norm: float,
    step: int,
    on_nonfinite: str,
    reporter: Any,
) -> Any:
    """``accumulate_and_step`` over ``loss`` (one tensor, or the micro-batch losses of one step) honouring
    the spec's ``on_nonfinite``: "skip" reports the skipped batch as an event and returns a NaN norm (the
    reporter drops non-finite values); "fail" raises NonFiniteError."""
    losses = [loss] if isinstance(loss, torch.Tensor) else loss
    grad_norm = accumulate_and_step(
        model, optimizer, losses, max_grad_norm, step=step, skip_nonfinite=on_nonfinite == "skip"
    )
    if grad_norm is None:
        reporter.event(
            "warning", f"step {step}: non-finite loss or gradient; batch skipped, weights unchanged"
        )
        return torch.tensor(float("nan"))
    return grad_norm


# Where a run starts, and the session that carries it to its last step.


@dataclass(frozen=True)
class Start:
    """Where a run starts from: its context and reporter, the model folder to load (the checkpoint when
    resuming), the folder of the model the run started from (``start_path``, also when resuming), the
    adapter it trains (None: the whole model), the data-order generator and the device."""

    ctx: LoopContext
    reporter: Reporter
    model_path: str
    generator: torch.Generator
    device: torch.device
    start_path: str = ""
    adapter: AdapterSpec | None = None


def begin(
    ctx: LoopContext, reporter: Reporter, model: str, seed: int, adapter: AdapterSpec | None = None
) -> Start:
    """Resolve ``model`` (or take the checkpoint being resumed), then seed. Building a tiny preset on first
    use draws from torch's RNG, so a loop resolves every other model it needs before calling this. An
    adapter run resolves its start also when resuming: its checkpoints hold only the adapter."""
    start_path = ctx.resolve_model(model) if adapter is not None or not ctx.resume_from else ""
    model_path = str(ctx.resume_from) if ctx.resume_from else start_path
    return Start(ctx, reporter, model_path, seed_everything(seed), pick_device(), start_path, adapter)


def enable_checkpointing(model: Any) -> None:
    """Activation (gradient) checkpointing on ``model``'s transformer blocks, non-reentrant (so frozen
    inputs, as under an adapter, need no ``requires_grad`` trick); active in train mode only, so
    generation and no-grad passes are unaffected."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def load_trainable(
    start: Start, task: Task = "causal", *, checkpointing: bool = False, precision: str = "fp32"
) -> tuple[Any, Any]:
    """The model to train on the run's device (a causal LM, or with ``task="score"`` a scalar-head model)
    and its tokenizer: the start, or the checkpoint when resuming. With an adapter: the start's weights
    frozen under a fresh trainable adapter, or the resumed checkpoint's adapter (trainer/adapters.py).
    ``checkpointing``: activation checkpointing on (``enable_checkpointing``). Trained weights load in
    float32 (master weights); an adapter's frozen base in ``precision``'s dtype (trainer/precision.py).
    In a multi-rank run the model comes back spread over the ranks (DDP or FSDP2, trainer/distributed.py)."""
    loader = load_reward_model if task == "score" else load_causal_lm
    with start.reporter.phase("model_load"):
        if start.adapter is None:
            model, tokenizer = loader(start.model_path)
            if checkpointing:
                enable_checkpointing(model)
        else:
            check_adapter_supported(start.adapter)
            base, tokenizer = loader(
                start.start_path, quantization_config(start.adapter), frozen_dtype(precision, start.device)
            )
            if checkpointing:
                enable_checkpointing(base)
            if start.ctx.resume_from is not None:
                model = load_adapter(base, start.ctx.resume_from, trainable=True)
            else:
                model = add_adapter(base, start.adapter, task)
        if start.adapter is None or start.adapter.quantize is None:  # a quantized base is placed at load
            model.to(start.device)
    return wrap(model, start.ctx.ranks), tokenizer


def load_policy(start: Start, hp: TrainingHyperparameters) -> tuple[Any, Any]:
    """The causal LM to train (``load_trainable``, with ``hp.gradient_checkpointing`` and ``hp.precision``)
    and its tokenizer."""
    return load_trainable(start, "causal", checkpointing=hp.gradient_checkpointing, precision=hp.precision)


def begin_policy(
    ctx: LoopContext,
    reporter: Reporter,
    model: str,
    hp: TrainingHyperparameters,
    adapter: AdapterSpec | None = None,
) -> tuple[Start, Any, Any]:
    """``begin`` (resolve ``model``, then seed with ``hp.seed``) and ``load_policy``: the run's start, the
    causal LM to train and its tokenizer."""
    start = begin(ctx, reporter, model, hp.seed, adapter)
    policy, tokenizer = load_policy(start, hp)
    return start, policy, tokenizer


def eval_rows(n: int, max_rows: int, seed: int) -> list[int]:
    """Which of ``n`` rows an evaluation reads: all of them, or ``max_rows`` drawn without replacement
    with ``seed`` (the same rows at every evaluation of a run), in their original order."""
    if n <= max_rows:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n, generator=gen)[:max_rows].tolist())


@dataclass(frozen=True)
class Final:
    """What a loop adds at its last step: metrics over the whole data, files saved with the model, and how
    the closing event names the model."""

    metrics: dict[str, float] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    label: str = "model"
    note: str = ""


class TrainingSession:
    """Optimizer, data sampler, checkpoints and resume of one run; steps with stop checks and the LR
    schedule; logging and checkpoint cadence; the final save.

    ``extra_state`` (set by the loop) returns what else a checkpoint must hold to resume exactly (the KL
    coefficient, a critic, precomputed reference log-probs); on resume ``extra`` holds what it returned.
    ``schedule`` maps a step to its learning rate (default: linear warmup, then constant).
    """

    def __init__(
        self,
        start: Start,
        hp: TrainingHyperparameters,
        model: Any,
        tokenizer: Any,
        n_rows: int,
        *,
        batch_size: int | None = None,
        schedule: Callable[[int], float] | None = None,
    ):
        """``n_rows`` rows are sampled ``batch_size`` (default ``hp.batch_size``) at a time."""
        ctx, reporter = start.ctx, start.reporter
        self.hp, self.reporter, self.ctx, self.device = hp, reporter, ctx, start.device
        self.ranks = ctx.ranks
        self.model, self.tokenizer = model, tokenizer
        # An adapter checkpoint names the model it was trained on, so it loads on its own (run:<id>).
        self.model_files = base_file(start.start_path) if start.adapter is not None else {}
        self.optimizer = make_optimizer(model, hp.lr, hp.weight_decay, hp.precision)
        self.sampler = EpochSampler(n_rows, batch_size or hp.batch_size, start.generator)
        self.generator = start.generator
        self.checkpointer = Checkpointer(
            ctx.checkpoint_dir,
            reporter,
            keep_last=hp.keep_last_checkpoints,
            best_metric=hp.best_metric,
            best_mode=hp.best_mode,
        )
        self.schedule = schedule or (
            lambda s: warmup_constant_lr(s, base_lr=hp.lr, warmup_steps=hp.warmup_steps)
        )
        self.extra_state: Callable[[], dict[str, Any]] = dict
        self.extra: dict[str, Any] = {}
        self.last_eval: dict[str, float] = {}  # the latest held-out metrics, kept with every checkpoint
        self.first = self.step = 0
        self.lr = 0.0
        self.health = RunHealth()
        self.skipped_updates = 0  # batches skipped as non-finite in the current step
        self.trained_tokens = 0  # ``count_tokens``: logged as TRAINED_TOKENS, kept in checkpoints
        self._result: LoopResult | None = None
        if ctx.resume_from is not None:
            resumed = load_trainer_state(
                ctx.resume_from,
                optimizer=self.optimizer,
                sampler=self.sampler,
                restore_optimizer=lambda state: load_optimizer_state(model, self.optimizer, state),
                restore_shards=lambda folder: load_optimizer_shards(model, self.optimizer, folder),
            )
            self.first = self.step = resumed.step
            self.extra = resumed.extra
            self.trained_tokens = int(resumed.extra.get("trained_tokens", 0))
            reporter.event("info", f"resumed from checkpoint at step {self.first}")
            if self.first >= hp.max_steps:  # an earlier attempt wrote the final checkpoint
                self._result = LoopResult(status="succeeded", output_path=ctx.resume_from)

    @property
    def resumed(self) -> bool:
        return self.ctx.resume_from is not None

    @property
    def finished_before(self) -> bool:
        """True when the checkpoint being resumed is already the final one: nothing is left to do."""
        return self._result is not None

    @property
    def result(self) -> LoopResult:
        if self._result is None:
            raise RuntimeError("the loop ended before its last step was closed with end_step")
        return self._result

    def steps(self) -> Iterator[int]:
        """The steps left, each with its learning rate set; ends early (result: cancelled) when a cancel or
        pause asks to stop, after a checkpoint of the steps done since the start or the last save."""
        for step in range(self.first + 1, self.hp.max_steps + 1):
            if stop_requested(
                self.reporter, step, self.first, self.checkpointer.saved, self._keep_work, self.ranks
            ):
                self._result = LoopResult(status="cancelled", output_path=None)
                return
            self.step, self.skipped_updates = step, 0
            self.lr = self.schedule(step)
            set_lr(self.optimizer, self.lr)
            yield step

    def _keep_work(self, step: int) -> Path:
        return self.save(step, self.last_eval)

    @property
    def log_due(self) -> bool:
        return is_due(self.step, self.hp.log_every, self.hp.max_steps)

    @property
    def eval_due(self) -> bool:
        return is_due(self.step, self.hp.eval_every, self.hp.max_steps)

    @property
    def last_step(self) -> bool:
        return self.step == self.hp.max_steps

    def train_metrics(self, stats: dict[str, Any], n_tokens: int, t0: float) -> dict[str, float]:
        """A step's logged metrics: ``stats`` as floats (one host sync each), the learning rate, and the
        tokens per second since ``t0``."""
        return to_floats(stats) | {"lr": self.lr, "perf/tokens_per_s": n_tokens / (time.perf_counter() - t0)}

    def evaluate(self, held_out: Sized, run: Callable[[Phase], dict[str, float]]) -> dict[str, float]:
        """``run(progress)`` when there is held-out data and an evaluation is due (kept as ``last_eval``),
        else {}; it runs as the ``eval`` phase over ``len(held_out)`` rows."""
        if not len(held_out) or not self.eval_due:
            return {}
        with self.reporter.phase("eval", len(held_out)) as progress:
            self.last_eval = run(progress)
        return self.last_eval

    def micro_batches(self, rows: Sequence[T]) -> list[Sequence[T]]:
        """A step's rows cut into micro-batches of ``micro_batch_size`` (one, the whole batch, when unset)."""
        return micro_batches(rows, self.hp.micro_batch_size)

    def update(self, loss: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """One optimizer step on ``loss`` honouring ``on_nonfinite``; returns the pre-clip gradient norm.
        ``loss`` may be the micro-batch losses of the step, each scaled for the whole batch (their sum is
        its loss), as a generator that runs each forward pass when asked (gradient accumulation)."""
        norm = update_or_skip(
            self.model,
            self.optimizer,
            loss,
            max_grad_norm=self.hp.max_grad_norm,
            step=self.step,
            on_nonfinite=self.hp.on_nonfinite,
            reporter=self.reporter,
        )
        if not torch.isfinite(norm):
            self.skipped_updates += 1
        return norm

    def count_tokens(self, n: int) -> None:
        """Add a step's trained tokens (non-padding, every rank's) to the run's total."""
        self.trained_tokens += n

    def end_step(self, metrics: dict[str, float], final: Callable[[Phase], Final] | None = None) -> None:
        """Log ``metrics`` (with the run's trained tokens so far, when the loop counts them, and the warnings
        the run's health rules raise on them); save a checkpoint when one is due; at the last step run
        ``final`` (the ``final_metrics`` phase), log its metrics, save the final model (with its files) and
        close the run as succeeded."""
        if self.trained_tokens and (metrics or self.last_step):
            metrics = metrics | {TRAINED_TOKENS: float(self.trained_tokens)}
        if metrics:
            self.reporter.log_metrics(self.step, metrics)
        self.check_health(metrics)
        if not is_due(self.step, self.hp.checkpoint_every, self.hp.max_steps):
            return
        if not self.last_step:
            self.save(self.step, metrics | self.last_eval)
            return
        end = Final()
        if final is not None:
            with self.reporter.phase("final_metrics") as progress:
                end = final(progress)
        if end.metrics:
            self.reporter.log_metrics(self.step, end.metrics)
        path = self.save(self.step, metrics | end.metrics | self.last_eval, files=end.files)
        self.reporter.event("info", f"final {end.label} saved to {path}{end.note}")
        self._result = LoopResult(status="succeeded", output_path=path, final_metrics=end.metrics or metrics)

    def check_health(self, metrics: dict[str, float]) -> None:
        """Feed the step's metrics to the health rules (``trainer/run_health.py``); each warning they
        raise goes to the run (``Reporter.warn``)."""
        seen = metrics | {"skipped_updates": float(self.skipped_updates)} if self.skipped_updates else metrics
        for warning in self.health.observe(self.step, seen):
            self.reporter.warn(warning.code, warning.step, warning.message)

    def save(self, step: int, metrics: dict[str, float], files: dict[str, str] | None = None) -> Path:
        """A checkpoint of ``step``. Every rank of a multi-rank run calls it (a sharded model's state is
        gathered from all of them); rank 0 writes it, but for a sharded model's optimizer state, which every
        rank writes its own shards of."""
        model_state = full_model_state(self.model, self.ranks)
        sharded = is_sharded(self.model)
        optimizer_state = None if sharded else self.optimizer.state_dict()
        extra = self.extra_state() | ({"trained_tokens": self.trained_tokens} if self.trained_tokens else {})
        return self.checkpointer.save(
            step,
            model=unwrap(self.model),
            tokenizer=self.tokenizer,
            optimizer_state=optimizer_state,
            sampler=self.sampler,
            metrics=metrics,
            extra=extra,
            files=(files or {}) | self.model_files,
            model_state=model_state,
            write=self.ranks.main,
            optimizer_shards=(
                (lambda folder: save_optimizer_shards(self.model, self.optimizer, folder))
                if sharded
                else None
            ),
        )
