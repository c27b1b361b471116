"""Run specs: what a user submits, validated once at the API and again in the worker.

Torch-free on purpose: ``api`` imports this package and must not pull in torch.
One pydantic model per run type; ``RunSpec`` is their union, discriminated on ``algorithm``. Every
field has a default (where one makes sense) and a description, which becomes the OpenAPI docs.
Modules: ``refs`` (model/dataset references), ``base`` (what every spec shares), ``offline`` (SFT, reward
model, DPO), ``online`` (group RL, PPO, presets), ``evaluation`` (eval runs: pass@k, nothing trained),
``merge`` (an adapter folded into its base).
"""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import Field, TypeAdapter

from trainer.specs.agents import AgentSpec
from trainer.specs.base import (
    LR_DOC,
    AdapterSpec,
    AdvantageName,
    AggregationName,
    KlControllerName,
    KlEstimatorName,
    PolicyLossName,
    PreferenceLossName,
    ResourcesSpec,
    TrainingHyperparameters,
)
from trainer.specs.environments import EnvironmentSpec
from trainer.specs.evaluation import EvalHyperparameters, EvalSpec
from trainer.specs.merge import MergeHyperparameters, MergeSpec
from trainer.specs.offline import (
    DpoHyperparameters,
    DpoSpec,
    KtoHyperparameters,
    KtoSpec,
    OrpoHyperparameters,
    OrpoSpec,
    RewardModelHyperparameters,
    RewardModelSpec,
    SftHyperparameters,
    SftSpec,
)
from trainer.specs.online import (
    GROUP_BASELINE_ADVANTAGES,
    GROUP_PRESETS,
    PPO_PRESETS,
    PRESET_MARK,
    GroupAlgorithm,
    GroupRlHyperparameters,
    GroupRlSpec,
    OnlineRlHyperparameters,
    PpoAlgorithm,
    PpoHyperparameters,
    PpoSpec,
    RewardSpec,
    VerifierName,
)
from trainer.specs.refs import (
    CRITIC_MODEL_REFERENCE,
    DATASET_REFERENCE,
    MAX_STEP,
    MODEL_REF_DOC,
    MODEL_REFERENCE,
    REFERENCE_MARK,
    REWARD_MODEL_REFERENCE,
    ROLE_MARK,
    TINY_PRESETS,
    ModelRole,
    Reference,
    ReferenceKind,
    SpecPath,
    check_model_ref,
    parse_run_ref,
    parse_run_ref_step,
    parse_stage_ref,
    refuse_nul,
    set_at,
    spec_references,
    without_nul,
)
from trainer.specs.session import SessionHyperparameters, TrainingSessionSpec

__all__ = [
    "AdapterSpec",
    "AgentSpec",
    "EnvironmentSpec",
    "ResourcesSpec",
    "ALGORITHMS",
    "CRITIC_MODEL_REFERENCE",
    "DATASET_REFERENCE",
    "GROUP_BASELINE_ADVANTAGES",
    "GROUP_PRESETS",
    "LR_DOC",
    "MAX_STEP",
    "MODELLESS_ALGORITHMS",
    "MODEL_REFERENCE",
    "MODEL_REF_DOC",
    "PPO_PRESETS",
    "PRESET_MARK",
    "REFERENCE_MARK",
    "REWARD_MODEL_REFERENCE",
    "ROLE_MARK",
    "RUN_SPEC_ADAPTER",
    "TINY_PRESETS",
    "AdvantageName",
    "AggregationName",
    "AnyRunSpec",
    "DpoHyperparameters",
    "DpoSpec",
    "KtoHyperparameters",
    "KtoSpec",
    "OrpoHyperparameters",
    "OrpoSpec",
    "EvalHyperparameters",
    "EvalSpec",
    "MergeHyperparameters",
    "MergeSpec",
    "SessionHyperparameters",
    "TrainingSessionSpec",
    "GroupAlgorithm",
    "GroupRlHyperparameters",
    "GroupRlSpec",
    "KlControllerName",
    "KlEstimatorName",
    "ModelRole",
    "OnlineRlHyperparameters",
    "PolicyLossName",
    "PpoAlgorithm",
    "PpoHyperparameters",
    "PpoSpec",
    "PreferenceLossName",
    "Reference",
    "ReferenceKind",
    "RewardModelHyperparameters",
    "RewardModelSpec",
    "RewardSpec",
    "RunSpec",
    "SftHyperparameters",
    "SftSpec",
    "SpecPath",
    "TrainingHyperparameters",
    "VerifierName",
    "check_model_ref",
    "learning_problems",
    "parse_run_ref",
    "parse_run_ref_step",
    "parse_spec",
    "parse_stage_ref",
    "refuse_nul",
    "set_at",
    "spec_references",
    "without_nul",
]

AnyRunSpec = (
    DpoSpec
    | OrpoSpec
    | KtoSpec
    | SftSpec
    | RewardModelSpec
    | GroupRlSpec
    | PpoSpec
    | EvalSpec
    | MergeSpec
    | TrainingSessionSpec
)
RunSpec = Annotated[AnyRunSpec, Field(discriminator="algorithm")]
RUN_SPEC_ADAPTER: TypeAdapter[AnyRunSpec] = TypeAdapter(RunSpec)
ALGORITHMS: tuple[str, ...] = (
    "dpo",
    "orpo",
    "kto",
    "sft",
    "reward_model",
    *get_args(GroupAlgorithm),
    *get_args(PpoAlgorithm),
    "eval",
    "merge",
    "training_session",
)
MODELLESS_ALGORITHMS = frozenset({"eval"})  # runs that make no model (their run:<id> names nothing)


def learning_problems(spec: AnyRunSpec) -> list[tuple[str, str]]:
    """(field, why) for each setting with which the run could not learn, although every field is valid
    alone: the API refuses such a spec at submit (422) rather than let it "succeed" having learned nothing.
    """
    problems: list[tuple[str, str]] = []
    if not isinstance(spec, GroupRlSpec | PpoSpec):
        return problems
    hp = spec.hyperparameters
    if hp.group_baseline and hp.samples_per_prompt < 2:
        assert isinstance(hp, GroupRlHyperparameters)
        advantage = hp.advantage
        problems.append(
            (
                "hyperparameters.samples_per_prompt",
                f"the {advantage} advantage compares the completions of one prompt: with "
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
