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
change here; a phase of one run kind is one change in that loop's file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
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
from trainer.data.sampling import EpochSampler
from trainer.distributed import (
    full_model_state,
    full_optimizer_state,
    load_optimizer_state,
    unwrap,
    wrap,
)
from trainer.loops.common import (
    is_due,
    make_optimizer,
    micro_batches,
    seed_everything,
    set_lr,
    stop_requested,
    to_floats,
    update_or_skip,
    warmup_constant_lr,
)
from trainer.models import load_causal_lm, load_reward_model, pick_device
from trainer.phases import Phase
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter
from trainer.run_health import RunHealth
from trainer.specs import AdapterSpec, TrainingHyperparameters

T = TypeVar("T")
TRAINED_TOKENS = "tokens/trained"  # metric: non-padding tokens of the rows trained on so far (cumulative)


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
                start.start_path, quantization_config(start.adapter), frozen_dtype(precision)
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
        gathered from all of them); rank 0 writes it."""
        model_state = full_model_state(self.model, self.ranks)
        optimizer_state = full_optimizer_state(self.model, self.optimizer)
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
        )
