"""Run specs trained on a fixed dataset: SFT, reward model, DPO."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from trainer.specs.base import (
    PreferenceLossName,
    TrainingHyperparameters,
    _ReferencedSpecBase,
    _RunSpecBase,
)

PACKING_DOC = (
    "Padding-free packing: a (micro-)batch's sequences go end to end into rows of at most `max_length` "
    "tokens (first-fit decreasing), position ids restarting at 0 for each, and attention never crosses a "
    "boundary (transformers' block-diagonal mask from the position ids), so no compute or memory goes to "
    "padding. The same losses as padded batches (tested to 1e-5); it pays when lengths vary a lot (chat "
    "data), not on uniform short rows. A model whose layers ignore the boundaries (linear attention) is "
    "refused at start."
)


SHARED_PROMPT_DOC = (
    "Run each pair's prompt once: one `prompt | chosen | rejected` row per pair, with position "
    "ids and a 4D attention mask that keep the rejected answer from seeing the chosen one, so "
    "every log-prob is the padded layout's (to float rounding) for P + C + R token positions "
    "instead of 2P + C + R. A model whose attention ignores custom 4D masks (e.g. flash "
    "attention) is detected at start and runs the padded layout, with a warning event. Not "
    "combined with `packing` (packing wins)."
)


class _PairHyperparameters(TrainingHyperparameters):
    """What every preference-pair run type (dpo, orpo) shares: prompt budget and the pair layouts."""

    family: ClassVar[str] = "dpo"

    max_prompt_length: int = Field(
        default=128, ge=1, description="Longest prompt in tokens (cut from the left)."
    )
    packing: bool = Field(default=False, description=PACKING_DOC)
    shared_prompt: bool = Field(default=True, description=SHARED_PROMPT_DOC)

    @model_validator(mode="after")
    def _prompt_fits(self) -> _PairHyperparameters:
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        return self


SIMPO_BETA = 2.0  # SimPO's beta when the spec leaves it out (Meng et al. 2024 use 2.0 to 2.5)


class DpoHyperparameters(_PairHyperparameters):
    """Direct Preference Optimization (Rafailov et al. 2023) and its loss variants."""

    loss_type: PreferenceLossName = Field(
        default="sigmoid",
        description="Preference loss: sigmoid (DPO), cdpo (label smoothing), robust (rDPO), ipo, hinge, "
        "simpo (SimPO: length-normalised likelihoods, margin `gamma`, no reference model).",
    )
    beta: float = Field(
        default=0.1,
        gt=0,
        le=100.0,
        description="Strength of the implicit KL constraint to the reference (simpo: the reward scale; "
        f"left out, {SIMPO_BETA}).",
    )
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="Assumed label-noise rate; used by cdpo and robust only."
    )
    gamma: float = Field(
        default=0.5,
        ge=0,
        le=100.0,
        description="simpo only: the target reward margin (SimPO's gamma; the paper tunes 0.5 to 1.6).",
    )
    rpo_alpha: float = Field(
        default=0.0,
        ge=0,
        le=100.0,
        description=(
            "Weight of a negative log-likelihood term on the chosen answer added to each pair's loss (RPO, "
            "Pang et al. 2024): loss + rpo_alpha * (-log pi(chosen|prompt) / chosen tokens). DPO alone can "
            "lower the chosen answers' likelihood while it widens the margin; this holds them up. 1.0 is "
            "the paper's value; 0 (default) is plain DPO. Logged as `nll/chosen`."
        ),
    )
    reference_mode: Literal["lazy", "precompute"] = Field(
        default="lazy",
        description="lazy: the reference log-probs of the pairs a step uses are computed when a step first "
        "uses them (a frozen copy of the reference is kept meanwhile), so step 1 starts at once; "
        "precompute: every pair's before step 1 (no reference kept in memory while training). Either way "
        "the values computed travel in checkpoints, so a resumed run reads the same ones. simpo has no "
        "reference.",
    )

    @model_validator(mode="before")
    @classmethod
    def _simpo_beta(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss_type") == "simpo" and data.get("beta") is None:
            return {**data, "beta": SIMPO_BETA}
        return data

    @model_validator(mode="after")
    def _smoothing_for_its_losses(self) -> DpoHyperparameters:
        if self.label_smoothing > 0 and self.loss_type not in ("cdpo", "robust"):
            raise ValueError("label_smoothing applies only to loss_type 'cdpo' or 'robust'")
        return self


class OrpoHyperparameters(_PairHyperparameters):
    """ORPO (Hong et al. 2024): SFT on the chosen answer plus lambda times an odds-ratio preference term."""

    beta: float = Field(
        default=0.1,
        gt=0,
        le=100.0,
        description="ORPO's lambda: the weight of the odds-ratio term next to the chosen answer's NLL "
        "(the paper and TRL use 0.1).",
    )


class SftHyperparameters(TrainingHyperparameters):
    """Supervised fine-tuning: next-token cross-entropy on completion tokens only."""

    family: ClassVar[str] = "sft"

    packing: bool = Field(default=False, description=PACKING_DOC)


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


class DpoSpec(_ReferencedSpecBase):
    """A DPO run: a policy trained on preference pairs against a frozen reference model (none for
    ``loss_type: simpo``, which is reference-free)."""

    algorithm: Literal["dpo"] = Field(description="Run type.")
    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("preference",)

    @model_validator(mode="after")
    def _simpo_has_no_reference(self) -> DpoSpec:
        if self.hyperparameters.loss_type == "simpo" and self.reference_model is not None:
            raise ValueError(
                "reference_model: loss_type 'simpo' is reference-free (no reference model is loaded); "
                "leave reference_model out"
            )
        return self

    def rank_split(self) -> tuple[str, int] | None:
        return "hyperparameters.batch_size", self.hyperparameters.batch_size


class KtoHyperparameters(TrainingHyperparameters):
    """KTO (Ethayarajh et al. 2024): a policy trained on answers marked desirable or undesirable, each
    against a frozen reference, with the KL reference point estimated from mismatched pairs in the batch."""

    family: ClassVar[str] = "dpo"

    beta: float = Field(
        default=0.1, gt=0, le=100.0, description="Strength of the implicit KL constraint to the reference."
    )
    desirable_weight: float = Field(
        default=1.0,
        gt=0,
        le=100.0,
        description="lambda_D: the weight of desirable answers' losses. Ethayarajh et al. advise "
        "lambda_D n_D / (lambda_U n_U) in [1, 4/3] when the classes are unbalanced.",
    )
    undesirable_weight: float = Field(
        default=1.0, gt=0, le=100.0, description="lambda_U: the weight of undesirable answers' losses."
    )
    max_prompt_length: int = Field(
        default=128, ge=1, description="Longest prompt in tokens (cut from the left)."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> KtoHyperparameters:
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        return self

    @field_validator("batch_size")
    @classmethod
    def _two_examples_per_batch(cls, v: int) -> int:
        # z_0 pairs each prompt with another example's answer of the same batch; in a batch of one the
        # example would be paired with its own answer (TRL's KTOTrainer refuses it too)
        if v < 2:
            raise ValueError(
                "KTO needs batch_size >= 2: its KL reference point pairs each prompt with another "
                "example's answer in the batch"
            )
        return v


class KtoSpec(_ReferencedSpecBase):
    """A KTO run: unpaired desirable/undesirable answers (an `unpaired` dataset) against a frozen reference
    model (`reference_model`, default the starting model)."""

    algorithm: Literal["kto"] = Field(description="Run type.")
    hyperparameters: KtoHyperparameters = Field(default_factory=KtoHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("unpaired",)
    # One device for now: its loop sums z_0 over ranks, but no multi-rank test has run it yet.


class OrpoSpec(_RunSpecBase):
    """An ORPO run: the policy alone on preference pairs (no reference model): the chosen answer's NLL
    plus lambda times the odds-ratio loss, both on length-normalised likelihoods."""

    algorithm: Literal["orpo"] = Field(description="Run type.")
    hyperparameters: OrpoHyperparameters = Field(default_factory=OrpoHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    # One device for now: the DPO loop it runs in splits batches over ranks, but untested for orpo.


class SftSpec(_RunSpecBase):
    """Supervised fine-tuning on prompt/completion pairs or chat conversations."""

    algorithm: Literal["sft"] = Field(description="Run type.")
    hyperparameters: SftHyperparameters = Field(default_factory=SftHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("sft",)

    def rank_split(self) -> tuple[str, int] | None:
        return "hyperparameters.batch_size", self.hyperparameters.batch_size


class RewardModelSpec(_RunSpecBase):
    """A reward model: the LM with a scalar head, on preference pairs or K-way rankings."""

    algorithm: Literal["reward_model"] = Field(description="Run type.")
    hyperparameters: RewardModelHyperparameters = Field(default_factory=RewardModelHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("preference", "ranking")
