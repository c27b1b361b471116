"""execute_run called directly with fake loops: claim, idempotency, lease expiry, cancel, failure."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Dataset, Event, Metric, Run, utcnow
from api.settings import Settings
from tests.factories import make_run
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.worker import claim_run, execute_run


def new_run(factory: sessionmaker[Session], dataset: Dataset, **over: Any) -> uuid.UUID:
    with factory.begin() as s:
        return make_run(s, dataset, **over).id


def read(factory: sessionmaker[Session], run_id: uuid.UUID) -> tuple[Run, list[Event], list[Metric]]:
    with factory() as s:
        run = s.get(Run, run_id)
        events = list(s.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))
        metrics = list(s.scalars(select(Metric).where(Metric.run_id == run_id).order_by(Metric.step)))
    assert run is not None
    return run, events, metrics


class CountingLoop:
    """Logs `loss` for each of `steps` steps; stops when asked; can raise at a given step."""

    def __init__(self, steps: int = 3, fail_at: int | None = None, on_step: Any = None):
        self.calls = 0
        self.steps, self.fail_at, self.on_step = steps, fail_at, on_step
        self.steps_after_stop_seen = 0

    def __call__(self, spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        self.calls += 1
        assert len(data.train) == 10 and data.validation == [] and spec.algorithm == "dpo"
        for step in range(1, self.steps + 1):
            if reporter.should_stop():
                return LoopResult(status="cancelled", output_path=None)
            if self.on_step:
                self.on_step(step)
            if step == self.fail_at:
                raise RuntimeError(f"boom at step {step}\nsecond line never shown")
            reporter.log_metrics(step, {"loss": 1.0 / step})
        return LoopResult(status="succeeded", output_path=ctx.checkpoint_dir / "final")


def test_runs_once_and_records_everything(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)
    loop = CountingLoop()
    assert (
        execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
        == "succeeded"
    )
    # A second delivery of the same id claims nothing and runs nothing.
    assert (
        execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
        is None
    )
    assert loop.calls == 1
    run, events, metrics = read(committing_factory, run_id)
    assert run.status == "succeeded" and run.attempt == 1 and run.step == 3
    assert run.output_path and run.output_path.endswith(f"{run_id}/checkpoints/final")
    assert run.finished_at is not None and run.lease_expires_at is None
    assert [e.message for e in events if e.kind == "status"] == ["running", "succeeded"]
    assert [(m.step, m.value) for m in metrics] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]


def test_concurrent_claims_let_exactly_one_worker_win(
    committing_factory: sessionmaker[Session], dataset: Dataset
) -> None:
    run_id = new_run(committing_factory, dataset)
    results: list[bool] = []
    barrier = threading.Barrier(4)

    def claim(i: int) -> None:
        barrier.wait()
        results.append(claim_run(committing_factory, run_id, f"w{i}", 60))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]


def test_expired_lease_is_reclaimed_with_attempt_incremented(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    stale = new_run(
        committing_factory,
        dataset,
        status="running",
        attempt=1,
        worker_id="dead",
        lease_expires_at=utcnow() - timedelta(seconds=5),
    )
    fresh = new_run(
        committing_factory,
        dataset,
        status="running",
        attempt=1,
        worker_id="alive",
        lease_expires_at=utcnow() + timedelta(seconds=60),
    )
    loop = CountingLoop()
    assert (
        execute_run(fresh, session_factory=committing_factory, settings=settings, loops={"dpo": loop}) is None
    )
    assert (
        execute_run(stale, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
        == "succeeded"
    )
    run, _, _ = read(committing_factory, stale)
    assert run.attempt == 2 and run.status == "succeeded"
    assert run.lost_workers == 1  # taking over an expired lease counts the lost worker
    assert read(committing_factory, fresh)[0].worker_id == "alive"
    assert read(committing_factory, fresh)[0].lost_workers == 0


def test_cancel_lands_within_one_step(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)
    steps_seen: list[int] = []

    def cancel_at_step_2(step: int) -> None:
        steps_seen.append(step)
        if step == 2:
            with committing_factory.begin() as s:
                s.get(Run, run_id).cancel_requested = True  # type: ignore[union-attr]

    loop = CountingLoop(steps=50, on_step=cancel_at_step_2)
    assert (
        execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
        == "cancelled"
    )
    assert steps_seen == [1, 2]  # the check before step 3 saw the flag
    run, events, metrics = read(committing_factory, run_id)
    assert run.status == "cancelled" and run.output_path is None
    assert [m.step for m in metrics] == [1, 2]  # metrics logged before the cancel are kept
    assert events[-1].message == "cancelled"


def test_exception_fails_the_run_with_a_one_line_reason(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)
    loop = CountingLoop(steps=5, fail_at=3)
    assert (
        execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
        == "failed"
    )
    run, events, metrics = read(committing_factory, run_id)
    assert run.status == "failed"
    assert run.error == "RuntimeError: boom at step 3"
    assert events[-1].message == "failed" and events[-1].data == {"error": "RuntimeError: boom at step 3"}
    assert [m.step for m in metrics] == [1, 2]


def test_invalid_stored_spec_fails_with_reason(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset.id),
        "hyperparameters": {"max_steps": 3, "no_such_field": 1},
    }
    run_id = new_run(committing_factory, dataset, spec=spec)
    assert (
        execute_run(
            run_id, session_factory=committing_factory, settings=settings, loops={"dpo": CountingLoop()}
        )
        == "failed"
    )
    run, _, _ = read(committing_factory, run_id)
    assert run.error is not None and run.error.startswith("ValidationError")


def test_lost_lease_stops_without_overwriting_the_new_owner(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)

    def stolen(step: int) -> None:
        if step == 2:
            with committing_factory.begin() as s:
                s.get(Run, run_id).worker_id = "someone-else"  # type: ignore[union-attr]

    quick = Settings(home=settings.home, lease_seconds=60)
    loop = CountingLoop(steps=3, on_step=stolen)
    assert (
        execute_run(run_id, session_factory=committing_factory, settings=quick, loops={"dpo": loop}) is None
    )
    run, _, _ = read(committing_factory, run_id)
    assert run.worker_id == "someone-else" and run.status == "running"


def test_a_succeeded_runs_answer_carries_its_result_and_names_its_model(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    """The final metrics the loop returned are stored on the run (NaN left out: JSONB refuses it) and
    answered with the model it produced; a failed run has neither (issue 41 item 3)."""
    from api.services.runs import run_read

    final = {"final/loss": 0.25, "eval/prompts": 10, "final/kl": float("nan")}

    def finishing(spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        return LoopResult(status="succeeded", output_path=ctx.checkpoint_dir / "final", final_metrics=final)

    ok = new_run(committing_factory, dataset)
    failed = new_run(committing_factory, dataset)
    assert execute_run(ok, session_factory=committing_factory, settings=settings, loops={"dpo": finishing})
    execute_run(
        failed, session_factory=committing_factory, settings=settings, loops={"dpo": CountingLoop(fail_at=1)}
    )
    answer = run_read(read(committing_factory, ok)[0]).model_dump(mode="json")
    assert answer["result"] == {"final/loss": 0.25, "eval/prompts": 10}
    assert isinstance(answer["result"]["eval/prompts"], int)
    assert answer["output_model"] == f"run:{ok}"
    gone = run_read(read(committing_factory, failed)[0])
    assert gone.status == "failed" and gone.result is None and gone.output_model is None
