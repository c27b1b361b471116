"""What every run spec shares: optimiser, schedule, eval and checkpoint settings; model, datasets,
queue and validation split. Torch-free (the API imports it)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlrun.schemas import MAX_NOTE_LENGTH, MAX_TAG_LENGTH, MAX_TAGS, Tags
from trainer.lr_defaults import default_learning_rate, preset_params_of
from trainer.specs.refs import (
    DATASET_REFERENCE,
    MODEL_REF_DOC,
    MODEL_REFERENCE,
    check_model_ref,
    refuse_nul,
    spec_references,
)
from trainer.specs.sinks import METRIC_SINKS_DOC, MetricSinks

# Names of the algorithm registries in trainer/algorithms; a test checks they match the registry keys.
PreferenceLossName = Literal["sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_baseline", "remax"]
PolicyLossName = Literal["ppo_clip", "vanilla", "gspo", "cispo"]
KlEstimatorName = Literal["k1", "k2", "k3", "abs"]
AggregationName = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
KlControllerName = Literal["fixed", "adaptive"]
# hf: transformers generate; vllm: in-process vLLM (GPU); vllm_server: vLLM's server in its own process
# (trainer/rollout/engine_process.py)
EngineName = Literal["hf", "vllm", "vllm_server"]

LR_DOC = (
    "AdamW learning rate (after warmup). Default: by the run family and the model's size "
    "(trainer/lr_defaults.py: 1e-3 for the tiny presets, TRL's and Tülu 3's rates for 1B-70B models, 10x "
    "those with a LoRA adapter, 5e-5 for online RL with LoRA up to 500M, as measured); the stored spec holds "
    "the rate picked."
)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Examples per forward/backward pass: a step's batch is cut into micro-batches whose "
        "gradients add up to the whole batch's before one optimizer step (gradient accumulation: the "
        "same update, less activation memory). Must divide the step's batch (`batch_size`; online RL: "
        "`minibatch_size`, else prompts_per_step x samples_per_prompt). Default: the whole batch at once.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Keep only each transformer block's inputs in the forward pass and recompute the rest "
        "in the backward (transformers' activation checkpointing, non-reentrant): much less activation "
        "memory for about one more forward pass of time; the same gradients.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="Mixed precision: forward passes under autocast in bf16 or fp16 with float32 master "
        "weights and optimizer state (fp16 adds dynamic loss scaling); weights that never train (an "
        "adapter's base, a reference) load in that dtype on a GPU, in float32 on a CPU (faster there). "
        "bf16 needs a CUDA GPU or a CPU with AMX or AVX512-BF16, fp16 a CUDA GPU; a worker without fails "
        "the run at start, saying why. fp32: everything in float32.",
    )
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
    eval_max_rows: int = Field(
        default=128,
        ge=1,
        le=10_000_000,
        description="Most rows an evaluation reads: held-out metrics every `eval_every` steps and the "
        "`final/*` metrics over the training rows use at most this many (drawn once with the seed), so "
        "they take seconds, not minutes, on a large dataset.",
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

    @field_validator("micro_batch_size")
    @classmethod
    def _micro_divides_batch(cls, v: int | None, info: ValidationInfo) -> int | None:
        batch = info.data.get("batch_size")
        online = "prompts_per_step" in cls.model_fields  # online RL checks its own batch (specs/online.py)
        if v is not None and not online and batch is not None and batch % v:
            raise ValueError(f"micro_batch_size ({v}) must divide batch_size ({batch})")
        return v

    @property
    def lr(self) -> float:
        """The learning rate to train with: the spec's (given, or picked at submit), else the unknown-size
        row of the defaults table (a spec built outside the API)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return default_learning_rate(self.family, None)


class AdapterSpec(_Frozen):
    """A LoRA adapter (Hu et al. 2021) trained instead of the whole model, with peft; QLoRA (Dettmers et
    al. 2023) with ``quantize``. The frozen reference of DPO and online RL is the same model with the
    adapter off (no second copy); reward and critic heads train in full beside it."""

    type: Literal["lora"] = Field(default="lora", description="Adapter kind: lora.")
    r: int = Field(default=16, ge=1, le=1024, description="Rank of the low-rank update B A.")
    alpha: int = Field(default=32, ge=1, le=100_000, description="Scale: the update is alpha / r * B A x.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: (
        Literal["all-linear"] | list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.*-]{1,100}$")]]
    ) = Field(
        default="all-linear",
        description="Layers that get an adapter: `all-linear` (every linear layer but the output head, "
        'peft\'s choice, as QLoRA recommends) or module names such as ["q_proj", "v_proj"].',
    )
    quantize: Literal["4bit", "8bit"] | None = Field(
        default=None,
        description="QLoRA: keep the base weights in 4-bit NF4 (or 8-bit) with bitsandbytes; needs a CUDA "
        "worker (a worker without CUDA fails the run at start, saying so).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("give at least one module name, or 'all-linear'")
        return v


MULTI_RANK_RUNS = "sft, dpo and the group family (grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce*, remax)"


class ResourcesSpec(_Frozen):
    """How many devices one run trains on, and how the model is spread over them (trainer/distributed.py)."""

    devices: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Processes (ranks) this run trains on, one per GPU on a CUDA worker (NCCL), or CPU "
        "processes (gloo) on a CPU worker. Each takes an equal share of every batch: `batch_size` (online "
        "RL: `prompts_per_step`) must divide evenly. Supported for " + MULTI_RANK_RUNS + " so far.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Hosts (worker machines) this run trains on, each with `devices` ranks: the worker that "
        "takes the run gathers `nodes - 1` more from its queue, all or none, through torch's c10d rendezvous "
        "(docs/runs.md, runs across hosts). The batch splits over `nodes x devices` ranks.",
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="ddp: every rank holds the whole model, gradients all-reduced (DistributedDataParallel). "
        "fsdp: parameters, gradients and optimizer state sharded over the ranks, gathered block by block "
        "(FSDP2 fully_shard per transformer block, then the root): for models that do not fit one device.",
    )

    @property
    def ranks(self) -> int:
        """Every rank of the run: ``devices`` on each of its ``nodes`` hosts."""
        return self.devices * self.nodes


class _SpecCore(_Frozen):
    """What every spec shares, training or not: the model, the queue and the devices."""

    spec_version: Literal[1] = Field(default=1, description="Version of this spec's schema.")
    name: str | None = Field(default=None, max_length=200, description="Free-form label.")
    model: str = Field(min_length=1, description=MODEL_REF_DOC, json_schema_extra=MODEL_REFERENCE)
    queue: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Worker queue this run is sent to (workers consume one with RLRUN_QUEUE, e.g. `gpu` or "
        "`cpu`); default: the server's RLRUN_QUEUE.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="Devices for this one run (several ranks with torch.distributed: DDP or FSDP2).",
    )
    metric_sinks: MetricSinks | None = Field(default=None, description=METRIC_SINKS_DOC)
    # The run's labels, set at submit as PATCH /v1/runs/{id} sets them later: kept on the run, never in
    # its stored spec (excluded from every dump), so a later PATCH leaves no stale copy behind.
    tags: Tags | None = Field(
        default=None,
        max_length=MAX_TAGS,
        exclude=True,
        description=f"The run's tags (as PATCH /v1/runs/{{id}} sets them): at most {MAX_TAGS}, each "
        f"1-{MAX_TAG_LENGTH} characters of a-z, 0-9 and . _ : / + - (stored lowercase, repeats dropped). "
        "Kept on the run, not in its stored spec.",
    )
    note: str | None = Field(
        default=None,
        max_length=MAX_NOTE_LENGTH,
        exclude=True,
        description=f"The run's note (as PATCH sets it), at most {MAX_NOTE_LENGTH} characters. Kept on the "
        "run, not in its stored spec.",
    )

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        return check_model_ref(v)

    @field_validator("name")
    @classmethod
    def _name_without_nul(cls, v: str | None) -> str | None:
        return refuse_nul(v, "name")  # type: ignore[no-any-return]

    @field_validator("note")
    @classmethod
    def _note_without_nul(cls, v: str | None) -> str | None:
        return refuse_nul(v, "note")  # type: ignore[no-any-return]

    def rank_split(self) -> tuple[str, int] | None:
        """The batch a multi-rank run splits over its ranks, as (field path, size); None: this run kind
        does not run on several ranks yet. Overridden by the spec classes whose loops do."""
        return None

    @model_validator(mode="after")
    def _ranks_split_the_batch(self) -> _SpecCore:
        n = self.resources.ranks
        if n == 1:
            return self
        # "resources.devices" alone on one host; the product across hosts
        what = "resources.devices" if self.resources.nodes == 1 else "resources.devices x resources.nodes"
        split = self.rank_split()
        if split is None:
            raise ValueError(
                f"{what} > 1 is supported for {MULTI_RANK_RUNS} runs so far, "
                f"not {getattr(self, 'algorithm', '')}"
            )
        name, size = split
        if size % n:
            raise ValueError(f"{what} ({n}) must divide {name} ({size})")
        hp: Any = getattr(self, "hyperparameters", None)
        online = hasattr(hp, "prompts_per_step")  # online RL splits each minibatch as it comes
        if not online and hp.micro_batch_size is not None and (size // n) % hp.micro_batch_size:
            raise ValueError(
                f"hyperparameters.micro_batch_size ({hp.micro_batch_size}) must divide each device's share "
                f"of the batch ({size // n} = batch_size / {what})"
            )
        adapter: AdapterSpec | None = getattr(self, "adapter", None)
        if adapter is not None and adapter.quantize is not None and self.resources.sharding == "fsdp":
            raise ValueError("resources.sharding 'fsdp' does not shard a quantized (QLoRA) base: use 'ddp'")
        return self

    @property
    def model_refs(self) -> dict[str, str]:
        """Every model reference in the spec, by field path (``rewards[0].model``)."""
        return {r.field: r.value for r in spec_references(self) if r.kind == "model"}

    @property
    def total_steps(self) -> int | None:
        """The run's steps, known from the spec (None: known only from its dataset, as for an eval)."""
        steps: int = self.hyperparameters.max_steps  # type: ignore[attr-defined]
        return steps


class _RunSpecBase(_SpecCore):
    """What every training run adds: its dataset, a validation source and an optional adapter."""

    dataset_id: uuid.UUID = Field(description="Training dataset.", json_schema_extra=DATASET_REFERENCE)
    validation_dataset_id: uuid.UUID | None = Field(
        default=None,
        description="Validation dataset of the same kind (evaluated every `eval_every` steps).",
        json_schema_extra=DATASET_REFERENCE,
    )
    validation_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="Hold out this fraction of the training rows (split by `seed`) when no validation set.",
    )
    adapter: AdapterSpec | None = Field(
        default=None,
        description="Train a LoRA adapter instead of the whole model (null: full fine-tuning). Checkpoints "
        "hold the adapter (and trained heads); `run:<id>` of such a run loads its base with the adapter.",
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
        lora = data.get("adapter") is not None
        rate = default_learning_rate(str(data.get("algorithm", "")), n_params, lora=lora)
        if isinstance(hp, BaseModel):
            return {**data, "hyperparameters": hp.model_copy(update={"learning_rate": rate})}
        return {**data, "hyperparameters": {**hp, "learning_rate": rate}}

    @model_validator(mode="after")
    def _one_validation_source(self) -> _RunSpecBase:
        if self.validation_dataset_id is not None and self.validation_fraction > 0:
            raise ValueError("give validation_dataset_id or validation_fraction, not both")
        return self


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
