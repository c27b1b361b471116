"""A training session (``algorithm: training_session``): a model held by one worker, trained step by step by
the caller's own loop through the Tinker protocol (issue 40; api/routers/tinker.py): the worker loads the
base with a fresh LoRA adapter and waits for ``forward_backward`` / ``optim_step`` calls until the caller
finishes the session, cancels the run, or leaves it idle. Torch-free."""

from __future__ import annotations

import uuid
from typing import ClassVar, Literal

from pydantic import Field

from trainer.specs.base import _Frozen, _SpecCore


class SessionHyperparameters(_Frozen):
    """The adapter the session trains and how long it waits."""

    lora_rank: int = Field(
        default=32, ge=1, le=512, description="Rank of the LoRA adapter on every linear layer."
    )
    idle_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Seconds without a call after which the session ends (the run succeeds with what it "
        "has).",
    )
    max_length: int = Field(default=4096, ge=2, le=131_072, description="Tokens per datum, at most.")
    seed: int = Field(default=0, ge=0, description="Seeds the adapter's initialisation.")


# What a session's ``save_state`` writes beside its peft folder (trainer/loops/training_session.py), and
# what ``load_state`` reads: the adapter's tensors and the optimizer's state.
TRAINABLE_FILE, OPTIMIZER_FILE = "session_trainable.pt", "session_optimizer.pt"


class SessionState(_Frozen):
    """A state saved by a training session (the SDK's ``save_state``), to start this one from."""

    run_id: uuid.UUID = Field(description="The session run that saved it.")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The name it was saved under.")
    optimizer: bool = Field(default=False, description="Also restore the optimizer's state (Adam moments).")


class TrainingSessionSpec(_SpecCore):
    """A model trained call by call from the caller's own loop (the `tinker` SDK: `forward_backward`,
    `optim_step`), held by one worker while the session lasts. Created by the SDK's
    `create_lora_training_client`; no dataset."""

    algorithm: Literal["training_session"] = Field(description="Run type.")
    hyperparameters: SessionHyperparameters = Field(default_factory=SessionHyperparameters)
    load_state: SessionState | None = Field(
        default=None,
        description="Start from a state another session saved (the SDK's create_training_client_from_state): "
        "its adapter weights, and with `optimizer` its Adam state; the base model and rank must be its.",
    )
    dataset_kinds: ClassVar[tuple[str, ...]] = ()

    @property
    def total_steps(self) -> int | None:
        return None
