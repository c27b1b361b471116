"""The two metric sinks a run can mirror to: an MLflow tracking server and Weights & Biases.

Each sink is the field's own client (``mlflow``'s ``MlflowClient``, ``wandb``), imported when a sink opens,
so a worker without them trains every run that names no sink. One interface, used live by the worker's
mirror thread (``trainer/sink_mirror.py``) and after the fact by ``rlrun runs export-metrics``:
``open()``, ``log(points)``, ``tag(name, value)``, ``close(status)``; each may raise, and the caller decides
what a failure means (the mirror retries, the CLI reports).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from trainer.specs.sinks import MetricSinkSpec, MlflowSinkSpec, WandbSinkSpec

MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
MLFLOW_PARAMS_BATCH = 100  # ... and of params
MLFLOW_PARAM_LENGTH = 6000  # longest param value MLflow stores
WANDB_STEP_KEY = "rlrun_step"  # the x axis of every W&B chart of an rlrun run (define_metric)
# MLflow names may hold letters, digits and _ - . / space : only (mlflow.utils.validation)
_MLFLOW_BAD = re.compile(r"[^\w./\- :]")


class Point(NamedTuple):
    key: str
    step: int
    value: float
    time: float  # unix seconds, when it was logged


@dataclass(frozen=True)
class RunIdentity:
    """What every sink is told about the rlrun run it mirrors."""

    run_id: uuid.UUID
    algorithm: str
    spec: dict[str, Any]  # the resolved spec, as stored: the params/config
    folder: Path  # where an offline W&B run is written (the worker: the run's <artifacts>/runs/<id>)

    @property
    def name(self) -> str | None:
        name: str | None = self.spec.get("name")
        return name

    @property
    def tags(self) -> dict[str, str]:
        return {"rlrun.algorithm": self.algorithm, "rlrun.model": str(self.spec.get("model", ""))}


class Sink(Protocol):
    label: str  # "mlflow" or "wandb": names the sink in warnings

    @property
    def where(self) -> str:
        """Where the points go, for a warning a user can act on."""

    def open(self) -> None: ...

    def log(self, points: Sequence[Point]) -> None: ...

    def tag(self, name: str, value: str) -> None: ...

    def close(self, status: str) -> None: ...


def mlflow_name(key: str) -> str:
    """``key`` as MLflow accepts it: ``@`` becomes ``_at_`` (``eval/pass@4`` -> ``eval/pass_at_4``), any
    other character outside letters, digits and ``_ - . / : `` and space becomes ``_``."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


def flat_params(spec: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested spec JSON -> ``{"hyperparameters.learning_rate": "0.001", ...}``: dicts are walked, lists and
    scalars written as JSON (strings bare), each cut at MLflow's longest value."""
    out: dict[str, str] = {}
    for k, v in spec.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_params(v, name + "."))
            continue
        text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        out[name] = text[:MLFLOW_PARAM_LENGTH]
    return out


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _quiet_mlflow_http() -> None:
    """MLflow's client retries a refused connection for minutes by default (7 retries, backoff 2): the
    mirror retries on its own schedule instead, so one try per call and a short timeout, unless the
    worker's environment says otherwise."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")


class MlflowSink:
    """One MLflow run per rlrun run, found again by its ``rlrun.run_id`` tag (a resumed attempt, or an
    export after the live mirror, continues the same MLflow run)."""

    label = "mlflow"

    def __init__(self, spec: MlflowSinkSpec, run: RunIdentity):
        self.spec, self.run = spec, run
        self.client: Any = None
        self.mlflow_run_id: str | None = None

    @property
    def where(self) -> str:
        return f"{self.spec.tracking_uri} (experiment {self.spec.experiment!r})"

    def open(self) -> None:
        _quiet_mlflow_http()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        experiment_id = self._experiment(client)
        rid = str(self.run.run_id)
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`rlrun.run_id` = '{rid}'", max_results=1
        )
        if found:  # a resumed attempt, or an export after the live mirror: the same MLflow run, running again
            run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
        else:
            name = self.spec.run_name or self.run.name or rid
            tags = {"rlrun.run_id": rid, **self.run.tags}
            run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
            params = [Param(mlflow_name(k), v) for k, v in flat_params(self.run.spec).items()]
            for part in chunks(params, MLFLOW_PARAMS_BATCH):
                client.log_batch(run_id, params=list(part))
        self.client, self.mlflow_run_id = client, run_id

    def _experiment(self, client: Any) -> str:
        found = client.get_experiment_by_name(self.spec.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(self.spec.experiment))
        except Exception:  # another worker created it meanwhile
            again = client.get_experiment_by_name(self.spec.experiment)
            if again is None:
                raise
            return str(again.experiment_id)

    def logged(self, keys: Sequence[str]) -> set[tuple[str, int]]:
        """The (key, step) pairs the MLflow run holds already: what an export after a live mirror (a sink
        down for a while, say) need not send again. One history read per key."""
        return {
            (key, m.step)
            for key in keys
            for m in self.client.get_metric_history(self.mlflow_run_id, mlflow_name(key))
        }

    def log(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(mlflow_name(p.key), p.value, int(p.time * 1000), p.step) for p in points]
        for part in chunks(metrics, MLFLOW_BATCH):
            self.client.log_batch(self.mlflow_run_id, metrics=list(part))

    def tag(self, name: str, value: str) -> None:
        self.client.set_tag(self.mlflow_run_id, f"rlrun.{mlflow_name(name)}", value)

    def close(self, status: str) -> None:
        """The MLflow run's end state from the rlrun run's status (a run not ended yet stays RUNNING)."""
        state = {"succeeded": "FINISHED", "cancelled": "KILLED", "failed": "FAILED"}.get(status)
        if state is not None:
            self.client.set_terminated(self.mlflow_run_id, state)


class WandbSink:
    """One W&B run per rlrun run, id = the rlrun id's hex (``resume="allow"``: a resumed attempt goes on
    in the same run). Every chart's x axis is ``rlrun_step`` (``define_metric``, as transformers'
    WandbCallback does with its global step), so points that arrive out of step order are kept, where
    ``log(step=...)`` would drop any step below the last one."""

    label = "wandb"

    def __init__(self, spec: WandbSinkSpec, run: RunIdentity):
        self.spec, self.run = spec, run
        self.directory = run.folder
        self.wb_run: Any = None

    @property
    def where(self) -> str:
        mode = "offline, in " + str(self.directory / "wandb") if self.spec.mode == "offline" else "online"
        return f"project {self.spec.project!r} ({mode})"

    def open(self) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",  # never capture the worker's stdout
            save_code=False,
            disable_git=True,
            silent=True,
            x_disable_stats=True,  # the worker's system metrics are not the run's
            x_save_requirements=False,
            init_timeout=30.0,
        )
        run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            name=self.spec.name or self.run.name or str(self.run.run_id),
            id=self.run.run_id.hex,
            resume="allow",
            mode=self.spec.mode,
            dir=str(self.directory),
            config=self.run.spec,
            tags=list(self.spec.tags) or None,
            reinit="create_new",
            settings=settings,
        )
        run.define_metric(WANDB_STEP_KEY)
        run.define_metric("*", step_metric=WANDB_STEP_KEY)
        self.wb_run = run

    def log(self, points: Sequence[Point]) -> None:
        by_step: dict[int, dict[str, float]] = defaultdict(dict)
        for p in points:
            by_step[p.step][p.key] = p.value
        for step in sorted(by_step):
            self.wb_run.log({WANDB_STEP_KEY: step, **by_step[step]})

    def tag(self, name: str, value: str) -> None:
        self.wb_run.summary[f"rlrun_{name}"] = value

    def close(self, status: str) -> None:
        self.wb_run.finish(exit_code=1 if status in ("failed", "cancelled") else 0)


def make_sink(spec: MetricSinkSpec, run: RunIdentity) -> Sink:
    if isinstance(spec, MlflowSinkSpec):
        return MlflowSink(spec, run)
    return WandbSink(spec, run)
