"""Local model paths must stay inside the server's model roots; hub ids are well formed."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from api.settings import Settings
from tests.factories import api_client, dpo_spec, make_dataset
from trainer.model_refs import check_hub_id, check_local_model


def test_local_paths_must_resolve_inside_a_root(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "good").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "sneaky").symlink_to(outside)
    assert check_local_model(str(root / "good"), [root]) == (root / "good").resolve()
    for bad in (str(outside), str(root / "good" / ".." / ".." / "elsewhere"), str(root / "sneaky"), "/etc"):
        with pytest.raises(ValueError, match="outside the server's model roots"):
            check_local_model(bad, [root])


@pytest.mark.parametrize("ref", ["org/name", "gpt2", "Qwen/Qwen2.5-0.5B"])
def test_hub_ids_pass(ref: str) -> None:
    assert check_hub_id(ref) == ref


@pytest.mark.parametrize("ref", ["org/../x", "a/b/c", "with space", "org/na$me"])
def test_malformed_hub_ids_are_refused(ref: str) -> None:
    with pytest.raises(ValueError):
        check_hub_id(ref)


def test_submit_refuses_paths_outside_the_roots_with_the_field_named(
    session: Session, tmp_path: Path
) -> None:
    ds = make_dataset(session)
    settings = Settings(home=tmp_path)
    inside = tmp_path / "models" / "mine"
    inside.mkdir(parents=True)
    with api_client(session, settings=settings) as client:
        outside = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": "/etc"})
        ref = client.post("/v1/runs", json={**dpo_spec(ds.id), "reference_model": "../../etc"})
        ok = client.post("/v1/runs", json={**dpo_spec(ds.id), "model": str(inside)})
    assert outside.status_code == 409 and outside.json()["error"]["field"] == "model"
    assert ref.status_code == 409 and ref.json()["error"]["field"] == "reference_model"
    assert ok.status_code == 201
