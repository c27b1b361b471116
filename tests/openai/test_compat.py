"""The pure translation between OpenAI's fine-tuning objects and rlrun's datasets and runs (no DB)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from openai.types.fine_tuning import FineTuningJob as SdkJob

from api import openai_mapping as mapping
from api.errors import ApiError
from api.models import DEFAULT_PROJECT_ID, Dataset, Run
from api.schemas_openai import FineTuningJobCreate
from tests.openai.helpers import chat_line, dpo_line

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def dataset(kind: str, rows: int) -> Dataset:
    return Dataset(id=uuid.uuid4(), name="f.jsonl", kind=kind, row_count=rows, size_bytes=10, created_at=NOW)


def request(training: Dataset, **over: Any) -> FineTuningJobCreate:
    return FineTuningJobCreate.model_validate(
        {"model": "tiny:llama-0.4m", "training_file": mapping.file_id(training.id), **over}
    )


def refusal(body: FineTuningJobCreate, training: Dataset, validation: Dataset | None = None) -> ApiError:
    with pytest.raises(ApiError) as info:
        mapping.plan_job(body, training=training, validation=validation, seed=0)
    return info.value


def test_ids_round_trip_and_foreign_ids_do_not_parse() -> None:
    rid = uuid.uuid4()
    assert mapping.parse_file_id(mapping.file_id(rid)) == rid
    assert mapping.parse_job_id(mapping.job_id(rid)) == rid
    assert mapping.job_id(rid) == f"ftjob-{rid.hex}" and mapping.file_id(rid) == f"file-{rid.hex}"
    assert mapping.parse_event_id(mapping.event_id(42)) == 42
    assert mapping.parse_checkpoint_step(mapping.checkpoint_id(rid, 300)) == 300
    for bad in ("", "file-", "file-xyz", f"ftjob-{rid.hex}", str(rid)):
        assert mapping.parse_file_id(bad) is None, bad
    assert mapping.parse_job_id(f"file-{rid.hex}") is None
    assert mapping.parse_event_id("ftevent-x") is None and mapping.parse_event_id("12") is None
    assert mapping.parse_event_id("ftevent-\u00b2") is None  # a digit to str.isdigit, not to int()
    assert mapping.parse_event_id("ftevent-" + "9" * 40) is None  # no DB integer holds it
    assert mapping.parse_checkpoint_step("ftckpt-abc") is None


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (dpo_line("q", "a", "b"), "preference"),
        ({"prompt": "q", "chosen": "a", "rejected": "b"}, "preference"),
        (chat_line("q", "a"), "sft"),
        ({"prompt": "q", "completion": "a"}, "sft"),
    ],
)
def test_the_kind_of_a_file_is_read_from_its_first_line(line: dict[str, Any], kind: str) -> None:
    assert mapping.detect_kind(json.dumps(line).encode() + b"\n") == kind


def test_an_unreadable_first_line_reads_as_sft_so_ingest_names_it() -> None:
    assert mapping.detect_kind(b"{not json") == "sft"
    assert mapping.detect_kind(b"") == "sft"


def test_n_epochs_batch_size_and_multiplier_become_steps_and_learning_rate() -> None:
    training = dataset("preference", rows=100)
    hp = {"n_epochs": 3, "batch_size": 7, "learning_rate_multiplier": 20, "beta": 0.25}
    body = request(training, method={"type": "dpo", "dpo": {"hyperparameters": hp}}, suffix="adder")
    spec, method = mapping.plan_job(body, training=training, validation=None, seed=11)
    assert spec.algorithm == "dpo" and spec.name == "adder" and spec.dataset_id == training.id
    # ceil(3 * 100 / 7) = ceil(42.86) = 43; DPO's default learning rate for a tiny preset (<= 50M
    # parameters) is 1e-3 by the table in trainer/lr_defaults.py, times 20
    assert spec.hyperparameters.max_steps == 43
    assert spec.hyperparameters.batch_size == 7
    assert spec.hyperparameters.learning_rate == pytest.approx(20e-3)
    assert spec.hyperparameters.beta == 0.25 and spec.hyperparameters.seed == 11
    assert method.model_dump(exclude_none=True) == {"type": "dpo", "dpo": {"hyperparameters": hp}}


def test_auto_resolves_to_three_epochs_the_default_batch_capped_at_the_rows() -> None:
    small, big = dataset("sft", rows=5), dataset("sft", rows=20)
    auto = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
    body = request(small, method={"type": "supervised", "supervised": {"hyperparameters": auto}})
    spec, method = mapping.plan_job(body, training=small, validation=None, seed=0)
    # 5 rows: batch min(8, 5) = 5, 3 epochs -> ceil(15 / 5) = 3 steps; SFT's default for a tiny preset 1e-3
    assert (spec.hyperparameters.max_steps, spec.hyperparameters.batch_size) == (3, 5)
    assert spec.hyperparameters.learning_rate == pytest.approx(1e-3)
    # A model of 7B parameters (the size the API reads from its config) gets the table's 1e-5.
    spec, _ = mapping.plan_job(body, training=small, validation=None, seed=0, n_params=7_000_000_000)
    assert spec.hyperparameters.learning_rate == pytest.approx(1e-5)
    assert method.supervised is not None and method.supervised.hyperparameters is not None
    assert method.supervised.hyperparameters.n_epochs == 3
    spec, _ = mapping.plan_job(request(big), training=big, validation=None, seed=0)  # no method: supervised
    assert spec.algorithm == "sft" and spec.hyperparameters.max_steps == 8  # ceil(60 / 8)


def test_legacy_top_level_hyperparameters_are_supervised() -> None:
    training = dataset("sft", rows=16)
    body = request(training, hyperparameters={"n_epochs": 2, "batch_size": 4})
    spec, method = mapping.plan_job(body, training=training, validation=dataset("sft", 4), seed=0)
    assert spec.algorithm == "sft" and spec.hyperparameters.max_steps == 8 and method.type == "supervised"
    assert spec.validation_dataset_id is not None
    both = request(
        training,
        hyperparameters={"n_epochs": 2},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
    )
    assert refusal(both, training).field == "hyperparameters"


def test_refusals_name_the_openai_parameter() -> None:
    sft, pref = dataset("sft", 10), dataset("preference", 10)
    dpo_on_sft = refusal(request(sft, method={"type": "dpo"}), sft)
    assert dpo_on_sft.field == "training_file"
    assert "preferred_output" in dpo_on_sft.message and mapping.file_id(sft.id) in dpo_on_sft.message
    assert refusal(request(pref), pref).field == "training_file"  # supervised is the default method
    assert refusal(request(pref, method={"type": "dpo"}), pref, validation=sft).field == "validation_file"
    assert refusal(request(sft, method={"type": "reinforcement"}), sft).field == "method.reinforcement"
    grader = {"type": "string_check", "name": "g", "input": "a", "reference": "a", "operation": "eq"}
    rft_on_sft = refusal(
        request(sft, method={"type": "reinforcement", "reinforcement": {"grader": grader}}), sft
    )
    assert rft_on_sft.field == "training_file" and "ending in a user turn" in rft_on_sft.message
    assert refusal(request(sft, method={"type": "supervised", "dpo": {}}), sft).field == "method.dpo"
    assert refusal(request(sft, model="tiny:nope"), sft).field == "model"
    assert refusal(request(sft, integrations=[{"type": "wandb"}]), sft).field == "integrations[0].wandb"
    assert refusal(request(sft, integrations=[{"type": "mlflow"}]), sft).field == "integrations[0].type"
    no_project = refusal(request(sft, integrations=[{"type": "wandb", "wandb": {"name": "x"}}]), sft)
    assert no_project.field == "integrations[0].wandb.project"
    too_fast = refusal(request(sft, hyperparameters={"learning_rate_multiplier": 2e3}), sft)
    assert too_fast.field == "hyperparameters.learning_rate_multiplier"
    assert "learning rate is 2" in too_fast.message  # 2e3 x 1e-3 (a tiny preset's SFT rate) = 2 > 1
    too_long = refusal(
        request(
            sft,
            method={
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1000, "batch_size": 1}},
            },
        ),
        dataset("sft", 1_000_000),
    )
    assert too_long.field == "method.supervised.hyperparameters.n_epochs"


def test_a_wandb_integration_becomes_the_runs_online_wandb_sink_and_reads_back() -> None:
    sft = dataset("sft", 40)
    given = {"project": "ft-tests", "name": "adder", "entity": "team-a", "tags": ["first"]}
    spec, _ = mapping.plan_job(
        request(sft, integrations=[{"type": "wandb", "wandb": given}]), training=sft, validation=None, seed=0
    )
    stored = spec.model_dump(mode="json")
    assert stored["metric_sinks"] == [{"type": "wandb", "mode": "online", **given}]
    run = Run(
        id=uuid.uuid4(),
        project_id=DEFAULT_PROJECT_ID,
        algorithm="sft",
        status="queued",
        spec=stored,
        created_at=NOW,
        pause_requested=False,
        cancel_requested=False,
    )
    job = mapping.job_object(run).model_dump(mode="json")
    SdkJob.model_validate(job)
    assert job["integrations"] == [{"type": "wandb", "wandb": given}]
    plain, _ = mapping.plan_job(request(sft), training=sft, validation=None, seed=0)
    assert plain.metric_sinks is None  # none asked: the worker's default applies


def test_request_body_refuses_unknown_fields_and_out_of_range_values() -> None:
    for bad in (
        {"model": "m", "training_file": "f", "hyperparamters": {}},
        {"model": "m", "training_file": "f", "hyperparameters": {"n_epochs": 0}},
        {
            "model": "m",
            "training_file": "f",
            "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}},
        },
        {"model": "m", "training_file": "f", "suffix": "x" * 65},
        {"model": "m", "training_file": "f", "metadata": {f"k{i}": "v" for i in range(17)}},
    ):
        with pytest.raises(ValueError):
            FineTuningJobCreate.model_validate(bad)


def run_row(status: str = "queued", **over: Any) -> Run:
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(uuid.uuid4()),
        "name": "adder",
        "hyperparameters": {"batch_size": 8, "max_steps": 13, "learning_rate": 1e-3, "beta": 0.1, "seed": 5},
    }
    fields: dict[str, Any] = {
        "id": uuid.uuid4(),
        "project_id": DEFAULT_PROJECT_ID,
        "algorithm": "dpo",
        "status": status,
        "spec": spec,
        "pause_requested": False,
        "cancel_requested": False,
        "created_at": NOW,
        "finished_at": None,
        "error": None,
        "user_metadata": {"team": "evals"},
    }
    return Run(**(fields | over))


def test_a_run_reads_as_an_sdk_valid_job_object() -> None:
    run = run_row("succeeded", finished_at=NOW)
    job = mapping.job_object(run).model_dump(mode="json")
    SdkJob.model_validate(job)  # the official SDK's model of the object, strictly
    assert job["id"] == f"ftjob-{run.id.hex}" and job["object"] == "fine_tuning.job"
    assert job["fine_tuned_model"] == f"run:{run.id}"
    assert job["created_at"] == job["finished_at"] == int(NOW.timestamp())
    assert (
        job["seed"] == 5 and job["user_provided_suffix"] == "adder" and job["metadata"] == {"team": "evals"}
    )
    # made outside this surface: budgeted in steps, so n_epochs is auto; 1e-3 / a tiny preset's DPO 1e-3 = 1
    assert job["hyperparameters"] == {"n_epochs": "auto", "batch_size": 8, "learning_rate_multiplier": 1.0}
    assert job["method"]["dpo"]["hyperparameters"]["beta"] == 0.1
    assert job["error"] is None and job["result_files"] == [f"file-results-{run.id.hex}"]
    assert job["trained_tokens"] is None  # the run logged no tokens/trained metric


def test_status_names_and_the_failure_object() -> None:
    names = {
        s: mapping.job_object(run_row(s)).status
        for s in ("queued", "running", "paused", "succeeded", "failed", "cancelled")
    }
    assert names == {s: s for s in names}
    assert mapping.job_object(run_row("running", pause_requested=True)).status == "pausing"
    assert (
        mapping.job_object(run_row("running", pause_requested=True, cancel_requested=True)).status
        == "running"
    )
    failed = mapping.job_object(run_row("failed", error="non-finite loss at step 3")).error
    assert failed is not None and failed.message == "non-finite loss at step 3" and failed.param is None
    assert mapping.job_object(run_row("running")).fine_tuned_model is None


def test_event_levels_and_status_sentences() -> None:
    assert mapping.event_level("warning", "broker down") == "warn"
    assert mapping.event_level("status", "failed") == "error"
    assert mapping.event_level("status", "succeeded") == "info"
    assert mapping.event_level("checkpoint", "checkpoint at step 3") == "info"
    assert mapping.event_message("status", "running", {"attempt": 2}) == "Job started (attempt 2)"
    assert mapping.event_message("status", "failed", {"error": "boom"}) == "The job failed: boom"
    assert mapping.event_message("status", "queued", {"reason": "resumed by the user"}) == (
        "Job queued (resumed by the user)"
    )
    assert mapping.event_message("info", "final model saved", None) == "final model saved"


def test_checkpoint_metrics_take_the_step_values_or_the_final_ones() -> None:
    mid = mapping.checkpoint_metrics(5, {"loss": 0.5, "token_accuracy": 0.75, "eval/loss": 0.625, "lr": 1.0})
    assert mid.model_dump(exclude_none=True) == {
        "step": 5.0,
        "train_loss": 0.5,
        "train_mean_token_accuracy": 0.75,
        "valid_loss": 0.625,
    }
    final = mapping.checkpoint_metrics(13, {"final/loss": 0.25, "final/rewards/accuracy": 0.9})
    assert final.model_dump(exclude_none=True) == {"step": 13.0, "train_loss": 0.25}
