"""execute_run with loops that sit in a long phase or raise warnings: a cancel or pause lands inside the
phase within seconds, the phase shows on the run while it lasts, warnings are kept once per code."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.models import Dataset, Run
from api.settings import Settings
from tests.worker.test_execute_run import new_run, read
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.worker import execute_run


def busy(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


class PhaseLoop:
    """Logs step 1, then sits in phase ``name`` for up to ``seconds`` of pure-Python work."""

    def __init__(self, name: str, seconds: float, total: int = 40):
        self.name, self.seconds, self.total = name, seconds, total
        self.finished_phase = False

    def __call__(self, spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        reporter.log_metrics(1, {"loss": 1.0})
        with reporter.phase(self.name, self.total) as progress:
            for _ in range(self.total):
                busy(self.seconds / self.total)
                progress.advance()
        self.finished_phase = True
        return LoopResult(status="succeeded", output_path=None)


def flag_later(factory: sessionmaker[Session], run_id: uuid.UUID, field: str, after: float) -> list[float]:
    """Set ``runs.<field>`` after ``after`` seconds in another thread; returns [when it was set]."""
    when: list[float] = []

    def go() -> None:
        with factory.begin() as s:
            setattr(s.get_one(Run, run_id), field, True)
        when.append(time.monotonic())

    threading.Timer(after, go).start()
    return when


@pytest.mark.parametrize(
    ("field", "outcome"), [("cancel_requested", "cancelled"), ("pause_requested", "paused")]
)
def test_a_stop_lands_inside_a_long_phase_within_seconds(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings, field: str, outcome: str
) -> None:
    run_id = new_run(committing_factory, dataset)
    loop = PhaseLoop("reference", seconds=60)
    when = flag_later(committing_factory, run_id, field, after=1.5)
    status = execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
    landed = time.monotonic() - when[0]
    assert status == outcome and not loop.finished_phase
    assert landed < 5.0, f"the stop took {landed:.1f} s to land"
    run, events, metrics = read(committing_factory, run_id)
    assert run.status == outcome and run.phase is None and run.phase_done is None
    assert [m.step for m in metrics] == [1]  # what was logged before is kept
    assert any("stopped during a long phase" in e.message for e in events)


class StopsAtTheBoundary:
    """Logs step 1, waits (pure Python) until ``should_stop`` says yes at a step boundary, then keeps its
    work in a ``checkpoint`` phase longer than the watcher's grace, as ``stop_requested`` does."""

    def __init__(self, save_seconds: float):
        self.save_seconds, self.saved = save_seconds, False

    def __call__(self, spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        reporter.log_metrics(1, {"loss": 1.0})
        deadline = time.monotonic() + 30
        while not reporter.should_stop():
            assert time.monotonic() < deadline, "the pause never arrived"
            busy(0.05)
        with reporter.phase("checkpoint") as progress:
            busy(self.save_seconds)
            progress.advance()
        self.saved = True
        return LoopResult(status="cancelled", output_path=None)


def test_the_save_a_loop_makes_to_honour_a_stop_is_not_interrupted_by_it(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)
    loop = StopsAtTheBoundary(save_seconds=2.5)  # the watcher's grace is 1 s: it would interrupt it
    flag_later(committing_factory, run_id, "pause_requested", after=0.3)
    status = execute_run(run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop})
    assert status == "paused" and loop.saved
    _, events, _ = read(committing_factory, run_id)
    assert not any("stopped during a long phase" in e.message for e in events)


def test_a_long_phase_shows_on_the_run_with_its_progress(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)
    seen: list[tuple[str | None, int | None, int | None]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            with committing_factory() as s:
                run = s.get_one(Run, run_id)
                seen.append((run.phase, run.phase_done, run.phase_total))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        loop = PhaseLoop("final_metrics", seconds=3.0, total=30)
        status = execute_run(
            run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop}
        )
    finally:
        stop.set()
        sampler.join()
    assert status == "succeeded"
    shown = [s for s in seen if s[0] is not None]
    assert shown and {s[0] for s in shown} == {"final_metrics"} and {s[2] for s in shown} == {30}
    dones = [s[1] for s in shown]
    assert dones == sorted(dones) and 0 <= dones[0] and dones[-1] <= 30  # type: ignore[operator]
    run, events, _ = read(committing_factory, run_id)
    assert run.phase is None  # cleared at the end
    progress = [e for e in events if e.kind == "progress"]
    assert progress and progress[0].data is not None and progress[0].data["phase"] == "final_metrics"
    assert progress[0].data["total"] == 30


def test_warnings_are_kept_once_per_code_with_an_event_each(
    committing_factory: sessionmaker[Session], dataset: Dataset, settings: Settings
) -> None:
    run_id = new_run(committing_factory, dataset)

    def loop(spec: Any, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
        reporter.warn("zero_advantage", 3, "zero advantage at steps 1-3")
        reporter.warn("zero_advantage", 7, "again (a resumed attempt): not added")
        reporter.warn("kl_diverging", 9, "kl above 1 nat")
        return LoopResult(status="succeeded", output_path=None)

    assert execute_run(
        run_id, session_factory=committing_factory, settings=settings, loops={"dpo": loop}
    ) == ("succeeded")
    run, events, _ = read(committing_factory, run_id)
    assert run.warnings == [
        {"code": "zero_advantage", "step": 3, "message": "zero advantage at steps 1-3"},
        {"code": "kl_diverging", "step": 9, "message": "kl above 1 nat"},
    ]
    assert run.warning_count == 2
    warning_events = [(e.message, e.data) for e in events if e.kind == "warning"]
    assert warning_events == [
        ("zero advantage at steps 1-3", {"code": "zero_advantage", "step": 3}),
        ("kl above 1 nat", {"code": "kl_diverging", "step": 9}),
    ]


def test_checkpoint_stopped_midway_leaves_no_half_written_folder(tmp_path: Path) -> None:
    import torch

    from trainer.checkpoints import Checkpointer
    from trainer.data.sampling import EpochSampler
    from trainer.phases import RunStopped
    from trainer.reporting import MemoryReporter

    class Broken:
        def save_pretrained(self, folder: Path) -> None:
            (folder / "model.safetensors").write_bytes(b"half")
            raise RunStopped("stop landed while writing")

    reporter = MemoryReporter()
    ckpt = Checkpointer(tmp_path, reporter, keep_last=2)
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RunStopped):
        ckpt.save(
            1,
            model=Broken(),
            tokenizer=Broken(),
            optimizer_state=torch.optim.AdamW(params).state_dict(),
            sampler=EpochSampler(4, 2, torch.Generator()),
            metrics={},
        )
    assert list(tmp_path.iterdir()) == [] and reporter.checkpoints == {}
    assert [p.name for p in reporter.phases] == ["checkpoint"]
