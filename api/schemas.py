"""Request bodies of the public API. Response bodies are in ``rlrun.schemas``, shared with the client."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from rlrun.schemas import DatasetKind, WebhookEventType
from trainer.specs import RunSpec, refuse_nul
from trainer.specs.graders import MAX_SOURCE_CHARS

# Text the API stores: U+0000 is refused (422) on every backend, since PostgreSQL cannot store it.
NulFreeStr = Annotated[str, AfterValidator(refuse_nul)]


class DatasetCreateJson(BaseModel):
    """Small datasets as one JSON body; large ones go as a multipart JSONL file."""

    model_config = ConfigDict(extra="forbid")

    name: NulFreeStr = Field(min_length=1, max_length=200)
    kind: DatasetKind | None = Field(
        default=None, description="Omit to detect it from the keys of the first rows (`kind_detected`)."
    )
    rows: list[dict[str, Any]] = Field(description="Lines as objects, in any accepted format for `kind`.")
    skip_invalid: bool = Field(
        default=False,
        description="Store the valid rows and list the invalid ones (`skipped_count`, `skipped`) instead of "
        "refusing the whole upload; an upload without one valid row is still refused.",
    )


class StageIn(BaseModel):
    """One pipeline stage: a name and a run spec; its model fields may say `stage:<earlier stage>`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Unique within the pipeline.")
    spec: RunSpec


class PipelineCreate(BaseModel):
    """Stages run as their inputs succeed; stage order is the list order (refs point backwards)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "sft-rm-dpo",
                    "stages": [
                        {
                            "name": "sft",
                            "spec": {
                                "algorithm": "sft",
                                "model": "tiny:llama-0.4m",
                                "dataset_id": "<sft dataset>",
                            },
                        },
                        {
                            "name": "rm",
                            "spec": {
                                "algorithm": "reward_model",
                                "model": "stage:sft",
                                "dataset_id": "<preference dataset>",
                            },
                        },
                        {
                            "name": "dpo",
                            "spec": {
                                "algorithm": "dpo",
                                "model": "stage:sft",
                                "dataset_id": "<preference dataset>",
                            },
                        },
                    ],
                }
            ]
        },
    )

    name: NulFreeStr | None = Field(default=None, max_length=200)
    stages: list[StageIn] = Field(min_length=1, max_length=20)


def _all_event_types() -> list[WebhookEventType]:
    return ["run.succeeded", "run.failed", "run.cancelled"]


class EnvironmentCreate(BaseModel):
    """Environment code for multi-turn RL runs (docs/runs.md, "Environments"): Python that defines
    `reset(row)` and `step(messages, row)`."""

    model_config = ConfigDict(extra="forbid")

    name: NulFreeStr = Field(min_length=1, max_length=200, examples=["guess-the-number"])
    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="The Python source; refused with the line named where it does not compile or lacks "
        "`reset(row)` or `step(messages, row)`.",
    )


class WebhookCreate(BaseModel):
    """A URL to POST to when a run of this project ends. It must pass the server's allow-list."""

    model_config = ConfigDict(extra="forbid")

    url: NulFreeStr = Field(min_length=1, max_length=2000, examples=["https://hooks.example.com/rlrun"])
    description: NulFreeStr | None = Field(default=None, max_length=200)
    event_types: list[WebhookEventType] = Field(
        default_factory=_all_event_types,
        min_length=1,
        description="Which ends to announce (default: all three).",
    )


class AgentReward(BaseModel):
    """An agent episode's reward (its calls are done)."""

    model_config = ConfigDict(extra="forbid")

    reward: float = Field(ge=-1e6, le=1e6, allow_inf_nan=False, description="What the episode earned.")
