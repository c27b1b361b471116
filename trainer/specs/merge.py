"""Merge run spec (``algorithm: merge``): an adapter run's LoRA adapter folded into its base, saved as a
plain Hugging Face model (what ``export?format=hf`` of the adapter run streams). Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from trainer.specs.base import _Frozen, _SpecCore
from trainer.specs.refs import MODEL_REFERENCE


class MergeHyperparameters(_Frozen):
    """How the merged model is written."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="The merged weights' dtype: `auto` keeps the base's (its config's `torch_dtype`, "
        "float32 when it names none), so a bf16 7B base merges and saves in bf16 (about 14 GB of "
        "memory on the worker, CPU or GPU).",
    )


class MergeSpec(_SpecCore):
    """Fold a LoRA adapter into its base (peft's ``merge_and_unload``) and save the result as a full model:
    `run:<merge run>` is then a plain Hugging Face folder, loadable without peft, and `GET
    /v1/runs/{adapter run}/export?format=hf` streams it. Trains nothing; no dataset."""

    algorithm: Literal["merge"] = Field(description="Run type.")
    model: str = Field(
        min_length=1,
        description="The adapter to merge: `run:<id>` (or `run:<id>@<step>`) of a run trained with an "
        "`adapter`, `stage:<name>` of such a stage, or an adapter folder under the model roots.",
        json_schema_extra=MODEL_REFERENCE,
    )
    hyperparameters: MergeHyperparameters = Field(default_factory=MergeHyperparameters)
    dataset_kinds: ClassVar[tuple[str, ...]] = ()

    @property
    def total_steps(self) -> int | None:
        return 1
