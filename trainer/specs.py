"""Run specs: what a user submits, validated once at the API and again in the worker.

Torch-free on purpose: ``api`` imports this module and must not pull in torch.
One pydantic model per run type; ``RunSpec`` is their union, discriminated on ``algorithm``. Every
field has a default (where one makes sense) and a description, which becomes the OpenAPI docs.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.lr_defaults import default_learning_rate, preset_params_of

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
    # One token per character (no BPE merges): arithmetic demos learn digit by digit.
    "llama-char-0.4m": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "char_level": 1,
    },
}

_RUN_REF = re.compile(r"^run:(?P<id>[0-9a-fA-F-]{32,36})(@(?P<step>\d{1,10}))?$")
MAX_STEP = 2**31 - 1  # steps are 32-bit integer columns (PostgreSQL INTEGER)
_STAGE_REF = re.compile(r"^stage:(?P<name>[A-Za-z0-9_.-]{1,64})$")


def parse_run_ref(ref: str) -> uuid.UUID | None:
    """The run id of a ``run:<id>`` or ``run:<id>@<step>`` reference, or None for other references."""
    match = _RUN_REF.match(ref)
    try:
        return uuid.UUID(match["id"]) if match else None
    except ValueError:  # "run:" and 36 hyphens match the pattern but are no UUID
        return None


def parse_run_ref_step(ref: str) -> int | None:
    """The checkpoint step of a ``run:<id>@<step>`` reference (None: the run's final model)."""
    match = _RUN_REF.match(ref)
    return int(match["step"]) if match and match["step"] is not None else None


def parse_stage_ref(ref: str) -> str | None:
    """The stage name of a ``stage:<name>`` reference (valid only inside a pipeline)."""
    match = _STAGE_REF.match(ref)
    return match["name"] if match else None


def check_model_ref(ref: str) -> str:
    """Refuse model references that can never resolve; see ``MODEL_REF_DOC`` for the accepted forms."""
    ref = ref.strip()
    if not ref:
        raise ValueError("model reference is empty")
    if ref.startswith("tiny:"):
        name = ref.removeprefix("tiny:")
        if name not in TINY_PRESETS:
            raise ValueError(f"unknown tiny preset {name!r}; known: {', '.join(sorted(TINY_PRESETS))}")
    elif ref.startswith("run:"):
        if parse_run_ref(ref) is None:
            raise ValueError("a run reference is run:<run id> or run:<run id>@<checkpoint step>")
        step = parse_run_ref_step(ref)
        if step is not None and step > MAX_STEP:
            raise ValueError(f"checkpoint step must be at most {MAX_STEP}")
    elif ref.startswith("stage:") and parse_stage_ref(ref) is None:
        raise ValueError("a stage reference is stage:<name> (letters, digits, _ . -)")
    return ref


MODEL_REF_DOC = (
    "Model: `tiny:<preset>` (built-in random-init model: "
    + ", ".join(f"`tiny:{n}`" for n in TINY_PRESETS)
    + "), a local folder in Hugging Face format, a hub id (where the hub is reachable), `run:<id>` "
    "(the final model of a succeeded run), `run:<id>@<step>` (one of its checkpoints), or, inside a "
    "pipeline, `stage:<name>` (the model of an earlier stage)."
)


LR_DOC = (
    "AdamW learning rate (after warmup). Default: by the run family and the model's size "
    "(trainer/lr_defaults.py: 1e-3 for the tiny presets, TRL's and Tülu 3's rates for 1B-70B models); the "
    "stored spec holds the rate picked."
)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Fields that point at something stored (a model or a dataset) carry this mark in their JSON schema, so
# one walker (``spec_references``) finds them all: the API checks each against the caller's project and
# a pipeline resolves ``stage:`` refs in each. A test walks the OpenAPI schema and fails on a reference
# field without the mark.
REFERENCE_MARK = "x-rlrun-reference"
ROLE_MARK = "x-rlrun-model-role"
ReferenceKind = Literal["model", "dataset"]
# What a referenced model is used as: a causal LM (policy, reference), a scorer (reward) or a critic
# (either: a causal LM gets a fresh value head, a reward model keeps its score head).
ModelRole = Literal["policy", "reward", "critic"]
MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "policy"}
REWARD_MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "reward"}
CRITIC_MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "critic"}
DATASET_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "dataset"}

SpecPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Reference:
    """One reference in a spec: where it is (``("rewards", 0, "model")``), what it points at, its value."""

    path: SpecPath
    kind: ReferenceKind
    value: str
    role: ModelRole | None = None  # models only

    @property
    def field(self) -> str:
        """The path as errors name it: ``rewards[0].model``."""
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
        return out


def _field_mark(model: type[BaseModel], name: str) -> tuple[ReferenceKind | None, ModelRole | None]:
    extra = model.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or extra.get(REFERENCE_MARK) not in ("model", "dataset"):
        return None, None
    return extra[REFERENCE_MARK], extra.get(ROLE_MARK)  # type: ignore[return-value]


def spec_references(node: BaseModel, path: SpecPath = ()) -> list[Reference]:
    """Every set reference field in ``node`` and the models nested in it, in field order."""
    out: list[Reference] = []
    for name in type(node).model_fields:
        value = getattr(node, name)
        kind, role = _field_mark(type(node), name)
        if kind is not None and value is not None:
            out.append(Reference((*path, name), kind, str(value), role))
        elif isinstance(value, BaseModel):
            out += spec_references(value, (*path, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += spec_references(item, (*path, name, i))
    return out


def set_at(data: dict[str, Any], path: SpecPath, value: Any) -> None:
    """Set ``value`` at ``path`` inside a spec's JSON (in place)."""
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def refuse_nul(value: Any, where: str = "") -> Any:
    """``value`` unchanged, or ValueError if any string in it (keys included) holds U+0000.

    PostgreSQL text and JSONB cannot store NUL; refusing it at the door keeps both backends alike."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where or 'text'} contains a NUL character (U+0000)")
    elif isinstance(value, dict):
        for k, v in value.items():
            refuse_nul(k, where)
            refuse_nul(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            refuse_nul(v, f"{where}[{i}]")
    return value


class TrainingHyperparameters(_Frozen):
    """Optimiser, schedule, evaluation and checkpoint settings shared by every run type."""

    learning_rate: float | None = Field(
        default=None,
        gt=0,
        le=1.0,
        description=LR_DOC,
    )
    family: ClassVar[str] = "online_rl"  # which column of trainer/lr_defaults.py's table
    weight_decay: float = Field(default=0.0, ge=0, le=10.0, description="AdamW weight decay.")
    warmup_steps: int = Field(
        default=0, ge=0, le=1_000_000, description="Linear learning-rate warmup from 0."
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient norm clip.")
    batch_size: int = Field(default=8, ge=1, le=4096, description="Examples per optimizer step.")
    max_steps: int = Field(default=100, ge=1, le=10_000_000, description="Optimizer steps to run.")
    max_length: int = Field(default=256, ge=2, le=131_072, description="Longest sequence in tokens.")
    seed: int = Field(
        default=0, description="Seed for data order and dropout (a tiny preset has fixed weights)."
    )
    log_every: int = Field(default=1, ge=1, description="Log training metrics every N steps.")
    eval_every: int = Field(
        default=0, ge=0, description="Evaluate on the validation set every N steps (0: only at the end)."
    )
    checkpoint_every: int = Field(
        default=0, ge=0, description="Save a resumable checkpoint every N steps (0: only the final model)."
    )
    keep_last_checkpoints: int = Field(
        default=2, ge=1, le=1000, description="Checkpoints kept, newest first."
    )
    best_metric: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_./-]{1,200}$",
        description="Also keep the checkpoint best by this metric (e.g. `eval/loss`), besides the newest.",
    )
    best_mode: Literal["min", "max"] = Field(default="min", description="Whether lower or higher is better.")
    on_nonfinite: Literal["fail", "skip"] = Field(
        default="fail",
        description="NaN/inf loss or gradient: fail the run naming the step, or skip the batch (an event).",
    )

    @property
    def lr(self) -> float:
        """The learning rate to train with: the spec's (given, or picked at submit), else the unknown-size
        row of the defaults table (a spec built outside the API)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return default_learning_rate(self.family, None)


class DpoHyperparameters(TrainingHyperparameters):
    """Direct Preference Optimization (Rafailov et al. 2023) and its loss variants."""

    family: ClassVar[str] = "dpo"

    loss_type: PreferenceLossName = Field(
        default="sigmoid",
        description="Preference loss: sigmoid (DPO), cdpo (label smoothing), robust (rDPO), ipo, hinge.",
    )
    beta: float = Field(
        default=0.1, gt=0, le=100.0, description="Strength of the implicit KL constraint to the reference."
    )
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="Assumed label-noise rate; used by cdpo and robust only."
    )
    max_prompt_length: int = Field(
        default=128, ge=1, description="Longest prompt in tokens (cut from the left)."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> DpoHyperparameters:
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        if self.label_smoothing > 0 and self.loss_type not in ("cdpo", "robust"):
            raise ValueError("label_smoothing applies only to loss_type 'cdpo' or 'robust'")
        return self


class SftHyperparameters(TrainingHyperparameters):
    """Supervised fine-tuning: next-token cross-entropy on completion tokens only."""

    family: ClassVar[str] = "sft"


class RewardModelHyperparameters(TrainingHyperparameters):
    """A scalar reward head on the LM, trained with Bradley-Terry pairs or InstructGPT K-wise rankings."""

    family: ClassVar[str] = "reward_model"

    center_coef: float = Field(
        default=0.0,
        ge=0,
        le=10.0,
        description="Centering regulariser c * mean((s_chosen + s_rejected)^2) (Eisenstein et al. 2023).",
    )
    use_margin: bool = Field(
        default=True, description="Use a preference row's `margin` (if present) in the Bradley-Terry loss."
    )


class _RunSpecBase(_Frozen):
    spec_version: Literal[1] = Field(default=1, description="Version of this spec's schema.")
    name: str | None = Field(default=None, max_length=200, description="Free-form label.")
    model: str = Field(min_length=1, description=MODEL_REF_DOC, json_schema_extra=MODEL_REFERENCE)
    dataset_id: uuid.UUID = Field(description="Training dataset.", json_schema_extra=DATASET_REFERENCE)
    validation_dataset_id: uuid.UUID | None = Field(
        default=None,
        description="Validation dataset of the same kind (evaluated every `eval_every` steps).",
        json_schema_extra=DATASET_REFERENCE,
    )
    queue: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Worker queue this run is sent to (workers consume one with RLRUN_QUEUE, e.g. `gpu` or "
        "`cpu`); default: the server's RLRUN_QUEUE.",
    )
    validation_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="Hold out this fraction of the training rows (split by `seed`) when no validation set.",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_learning_rate(cls, data: Any) -> Any:
        """A tiny preset's size is known from its name: fill a missing learning rate here. Other models'
        sizes are read at submit (api/services/references.py: ``with_default_learning_rate``)."""
        model = data.get("model") if isinstance(data, dict) else None
        n_params = preset_params_of(model) if isinstance(model, str) else None
        if n_params is None:
            return data
        hp = data.get("hyperparameters", {})
        given = hp.get("learning_rate") if isinstance(hp, dict) else getattr(hp, "learning_rate", 0)
        if given is not None:
            return data
        rate = default_learning_rate(str(data.get("algorithm", "")), n_params)
        if isinstance(hp, BaseModel):
            return {**data, "hyperparameters": hp.model_copy(update={"learning_rate": rate})}
        return {**data, "hyperparameters": {**hp, "learning_rate": rate}}

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        return check_model_ref(v)

    @field_validator("name")
    @classmethod
    def _name_without_nul(cls, v: str | None) -> str | None:
        return refuse_nul(v, "name")  # type: ignore[no-any-return]

    @model_validator(mode="after")
    def _one_validation_source(self) -> _RunSpecBase:
        if self.validation_dataset_id is not None and self.validation_fraction > 0:
            raise ValueError("give validation_dataset_id or validation_fraction, not both")
        return self

    @property
    def model_refs(self) -> dict[str, str]:
        """Every model reference in the spec, by field path (``rewards[0].model``)."""
        return {r.field: r.value for r in spec_references(self) if r.kind == "model"}

    @property
    def total_steps(self) -> int:
        steps: int = self.hyperparameters.max_steps  # type: ignore[attr-defined]
        return steps


class _ReferencedSpecBase(_RunSpecBase):
    reference_model: str | None = Field(
        default=None,
        min_length=1,
        description="Frozen reference model (DPO's implicit reward, the RL KL term); default: the starting "
        "model. " + MODEL_REF_DOC,
        json_schema_extra=MODEL_REFERENCE,
    )

    @field_validator("reference_model")
    @classmethod
    def _check_reference(cls, v: str | None) -> str | None:
        return None if v is None else check_model_ref(v)


def _fill_unset(hp: _Frozen, preset: dict[str, Any]) -> _Frozen:
    """``hp`` with every field the user left None taken from the algorithm's preset, validated again:
    a preset can make a combination invalid (DAPO's dynamic sampling with one sample per prompt)."""
    unset = {k: v for k, v in preset.items() if getattr(hp, k) is None}
    if not unset:
        return hp
    try:
        return type(hp).model_validate({**hp.model_dump(exclude_unset=True), **unset})
    except ValidationError as exc:
        messages = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ValueError(f"hyperparameters: {messages} (with this algorithm's preset)") from None


class DpoSpec(_ReferencedSpecBase):
    """A DPO run: a policy trained on preference pairs against a frozen reference model."""

    algorithm: Literal["dpo"] = Field(description="Run type.")
    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("preference",)


class SftSpec(_RunSpecBase):
    """Supervised fine-tuning on prompt/completion pairs or chat conversations."""

    algorithm: Literal["sft"] = Field(description="Run type.")
    hyperparameters: SftHyperparameters = Field(default_factory=SftHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("sft",)


class RewardModelSpec(_RunSpecBase):
    """A reward model: the LM with a scalar head, on preference pairs or K-way rankings."""

    algorithm: Literal["reward_model"] = Field(description="Run type.")
    hyperparameters: RewardModelHyperparameters = Field(default_factory=RewardModelHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("preference", "ranking")


VerifierName = Literal["exact_match", "numeric", "regex", "format", "length_penalty", "overlong_penalty"]
GroupAlgorithm = Literal[
    "grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "reinforce_baseline", "remax"
]


class RewardSpec(_Frozen):
    """One reward component: a rule-based verifier or a reward model, weighted into the total reward."""

    name: VerifierName | Literal["reward_model"] = Field(
        description="exact_match, numeric (last number, `#### N` or `\\boxed{}`), regex, format "
        "(<think>...</think><answer>...</answer>), length_penalty, overlong_penalty (DAPO), or reward_model."
    )
    weight: float = Field(default=1.0, ge=-100, le=100, description="Multiplier in the weighted sum.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description='Verifier keyword arguments, e.g. {"tolerance": 1e-6} for numeric, {"pattern": ...} '
        'for regex, {"cache_tokens": 16} for overlong_penalty, {"target_tokens": 32} for length_penalty.',
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="reward_model only: `run:<id>` of a reward-model run (`stage:<name>` in a pipeline), or "
        "a model folder whose config names a `...ForSequenceClassification` architecture.",
        json_schema_extra=REWARD_MODEL_REFERENCE,
    )
    normalize: bool = Field(
        default=True, description="reward_model only: standardise scores with the run's stored mean and std."
    )

    @model_validator(mode="after")
    def _model_iff_reward_model(self) -> RewardSpec:
        if (self.name == "reward_model") != (self.model is not None):
            raise ValueError("`model` is required for name 'reward_model' and not allowed otherwise")
        if self.model is not None:
            check_model_ref(self.model)
        return self

    @field_validator("params")
    @classmethod
    def _params_without_nul(cls, v: dict[str, Any]) -> dict[str, Any]:
        return refuse_nul(v, "params")  # type: ignore[no-any-return]


class OnlineRlHyperparameters(TrainingHyperparameters):
    """Online RL: sample -> reward -> advantage -> clipped policy-gradient epochs (see docs/algorithms.md)."""

    max_steps: int = Field(
        default=100, ge=1, le=1_000_000, description="RL steps (each: rollouts + updates)."
    )
    prompts_per_step: int = Field(default=8, ge=1, le=4096, description="Prompts sampled per RL step.")
    samples_per_prompt: int = Field(default=4, ge=1, le=256, description="Completions per prompt (G).")
    max_prompt_length: int = Field(
        default=128, ge=1, le=65_536, description="Prompt tokens (cut from the left)."
    )
    max_new_tokens: int = Field(default=64, ge=1, le=65_536, description="Generation budget per completion.")
    temperature: float = Field(default=1.0, ge=0, le=10, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    engine: Literal["hf", "vllm"] = Field(
        default="hf", description="Rollout engine: hf (transformers generate) or vllm (GPU extra)."
    )
    advantage: AdvantageName | None = Field(
        default=None, description="Advantage estimator; default: the algorithm preset's."
    )
    policy_loss: PolicyLossName | None = Field(default=None, description="Default: the preset's.")
    loss_aggregation: AggregationName | None = Field(default=None, description="Default: the preset's.")
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="Passes over each step's rollouts.")
    minibatch_size: int | None = Field(
        default=None, ge=1, description="Completions per optimizer step (default: all of a step's rollouts)."
    )
    clip_low: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip epsilon below 1 (ratio >= 1 - low)."
    )
    clip_high: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="Clip epsilon above 1; > clip_low is DAPO clip-higher. Default: preset.",
    )
    dual_clip: float | None = Field(
        default=None, gt=1, description="Dual-clip constant c > 1 (Ye et al. 2020)."
    )
    kl_coef: float | None = Field(
        default=None, ge=0, le=100, description="KL-to-reference coefficient; preset."
    )
    kl_estimator: KlEstimatorName = Field(default="k3", description="k1, k2, k3 or abs (Schulman 2020).")
    kl_placement: Literal["loss", "reward"] = Field(
        default="loss", description="KL as a loss term (GRPO) or folded into per-token rewards (RLHF recipe)."
    )
    kl_controller: KlControllerName = Field(default="fixed", description="fixed, or adaptive (Ziegler 2019).")
    kl_target: float = Field(default=6.0, gt=0, description="adaptive controller: target KL.")
    kl_horizon: int = Field(default=10_000, ge=1, description="adaptive controller: horizon.")
    entropy_coef: float = Field(default=0.0, ge=0, le=10, description="Entropy bonus coefficient.")
    dynamic_sampling: bool | None = Field(
        default=None,
        description="Drop zero-variance groups and sample more prompts to refill (DAPO); preset.",
    )
    max_refill_rounds: int = Field(
        default=3, ge=0, le=32, description="Extra sampling rounds to refill a step."
    )
    mask_truncated: bool = Field(default=False, description="Give completions cut at max_new_tokens no loss.")
    sample_every: int = Field(
        default=10, ge=0, description="Store sample completions every N steps (0: never)."
    )
    samples_to_store: int = Field(default=4, ge=0, le=64, description="How many completions to store then.")

    @model_validator(mode="after")
    def _fits(self) -> OnlineRlHyperparameters:
        if self.max_prompt_length + self.max_new_tokens > self.max_length:
            raise ValueError("max_prompt_length + max_new_tokens must not exceed max_length")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ValueError(
                "dynamic_sampling needs samples_per_prompt >= 2 (a group of one has no variance)"
            )
        return self


GROUP_PRESETS: dict[str, dict[str, Any]] = {
    # Shao et al. 2024 (DeepSeekMath): std-normalised group advantage, k3 KL in the loss, 1/|o| per sequence.
    "grpo": {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.04,
        "dynamic_sampling": False,
    },
    # Liu et al. 2025: no std division, no length normalisation (constant normaliser), no KL.
    "dr_grpo": {
        "advantage": "dr_grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_sum_norm",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
    # Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, no KL.
    "dapo": {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.28,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
    },
    "rloo": {
        "advantage": "rloo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
    "reinforce": {
        "advantage": "reinforce",
        "policy_loss": "vanilla",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
    "reinforce_pp": {
        "advantage": "reinforce_pp",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
    "reinforce_baseline": {
        "advantage": "reinforce_baseline",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
    # Li et al. 2023: the greedy completion's reward is the baseline.
    "remax": {
        "advantage": "remax",
        "policy_loss": "vanilla",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
    },
}


class _OnlineRlSpecBase(_ReferencedSpecBase):
    dataset_id: uuid.UUID = Field(
        description="A dataset of kind `prompts` ({prompt, answer?, meta}).",
        json_schema_extra=DATASET_REFERENCE,
    )
    rewards: list[RewardSpec] = Field(min_length=1, max_length=16, description="Reward components, summed.")
    eval_rewards: list[RewardSpec] | None = Field(
        default=None,
        description="Held-out metric on the validation prompts (greedy), e.g. exact_match; logged as "
        "`eval/accuracy` every `eval_every` steps. Default: the training rewards.",
    )
    dataset_kinds: ClassVar[tuple[str, ...]] = ("prompts",)


class GroupRlSpec(_OnlineRlSpecBase):
    """Group / leave-one-out family: G completions per prompt, advantages from their rewards (no critic)."""

    algorithm: GroupAlgorithm = Field(
        description="Preset: grpo, dr_grpo, dapo, rloo, reinforce, reinforce_pp, reinforce_baseline, remax. "
        "Each fills advantage, policy_loss, loss_aggregation, clip_high, kl_coef and dynamic_sampling "
        "unless given."
    )
    hyperparameters: OnlineRlHyperparameters = Field(default_factory=OnlineRlHyperparameters)

    @model_validator(mode="after")
    def _apply_preset(self) -> GroupRlSpec:
        object.__setattr__(
            self, "hyperparameters", _fill_unset(self.hyperparameters, GROUP_PRESETS[self.algorithm])
        )
        if self.hyperparameters.advantage == "remax" and self.algorithm != "remax":
            raise ValueError(
                "the remax advantage needs algorithm 'remax' (it adds the greedy baseline rollout)"
            )
        return self


PpoAlgorithm = Literal["ppo", "vc_ppo"]


class PpoHyperparameters(OnlineRlHyperparameters):
    """PPO with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022), and VC-PPO
    (Yuan et al. 2025: value pretraining, decoupled and length-adaptive lambda)."""

    samples_per_prompt: int = Field(default=1, ge=1, le=256, description="Completions per prompt.")
    kl_estimator: KlEstimatorName = Field(default="k1", description="k1, k2, k3 or abs (Schulman 2020).")
    kl_placement: Literal["loss", "reward"] = Field(
        default="reward", description="KL folded into per-token rewards (RLHF recipe) or added to the loss."
    )
    gamma: float = Field(default=1.0, gt=0, le=1, description="GAE discount.")
    lam: float | None = Field(default=None, ge=0, le=1, description="Actor GAE lambda; preset.")
    critic_lam: float | None = Field(
        default=None, ge=0, le=1, description="Critic (value target) GAE lambda; VC-PPO decouples it (1.0)."
    )
    length_adaptive_alpha: float | None = Field(
        default=None,
        gt=0,
        description="VC-PPO: actor lambda per sequence = 1 - 1/(alpha * length); None keeps `lam` fixed.",
    )
    value_clip: float | None = Field(
        default=0.2, gt=0, description="Clipped value loss range (None: unclipped)."
    )
    vf_coef: float = Field(default=0.5, gt=0, le=100, description="Value-loss weight.")
    critic_learning_rate: float | None = Field(
        default=None, gt=0, le=1.0, description="Critic AdamW learning rate (default: learning_rate)."
    )
    value_pretrain_steps: int | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="Steps that train only the critic before the actor; preset.",
    )
    whiten_advantages: bool = Field(default=True, description="Standardise advantages over valid tokens.")


PPO_PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {
        "lam": 0.95,
        "critic_lam": 0.95,
        "value_pretrain_steps": 0,
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.05,
        "dynamic_sampling": False,
    },
    # Yuan et al. 2025: critic lambda 1 (unbiased value targets), actor lambda adapted to the length,
    # and the value model pretrained on the initial policy's rollouts before any actor update.
    "vc_ppo": {
        "lam": 0.95,
        "critic_lam": 1.0,
        "length_adaptive_alpha": 0.05,
        "value_pretrain_steps": 10,
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_high": 0.2,
        "kl_coef": 0.05,
        "dynamic_sampling": False,
    },
}


class PpoSpec(_OnlineRlSpecBase):
    """PPO family: token-level advantages from a critic (value head) with GAE."""

    algorithm: PpoAlgorithm = Field(description="Preset: ppo or vc_ppo (fills the fields left unset).")
    critic_model: str | None = Field(
        default=None,
        min_length=1,
        description="Critic initialisation: default the starting policy with a fresh value head; or a "
        "reward-model run (`run:<id>`), the InstructGPT recipe. " + MODEL_REF_DOC,
        json_schema_extra=CRITIC_MODEL_REFERENCE,
    )
    hyperparameters: PpoHyperparameters = Field(default_factory=PpoHyperparameters)

    @field_validator("critic_model")
    @classmethod
    def _check_critic(cls, v: str | None) -> str | None:
        return None if v is None else check_model_ref(v)

    @model_validator(mode="after")
    def _apply_preset(self) -> PpoSpec:
        if self.hyperparameters.advantage is not None:
            raise ValueError("PPO takes its advantages from GAE; `advantage` is for the group family")
        object.__setattr__(
            self, "hyperparameters", _fill_unset(self.hyperparameters, PPO_PRESETS[self.algorithm])
        )
        return self


AnyRunSpec = DpoSpec | SftSpec | RewardModelSpec | GroupRlSpec | PpoSpec
RunSpec = Annotated[AnyRunSpec, Field(discriminator="algorithm")]
RUN_SPEC_ADAPTER: TypeAdapter[AnyRunSpec] = TypeAdapter(RunSpec)
ALGORITHMS: tuple[str, ...] = (
    "dpo",
    "sft",
    "reward_model",
    *get_args(GroupAlgorithm),
    *get_args(PpoAlgorithm),
)


# Advantages that compare the completions of one prompt: with one completion each is its own baseline and
# every advantage is 0 (nothing is learned). REINFORCE, REINFORCE++, ReMax and PPO have other baselines.
GROUP_BASELINE_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_baseline"})


def learning_problems(spec: AnyRunSpec) -> list[tuple[str, str]]:
    """(field, why) for each setting with which the run could not learn, although every field is valid
    alone: the API refuses such a spec at submit (422) rather than let it "succeed" having learned nothing.
    """
    problems: list[tuple[str, str]] = []
    if not isinstance(spec, GroupRlSpec | PpoSpec):
        return problems
    hp = spec.hyperparameters
    group_baseline = isinstance(spec, GroupRlSpec) and hp.advantage in GROUP_BASELINE_ADVANTAGES
    if group_baseline and hp.samples_per_prompt < 2:
        problems.append(
            (
                "hyperparameters.samples_per_prompt",
                f"the {hp.advantage} advantage compares the completions of one prompt: with "
                f"samples_per_prompt {hp.samples_per_prompt} every advantage is 0 and nothing is learned; "
                "use 2 or more (or algorithm reinforce, reinforce_pp or remax)",
            )
        )
    if hp.kl_controller == "adaptive" and not hp.kl_coef:
        problems.append(
            (
                "hyperparameters.kl_coef",
                "the adaptive KL controller scales kl_coef up or down from its start: from 0 it stays 0; "
                "give kl_coef > 0 or use kl_controller 'fixed'",
            )
        )
    return problems


def parse_spec(data: object) -> AnyRunSpec:
    """Validate stored or submitted JSON as a run spec (raises pydantic.ValidationError)."""
    return RUN_SPEC_ADAPTER.validate_python(data)
