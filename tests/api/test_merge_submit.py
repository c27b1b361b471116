"""Merge runs at submit and export (SQLite): only adapters merge; format=hf of an adapter run answers 409
merge_required (naming a merge on its way) until a merge run succeeded, then streams its folder."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Run
from tests.factories import api_client, dpo_spec, make_dataset, make_run


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def test_only_adapters_merge_and_export_waits_for_the_merge(session: Session, tmp_path: Path) -> None:
    prefs = make_dataset(session)
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text("{}")
    with_adapter = {**dpo_spec(prefs.id), "adapter": {"type": "lora", "r": 4}}
    lora = make_run(
        session, prefs, status="succeeded", output_path=str(adapter_dir), spec=with_adapter
    )
    whole = make_run(session, prefs, status="succeeded", output_path=str(tmp_path))
    before = count(session)
    with api_client(session) as client:
        refused = {
            "whole": client.post("/v1/runs", json={"algorithm": "merge", "model": f"run:{whole.id}"}),
            "preset": client.post("/v1/runs", json={"algorithm": "merge", "model": "tiny:llama-0.4m"}),
            "dataset": client.post(
                "/v1/runs",
                json={"algorithm": "merge", "model": f"run:{lora.id}", "dataset_id": str(prefs.id)},
            ),
        }
        assert count(session) == before
        first = client.get(f"/v1/runs/{lora.id}/export", params={"format": "hf"})
        made = client.post("/v1/runs", json={"algorithm": "merge", "model": f"run:{lora.id}"})
        waiting = client.get(f"/v1/runs/{lora.id}/export", params={"format": "hf"})
    for name, resp in refused.items():
        assert resp.status_code == 422, (name, resp.text)
        assert resp.json()["error"]["field"] in ("model", "dataset_id"), resp.text
    assert "trained the whole model" in refused["whole"].json()["error"]["message"]
    assert first.status_code == 409 and first.json()["error"]["code"] == "merge_required"
    assert '"algorithm": "merge"' in first.json()["error"]["message"]
    assert made.status_code == 201, made.text
    merge = made.json()
    assert merge["dataset_id"] is None and merge["progress"]["total_steps"] == 1
    assert waiting.status_code == 409 and merge["id"] in waiting.json()["error"]["message"]

    merged_dir = tmp_path / "merged"
    merged_dir.mkdir()
    (merged_dir / "config.json").write_text('{"merged": true}')
    run = session.scalar(select(Run).where(Run.algorithm == "merge"))
    assert run is not None
    run.status, run.output_path = "succeeded", str(merged_dir)
    session.flush()
    with api_client(session) as client:
        done = client.get(f"/v1/runs/{lora.id}/export", params={"format": "hf"})
    assert done.status_code == 200 and int(done.headers["content-length"]) == len(done.content)
    with tarfile.open(fileobj=io.BytesIO(done.content)) as tar:
        names = tar.getnames()
        member = next(m for m in tar.getmembers() if m.name.endswith("config.json"))
        assert tar.extractfile(member).read() == b'{"merged": true}'  # type: ignore[union-attr]
    assert names
