"""The model card an export carries as its ``README.md``: what produced the model, in the Hugging Face hub's
layout (YAML front matter with ``base_model``, ``library_name`` and ``tags``, then prose and tables), so a
folder pushed to a hub, or found on a disk a year later, says where it came from.

Pure: it formats what the caller read (the run, its datasets, the merge that made a folder); nothing here
touches the database or the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from api.models import Dataset, Run


@dataclass(frozen=True)
class CardDataset:
    role: str  # "training" or "validation"
    id: str
    name: str
    kind: str
    rows: int


def rlrun_version() -> str:
    try:
        return metadata.version("rlrun")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def card_datasets(run: Run, lookup: dict[str, Dataset | None]) -> list[CardDataset]:
    """The run's training and validation datasets (``lookup``: each id the spec names, read by the caller;
    None where it is gone)."""
    out = []
    for role, key in (("training", "dataset_id"), ("validation", "validation_dataset_id")):
        dataset_id = run.spec.get(key)
        if not dataset_id:
            continue
        found = lookup.get(str(dataset_id))
        if found is None:
            out.append(CardDataset(role, str(dataset_id), "(deleted)", "?", 0))
        else:
            out.append(CardDataset(role, str(found.id), found.name, found.kind, found.row_count))
    return out


def _front_matter(base: str, adapter: bool, algorithm: str) -> str:
    lines = ["---", f"library_name: {'peft' if adapter else 'transformers'}"]
    if not base.startswith(("run:", "stage:", "tiny:")):  # a hub id or a folder: what a hub can link
        lines.append(f"base_model: {json.dumps(base)}")
    lines += ["tags:", "- rlrun", f"- {algorithm}", "---"]
    return "\n".join(lines)


def model_card(run: Run, datasets: list[CardDataset], *, adapter: bool, merged_by: Run | None = None) -> str:
    """``README.md`` for the export of ``run``'s model: ``adapter`` for a LoRA adapter folder (loaded with
    peft over its base), else a whole model; ``merged_by``: the merge run that folded the adapter into its
    base for this folder."""
    spec: dict[str, Any] = run.spec
    base = str(spec.get("model", "?"))
    title = spec.get("name") or f"{run.algorithm} run {run.id}"
    out = [_front_matter(base, adapter, run.algorithm), "", f"# {title}", ""]
    what = "A LoRA adapter" if adapter else "A causal language model"
    out.append(f"{what} trained by rlrun {rlrun_version()}: run `{run.id}`, ")
    out.append(f"algorithm `{run.algorithm}`, starting from `{base}`.")
    if spec.get("reference_model"):
        out.append(f"Reference model: `{spec['reference_model']}`.")
    if merged_by is not None:
        out.append(f"The adapter was merged into its base by merge run `{merged_by.id}`.")
    times = [f"created {run.created_at:%Y-%m-%d %H:%M} UTC"]
    if run.finished_at is not None:
        times.append(f"finished {run.finished_at:%Y-%m-%d %H:%M} UTC")
    out += ["", f"Run {', '.join(times)}; {run.step} steps."]
    if adapter:
        out += [
            "",
            "## Loading",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            "base = AutoModelForCausalLM.from_pretrained(<the base model's folder or id>)",
            'model = PeftModel.from_pretrained(base, "<this folder>")',
            "```",
        ]
    else:
        out += [
            "",
            "## Loading",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
            'tokenizer = AutoTokenizer.from_pretrained("<this folder>")',
            "```",
        ]
    if datasets:
        out += ["", "## Data", "", "| role | dataset | name | kind | rows |", "|---|---|---|---|---|"]
        out += [f"| {d.role} | `{d.id}` | {d.name} | {d.kind} | {d.rows} |" for d in datasets]
    hp = spec.get("hyperparameters") or {}
    if hp:
        out += ["", "## Hyperparameters (resolved)", "", "| name | value |", "|---|---|"]
        out += [f"| `{k}` | `{json.dumps(v)}` |" for k, v in sorted(hp.items())]
    if run.result:
        out += ["", "## Final metrics", "", "| metric | value |", "|---|---|"]
        out += [f"| `{k}` | {v:.6g} |" for k, v in sorted(run.result.items())]
    out += ["", "## Spec", "", "```json", json.dumps(spec, indent=2, sort_keys=True), "```", ""]
    return "\n".join(out)
