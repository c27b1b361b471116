"""api/model_card.py: an export's README.md names what produced the model (base, algorithm, datasets with
their rows, resolved hyperparameters, final metrics, rlrun's version), in the hub's front-matter layout."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from api.model_card import CardDataset, card_datasets, model_card, rlrun_version
from api.models import Dataset, Run


def a_run(**over: object) -> Run:
    spec = {
        "algorithm": "dpo",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dataset_id": str(uuid.UUID(int=1)),
        "validation_dataset_id": str(uuid.UUID(int=2)),
        "hyperparameters": {"beta": 0.1, "learning_rate": 5e-7, "max_steps": 300},
        "name": "hh-dpo",
    }
    fields: dict[str, object] = {
        "id": uuid.UUID(int=7),
        "algorithm": "dpo",
        "spec": spec,
        "step": 300,
        "result": {"final/loss": 0.4321, "final/rewards/accuracy": 0.75},
        "created_at": datetime(2026, 12, 6, 8, 0, tzinfo=UTC),
        "finished_at": datetime(2026, 12, 6, 9, 30, tzinfo=UTC),
    }
    return Run(**(fields | over))


def test_a_whole_models_card_says_what_produced_it() -> None:
    run = a_run()
    training = Dataset(id=uuid.UUID(int=1), name="hh-train", kind="preference", row_count=160_000)
    lookup = {str(uuid.UUID(int=1)): training, str(uuid.UUID(int=2)): None}  # the validation set was deleted
    card = model_card(run, card_datasets(run, lookup), adapter=False)
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: transformers" in front
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M-Instruct"' in front
    assert "- rlrun" in front and "- dpo" in front
    assert body.splitlines()[1] == "# hh-dpo"
    assert f"rlrun {rlrun_version()}: run `{run.id}`" in body and "algorithm `dpo`" in body
    assert f"| training | `{uuid.UUID(int=1)}` | hh-train | preference | 160000 |" in body
    assert f"| validation | `{uuid.UUID(int=2)}` | (deleted) | ? | 0 |" in body
    assert "| `beta` | `0.1` |" in body and "| `learning_rate` | `5e-07` |" in body
    assert "| `final/loss` | 0.4321 |" in body and "| `final/rewards/accuracy` | 0.75 |" in body
    assert "AutoModelForCausalLM.from_pretrained" in body and "PeftModel" not in body
    assert "finished 2026-12-06 09:30 UTC; 300 steps" in body


def test_an_adapters_card_says_how_to_load_it_and_a_merge_names_its_run() -> None:
    run = a_run(spec={"algorithm": "sft", "model": "tiny:llama-0.4m", "dataset_id": str(uuid.UUID(int=1))})
    merge = a_run(id=uuid.UUID(int=9), algorithm="merge")
    adapter = model_card(run, [CardDataset("training", "x", "sft-rows", "sft", 12)], adapter=True)
    merged = model_card(run, [], adapter=False, merged_by=merge)
    assert "library_name: peft" in adapter and "PeftModel.from_pretrained" in adapter
    assert "base_model" not in adapter  # a preset is no hub id: nothing for a hub to link
    assert f"merged into its base by merge run `{uuid.UUID(int=9)}`" in merged
    assert "## Data" not in merged
