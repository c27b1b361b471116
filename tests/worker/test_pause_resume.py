"""Pause and resume: the API transitions, and a real DPO run paused mid-way that resumes from the
checkpoint it saved and ends with the same weights as an uninterrupted run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Event, Metric, Run
from api.services.runs import pause_run, resume_run
from api.settings import Settings
from tests.factories import FakeEnqueue, api_client, make_dataset, make_run
from trainer.loops import LOOPS
from trainer.models import load_causal_lm
from trainer.worker import execute_run

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(4)
    for b in range(4)
]


def test_pause_and_resume_transitions_over_the_api(session: Session) -> None:
    ds = make_dataset(session)
    queued, running = make_run(session, ds), make_run(session, ds, status="running")
    enqueue = FakeEnqueue()
    with api_client(session, enqueue=enqueue) as client:
        p1 = client.post(f"/v1/runs/{queued.id}/pause")
        again = client.post(f"/v1/runs/{queued.id}/pause")
        p2 = client.post(f"/v1/runs/{running.id}/pause")
        r_running = client.post(f"/v1/runs/{running.id}/resume")
        r1 = client.post(f"/v1/runs/{queued.id}/resume")
        # only this test's runs: worker tests commit runs (paused ones too) into the same database
        paused_list = [
            r
            for r in client.get("/v1/runs", params={"status": "paused", "limit": 200}).json()["data"]
            if r["id"] in (str(queued.id), str(running.id))
        ]
    assert p1.status_code == 200 and p1.json()["status"] == "paused"
    assert again.status_code == 409
    assert p2.status_code == 200 and p2.json()["status"] == "running" and p2.json()["pause_requested"]
    assert r_running.status_code == 409
    assert r1.status_code == 200 and r1.json()["status"] == "queued" and enqueue.sent == [queued.id]
    assert paused_list == []


def _spec(dataset_id: uuid.UUID) -> dict[str, Any]:
    return {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "hyperparameters": {"max_steps": 8, "batch_size": 4, "learning_rate": 1e-2},
    }


class PauseAt:
    """Wraps the real DPO loop; requests a pause (through the DB, like the API) once step `at` is logged."""

    def __init__(self, factory: sessionmaker[Session], run_id: uuid.UUID, at: int):
        self.factory, self.run_id, self.at = factory, run_id, at

    def __call__(self, spec: Any, data: Any, reporter: Any, ctx: Any) -> Any:
        original = reporter.log_metrics

        def log_metrics(step: int, metrics: Any) -> None:
            original(step, metrics)
            if step == self.at:
                with self.factory.begin() as s:
                    run = s.get(Run, self.run_id)
                    assert run is not None
                    pause_run(session=s, run=run)

        reporter.log_metrics = log_metrics
        return LOOPS["dpo"](spec, data, reporter, ctx)


def test_paused_run_resumes_from_its_checkpoint_exactly(
    committing_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path)
    with committing_factory.begin() as s:
        ds = make_dataset(s, rows=ROWS)
        paused_id = make_run(s, ds, spec=_spec(ds.id)).id
        straight_id = make_run(s, ds, spec=_spec(ds.id)).id
    assert execute_run(straight_id, session_factory=committing_factory, settings=settings) == "succeeded"
    status = execute_run(
        paused_id,
        session_factory=committing_factory,
        settings=settings,
        loops={"dpo": PauseAt(committing_factory, paused_id, at=3)},
    )
    assert status == "paused"
    with committing_factory.begin() as s:
        run = s.get(Run, paused_id)
        assert run is not None and run.status == "paused" and run.worker_id is None
        resume_run(session=s, run=run)
    assert execute_run(paused_id, session_factory=committing_factory, settings=settings) == "succeeded"
    with committing_factory() as s:
        steps = sorted(s.scalars(select(Metric.step).where(Metric.run_id == paused_id, Metric.key == "loss")))
        messages = [
            e.message for e in s.scalars(select(Event).where(Event.run_id == paused_id).order_by(Event.id))
        ]
        paths = {rid: s.get(Run, rid).output_path for rid in (paused_id, straight_id)}  # type: ignore[union-attr]
    assert steps == list(range(1, 9))
    assert "paused" in messages and "resumed from checkpoint at step 3" in messages
    a, _ = load_causal_lm(str(paths[straight_id]))
    b, _ = load_causal_lm(str(paths[paused_id]))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
