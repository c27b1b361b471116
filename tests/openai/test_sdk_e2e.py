"""The official `openai` SDK against `rlrun serve` (API + worker, SQLite + SQL broker): a DPO and a
supervised fine-tuning job from upload to checkpoints, and the SDK's typed errors."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.fine_tuning import FineTuningJob

from rlrun.demo import addition_pairs
from tests.factories import jsonl
from tests.integration.flow import all_metrics, embedded_server
from tests.openai.helpers import chat_lines, dpo_line

pytestmark = [pytest.mark.slow]

FINISHED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with embedded_server(tmp_path_factory.mktemp("openai-sdk"), inference=True) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(served: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{str(served.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)


def wait(sdk: openai.OpenAI, job_id: str, timeout: float = 180) -> FineTuningJob:
    deadline = time.monotonic() + timeout
    while (job := sdk.fine_tuning.jobs.retrieve(job_id)).status not in FINISHED:
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    return job


def run_id(job_id: str) -> uuid.UUID:
    return uuid.UUID(hex=job_id.removeprefix("ftjob-"))


def test_a_dpo_job_from_upload_to_checkpoints(sdk: openai.OpenAI, served: httpx.Client) -> None:
    rows = [dpo_line(p["prompt"], p["chosen"], p["rejected"]) for p in addition_pairs(100)]
    data = jsonl(rows)
    file = sdk.files.create(file=("pairs.jsonl", data), purpose="fine-tune")
    assert file.id.startswith("file-") and file.bytes == len(data) and file.status == "processed"
    assert sdk.files.retrieve(file.id) == file and file.id in [f.id for f in sdk.files.list()]

    # Only beta besides the budget: the learning rate is the default for the model's size (a tiny preset's
    # 1e-3), so the job trains (with one default for every size it stayed at loss ln 2).
    hp: dict[str, Any] = {"n_epochs": 1, "batch_size": 8, "beta": 0.1}
    job = sdk.fine_tuning.jobs.create(
        model="tiny:llama-0.4m",
        training_file=file.id,
        method={"type": "dpo", "dpo": {"hyperparameters": hp}},
        suffix="adder",
        seed=7,
        metadata={"team": "evals"},
    )
    assert job.status == "queued" and job.method is not None and job.method.type == "dpo"
    done = wait(sdk, job.id)
    assert done.status == "succeeded", done
    rid = run_id(job.id)
    assert done.fine_tuned_model == f"run:{rid}" and done.finished_at is not None
    assert (done.seed, done.metadata, done.training_file) == (7, {"team": "evals"}, file.id)
    steps = -(-1 * 100 // 8)  # ceil(n_epochs * rows / batch_size) = 13
    run = served.get(f"/v1/runs/{rid}").json()  # the same run through rlrun's own API
    assert (
        run["progress"] == {"step": steps, "total_steps": steps, "phase": None, "done": None, "total": None}
        and run["name"] == "adder"
    )
    assert run["spec"]["hyperparameters"]["learning_rate"] == pytest.approx(1e-3)

    checkpoints = sdk.fine_tuning.jobs.checkpoints.list(job.id).data
    final = checkpoints[0]
    assert final.step_number == steps and final.fine_tuned_model_checkpoint == f"run:{rid}@{steps}"
    assert final.metrics.step == steps and final.metrics.train_loss is not None
    assert final.metrics.train_loss < math.log(2) - 0.01  # it learned: DPO starts at ln 2 (1e-6 stayed there)

    events = sdk.fine_tuning.jobs.list_events(job.id, limit=100).data
    messages = [e.message for e in events]
    assert messages[0] == "The job has successfully completed"  # newest first
    assert {"Job queued", "Job started (attempt 1)", f"Created fine-tuning job: {job.id}"} <= set(messages)
    assert all(e.level in ("info", "warn") for e in events)
    assert f"checkpoint at step {steps}" in messages

    # Besides the model the job leaves its trained tokens and its metrics as OpenAI's result file (CSV).
    metrics = all_metrics(served, str(rid))
    counted = [m["value"] for m in metrics if m["key"] == "tokens/trained"]
    assert done.trained_tokens == counted[-1] == max(counted) > 0 and len(counted) == steps
    (results,) = done.result_files
    assert sdk.files.retrieve(results).purpose == "fine-tune-results"
    csv = sdk.files.content(results).text
    lines = [line.split(",") for line in csv.splitlines()]
    header, body = lines[0], lines[1:]
    assert header[:3] == ["step", "train_loss", "train_accuracy"] and "tokens/trained" in header
    assert [int(row[0]) for row in body] == list(range(1, steps + 1))
    losses = {m["step"]: m["value"] for m in metrics if m["key"] == "loss"}
    assert [float(row[1]) for row in body] == [losses[k] for k in range(1, steps + 1)]
    assert sdk.files.retrieve(results).bytes == len(csv.encode())
    assert sdk.files.content(file.id).content == data  # the bytes uploaded, as OpenAI gives them
    with pytest.raises(openai.ConflictError):
        sdk.files.delete(results)

    paged = [j.id for j in sdk.fine_tuning.jobs.list(limit=1)]  # the SDK follows `after` page by page
    assert job.id in paged and len(paged) == len(set(paged))

    # The tuned model answers the minute the job ends, through the same base URL (`rlrun serve` started
    # the inference process beside the API).
    model = done.fine_tuned_model
    assert sdk.models.retrieve(model).id == model and model in [m.id for m in sdk.models.list()]
    prompt = addition_pairs(1)[0]["prompt"]
    answer = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0, n=2
    )
    assert answer.object == "chat.completion" and answer.model == model and len(answer.choices) == 2
    assert answer.choices[0].message.content == answer.choices[1].message.content  # greedy: the same twice
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 16
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    text = sdk.completions.create(model=f"run:{rid}@{steps}", prompt=prompt, max_tokens=4, temperature=0)
    assert text.object == "text_completion" and text.choices[0].finish_reason in ("stop", "length")


def test_a_supervised_job_and_the_checkpoint_it_leaves(sdk: openai.OpenAI) -> None:
    file = sdk.files.create(file=("chat.jsonl", jsonl(chat_lines(24))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(
        model="tiny:llama-0.4m",
        training_file=file.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 8}}},
    )
    done = wait(sdk, job.id)
    assert done.status == "succeeded", done
    assert done.hyperparameters.n_epochs == 1 and done.hyperparameters.batch_size == 8
    (final, *_) = sdk.fine_tuning.jobs.checkpoints.list(job.id).data
    assert final.step_number == 3  # ceil(24 / 8)
    assert final.metrics.train_loss is not None and final.metrics.train_mean_token_accuracy is not None
    with pytest.raises(openai.ConflictError) as ended:
        sdk.fine_tuning.jobs.cancel(job.id)
    assert ended.value.code == "invalid_transition" and "succeeded" in ended.value.message
    with pytest.raises(openai.ConflictError) as in_use:
        sdk.files.delete(file.id)
    assert in_use.value.code == "file_in_use"


def test_sdk_errors_are_typed_and_name_the_parameter(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown_job:
        sdk.fine_tuning.jobs.retrieve(f"ftjob-{uuid.uuid4().hex}")
    assert unknown_job.value.param == "fine_tuning_job_id"
    assert unknown_job.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as unknown_file:
        sdk.fine_tuning.jobs.create(model="tiny:llama-0.4m", training_file="file-nope")
    assert unknown_file.value.param == "training_file" and "file-nope" in unknown_file.value.message
    with pytest.raises(openai.BadRequestError) as purpose:
        sdk.files.create(file=("x.jsonl", jsonl(chat_lines(2))), purpose="assistants")
    assert purpose.value.param == "purpose"
    chat = sdk.files.create(file=("c.jsonl", jsonl(chat_lines(4))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as wrong_kind:
        sdk.fine_tuning.jobs.create(model="tiny:llama-0.4m", training_file=chat.id, method={"type": "dpo"})
    assert wrong_kind.value.param == "training_file" and "preferred_output" in wrong_kind.value.message
    with pytest.raises(openai.BadRequestError) as rft:
        sdk.fine_tuning.jobs.create(
            model="tiny:llama-0.4m",
            training_file=chat.id,
            method={"type": "reinforcement", "reinforcement": {"grader": EXACT}},  # type: ignore[typeddict-item]
        )
    assert rft.value.param == "training_file" and "ending in a user turn" in rft.value.message
    rft_file = sdk.files.create(file=("rft.jsonl", jsonl(rft_lines(4))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as effort:
        sdk.fine_tuning.jobs.create(
            model="tiny:llama-0.4m",
            training_file=rft_file.id,
            method={
                "type": "reinforcement",
                "reinforcement": {"grader": EXACT, "hyperparameters": {"reasoning_effort": "high"}},
            },  # type: ignore[typeddict-item]
        )
    assert effort.value.param == "method.reinforcement.hyperparameters.reasoning_effort"
    with pytest.raises(openai.BadRequestError) as escape:
        sdk.fine_tuning.jobs.create(
            model="tiny:llama-0.4m",
            training_file=rft_file.id,
            method={
                "type": "reinforcement",
                "reinforcement": {"grader": {**EXACT, "input": "{{os.environ}}"}},
            },  # type: ignore[typeddict-item]
        )
    assert escape.value.param is not None and escape.value.param.startswith("method.reinforcement.grader")
    bad = jsonl(chat_lines(2)) + b'{"messages": []}\n'
    with pytest.raises(openai.BadRequestError) as malformed:
        sdk.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert malformed.value.param == "file" and "line 3" in malformed.value.message


EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "like",
}
CLOSE = {
    "type": "python",
    "name": "close",
    "source": "import re\n"
    "def grade(sample, item):\n"
    "    numbers = re.findall(r'-?\\d+', sample['output_text'])\n"
    "    if not numbers:\n"
    "        return 0.0\n"
    "    return 1.0 / (1.0 + abs(int(numbers[-1]) - int(item['answer'])))\n",
}


def rft_lines(n: int) -> list[dict[str, Any]]:
    """OpenAI's reinforcement lines: messages ending in the user's turn, and the fields graders read."""
    return [
        {"messages": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i), "level": i % 3}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "grader",
    [
        pytest.param(CLOSE, id="python"),
        pytest.param(
            {
                "type": "multi",
                "name": "mixed",
                "graders": {"exact": EXACT, "close": CLOSE},
                "calculate_output": "0.5 * exact + 0.5 * close",
            },
            id="multi",
        ),
    ],
)
def test_a_reinforcement_job_with_a_grader(
    sdk: openai.OpenAI, served: httpx.Client, grader: dict[str, Any]
) -> None:
    file = sdk.files.create(file=("rft.jsonl", jsonl(rft_lines(8))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(
        model="tiny:llama-0.4m",
        training_file=file.id,
        validation_file=file.id,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": grader,
                "hyperparameters": {
                    "n_epochs": 1,
                    "batch_size": 4,
                    "compute_multiplier": 0.5,
                    "eval_interval": 1,
                },
            },
        },  # type: ignore[typeddict-item]
    )
    assert job.method is not None and job.method.type == "reinforcement"
    done = wait(sdk, job.id)
    assert done.status == "succeeded", done
    assert done.fine_tuned_model == f"run:{run_id(job.id)}" and done.method.reinforcement is not None
    assert done.method.reinforcement.grader.name == grader["name"]
    hp = done.method.reinforcement.hyperparameters
    assert hp is not None and (hp.n_epochs, hp.batch_size, hp.compute_multiplier) == (1, 4, 0.5)
    run = served.get(f"/v1/runs/{run_id(job.id)}").json()
    assert run["algorithm"] == "grpo" and run["spec"]["rewards"][0]["grader"]["name"] == grader["name"]
    # 8 rows / 4 prompts per step = 2 steps of 4 prompts x 2 samples (round(4 x 0.5))
    assert run["progress"]["step"] == 2 and run["spec"]["hyperparameters"]["samples_per_prompt"] == 2
    keys = {m["key"] for m in all_metrics(served, str(run_id(job.id)))}
    assert {f"reward/{grader['name']}/mean", "reward/failures", "eval/accuracy"} <= keys
    assert job.id in [j.id for j in sdk.fine_tuning.jobs.list(limit=100)]
