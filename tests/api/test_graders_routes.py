"""POST /v1/fine_tuning/alpha/graders/run and /validate through the official `openai` SDK: answers in the
SDK's types, scores as the graders' definitions give them, refusals in OpenAI's error shape naming the field,
a hostile python grader contained; and a grader as a run's reward component, refused when malformed."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from tests.factories import api_client, make_dataset

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
PYTHON = {
    "type": "python",
    "name": "closeness",
    "source": "def grade(sample, item):\n"
    "    return 1.0 / (1.0 + abs(float(sample['output_text']) - float(item['answer'])))\n",
}


@pytest.fixture
def client(session: Session) -> Any:
    with api_client(session) as c:
        yield c


def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def test_run_scores_a_sample_and_a_multi_reports_each_grader(client: TestClient) -> None:
    graders = sdk(client).fine_tuning.alpha.graders
    ran = graders.run(grader=EXACT, model_sample="42", item={"answer": "42"})  # type: ignore[arg-type]
    assert ran.reward == 1.0 and ran.metadata.type == "string_check" and ran.metadata.name == "exact"
    assert not ran.metadata.errors.other_error and ran.sub_rewards == {}
    multi = {
        "type": "multi",
        "name": "mixed",
        "graders": {"exact": EXACT, "closeness": PYTHON},
        "calculate_output": "0.25 * exact + 0.75 * closeness",
    }
    ran = graders.run(grader=multi, model_sample="40", item={"answer": "42"})  # type: ignore[arg-type]
    # exact: 0; closeness: 1 / (1 + |40 - 42|) = 1/3
    assert ran.reward == pytest.approx(0.75 / 3)
    assert ran.sub_rewards == {"exact": 0.0, "closeness": pytest.approx(1 / 3)}
    assert ran.metadata.scores == ran.sub_rewards


def test_run_reports_a_failing_python_grader_as_reward_0_with_its_error(client: TestClient) -> None:
    graders = sdk(client).fine_tuning.alpha.graders
    ran = graders.run(grader=PYTHON, model_sample="forty", item={"answer": "42"})  # type: ignore[arg-type]
    assert ran.reward == 0.0 and ran.metadata.errors.python_grader_runtime_error
    assert "ValueError" in (ran.metadata.errors.python_grader_runtime_error_details or "")
    hostile = {
        "type": "python",
        "name": "h",
        "source": "def grade(s, i):\n    return float(open('/etc/passwd').read() != '')\n",
    }
    ran = graders.run(grader=hostile, model_sample="x")  # type: ignore[arg-type]
    assert ran.reward == 0.0 and "FileNotFoundError" in (
        ran.metadata.errors.python_grader_runtime_error_details or ""
    )


def test_validate_echoes_a_good_grader_and_names_the_field_of_a_bad_one(client: TestClient) -> None:
    graders = sdk(client).fine_tuning.alpha.graders
    checked = graders.validate(grader=EXACT)  # type: ignore[arg-type]
    assert checked.grader is not None and checked.grader.model_dump(exclude_none=True) == EXACT
    for bad, words in [
        ({**EXACT, "operation": "regex"}, "operation"),
        ({**EXACT, "reference": "{{item.answer}} {{secrets}}"}, "template"),
        ({"type": "multi", "name": "m", "graders": {"exact": EXACT}, "calculate_output": "exact + x"}, "x"),
        ({"type": "python", "name": "p", "source": "import os\n"}, "grade"),
        ({"type": "label_model", "name": "s", "input": [], "model": "gpt-4o"}, "label_model"),
        (
            {
                "type": "score_model",
                "name": "s",
                "input": [{"role": "user", "content": "x"}],
                "model": "run:x",
            },
            "run",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            graders.validate(grader=bad)  # type: ignore[arg-type]
        error = caught.value.body
        assert isinstance(error, dict) and words in error["message"] and error["param"].startswith("grader")


def test_run_of_a_score_model_grader_says_the_api_loads_no_judge(client: TestClient) -> None:
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny:llama-0.4m",
        "input": [{"role": "user", "content": "Rate: {{sample.output_text}}"}],
        "range": [0, 10],
    }
    ran = sdk(client).fine_tuning.alpha.graders.run(grader=judge, model_sample="42")  # type: ignore[arg-type]
    assert ran.reward == 0.0 and ran.metadata.errors.model_grader_server_error
    assert "training runs" in (ran.metadata.errors.model_grader_server_error_details or "")


def grpo_spec(dataset_id: str, reward: dict[str, Any]) -> dict[str, Any]:
    return {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": dataset_id,
        "rewards": [reward],
        "hyperparameters": {"max_steps": 2},
    }


def test_a_grader_reward_is_stored_with_the_run_and_a_bad_one_is_refused(
    client: TestClient, session: Session
) -> None:
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "meta": {}} for a in range(8)]
    dataset = make_dataset(session, rows, kind="prompts")
    made = client.post("/v1/runs", json=grpo_spec(str(dataset.id), {"grader": EXACT, "weight": 2.0}))
    assert made.status_code == 201, made.text
    stored = made.json()["spec"]["rewards"][0]
    assert stored["name"] == "grader" and stored["grader"]["name"] == "exact" and stored["weight"] == 2.0
    refused = client.post(
        "/v1/runs", json=grpo_spec(str(dataset.id), {"grader": {**EXACT, "input": "{{sample.text}}"}})
    )
    assert refused.status_code == 422 and "rewards.0.grader" in refused.json()["error"]["field"]
    judge = {
        "type": "multi",
        "name": "mixed",
        "graders": {
            "exact": EXACT,
            "judge": {
                "type": "score_model",
                "name": "judge",
                "model": f"run:{uuid.uuid4()}",  # no such run in this project
                "input": [{"role": "user", "content": "{{sample.output_text}}"}],
            },
        },
        "calculate_output": "exact + judge",
    }
    unknown_judge = client.post("/v1/runs", json=grpo_spec(str(dataset.id), {"grader": judge}))
    assert unknown_judge.status_code in (404, 409, 422), unknown_judge.text
    assert unknown_judge.json()["error"]["field"] == "rewards[0].grader.graders.judge.model"
    both = client.post("/v1/runs", json=grpo_spec(str(dataset.id), {"name": "numeric", "grader": EXACT}))
    assert both.status_code == 422 and "`grader` is required for name 'grader'" in both.text
    assert uuid.UUID(made.json()["id"])
