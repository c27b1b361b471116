"""A run's long phase and health warnings in the CLI: the pure renderers (`runs watch` frame and status line,
`runs get` summary, `runs list` table) against hand-derived strings, and `--flagged` / ``flagged=`` as the
query parameter the API filters on (through httpx's MockTransport: no server)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import rlrun.client
from rlrun import Client
from rlrun.cli import main
from rlrun.commands import run_summary, runs_table, watch_state
from rlrun.schemas import PHASES, RunRead
from rlrun.terminal import (
    PHASE_LABELS,
    HealthWarning,
    WatchState,
    phase_text,
    progress_cell,
    status_line,
    warning_text,
    watch_frame,
)

ZERO_ADV = HealthWarning("zero_advantage", 3, "every group's rewards were equal at steps 1-3")
KL = HealthWarning("kl_diverging", 7, "kl/ref 1.2 > 1 at steps 5-7")


def run_read(**over: Any) -> RunRead:
    """A RunRead as the API sends it (JSON), ``progress`` and ``warnings`` as given."""
    body: dict[str, Any] = {
        "id": "00000000-0000-4000-8000-000000000001",
        "name": "probe",
        "algorithm": "grpo",
        "status": "running",
        "spec": {"model": "tiny:llama-0.4m"},
        "dataset_id": None,
        "attempt": 1,
        "progress": {"step": 0, "total_steps": 300},
        "warnings": [],
        "cancel_requested": False,
        "pause_requested": False,
        "error": None,
        "output_path": None,
        "created_at": "2026-01-02T03:04:05Z",
        "started_at": None,
        "finished_at": None,
    }
    return RunRead.model_validate(body | over)


def test_every_phase_has_a_label() -> None:
    assert set(PHASE_LABELS) == set(PHASES)


@pytest.mark.parametrize(
    ("phase", "done", "total", "expected"),
    [
        ("reference", 120, 1300, "reference log-probs 120/1300"),
        ("eval", None, 10, "evaluating 0/10"),
        ("model_load", None, None, "loading model…"),
        ("tokenize", 1200, None, "tokenising… 1200 done"),
        ("tokenize", 0, None, "tokenising…"),
        ("warm_up", 1, 2, "warm up 1/2"),  # a phase this client does not know yet: its name, readable
    ],
)
def test_phase_text(phase: str, done: int | None, total: int | None, expected: str) -> None:
    assert phase_text(phase, done, total) == expected


def test_progress_cell_is_the_step_or_the_phase_and_its_percent() -> None:
    assert progress_cell(5, 10) == "5/10"
    assert progress_cell(3, None) == "3"
    assert progress_cell(0, 300, "reference", 120, 1300) == "reference 9%"  # 9.23 % rounded down
    assert progress_cell(0, 300, "final_metrics", 50, 50) == "final_metrics 100%"
    assert progress_cell(0, 300, "model_load", None, None) == "model_load…"


def test_watch_frame_shows_the_phase_instead_of_step_zero() -> None:
    state = WatchState(
        run_id="r3",
        status="running",
        step=0,
        total_steps=300,
        algorithm="grpo",
        model="tiny",
        phase="reference",
        phase_done=120,
        phase_total=1300,
    )
    # 120/1300 = 9.2 %: 0 of 10 cells, "  9%"
    assert watch_frame(state, bar_width=10) == (
        "run r3  grpo  tiny\nstatus  running\nphase   reference log-probs 120/1300  ░░░░░░░░░░    9%\n"
        "(no metrics yet)"
    )
    assert status_line(state) == "running  reference log-probs 120/1300"


def test_watch_frame_with_an_unknown_total_has_no_bar() -> None:
    state = WatchState(run_id="r4", status="running", step=0, total_steps=300, phase="model_load")
    assert watch_frame(state) == "run r4\nstatus  running\nphase   loading model…\n(no metrics yet)"
    assert status_line(state) == "running  loading model…"


def test_watch_frame_mid_run_phase_keeps_the_step_and_lists_warnings() -> None:
    state = WatchState(
        run_id="r5",
        status="running",
        step=5,
        total_steps=10,
        series={"loss": [3.0, 2.0, 1.0]},
        phase="eval",
        phase_done=3,
        phase_total=4,
        warnings=(ZERO_ADV, KL),
        error=None,
    )
    # step 5/10: 5 of 10 cells; eval 3/4: 7 of 10 cells, 75 %; loss 3, 2, 1 -> levels 7, 4, 0
    assert watch_frame(state, bar_width=10, spark_width=8) == (
        "run r5\n"
        "status  running\n"
        "step    5/10  █████░░░░░   50%\n"
        "phase   evaluating 3/4  ███████░░░   75%\n"
        "loss           1  █▅▁\n"
        "warning zero_advantage at step 3: every group's rewards were equal at steps 1-3\n"
        "warning kl_diverging at step 7: kl/ref 1.2 > 1 at steps 5-7"
    )
    assert status_line(state) == (
        "running  step 5/10  evaluating 3/4  loss=1  warnings=zero_advantage,kl_diverging"
    )


def test_warning_lines_come_before_the_error_and_are_cut_to_width() -> None:
    failed = WatchState(
        run_id="r6", status="failed", step=9, total_steps=None, warnings=(KL,), error="ValueError: boom"
    )
    assert watch_frame(failed, width=30).splitlines()[-2:] == [
        "warning kl_diverging at step 7",
        "error   ValueError: boom",
    ]
    assert warning_text(ZERO_ADV) == "zero_advantage at step 3: every group's rewards were equal at steps 1-3"


def test_watch_state_takes_the_phase_and_warnings_from_the_run() -> None:
    run = run_read(
        progress={"step": 0, "total_steps": 300, "phase": "tokenize", "done": 40, "total": None},
        warnings=[ZERO_ADV._asdict()],
    )
    state = watch_state(run, {})
    assert (state.phase, state.phase_done, state.phase_total) == ("tokenize", 40, None)
    assert state.warnings == [ZERO_ADV]
    assert (state.run_id, state.model, state.name) == (str(run.id), "tiny:llama-0.4m", "probe")


def test_runs_get_summary_shows_the_phase_and_each_warning() -> None:
    in_phase = run_read(
        progress={"step": 0, "total_steps": 300, "phase": "reference", "done": 120, "total": 1300}
    )
    lines = run_summary(in_phase, {}).splitlines()
    assert "phase     reference log-probs 120/1300" in lines
    assert not [line for line in lines if line.startswith("progress")]  # "0/300" says nothing yet

    later = run_read(
        progress={"step": 40, "total_steps": 300, "phase": "eval", "done": None, "total": 8},
        warnings=[ZERO_ADV._asdict(), KL._asdict()],
    )
    lines = run_summary(later, {"loss": 0.5}).splitlines()
    at = lines.index("progress  40/300")
    assert lines[at + 1] == "phase     evaluating 0/8"
    warned = lines.index("warnings  zero_advantage at step 3: every group's rewards were equal at steps 1-3")
    assert lines[warned + 1] == "          kl_diverging at step 7: kl/ref 1.2 > 1 at steps 5-7"
    assert lines[-2:] == ["metrics   (last values)", "  loss  0.5"]

    plain = run_summary(run_read(status="succeeded", progress={"step": 300, "total_steps": 300}), {})
    assert "progress  300/300" in plain.splitlines() and "phase" not in plain and "warnings" not in plain


def test_runs_table_marks_flagged_runs_and_shows_phases() -> None:
    flagged = run_read(name="a", warnings=[ZERO_ADV._asdict(), KL._asdict()])
    phase = run_read(
        id="00000000-0000-4000-8000-000000000002",
        name="b",
        progress={"step": 0, "total_steps": 300, "phase": "reference", "done": 120, "total": 1300},
    )
    lines = runs_table([flagged, phase]).splitlines()
    assert lines[0] == (
        "ID                                    STATUS     ALGORITHM                   PROGRESS  WARN  "
        "CREATED           NAME"
    )
    assert lines[1] == (
        "00000000-0000-4000-8000-000000000001  running    grpo                           0/300  ⚠2    "
        "2026-01-02 03:04  a"
    )
    assert lines[2] == (
        "00000000-0000-4000-8000-000000000002  running    grpo                    reference 9%        "
        "2026-01-02 03:04  b"
    )


# ---------- flagged= on the wire ----------


class Recorder:
    """A MockTransport handler: answers GET /v1/runs with ``runs`` (one page) and records each request."""

    def __init__(self, runs: list[RunRead]):
        self.runs = runs
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        page = {
            "data": [r.model_dump(mode="json") for r in self.runs],
            "has_more": False,
            "next_cursor": None,
        }
        return httpx.Response(200, json=page)

    def queries(self) -> list[dict[str, str]]:
        return [dict(r.url.params) for r in self.requests]


def test_client_list_and_iter_pass_flagged() -> None:
    recorder = Recorder([run_read(warnings=[ZERO_ADV._asdict()])])
    with Client("http://rlrun.test", transport=httpx.MockTransport(recorder)) as rl:
        assert rl.runs.list(flagged=True).data[0].warnings[0].code == "zero_advantage"
        rl.runs.list(flagged=False, status="running")
        rl.runs.list()
        assert len(list(rl.runs.iter(flagged=True, page_size=5))) == 1
    assert recorder.queries() == [
        {"flagged": "true"},
        {"status": "running", "flagged": "false"},
        {},
        {"limit": "5", "flagged": "true"},
    ]


@pytest.fixture
def mocked(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """The CLI's Client talks to a Recorder instead of a server."""
    recorder = Recorder([run_read(name="flagged-run", warnings=[ZERO_ADV._asdict(), KL._asdict()])])

    class MockedClient(Client):
        def __init__(self, base_url: str | None = None, api_key: str | None = None, **kw: Any):
            super().__init__(base_url, api_key, transport=httpx.MockTransport(recorder), **kw)

    monkeypatch.setattr(rlrun.client, "Client", MockedClient)
    yield recorder


def test_runs_list_flagged(mocked: Recorder, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "list", "--flagged", "--url", "http://rlrun.test"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"{mocked.runs[0].id}  running    grpo") and "  ⚠2    " in out[1]
    assert main(["runs", "list", "--all", "--flagged", "--json", "--url", "http://rlrun.test"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [w["code"] for w in listed[0]["warnings"]] == ["zero_advantage", "kl_diverging"]
    assert main(["runs", "list", "--url", "http://rlrun.test"]) == 0
    assert mocked.queries() == [
        {"limit": "20", "flagged": "true"},
        {"limit": "100", "flagged": "true"},
        {"limit": "20"},
    ]
    assert uuid.UUID(out[1].split()[0]) == mocked.runs[0].id
