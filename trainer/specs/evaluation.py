"""Evaluation run spec (``algorithm: eval``): a model's pass@k and rewards on a prompts dataset, nothing
trained. Torch-free (the API imports it)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from trainer.specs.base import EngineName, _Frozen, _SpecCore
from trainer.specs.online import DEFAULT_MAX_NEW_TOKENS, RewardSpec
from trainer.specs.refs import DATASET_REFERENCE, MODEL_REF_DOC, MODEL_REFERENCE

EVAL_TEMPERATURE_DOC = (
    "Sampling temperature. Default: 0 (greedy) with one sample per prompt, 1.0 with more (pass@k with k > 1 "
    "needs distinct samples)."
)


def _no_default(schema: dict[str, Any]) -> None:
    """The schema names no default where the validator picks one from other fields."""
    schema.pop("default", None)


class EvalHyperparameters(_Frozen):
    """How an eval samples and scores: n samples per prompt, pass@k for each k asked."""

    samples_per_prompt: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Completions sampled per prompt (n of Chen et al. 2021's pass@k estimator).",
    )
    pass_k: list[int] = Field(
        default=[1],  # never used: ``_defaults_from_samples`` fills it from samples_per_prompt
        json_schema_extra=_no_default,
        min_length=1,
        max_length=16,
        description="The k of each `eval/pass@k` metric, each in 1..samples_per_prompt. Default: [1] and "
        "samples_per_prompt when it is more than 1.",
    )
    pass_threshold: float = Field(
        default=1.0,
        ge=-1e6,
        le=1e6,
        description="A sample counts as correct (for pass@k) when its total reward is at least this: 1.0 for "
        "one 0/1 verifier such as numeric or exact_match.",
    )
    temperature: float = Field(
        default=0.0,  # never used: ``_defaults_from_samples`` fills it from samples_per_prompt
        ge=0,
        le=10,
        description=EVAL_TEMPERATURE_DOC,
        json_schema_extra=_no_default,
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    max_prompt_length: int = Field(
        default=256, ge=1, le=65_536, description="Prompt tokens (cut from the left)."
    )
    max_new_tokens: int = Field(
        default=DEFAULT_MAX_NEW_TOKENS,
        ge=1,
        le=65_536,
        description="Generation budget per completion (online RL's default too, so an eval before and "
        "after a run reads answers of the length it trained on).",
    )
    max_rows: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Evaluate this many rows, drawn once with `seed` (the same rows for every model with "
        "the same seed), in dataset order. Default: every row.",
    )
    prompts_per_batch: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Prompts generated together (with all their samples); progress and the running "
        "metrics are logged after each batch.",
    )
    stored_samples: int = Field(
        default=10_000,
        ge=0,
        le=1_000_000,
        description="Completions kept with their rewards and reference answers (the first ones in row "
        "order), readable at /v1/runs/{id}/samples.",
    )
    seed: int = Field(default=0, description="Seed of the row draw and of sampling.")
    engine: EngineName = Field(
        default="hf",
        description="Generation engine: hf (transformers generate), vllm (in-process, GPU extra) or "
        "vllm_server (vLLM's server as a separate process from the engine environment; any machine).",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="Weights' dtype (bf16/fp16 halve the memory): bf16 on a CUDA worker or a CPU with AMX or "
        "AVX512-BF16, fp16 on a CUDA worker; another worker fails the run at start, saying why.",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_samples(cls, data: Any) -> Any:
        """Temperature and pass_k defaults follow ``samples_per_prompt``, so the stored spec says them."""
        if not isinstance(data, dict):
            return data
        n = data.get("samples_per_prompt", 1)
        if not isinstance(n, int) or isinstance(n, bool):
            return data
        filled = dict(data)
        if filled.get("temperature") is None:
            filled["temperature"] = 0.0 if n == 1 else 1.0
        if filled.get("pass_k") is None:
            filled["pass_k"] = sorted({1, n})
        return filled

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalHyperparameters:
        n = self.samples_per_prompt
        ks = self.pass_k
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ValueError(
                f"pass_k {bad} out of range: each k must be between 1 and samples_per_prompt ({n})"
            )
        if len(set(ks)) != len(ks):
            raise ValueError("pass_k lists a k twice")
        if n > 1 and self.temperature == 0:
            raise ValueError(
                "temperature 0 (greedy) with samples_per_prompt > 1 samples one completion n times: "
                "pass@k would equal pass@1; give temperature > 0 or samples_per_prompt 1"
            )
        return self

    @property
    def ks(self) -> list[int]:
        """The pass@k values to report, ascending."""
        return sorted(self.pass_k)


class EvalSpec(_SpecCore):
    """An evaluation: a model answers every prompt of a prompts dataset `samples_per_prompt` times, the
    rewards score each answer, and the run reports pass@k (Chen et al. 2021) and mean rewards as `eval/*`
    metrics, with the samples kept. Trains nothing and makes no model."""

    algorithm: Literal["eval"] = Field(description="Run type.")
    model: str = Field(
        min_length=1,
        description="The model to evaluate (a generative one). " + MODEL_REF_DOC,
        json_schema_extra=MODEL_REFERENCE,
    )
    dataset_id: uuid.UUID = Field(
        description="A dataset of kind `prompts` ({prompt, answer?, meta}); the verifiers read `answer`.",
        json_schema_extra=DATASET_REFERENCE,
    )
    rewards: list[RewardSpec] = Field(
        min_length=1,
        max_length=16,
        description="Reward components, summed into each sample's reward (e.g. one numeric verifier).",
    )
    hyperparameters: EvalHyperparameters = Field(default_factory=EvalHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ("prompts",)

    @property
    def total_steps(self) -> int | None:
        """An eval's steps are its prompts; their number comes from the dataset (api/services/runs.py)."""
        return None

    def total_steps_for(self, dataset_rows: int) -> int:
        """Prompts this eval reads from a dataset of ``dataset_rows`` rows."""
        cap = self.hyperparameters.max_rows
        return dataset_rows if cap is None else min(cap, dataset_rows)
