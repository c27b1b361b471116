"""A run that asks for the engine process (``engine: vllm_server``) where no engine environment is
configured is refused at submit, the field, the setting and the install command named; nothing is stored.
The same for a pipeline stage. With an engine environment, or a running engine configured for the
workers (RLRUN_ENGINE_URL), the run is accepted."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Pipeline, Run
from api.settings import Settings
from tests.factories import api_client, make_dataset

PROMPTS = [{"prompt": "1+1=", "answer": "2"}]


def grpo(dataset_id: uuid.UUID, engine: str) -> dict[str, Any]:
    return {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "rewards": [{"name": "exact_match"}],
        "hyperparameters": {"max_steps": 2, "engine": engine},
    }


def count(session: Session, table: type) -> int:
    return int(session.scalar(select(func.count()).select_from(table)) or 0)


def test_the_engine_process_is_refused_where_none_is_installed(session: Session, tmp_path: Path) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    missing = Settings(engine_python=str(tmp_path / "no-engine" / "python"))
    runs, pipelines = count(session, Run), count(session, Pipeline)
    with api_client(session, settings=missing) as client:
        run = client.post("/v1/runs", json=grpo(prompts.id, "vllm_server"))
        stage = {"name": "rl", "spec": grpo(prompts.id, "vllm_server")}
        pipeline = client.post("/v1/pipelines", json={"name": "p", "stages": [stage]})
        plain = client.post("/v1/runs", json=grpo(prompts.id, "hf"))  # other engines are not affected
    assert run.status_code == 422, run.text
    error = run.json()["error"]
    assert error["field"] == "hyperparameters.engine"
    assert "RLRUN_ENGINE_PYTHON" in error["message"] and "make engine" in error["message"]
    assert pipeline.status_code == 422, pipeline.text
    assert pipeline.json()["error"]["field"] == "stages[0].spec.hyperparameters.engine"
    assert plain.status_code == 201, plain.text
    assert count(session, Run) == runs + 1 and count(session, Pipeline) == pipelines


def test_the_engine_is_accepted_without_an_environment_where_a_running_one_is_configured(
    session: Session, tmp_path: Path
) -> None:
    """RLRUN_ENGINE_URL: the workers use a running engine (``rlrun engine``), wherever the API runs."""
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    attached = Settings(
        engine_python=str(tmp_path / "no-engine" / "python"), engine_url="http://127.0.0.1:8100"
    )
    with api_client(session, settings=attached) as client:
        run = client.post("/v1/runs", json=grpo(prompts.id, "vllm_server"))
        stage = {"name": "rl", "spec": grpo(prompts.id, "vllm_server")}
        pipeline = client.post("/v1/pipelines", json={"name": "p", "stages": [stage]})
    assert run.status_code == 201, run.text
    assert pipeline.status_code == 201, pipeline.text


def test_the_engine_process_is_accepted_where_its_environment_exists(session: Session) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    present = Settings(engine_python=sys.executable)  # any existing python stands for the environment here
    with api_client(session, settings=present) as client:
        resp = client.post("/v1/runs", json=grpo(prompts.id, "vllm_server"))
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["hyperparameters"]["engine"] == "vllm_server"


def test_a_quantized_adapter_is_refused_and_several_devices_share_the_engine_process(
    session: Session,
) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    with api_client(session, settings=Settings(engine_python=sys.executable)) as client:
        adapter = client.post("/v1/runs", json={**grpo(prompts.id, "vllm_server"), "adapter": {"r": 4}})
        quantized = client.post(
            "/v1/runs", json={**grpo(prompts.id, "vllm_server"), "adapter": {"r": 4, "quantize": "4bit"}}
        )
        devices = client.post(
            "/v1/runs", json={**grpo(prompts.id, "vllm_server"), "resources": {"devices": 2}}
        )
        overlapped = {**grpo(prompts.id, "vllm_server"), "resources": {"devices": 2}}
        overlapped["hyperparameters"] = {**overlapped["hyperparameters"], "async_rollouts": 1}
        several_async = client.post("/v1/runs", json=overlapped)
    assert adapter.status_code == 201, adapter.text  # the engine takes the adapter as a LoRA
    assert quantized.status_code == 422 and "adapter.quantize" in quantized.text
    assert devices.status_code == 201, devices.text  # the ranks share one engine process
    assert several_async.status_code == 422, several_async.text
    assert "several devices with hyperparameters.async_rollouts" in several_async.text
