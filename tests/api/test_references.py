"""One resolver for every reference a spec carries (issue 12 items 1, 2, 11): another project's ids get the
unknown-id answer in every reference field, found by walking the OpenAPI schema; model names resolve
inside the model roots only; stage references work in every model field of a pipeline stage."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Pipeline, Run, utcnow
from api.services.auth import create_api_key
from api.services.pipelines import advance
from api.settings import Settings
from tests.api.test_pipelines import finish
from tests.factories import api_client, dpo_spec, make_dataset, make_run
from trainer.model_refs import UnknownModel
from trainer.specs import REFERENCE_MARK

SPEC_SCHEMAS = ("DpoSpec", "SftSpec", "RewardModelSpec", "GroupRlSpec", "PpoSpec")
ROWS = {
    "preference": [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}],
    "sft": [{"prompt": "1+1=", "completion": "2"}],
    "prompts": [{"prompt": "1+1=", "answer": "2"}],
}
NEEDS = {"DpoSpec": "preference", "SftSpec": "sft", "RewardModelSpec": "preference"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def project_of(session: Session, name: str) -> tuple[str, uuid.UUID]:
    key, row = create_api_key(session=session, project_name=name)
    return key, row.project_id


@pytest.fixture
def client(session: Session, tmp_path: Path) -> Iterator[TestClient]:
    with api_client(session, settings=Settings(home=tmp_path, auth=True)) as c:
        yield c


def reference_fields(openapi: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(schema, property, kind) of every marked property of the run-spec schemas."""
    schemas = openapi["components"]["schemas"]
    out = []
    for name, schema in schemas.items():
        for prop, body in schema.get("properties", {}).items():
            if REFERENCE_MARK in body:
                out.append((name, prop, body[REFERENCE_MARK]))
    return out


def algorithm_of(schema: dict[str, Any]) -> str:
    body = schema["properties"]["algorithm"]
    return str(body.get("const") or body["enum"][0])


def test_no_reference_field_goes_unmarked() -> None:
    """A property that names a model or a dataset must carry the mark the resolver walks by."""
    from api.main import create_app

    openapi = create_app(Settings()).openapi()
    schemas = openapi["components"]["schemas"]
    looks_like_ref = re.compile(r"(^|_)model$|dataset_id$")
    seen = 0
    for name in (*SPEC_SCHEMAS, "RewardSpec"):
        for prop, body in schemas[name]["properties"].items():
            if looks_like_ref.search(prop):
                seen += 1
                assert REFERENCE_MARK in body, f"{name}.{prop} carries no {REFERENCE_MARK}"
    assert seen >= 10


def placements(openapi: dict[str, Any], schema: str, prop: str) -> list[tuple[str, list[str | int]]]:
    """Where a marked property can be set in a submitted spec: (spec schema, path)."""
    schemas = openapi["components"]["schemas"]
    if schema in SPEC_SCHEMAS:
        return [(schema, [prop])]
    out: list[tuple[str, list[str | int]]] = []
    for spec_name in SPEC_SCHEMAS:
        for holder, body in schemas[spec_name]["properties"].items():
            items = [body.get("items", {})] + [
                b.get("items", {}) for b in body.get("anyOf", []) if isinstance(b, dict)
            ]
            if any(i.get("$ref", "").endswith(f"/{schema}") for i in items):
                out.append((spec_name, [holder, 0, prop]))
    return out


def base_spec(spec_name: str, algorithm: str, datasets: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "algorithm": algorithm,
        "model": "tiny:llama-0.4m",
        "dataset_id": datasets[NEEDS.get(spec_name, "prompts")],
        "hyperparameters": {"max_steps": 2},
    }
    if spec_name in ("GroupRlSpec", "PpoSpec"):
        spec["rewards"] = [{"name": "exact_match"}]
    return spec


def put(spec: dict[str, Any], path: list[str | int], value: str) -> dict[str, Any]:
    if len(path) == 1:
        return {**spec, str(path[0]): value}
    holder = str(path[0])
    return {**spec, holder: [{"name": "reward_model", str(path[2]): value}]}


def field_name(path: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def test_every_reference_field_answers_another_projects_id_as_unknown(
    client: TestClient, session: Session
) -> None:
    key_a, project_a = project_of(session, f"a-{uuid.uuid4().hex[:6]}")
    key_b, project_b = project_of(session, f"b-{uuid.uuid4().hex[:6]}")
    theirs = {k: make_dataset(session, rows=r, kind=k, project_id=project_a) for k, r in ROWS.items()}
    mine = {k: str(make_dataset(session, rows=r, kind=k, project_id=project_b).id) for k, r in ROWS.items()}
    their_rm = make_run(
        session,
        theirs["preference"],
        project_id=project_a,
        algorithm="reward_model",
        status="succeeded",
        output_path="/tmp/rm",
    )
    openapi = client.get("/openapi.json", headers=bearer(key_b)).json()
    fields = reference_fields(openapi)
    assert {(s, p) for s, p, _ in fields} >= {
        ("DpoSpec", "reference_model"),
        ("PpoSpec", "critic_model"),
        ("RewardSpec", "model"),
        ("GroupRlSpec", "validation_dataset_id"),
    }
    runs_before = session.scalar(select(func.count()).select_from(Run))
    checked = []
    for schema, prop, kind in fields:
        for spec_name, path in placements(openapi, schema, prop):
            spec = base_spec(spec_name, algorithm_of(openapi["components"]["schemas"][spec_name]), mine)
            if kind == "model":
                foreign, unknown = f"run:{their_rm.id}", f"run:{uuid.uuid4()}"
            else:
                kind_needed = NEEDS.get(spec_name, "prompts")
                foreign, unknown = str(theirs[kind_needed].id), str(uuid.uuid4())
            answers = []
            for value in (foreign, unknown):
                resp = client.post("/v1/runs", json=put(spec, path, value), headers=bearer(key_b))
                body = resp.json()["error"]
                answers.append(
                    (
                        resp.status_code,
                        body["code"],
                        body["field"],
                        body["message"].replace(value.removeprefix("run:"), "<id>"),
                    )
                )
            assert answers[0] == answers[1], (spec_name, path, answers)
            assert answers[0][0] == (409 if kind == "model" else 404), answers
            assert answers[0][2] == field_name(path)
            # The same inside a pipeline stage.
            stage = client.post(
                "/v1/pipelines",
                json={"stages": [{"name": "s", "spec": put(spec, path, foreign)}]},
                headers=bearer(key_b),
            )
            assert stage.status_code == answers[0][0], stage.text
            assert stage.json()["error"]["field"] == f"stages[0].spec.{field_name(path)}"
            checked.append(f"{spec_name}.{field_name(path)}")
    assert session.scalar(select(func.count()).select_from(Run)) == runs_before
    # eval_rewards[].model is the field the drill found unchecked.
    assert {"GroupRlSpec.eval_rewards[0].model", "PpoSpec.critic_model", "PpoSpec.rewards[0].model"} <= set(
        checked
    )
    # Project A itself may use them.
    rm_reward = [{"name": "reward_model", "model": f"run:{their_rm.id}"}]
    ok = client.post(
        "/v1/runs",
        json={
            "algorithm": "ppo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(theirs["prompts"].id),
            "rewards": rm_reward,
            "eval_rewards": rm_reward,
            "critic_model": f"run:{their_rm.id}",
        },
        headers=bearer(key_a),
    )
    assert ok.status_code == 201, ok.text


def test_openai_files_of_another_project_are_unknown(client: TestClient, session: Session) -> None:
    _, project_a = project_of(session, f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = project_of(session, f"b-{uuid.uuid4().hex[:6]}")
    theirs = make_dataset(session, rows=ROWS["sft"], kind="sft", project_id=project_a)
    answers = []
    for file_id in (f"file-{theirs.id.hex}", f"file-{uuid.uuid4().hex}"):
        resp = client.post(
            "/v1/fine_tuning/jobs",
            json={"model": "tiny:llama-0.4m", "training_file": file_id},
            headers=bearer(key_b),
        )
        answers.append((resp.status_code, resp.json()["error"]["param"]))
    assert answers == [(404, "training_file"), (404, "training_file")]


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A server whose model root holds ``org/mine``; the working directory holds ``outside/model``."""
    settings = Settings(home=tmp_path / "home")
    for folder in (tmp_path / "home" / "models" / "org" / "mine", tmp_path / "cwd" / "outside" / "model"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(tmp_path / "cwd")
    return settings


def test_model_names_resolve_in_the_roots_never_the_working_directory(
    session: Session, roots: Settings
) -> None:
    ds = make_dataset(session)
    run_out = roots.resolved_artifacts_dir / "runs" / "x" / "final"
    run_out.mkdir(parents=True)
    with api_client(session, settings=roots) as client:
        cwd_name = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": "outside/model"})
        etc = client.post("/v1/runs", json={**dpo_spec(ds.id), "reference_model": "etc/passwd"})
        hub = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": "Qwen/Qwen2.5-0.5B"})
        artifacts = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": str(run_out)})
        in_root = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": "org/mine"})
    for resp, field in ((cwd_name, "model"), (etc, "reference_model"), (hub, "model")):
        assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
        message = resp.json()["error"]["message"]
        assert "RLRUN_ALLOW_HUB" in message and "org/mine" in message and "tiny:llama-0.4m" in message
    # Run outputs are no model root: a path into them is outside the roots; run:<id> is the way.
    assert artifacts.status_code == 409 and "outside the server's model roots" in artifacts.text
    assert in_root.status_code == 201, in_root.text


def test_the_worker_resolves_names_in_the_roots_too(roots: Settings, tiny_cache: Path) -> None:
    from trainer.models import resolve_model

    def no_runs(ref: str) -> Path:
        raise AssertionError(ref)

    kwargs: dict[str, Any] = {
        "cache_dir": tiny_cache,
        "run_output": no_runs,
        "roots": roots.resolved_model_roots,
    }
    assert resolve_model("org/mine", **kwargs) == str(roots.home.resolve() / "models" / "org" / "mine")
    with pytest.raises(UnknownModel, match="outside/model"):
        resolve_model("outside/model", **kwargs)  # exists in the working directory: not loaded
    with pytest.raises(UnknownModel):
        resolve_model("outside/model", cache_dir=tiny_cache, run_output=no_runs)  # no roots at all


def test_sft_rm_ppo_pipeline_with_the_rm_stage_as_reward_and_critic(session: Session) -> None:
    sft_ds = make_dataset(session, rows=ROWS["sft"], kind="sft")
    prefs = make_dataset(session)
    prompts = make_dataset(session, rows=ROWS["prompts"], kind="prompts")
    rm_reward = {"name": "reward_model", "model": "stage:rm"}
    ppo = {
        "algorithm": "ppo",
        "model": "stage:sft",
        "dataset_id": str(prompts.id),
        "rewards": [rm_reward],
        "eval_rewards": [{"name": "exact_match"}, rm_reward],
        "critic_model": "stage:rm",
        "hyperparameters": {"max_steps": 2},
    }
    body = {
        "name": "sft-rm-ppo",
        "stages": [
            {
                "name": "sft",
                "spec": {"algorithm": "sft", "model": "tiny:llama-0.4m", "dataset_id": str(sft_ds.id)},
            },
            {
                "name": "rm",
                "spec": {"algorithm": "reward_model", "model": "stage:sft", "dataset_id": str(prefs.id)},
            },
            {"name": "ppo", "spec": ppo},
        ],
    }
    with api_client(session) as client:
        created = client.post("/v1/pipelines", json=body)
        assert created.status_code == 201, created.text
        p = created.json()
        pid = uuid.UUID(p["id"])
        finish(session, p["stages"][0]["run_id"], "succeeded")
        assert len(advance(session=session, pipeline_id=pid)) == 1  # rm only: ppo waits for rm
        rm_run = client.get(f"/v1/pipelines/{pid}").json()["stages"][1]["run_id"]
        finish(session, rm_run, "succeeded")
        assert len(advance(session=session, pipeline_id=pid)) == 1
        stages = client.get(f"/v1/pipelines/{pid}").json()["stages"]
        ppo_run = client.get(f"/v1/runs/{stages[2]['run_id']}").json()
        # A stage ref anywhere but a model field of a later stage is refused at creation.
        later = client.post(
            "/v1/pipelines",
            json={"stages": [{"name": "ppo", "spec": {**ppo, "model": "tiny:llama-0.4m"}}]},
        )
    spec = ppo_run["spec"]
    assert spec["model"] == f"run:{stages[0]['run_id']}"
    assert (
        spec["critic_model"]
        == spec["rewards"][0]["model"]
        == spec["eval_rewards"][1]["model"]
        == f"run:{rm_run}"
    )
    assert later.status_code == 422 and later.json()["error"]["field"] == "stages[0].spec.rewards[0].model"
    assert session.scalar(select(func.count()).select_from(Pipeline).where(Pipeline.id == pid)) == 1


def test_the_models_list_names_what_a_run_may_use(session: Session, roots: Settings) -> None:
    ds = make_dataset(session)
    done = make_run(session, ds, status="succeeded", output_path="/tmp/x", finished_at=utcnow())
    failed = make_run(session, ds, status="failed")
    with api_client(session, settings=roots) as client:
        listed = client.get("/v1/models").json()
    ids = [m["id"] for m in listed["data"]]
    assert listed["object"] == "list"
    assert ids[:3] == ["tiny:llama-0.4m", "tiny:llama-10m", "tiny:llama-char-0.4m"]
    assert "org/mine" in ids and "outside/model" not in ids  # the root's folder, not the working directory's
    ours = {f"run:{done.id}", f"run:{failed.id}"}  # other tests' committed runs may share the database
    assert [m for m in listed["data"] if m["source"] == "run" and m["id"] in ours] == [
        {
            "id": f"run:{done.id}",
            "object": "model",
            "created": int(done.finished_at.timestamp()),
            "owned_by": str(done.project_id),
            "source": "run",
            "algorithm": "dpo",
            "parameters": None,
            "chat": True,
            "imported_from": None,
        }
    ]
