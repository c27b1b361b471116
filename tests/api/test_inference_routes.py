"""The API's OpenAI inference routes and /v1/models/{model} (issue 21 items 1, 2) with the official `openai`
SDK: names resolve to the caller's project only, reward models and unfinished runs are refused, and the
request reaches a real inference process (uvicorn on loopback) and comes back, streamed or whole."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.models import Checkpoint, utcnow
from api.services.auth import create_api_key
from api.settings import Settings
from tests.factories import api_client, make_dataset, make_run, serving
from trainer.inference.server import create_app as inference_app
from trainer.models import tiny_model_dir


@pytest.fixture
def settings(tmp_path: Path, tiny_cache: Path) -> Iterator[Settings]:
    base = Settings(home=tmp_path, cache_dir=tiny_cache, auth=True)
    with serving(inference_app(base)) as url:
        yield base.model_copy(update={"inference_url": url})


def sdk(client: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


def a_model(settings: Settings, tiny_cache: Path, name: str) -> str:
    folder = settings.resolved_artifacts_dir / name
    shutil.copytree(tiny_model_dir("llama-0.4m", tiny_cache), folder)
    return str(folder)


def test_a_run_of_the_project_answers_and_another_projects_is_unknown(
    session: Session, settings: Settings, tiny_cache: Path
) -> None:
    mine, mine_row = create_api_key(session=session, project_name=f"p-{uuid.uuid4().hex[:8]}")
    theirs, _ = create_api_key(session=session, project_name=f"q-{uuid.uuid4().hex[:8]}")
    ds = make_dataset(session, project_id=mine_row.project_id)
    path = a_model(settings, tiny_cache, "dpo-final")
    run = make_run(
        session,
        ds,
        project_id=mine_row.project_id,
        status="succeeded",
        output_path=path,
        finished_at=utcnow(),
    )
    session.add(
        Checkpoint(
            run_id=run.id, step=3, path=a_model(settings, tiny_cache, "ckpt-3"), size_bytes=1, metrics={}
        )
    )
    session.flush()
    with api_client(session, settings=settings) as client:
        ours, other = sdk(client, mine), sdk(client, theirs)
        name = f"run:{run.id}"
        assert ours.models.retrieve(name).id == name
        listed = {m.id for m in ours.models.list()}
        assert {name, f"{name}@3"} <= listed
        ft = f"ft:tiny:llama-0.4m:adder:{run.id.hex}"  # OpenAI's form, the run id last
        assert ours.models.retrieve(ft).id == ft

        answer = ours.chat.completions.create(
            model=ft, messages=[{"role": "user", "content": "12+30="}], max_tokens=5, seed=1
        )
        assert answer.model == ft and answer.choices[0].message.role == "assistant"
        stream = ours.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "12+30="}], max_tokens=5, seed=1, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == answer.choices[0].message.content  # the same seed, streamed
        assert ours.completions.create(model=f"{name}@3", prompt="1+1=", max_tokens=3).choices

        for call in (
            lambda: other.models.retrieve(name),
            lambda: other.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}]),
            lambda: ours.chat.completions.create(
                model="my-model", messages=[{"role": "user", "content": "x"}]
            ),
        ):
            with pytest.raises(openai.NotFoundError) as unknown:
                call()
            assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
        assert str(run.id) not in str(other.models.list().data)


def test_reward_models_and_unfinished_runs_are_refused(session: Session, settings: Settings) -> None:
    key, row = create_api_key(session=session, project_name=f"p-{uuid.uuid4().hex[:8]}")
    ds = make_dataset(session, project_id=row.project_id)
    rm = make_run(
        session,
        ds,
        project_id=row.project_id,
        algorithm="reward_model",
        status="succeeded",
        output_path="/x",
        finished_at=utcnow(),
    )
    running = make_run(session, ds, project_id=row.project_id, status="running")
    with api_client(session, settings=settings) as client:
        client_sdk = sdk(client, key)
        with pytest.raises(openai.BadRequestError) as scorer:
            client_sdk.chat.completions.create(
                model=f"run:{rm.id}", messages=[{"role": "user", "content": "x"}]
            )
        assert scorer.value.code == "model_not_generative" and "reward model" in scorer.value.message
        assert client_sdk.models.retrieve(f"run:{rm.id}").model_extra["chat"] is False
        scorer = settings.home / "models" / "org" / "scorer"  # a folder under the server's model roots
        scorer.mkdir(parents=True)
        (scorer / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
        assert client_sdk.models.retrieve("org/scorer").model_extra["source"] == "folder"
        with pytest.raises(openai.BadRequestError) as folder_scorer:
            client_sdk.chat.completions.create(
                model="org/scorer", messages=[{"role": "user", "content": "x"}]
            )
        assert folder_scorer.value.code == "model_not_generative"
        with pytest.raises(openai.NotFoundError) as unfinished:
            client_sdk.completions.create(model=f"run:{running.id}", prompt="x")
        assert "running" in unfinished.value.message
        with pytest.raises(openai.BadRequestError) as bad:
            client_sdk.chat.completions.create(
                model="tiny:llama-0.4m", messages=[{"role": "user", "content": "x"}], n=99
            )
        assert bad.value.param == "n"


def test_without_an_inference_process_the_routes_say_so(
    session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.routers.inference._STARTING_SECONDS", 1.0)  # a starting process gets 20 s
    with api_client(session, settings=Settings(home=tmp_path)) as client:
        answer = client.post(
            "/v1/chat/completions",
            json={"model": "tiny:llama-0.4m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert answer.status_code == 503 and "rlrun inference" in answer.json()["error"]["message"]
        gone = Settings(home=tmp_path, inference_url="http://127.0.0.1:9")  # nothing listens on port 9
    with api_client(session, settings=gone) as client:
        answer = client.post("/v1/completions", json={"model": "tiny:llama-0.4m", "prompt": "x"})
        assert answer.status_code == 503 and "nothing listens" in answer.json()["error"]["message"]


def test_deleting_a_model_archives_it_under_every_name(
    session: Session, settings: Settings, tiny_cache: Path
) -> None:
    key, row = create_api_key(session=session, project_name=f"p-{uuid.uuid4().hex[:8]}")
    ds = make_dataset(session, project_id=row.project_id)
    path = a_model(settings, tiny_cache, "to-archive")
    run = make_run(
        session, ds, project_id=row.project_id, status="succeeded", output_path=path, finished_at=utcnow()
    )
    session.add(Checkpoint(run_id=run.id, step=2, path=path, size_bytes=1, metrics={}))
    session.flush()
    name = f"run:{run.id}"
    with api_client(session, settings=settings) as client:
        client_sdk = sdk(client, key)
        with pytest.raises(openai.PermissionDeniedError) as preset:
            client_sdk.models.delete("tiny:llama-0.4m")
        assert preset.value.code == "model_not_deletable"
        deleted = client_sdk.models.delete(f"ft:tiny:llama-0.4m:x:{run.id.hex}")
        assert deleted.deleted is True
        listed = {m.id for m in client_sdk.models.list()}
        assert name not in listed and f"{name}@2" not in listed
        for call in (
            lambda: client_sdk.models.retrieve(name),
            lambda: client_sdk.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x"}]
            ),
            lambda: client_sdk.completions.create(model=f"{name}@2", prompt="x"),
            lambda: client_sdk.models.delete(name),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        spec = {
            "algorithm": "sft",
            "model": name,
            "dataset_id": str(
                make_dataset(
                    session, project_id=row.project_id, kind="sft", rows=[{"prompt": "a", "completion": "b"}]
                ).id
            ),
        }
        refused = client.post("/v1/runs", json=spec, headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 409 and "archived" in refused.json()["error"]["message"], refused.text
    assert Path(path).is_dir()  # archived, not deleted
