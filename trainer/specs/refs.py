"""What a spec may point at: model and dataset references, their forms, the marks that find them, and the
two NUL rules for stored strings (``refuse_nul`` for what a user sends, ``without_nul`` for what a run
writes). Torch-free (the API imports it)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

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
    # Realistic sizes to measure memory and speed on, random-init like the rest (built on first use): Llama
    # blocks at GPT-2-small width (~123M parameters) and at ~0.5B (Qwen2.5-0.5B's size class).
    "llama-125m": {
        "hidden_size": 768,
        "num_hidden_layers": 13,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "llama-500m": {
        "hidden_size": 1280,
        "num_hidden_layers": 25,
        "num_attention_heads": 20,
        "intermediate_size": 3456,
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


# Fields that point at something stored (a model, a dataset or an environment) carry this mark in their
# JSON schema, so one walker (``spec_references``) finds them all: the API checks each against the
# caller's project and a pipeline resolves ``stage:`` refs in each. A test walks the OpenAPI schema and
# fails on a reference field without the mark.
REFERENCE_MARK = "x-rlrun-reference"
ROLE_MARK = "x-rlrun-model-role"
ReferenceKind = Literal["model", "dataset", "environment"]
# What a referenced model is used as: a causal LM (policy, reference), a scorer (reward) or a critic
# (either: a causal LM gets a fresh value head, a reward model keeps its score head).
ModelRole = Literal["policy", "reward", "critic"]
MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "policy"}
REWARD_MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "reward"}
CRITIC_MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model", ROLE_MARK: "critic"}
DATASET_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "dataset"}
ENVIRONMENT_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "environment"}

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
    if not isinstance(extra, dict) or extra.get(REFERENCE_MARK) not in ("model", "dataset", "environment"):
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
        elif isinstance(value, dict):  # e.g. a multi grader's graders by name
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    out += spec_references(item, (*path, name, key))
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


def without_nul(value: Any) -> Any:
    """``value`` with U+0000 replaced by U+FFFD in every string in it (dict keys, list and tuple items,
    nested; a tuple comes back a list).

    The other side of ``refuse_nul``, for text the service did not receive but made (a run's sampled
    completions and the data stored with them): it cannot be refused, and PostgreSQL text and JSONB cannot
    store NUL, so it is stored with the replacement character, alike on both backends."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_nul(v) for v in value]
    return value
