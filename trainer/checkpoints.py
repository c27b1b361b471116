"""Resumable checkpoints: model (HF folder, safetensors), optimizer, RNG states, data position, step.

A checkpoint is a folder ``<root>/step-<N>/`` holding the model and tokenizer (``save_pretrained``, so
``from_pretrained`` loads it like any model folder), ``trainer_state.pt`` (everything else needed to resume
exactly) and ``metrics.json`` (the metrics at that step, used for retention). It is written under a
temporary name and renamed, so a crash never leaves half a checkpoint that looks complete. A run whose
model is sharded over ranks (FSDP2) keeps its optimizer state in ``optimizer/`` instead of
``trainer_state.pt``: each rank writes its own shards there (``trainer/distributed.py``).

The learning-rate schedule is a pure function of the step (``warmup_constant_lr``), so restoring the step
restores the schedule; there is no separate scheduler object to save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from trainer.data.sampling import EpochSampler
    from trainer.phases import Phase

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.json"
OPTIMIZER_SHARDS = "optimizer"  # the folder of a sharded run's optimizer state (one file per rank)


class CheckpointSink(Protocol):
    """Where the checkpointer announces what it saved and removed (the run's Reporter)."""

    def checkpoint_saved(
        self, step: int, path: Path, size_bytes: int, metrics: Mapping[str, float]
    ) -> None: ...

    def checkpoint_removed(self, step: int) -> None: ...

    def phase(self, name: str, total: int | None = None) -> AbstractContextManager[Phase]: ...


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def steps_to_prune(
    saved: Mapping[int, Mapping[str, float]], *, keep_last: int, best_metric: str | None, best_mode: str
) -> set[int]:
    """Steps to delete: all but the ``keep_last`` newest and the best by ``best_metric`` (if any has it)."""
    keep = set(sorted(saved)[-keep_last:])
    if best_metric is not None:
        scored = [(m[best_metric], step) for step, m in saved.items() if best_metric in m]
        if scored:
            best = min(scored) if best_mode == "min" else max(scored)
            keep.add(best[1])
    return set(saved) - keep


@dataclass
class ResumeState:
    step: int
    extra: dict[str, Any]


class Checkpointer:
    """Saves checkpoints under ``root`` and applies retention (keep last K + best by a metric)."""

    def __init__(
        self,
        root: Path,
        sink: CheckpointSink,
        *,
        keep_last: int,
        best_metric: str | None = None,
        best_mode: str = "min",
    ):
        self.root, self.sink = root, sink
        self.keep_last, self.best_metric, self.best_mode = keep_last, best_metric, best_mode
        self.saved: dict[int, dict[str, float]] = {}
        for folder in sorted(root.glob("step-*")) if root.exists() else []:  # from an earlier attempt
            if (folder / STATE_FILE).exists():
                self.saved[int(folder.name.removeprefix("step-"))] = json.loads(
                    (folder / METRICS_FILE).read_text()
                )

    def save(
        self,
        step: int,
        *,
        model: Any,
        tokenizer: Any,
        optimizer_state: Mapping[str, Any] | None,
        sampler: EpochSampler,
        metrics: Mapping[str, float],
        extra: dict[str, Any] | None = None,
        files: Mapping[str, str] | None = None,
        model_state: Mapping[str, torch.Tensor] | None = None,
        write: bool = True,
        optimizer_shards: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write a complete checkpoint for ``step`` and prune old ones; returns its folder.

        ``extra`` rides in ``trainer_state.pt`` (resume only); ``files`` are text files written next to the
        model (name -> content, e.g. a reward model's score statistics), inside the folder before it is
        renamed into place and announced, so a reader never sees the model without them. ``model_state``:
        the whole model's state when the model in memory is sharded (``save_pretrained`` writes it).
        ``write=False`` (a rank other than 0 of a multi-rank run) only records the step: rank 0 writes.
        ``optimizer_shards`` (a sharded model; then ``optimizer_state`` is None): writes the optimizer's
        state into the folder it is given, called on every rank (each writes its own shards) once rank 0
        has made the checkpoint's temporary folder; the function itself makes the ranks meet first."""
        target = step_dir(self.root, step)
        tmp = self.root / f".tmp-step-{step:08d}"
        if not write:
            if optimizer_shards is not None:
                optimizer_shards(tmp / OPTIMIZER_SHARDS)
            self.saved[step] = {k: float(v) for k, v in metrics.items()}
            return target
        # The files are the long part (a 7B model: tens of seconds), watched as the ``checkpoint`` phase; a
        # stop inside it removes the half-written folder. Announcing the checkpoint comes after the phase.
        with self.sink.phase("checkpoint"):
            try:
                self._write(
                    tmp,
                    target,
                    step,
                    model,
                    tokenizer,
                    optimizer_state,
                    sampler,
                    metrics,
                    extra,
                    files,
                    model_state,
                    optimizer_shards,
                )
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        clean = {k: float(v) for k, v in metrics.items()}
        self.saved[step] = clean
        self.sink.checkpoint_saved(step, target, folder_size(target), clean)
        for old in sorted(
            steps_to_prune(
                self.saved, keep_last=self.keep_last, best_metric=self.best_metric, best_mode=self.best_mode
            )
        ):
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
            del self.saved[old]
            self.sink.checkpoint_removed(old)
        return target

    @staticmethod
    def _write(
        tmp: Path,
        target: Path,
        step: int,
        model: Any,
        tokenizer: Any,
        optimizer_state: Mapping[str, Any] | None,
        sampler: EpochSampler,
        metrics: Mapping[str, float],
        extra: dict[str, Any] | None,
        files: Mapping[str, str] | None,
        model_state: Mapping[str, torch.Tensor] | None = None,
        optimizer_shards: Callable[[Path], None] | None = None,
    ) -> None:
        """Write the checkpoint's files under ``tmp``, then rename it into place as ``target``."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if optimizer_shards is not None:  # first: the other ranks wait in it until this folder is made
            optimizer_shards(tmp / OPTIMIZER_SHARDS)
        if model_state is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=dict(model_state))
        tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        state = {
            "step": step,
            "optimizer": optimizer_state,
            "optimizer_shards": OPTIMIZER_SHARDS if optimizer_shards is not None else None,
            "rng": rng_state(),
            "sampler": sampler.state_dict(),
            "extra": extra or {},
        }
        torch.save(state, tmp / STATE_FILE)
        clean = {k: float(v) for k, v in metrics.items()}
        (tmp / METRICS_FILE).write_text(json.dumps(clean, sort_keys=True))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)


def load_trainer_state(
    folder: Path,
    *,
    optimizer: torch.optim.Optimizer,
    sampler: EpochSampler,
    restore_optimizer: Callable[[dict[str, Any]], None] | None = None,
    restore_shards: Callable[[Path], None] | None = None,
) -> ResumeState:
    """Restore optimizer, RNG and data position from a checkpoint folder (the model loads separately).
    ``restore_optimizer`` loads the optimizer's state when ``load_state_dict`` cannot (a sharded model);
    ``restore_shards`` reads it from the folder of shards a sharded run wrote (every rank calls it)."""
    state = torch.load(folder / STATE_FILE, weights_only=False)  # our own file: holds Python RNG tuples
    if state.get("optimizer_shards"):
        if restore_shards is None:
            raise ValueError(f"{folder} keeps its optimizer state in shards, and no reader of them was given")
        restore_shards(folder / state["optimizer_shards"])
    else:
        (restore_optimizer or optimizer.load_state_dict)(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    restore_rng(state["rng"])
    return ResumeState(step=int(state["step"]), extra=dict(state["extra"]))
