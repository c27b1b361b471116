"""Metric sinks: a real DPO run mirrored live to a real MLflow tracking server (SQLite store) and to an
offline W&B run, read back with MLflow's client and W&B's own reader (`wandb leet inspect --json`); a
sink on a closed port leaves the run succeeded with a warning; `rlrun runs export-metrics` sends that
run afterwards. The mirror thread's retry, once-only warning and last try are checked with a scripted
sink."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import mlflow  # the dev extra's full package: its client here, its server in the fixture
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.main import create_app
from api.models import Metric, Run
from api.settings import Settings
from rlrun.cli import main
from rlrun.schemas import SINK_WARNING_CODES
from tests.factories import FakeEnqueue, api_client, dpo_spec, make_dataset, make_run, serving
from tests.tracker_readers import wandb_records
from trainer.metric_sinks import MlflowSink, Point, WandbSink, flat_params, mlflow_name
from trainer.ports import free_port
from trainer.sink_mirror import SinkMirror
from trainer.worker import execute_run

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(4)
    for b in range(4)
]


# -- pure parts -------------------------------------------------------------------------------------------
def test_mlflow_names_keep_what_mlflow_accepts_and_spell_out_the_rest() -> None:
    assert mlflow_name("reward/mean") == "reward/mean"
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4"
    assert mlflow_name("a b:c-d.e") == "a b:c-d.e"
    assert mlflow_name("x#y%z") == "x_y_z"


def test_flat_params_walk_dicts_and_write_the_rest_as_json() -> None:
    spec = {"algorithm": "dpo", "hyperparameters": {"beta": 0.1, "max_steps": 3}, "rewards": [1, 2], "a": {}}
    assert flat_params(spec) == {
        "algorithm": "dpo",
        "hyperparameters.beta": "0.1",
        "hyperparameters.max_steps": "3",
        "rewards": "[1, 2]",
        "a": "{}",
    }
    assert len(flat_params({"long": "x" * 7000})["long"]) == 6000


def test_the_api_schema_names_each_sinks_warning_codes() -> None:
    """The codes the mirror writes (``metric_sink_<label>`` and ``..._incomplete``) for both real sinks are
    the ones RunWarningRead accepts (rlrun/schemas.py, written apart)."""
    labels = [MlflowSink.label, WandbSink.label]
    made = [f"metric_sink_{label}" for label in labels] + [
        f"metric_sink_{label}_incomplete" for label in labels
    ]
    assert sorted(made) == sorted(SINK_WARNING_CODES)


class ScriptedSink:
    """Fails ``open`` ``open_failures`` times and ``log`` ``log_failures`` times, then keeps what it gets;
    ``gate``: every log waits for it (a sink that hangs)."""

    label = "scripted"
    where = "memory"

    def __init__(self, open_failures: int = 0, log_failures: int = 0, gate: threading.Event | None = None):
        self.open_failures, self.log_failures, self.gate = open_failures, log_failures, gate
        self.points: list[Point] = []
        self.tags: dict[str, str] = {}
        self.closed: str | None = None

    def open(self) -> None:
        if self.open_failures:
            self.open_failures -= 1
            raise ConnectionError("connection refused")

    def log(self, points: Sequence[Point]) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.log_failures:
            self.log_failures -= 1
            raise TimeoutError("timed out")
        self.points += points

    def tag(self, name: str, value: str) -> None:
        self.tags[name] = value

    def close(self, status: str) -> None:
        self.closed = status


def mirror_of(sink: ScriptedSink) -> tuple[SinkMirror, list[tuple[str, int, str]], list[str]]:
    warnings: list[tuple[str, int, str]] = []
    events: list[str] = []
    mirror = SinkMirror(
        [sink], lambda c, s, m: warnings.append((c, s, m)), events.append, interval=0.02, backoff=0.02
    )
    mirror.start()
    return mirror, warnings, events


def points(steps: range) -> list[Point]:
    return [Point("loss", s, 1.0 / s, 1000.0 + s) for s in steps]


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failing_sink_is_retried_warned_once_and_sent_everything_once() -> None:
    sink = ScriptedSink(open_failures=2, log_failures=2)
    mirror, warnings, events = mirror_of(sink)
    mirror.put(points(range(1, 4)))
    mirror.put(points(range(4, 6)))
    mirror.tag("last_checkpoint", "/ckpt/step-5")
    wait_for(lambda: len(sink.points) == 5)
    mirror.close("succeeded")
    assert sink.points == points(range(1, 6))  # in order, none twice
    assert [(c, s) for c, s, _ in warnings] == [("metric_sink_scripted", 5)]
    assert "connection refused" in warnings[0][2]
    assert any("reachable again" in e for e in events)
    assert sink.tags == {"last_checkpoint": "/ckpt/step-5"} and sink.closed == "succeeded"


def test_a_sink_that_never_opens_says_how_many_points_it_missed() -> None:
    sink = ScriptedSink(open_failures=10**9)
    mirror, warnings, _ = mirror_of(sink)
    mirror.put(points(range(1, 8)))
    wait_for(lambda: warnings)
    mirror.close("failed")
    assert [c for c, _, _ in warnings] == ["metric_sink_scripted", "metric_sink_scripted_incomplete"]
    assert warnings[1][2].startswith("7 metric points were not sent")
    assert sink.closed is None  # never opened: nothing to close


def test_a_hanging_sink_never_holds_up_the_training_side() -> None:
    gate = threading.Event()
    sink = ScriptedSink(gate=gate)
    mirror, _, _ = mirror_of(sink)
    mirror.put(points(range(1, 2)))
    time.sleep(0.1)  # the thread is now stuck in log()
    started = time.monotonic()
    for step in range(2, 2000):
        mirror.put(points(range(step, step + 1)))
    assert time.monotonic() - started < 2.0  # put only queues (a blocked put would never return)
    gate.set()
    mirror.close("succeeded")
    assert [p.step for p in sink.points] == list(range(1, 2000))


# -- real servers -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` with a SQLite backend store on a free loopback port."""
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host=127.0.0.1",
        f"--port={port}",
        "--workers=1",
        f"--backend-store-uri=sqlite:///{work / 'mlflow.db'}",
        f"--default-artifact-root={work / 'artifacts'}",
    ]
    env = os.environ | {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    log = (work / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (work / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not answer in 120 s"
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield uri
    finally:  # killed: its graceful stop (2.5 s alone, up to 7 s beside the suite) is not what is tested
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def trained(factory: sessionmaker[Session], settings: Settings, spec: dict[str, Any]) -> Run:
    """``spec`` (its dataset made of ROWS) run to success by the worker's own execute_run and real loop."""
    with factory.begin() as s:
        ds = make_dataset(s, rows=ROWS)
        spec["dataset_id"] = str(ds.id)
        run_id = make_run(s, ds, spec=spec).id
    assert execute_run(run_id, session_factory=factory, settings=settings) == "succeeded"
    with factory() as s:
        return s.get_one(Run, run_id)


def rlrun_points(factory: sessionmaker[Session], run_id: uuid.UUID) -> dict[tuple[str, int], float]:
    with factory() as s:
        rows = s.scalars(select(Metric).where(Metric.run_id == run_id))
        return {(m.key, m.step): m.value for m in rows}


def mlflow_points(
    uri: str, experiment: str, run_id: uuid.UUID, keys: set[str]
) -> tuple[Any, dict[tuple[str, int], float]]:
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlrun.run_id` = '{run_id}'")
    assert len(found) == 1
    mrun = found[0]
    out: dict[tuple[str, int], float] = {}
    for key in keys:
        for m in client.get_metric_history(mrun.info.run_id, mlflow_name(key)):
            assert (key, m.step) not in out, f"{key} at step {m.step} logged twice"
            out[(key, m.step)] = m.value
    return mrun, out


def same(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], b[k])


def test_a_real_run_mirrors_every_point_to_mlflow_and_wandb(
    committing_factory: sessionmaker[Session], tmp_path: Path, mlflow_uri: str
) -> None:
    settings = Settings(home=tmp_path)
    experiment = f"tests-{uuid.uuid4().hex[:8]}"
    spec = dpo_spec(uuid.uuid4(), eval_every=2) | {
        "name": "mirrored",
        "validation_fraction": 0.25,
        "metric_sinks": [
            {"type": "mlflow", "tracking_uri": mlflow_uri, "experiment": experiment},
            {"type": "wandb", "project": "rlrun-tests", "mode": "offline", "tags": ["ci"]},
        ],
    }
    run = trained(committing_factory, settings, spec)
    run_id = run.id
    ours = rlrun_points(committing_factory, run_id)
    keys = {k for k, _ in ours}
    assert {"loss", "eval/loss"} <= keys and {s for _, s in ours} == {1, 2, 3}
    assert run.warnings in (None, [])

    mrun, theirs = mlflow_points(mlflow_uri, experiment, run_id, keys)
    same(ours, theirs)
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "mirrored"
    assert mrun.data.params["hyperparameters.max_steps"] == "3"
    assert mrun.data.params["validation_fraction"] == "0.25"
    assert mrun.data.tags["rlrun.output_path"] == run.output_path
    assert mrun.data.tags["rlrun.last_checkpoint"].endswith("step-00000003")

    runs_dir = settings.resolved_artifacts_dir / "runs" / str(run_id) / "wandb"
    (folder,) = runs_dir.glob(f"offline-run-*-{run_id.hex}")
    records = wandb_records(folder)
    history: dict[tuple[str, int], float] = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            step = int(item["rlrun_step"])
            for k, v in item.items():
                if not k.startswith("_") and k != "rlrun_step":
                    assert (k, step) not in history
                    history[(k, step)] = float(v)
    same(ours, history)
    (config,) = [r["run"]["config"]["update"] for r in records if r["type"] == "run"]
    assert config["hyperparameters"]["max_steps"] == 3 and config["name"] == "mirrored"
    summary: dict[str, Any] = {}
    for r in records:
        if r["type"] == "summary":
            summary |= r["summary"]["update"]
    assert summary["rlrun_output_path"] == run.output_path
    assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]


def test_a_sink_on_a_closed_port_warns_and_export_metrics_sends_the_run_later(
    committing_factory: sessionmaker[Session], tmp_path: Path, mlflow_uri: str
) -> None:
    settings = Settings(home=tmp_path)
    closed = f"http://127.0.0.1:{free_port()}"
    spec = dpo_spec(uuid.uuid4()) | {"metric_sinks": [{"type": "mlflow", "tracking_uri": closed}]}
    run = trained(committing_factory, settings, spec)
    run_id = run.id
    codes = [w["code"] for w in run.warnings]
    assert codes == ["metric_sink_mlflow", "metric_sink_mlflow_incomplete"]
    assert closed in run.warnings[0]["message"]
    ours = rlrun_points(committing_factory, run_id)
    assert {s for k, s in ours if k == "loss"} == {1, 2, 3}

    app = create_app(settings, session_factory=committing_factory, enqueue=FakeEnqueue())
    with serving(app) as url:
        args = ["runs", "export-metrics", str(run_id), "--url", url]
        assert main([*args, "--mlflow-uri", mlflow_uri, "--mlflow-experiment", "exported"]) == 0
        assert main(args) == 1  # no sink named: an error, nothing sent
        again = main([*args, "--mlflow-uri", mlflow_uri, "--mlflow-experiment", "exported"])
        assert again == 0  # the same MLflow run, reopened, sent only what it lacked: nothing
    mrun, theirs = mlflow_points(mlflow_uri, "exported", run_id, {k for k, _ in ours})
    same(ours, theirs)  # mlflow_points refuses a (key, step) logged twice
    assert mrun.info.status == "FINISHED" and mrun.data.tags["rlrun.output_path"] == run.output_path


def test_a_bad_sink_is_refused_naming_its_field_and_stores_nothing(session: Session) -> None:
    ds = make_dataset(session)
    bad = [
        ([{"type": "mlflow", "tracking_uri": "ftp://x"}], "metric_sinks.0.mlflow.tracking_uri"),
        ([{"type": "neptune"}], "metric_sinks.0.type"),
        ([{"type": "wandb", "project": "a b"}], "metric_sinks.0.wandb.project"),
    ]
    with api_client(session) as client:
        for sinks, field in bad:
            resp = client.post("/v1/runs", json=dpo_spec(ds.id) | {"metric_sinks": sinks})
            assert resp.status_code == 422, resp.text
            assert resp.json()["error"]["field"] == field, resp.json()
    assert session.scalars(select(Run).where(Run.dataset_id == ds.id)).all() == []
