"""An online-RL run's environment: Python code whose ``reset(row)`` opens each episode and whose
``step(messages, row)`` answers each of the policy's turns with messages, a reward and whether the episode
is done (trainer/rollout/env_episodes.py has the protocol). Torch-free (the API validates it)."""

from __future__ import annotations

import uuid

from pydantic import Field, field_validator, model_validator

from trainer.specs.base import _Frozen
from trainer.specs.graders import MAX_SOURCE_CHARS, refuse_without_sandbox, top_level_functions
from trainer.specs.refs import ENVIRONMENT_REFERENCE, refuse_nul

ENVIRONMENT_FUNCTIONS = {"reset": 1, "step": 2}  # name -> positional parameters it must take


class EnvironmentSpec(_Frozen):
    """Multi-turn episodes driven by an environment: the episode opens with ``reset(row)``'s messages;
    after every policy turn ``step(messages, row)`` returns ``{"messages", "reward", "done"}``; the
    episode's reward is the sum of its step rewards (``reward/environment``), plus the run's other
    reward components on the final answer. Loss, KL and entropy cover only the policy's tokens
    (docs/algorithms.md, "Multi-turn tool rollouts")."""

    id: uuid.UUID | None = Field(
        default=None,
        description="An environment stored with POST /v1/environments; the run stores its source in "
        "`source` at submit (replacing any given), so it keeps the code it ran with.",
        json_schema_extra=ENVIRONMENT_REFERENCE,
    )
    source: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="Python defining top-level `reset(row)` (the opening messages, or a string: one user "
        "message) and `step(messages, row)` ({'messages': [...], 'reward': float, 'done': bool}); run in "
        "the sandbox of python graders (no network, no host files, 5 s and 1 GiB per call), statelessly: "
        "each turn may run in a fresh process. Give `source` or `id`.",
    )
    max_turns: int = Field(default=4, ge=1, le=32, description="Policy turns per episode, at most.")
    max_episode_tokens: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Tokens after the prompt per episode: the policy's turns and the environment's messages "
        "together. Default: max_turns x hyperparameters.max_new_tokens.",
    )

    @field_validator("source")
    @classmethod
    def _defines_reset_and_step(cls, v: str | None) -> str | None:
        return None if v is None else cls.check_source(v)

    @model_validator(mode="after")
    def _source_or_id(self) -> EnvironmentSpec:
        if self.source is None and self.id is None:
            raise ValueError("give `source` (the environment's Python) or `id` (a stored environment)")
        return self

    @staticmethod
    def check_source(v: str) -> str:
        """``v`` if it is Python that defines ``reset(row)`` and ``step(messages, row)`` and can run here.

        Raises:
            ValueError: why not, naming the line where there is one.
        """
        refuse_nul(v, "source")
        functions = top_level_functions(v)
        for name, arity in ENVIRONMENT_FUNCTIONS.items():
            fn = functions.get(name)
            if fn is None:
                raise ValueError(f"defines no top-level function `{name}`")
            if len(fn.args.posonlyargs + fn.args.args) < arity and fn.args.vararg is None:
                wanted = "row" if name == "reset" else "messages, row"
                raise ValueError(f"`{name}` (line {fn.lineno}) must take ({wanted})")
        refuse_without_sandbox("environments")
        return v

    @property
    def code(self) -> str:
        """The environment's source (a stored one's is filled in at submit).

        Raises:
            ValueError: an ``id`` whose source was never filled in (a spec that did not go through submit).
        """
        if self.source is None:
            raise ValueError(f"environment {self.id}: its source was not filled in at submit")
        return self.source

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The episode's token budget after the prompt."""
        return self.max_episode_tokens or self.max_turns * max_new_tokens
