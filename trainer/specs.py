"""Run specs: what a user submits, validated once at the API and again in the worker.

Torch-free on purpose: ``api`` imports this module and must not pull in torch.
One pydantic model per run type; ``RunSpec`` is their union, discriminated on ``algorithm``. Every
field has a default (where one makes sense) and a description, which becomes the OpenAPI docs.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

# Names of the algorithm registries in trainer/algorithms; a test checks they match the registry keys.
PreferenceLossName = Literal["sigmoid", "cdpo", "robust", "ipo", "hinge"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_baseline", "remax"]
PolicyLossName = Literal["ppo_clip", "vanilla"]
KlEstimatorName = Literal["k1", "k2", "k3", "abs"]
AggregationName = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
KlControllerName = Literal["fixed", "adaptive"]

# Built-in tiny models (random init, tokenizer built offline). Kept here, torch-free, so the API can
# refuse an unknown preset at submit time; trainer/models.py builds them.
TINY_PRESETS: dict[str, dict[str, int]] = {
    "llama-0.4m": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
    },
    "llama-10m": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "intermediate_size": 1024,
    },
}

_RUN_REF = re.compile(r"^run:(?P<id>[0-9a-fA-F-]{32,36})$")


def parse_run_ref(ref: str) -> uuid.UUID | None:
    """The run id of a ``run:<id>`` model reference, or None for any other kind of reference."""
    match = _RUN_REF.match(ref)
    return uuid.UUID(match["id"]) if match else None


def check_model_ref(ref: str) -> str:
    """Refuse model references that can never resolve; see ``ModelRef`` for the accepted forms."""
    ref = ref.strip()
    if not ref:
        raise ValueError("model reference is empty")
    if ref.startswith("tiny:"):
        name = ref.removeprefix("tiny:")
        if name not in TINY_PRESETS:
            raise ValueError(f"unknown tiny preset {name!r}; known: {', '.join(sorted(TINY_PRESETS))}")
    elif ref.startswith("run:"):
        if parse_run_ref(ref) is None:
            raise ValueError("a run reference is run:<run id>")
    return ref


MODEL_REF_DOC = (
    "Model to start from: `tiny:<preset>` (built-in random-init model: "
    + ", ".join(f"`tiny:{n}`" for n in TINY_PRESETS)
    + "), a local folder in Hugging Face format, a hub id (where the hub is reachable), or `run:<id>` "
    "(the final model of a succeeded run)."
)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DpoHyperparameters(_Frozen):
    """Direct Preference Optimization (Rafailov et al. 2023) and its loss variants."""

    loss_type: PreferenceLossName = Field(
        default="sigmoid",
        description="Preference loss: sigmoid (DPO), cdpo (label smoothing), robust (rDPO), ipo, hinge.",
    )
    beta: float = Field(
        default=0.1, gt=0, description="Strength of the implicit KL constraint to the reference."
    )
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="Assumed label-noise rate; used by cdpo and robust only."
    )
    learning_rate: float = Field(default=1e-6, gt=0, description="AdamW learning rate (after warmup).")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warmup from 0.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient norm clip.")
    batch_size: int = Field(default=8, ge=1, le=4096, description="Preference pairs per optimizer step.")
    max_steps: int = Field(default=100, ge=1, le=10_000_000, description="Optimizer steps to run.")
    max_length: int = Field(
        default=256, ge=2, description="Longest prompt+completion in tokens (longer is cut)."
    )
    max_prompt_length: int = Field(
        default=128, ge=1, description="Longest prompt in tokens (cut from the left)."
    )
    seed: int = Field(
        default=0, description="Seed for data order and dropout (a tiny preset has fixed weights)."
    )
    log_every: int = Field(default=1, ge=1, description="Log training metrics every N steps.")

    @model_validator(mode="after")
    def _prompt_fits(self) -> DpoHyperparameters:
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        if self.label_smoothing > 0 and self.loss_type not in ("cdpo", "robust"):
            raise ValueError("label_smoothing applies only to loss_type 'cdpo' or 'robust'")
        return self


class DpoSpec(_Frozen):
    """A DPO run: a policy trained on preference pairs against a frozen reference model."""

    spec_version: Literal[1] = Field(default=1, description="Version of this spec's schema.")
    algorithm: Literal["dpo"] = Field(description="Run type.")
    name: str | None = Field(default=None, max_length=200, description="Free-form label.")
    model: str = Field(description=MODEL_REF_DOC)
    reference_model: str | None = Field(
        default=None, description="Frozen reference model; default: the starting model. " + MODEL_REF_DOC
    )
    dataset_id: uuid.UUID = Field(description="A dataset of kind `preference`.")
    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)

    @field_validator("model", "reference_model")
    @classmethod
    def _check_model_refs(cls, v: str | None) -> str | None:
        return None if v is None else check_model_ref(v)

    @property
    def dataset_kind(self) -> str:
        return "preference"

    @property
    def total_steps(self) -> int:
        return self.hyperparameters.max_steps


RunSpec = Annotated[DpoSpec, Field(discriminator="algorithm")]
RUN_SPEC_ADAPTER: TypeAdapter[DpoSpec] = TypeAdapter(RunSpec)
ALGORITHMS: tuple[str, ...] = ("dpo",)


def parse_spec(data: object) -> DpoSpec:
    """Validate stored or submitted JSON as a run spec (raises pydantic.ValidationError)."""
    return RUN_SPEC_ADAPTER.validate_python(data)
