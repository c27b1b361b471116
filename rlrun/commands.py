"""The user's CLI over the REST API: ``rlrun datasets ...``, ``rlrun runs ...``, ``rlrun environments ...``
and ``rlrun models ...``, built on :class:`rlrun.Client`.

Every command takes ``--url`` (default ``$RLRUN_URL`` or http://127.0.0.1:8000) and ``--api-key``
(default ``$RLRUN_API_KEY``). Errors print ``error: <message> (field: <field>)`` on stderr and exit 1,
never a traceback. The client is imported when a command runs, so ``rlrun serve`` and ``rlrun worker``
do not pay for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rlrun.terminal import (
    HealthWarning,
    WatchState,
    format_value,
    human_bytes,
    key_metrics,
    percent,
    phase_text,
    progress_cell,
    progress_line,
    redraw,
    status_line,
    warning_text,
    watch_frame,
)

if TYPE_CHECKING:
    from rlrun.client import Client
    from rlrun.errors import ApiError
    from rlrun.schemas import DatasetRead, RunRead
    from trainer.metric_sinks import Point, Sink

Handler = Callable[[argparse.Namespace, "Client"], int]
SPARK_WIDTH = 32
KEY_LIMIT = 6
# = rlrun.schemas.DatasetKind (a test keeps them equal)
KINDS = ("preference", "sft", "ranking", "prompts", "unpaired")
SKIPPED_SHOWN = 5  # skipped lines printed after an upload with --skip-invalid
LOCAL_LINE_BYTES = 8 * 1024 * 1024  # the server's default RLRUN_MAX_LINE_BYTES, for the local --kind check


class CliError(Exception):
    """A problem on this side (a spec file that does not parse): printed as ``error: <message>``."""


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``datasets``, ``environments``, ``runs`` and ``models`` on the ``rlrun`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=None, help="server URL (default: $RLRUN_URL or http://127.0.0.1:8000)"
    )
    common.add_argument("--api-key", default=None, help="API key (default: $RLRUN_API_KEY)")

    datasets = sub.add_parser("datasets", help="upload and list datasets (on a running server)")
    ds_sub = datasets.add_subparsers(dest="datasets_command", required=True)
    upload = ds_sub.add_parser("upload", parents=[common], help="upload a JSONL file (streamed)")
    upload.add_argument("file", help="JSONL file, one row a line")
    upload.add_argument(
        "--kind",
        default=None,
        choices=KINDS,
        help="default: detected by the server from the first lines; a kind the first lines plainly do not "
        "fit is refused here, before anything is sent",
    )
    upload.add_argument("--name", default=None, help="default: the file name")
    upload.add_argument(
        "--skip-invalid",
        action="store_true",
        help="store the valid rows and list the invalid lines (default: any invalid line refuses the upload)",
    )
    upload.add_argument("-q", "--quiet", action="store_true", help="print only the dataset id")
    upload.set_defaults(func=_command(cmd_datasets_upload))
    ds_list = ds_sub.add_parser("list", parents=[common], help="datasets, newest first")
    ds_list.add_argument("--limit", type=int, default=20)
    ds_list.add_argument("--json", action="store_true", help="the API's JSON page")
    ds_list.set_defaults(func=_command(cmd_datasets_list))

    envs = sub.add_parser(
        "environments", help="store, list and delete environment code (on a running server)"
    )
    env_sub = envs.add_subparsers(dest="environments_command", required=True)
    env_create = env_sub.add_parser(
        "create", parents=[common], help="store a Python file with reset(row) and step(messages, row)"
    )
    env_create.add_argument("file", help="the environment's Python source")
    env_create.add_argument("--name", default=None, help="default: the file name")
    env_create.add_argument("-q", "--quiet", action="store_true", help="print only the environment id")
    env_create.set_defaults(func=_command(cmd_environments_create))
    env_list = env_sub.add_parser("list", parents=[common], help="environments, newest first")
    env_list.add_argument("--limit", type=int, default=20)
    env_list.add_argument("--json", action="store_true", help="the API's JSON page")
    env_list.set_defaults(func=_command(cmd_environments_list))
    env_delete = env_sub.add_parser("delete", parents=[common], help="delete one (runs keep their copy)")
    env_delete.add_argument("environment_id")
    env_delete.set_defaults(func=_command(cmd_environments_delete))

    runs = sub.add_parser("runs", help="create, list, watch and cancel runs (on a running server)")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    create = runs_sub.add_parser("create", parents=[common], help="submit a run spec; prints the run id")
    create.add_argument("-f", "--file", required=True, help="run spec, YAML or JSON ('-': stdin)")
    create.add_argument(
        "--idempotency-key", default=None, help="a retry with the same key returns the same run"
    )
    create.add_argument("--watch", action="store_true", help="then watch it until it ends")
    create.add_argument("--interval", type=float, default=1.0, help="seconds between polls with --watch")
    create.set_defaults(func=_command(cmd_runs_create))
    runs_list = runs_sub.add_parser("list", parents=[common], help="runs, newest first")
    runs_list.add_argument("--status", default=None, help="only runs in this status")
    runs_list.add_argument(
        "--flagged", action="store_true", help="only runs with health warnings (marked ⚠n in the list)"
    )
    runs_list.add_argument("--limit", type=int, default=20)
    runs_list.add_argument("--all", action="store_true", help="every run (all pages)")
    runs_list.add_argument("--json", action="store_true", help="the API's JSON")
    runs_list.set_defaults(func=_command(cmd_runs_list))
    get = runs_sub.add_parser("get", parents=[common], help="one run: status, progress, key metrics")
    get.add_argument("run_id")
    get.add_argument("--json", action="store_true", help="the API's JSON")
    get.set_defaults(func=_command(cmd_runs_get))
    watch = runs_sub.add_parser(
        "watch", parents=[common], help="live status and key metrics; exit 0 if the run succeeds"
    )
    watch.add_argument("run_id")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    watch.set_defaults(func=_command(cmd_runs_watch))
    cancel = runs_sub.add_parser("cancel", parents=[common], help="cancel a queued or running run")
    cancel.add_argument("run_id")
    cancel.set_defaults(func=_command(cmd_runs_cancel))
    download = runs_sub.add_parser(
        "download", parents=[common], help="a succeeded run's model as a tar (progress on stderr)"
    )
    download.add_argument("run_id")
    download.add_argument(
        "-o", "--output", default=None, help="file to write (default: <run id>-<format>.tar)"
    )
    download.add_argument(
        "--format",
        choices=("hf", "adapter"),
        default="hf",
        help="hf: a Hugging Face model folder (an adapter run's adapter merged into its base by a merge "
        "run, made and waited for when there is none); adapter: an adapter run's LoRA adapter",
    )
    download.set_defaults(func=_command(cmd_runs_download))
    export = runs_sub.add_parser(
        "export-metrics",
        parents=[common],
        help="send a run's metrics, spec and paths to MLflow and/or W&B, after the fact",
        description="Every metric point of the run (read from the server at full resolution), its stored "
        "spec as params/config and its output path, to an MLflow tracking server and/or a W&B run; a "
        "run mirrored live before continues in the same MLflow run, which gets only the points it lacks. "
        "Needs `mlflow` and/or `wandb` "
        "installed here.",
    )
    export.add_argument("run_id")
    export.add_argument("--mlflow-uri", default=None, help="MLflow tracking URI (http(s)://... or file:...)")
    export.add_argument("--mlflow-experiment", default="rlrun", help="MLflow experiment (default: rlrun)")
    export.add_argument("--wandb-project", default=None, help="W&B project")
    export.add_argument("--wandb-entity", default=None, help="W&B entity")
    export.add_argument("--wandb-mode", choices=("online", "offline"), default="online")
    export.add_argument(
        "--wandb-dir", default=".", help="folder an offline W&B run is written under (default: here)"
    )
    export.set_defaults(func=_command(cmd_runs_export_metrics))

    models = sub.add_parser("models", help="list models; import a GGUF file, a folder or a catalog model")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_list = models_sub.add_parser("list", parents=[common], help="presets, model folders, run models")
    models_list.add_argument("--json", action="store_true", help="print the API's JSON")
    models_list.set_defaults(func=_command(cmd_models_list))
    models_import = models_sub.add_parser(
        "import",
        parents=[common],
        help="make a model folder on the server from a .gguf file, a safetensors folder or a catalog model",
    )
    models_import.add_argument(
        "source",
        help="a catalog name (smollm2-135m-instruct) or a path on the server inside its model roots; a "
        "relative path that exists here is sent as an absolute one",
    )
    models_import.add_argument("--name", default=None, help="the model's name (default: from the source)")
    models_import.set_defaults(func=_command(cmd_models_import))


def _command(handler: Handler) -> Callable[[argparse.Namespace], int]:
    """``handler(args, client)`` with a client for ``--url``/``--api-key`` and every expected failure
    turned into one ``error:`` line and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        # `rlrun` logs at INFO for the server commands; here that would print every HTTP request.
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.WARNING)
        try:
            return _run(handler, args)
        finally:
            root.setLevel(level)  # called in-process (tests, scripts): leave logging as it was

    return run


def _run(handler: Handler, args: argparse.Namespace) -> int:
    from rlrun.client import Client
    from rlrun.errors import ApiError, RlrunError

    try:
        with Client(args.url, args.api_key) as client:
            return handler(args, client)
    except ApiError as exc:
        _print_api_error(exc)
    except RlrunError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except OSError as exc:  # a missing or unreadable file
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1


def _print_api_error(exc: ApiError) -> None:
    field = f" (field: {exc.field})" if exc.field else ""
    print(f"error: {exc.message}{field}", file=sys.stderr)
    details = exc.details if len(exc.details) > 1 or any(d.line for d in exc.details) else []
    for d in details:
        where = "".join((f"line {d.line}: " if d.line else "", f"{d.field}: " if d.field else ""))
        print(f"  {where}{d.message}", file=sys.stderr)


# datasets


def cmd_datasets_upload(args: argparse.Namespace, client: Client) -> int:
    """Check a given ``--kind`` against the file's first lines, then upload with a progress bar on stderr;
    print the dataset id, then its stats (and the first skipped lines with ``--skip-invalid``)."""
    path = Path(args.file)
    if args.kind is not None:
        check_kind(path, args.kind)
    report = upload_progress(path.name, sys.stderr)
    dataset = client.datasets.upload(
        path, kind=args.kind, name=args.name, skip_invalid=args.skip_invalid, progress=report
    )
    print(dataset.id)
    if not args.quiet:
        print(_dataset_summary(dataset))
    return 0


def check_kind(path: Path, kind: str) -> None:
    """Raise ``CliError`` if the file's first lines plainly hold another kind of data than ``kind`` (none
    of them reads as ``kind`` and one reads as another kind): refused before a byte is sent, rather than
    after streaming a large file. Lines that fit no kind are left to the server's line-by-line report."""
    from rlrun.formats import kind_mismatch, upload_lines

    with path.open("rb") as fh:
        found = kind_mismatch(upload_lines(fh, LOCAL_LINE_BYTES), kind)
    if found is not None:
        raise CliError(
            f"{path}: line {found.line} is not {kind} data ({found.reason}) but reads as {found.fits} data: "
            f"pass --kind {found.fits}, or leave --kind out and the server detects the kind"
        )


def upload_progress(label: str, out: TextIO) -> Callable[[int, int], None]:
    """Redraw one line on a terminal; elsewhere print a line at 0, 25, 50, 75 and 100 %."""
    tty = out.isatty()
    printed: set[int] = set()

    def report(sent: int, total: int) -> None:
        if tty:  # back to the line's start, draw, clear what a longer previous line left
            out.write("\r" + progress_line(label, sent, total) + "\x1b[K")
            if sent >= total:
                out.write("\n")
        else:
            quarter = percent(sent, total) // 25
            if quarter in printed:
                return
            printed.add(quarter)
            out.write(progress_line(label, sent, total) + "\n")
        out.flush()

    return report


def _dataset_summary(ds: DatasetRead) -> str:
    stats = ds.stats
    lines = [
        f"name     {ds.name}",
        f"kind     {ds.kind}",
        *(["         (detected from the first lines: no --kind given)"] if ds.kind_detected else []),
        f"rows     {ds.row_count} ({stats.exact_duplicates} exact duplicates)",
        f"size     {human_bytes(ds.size_bytes)}",
        "formats  " + ", ".join(f"{k} {v}" for k, v in stats.source_formats.items()),
    ]
    if stats.lengths:
        lengths = "; ".join(f"{k} mean {v.mean:.1f} max {v.max}" for k, v in stats.lengths.items())
        lines.append(f"lengths  {lengths} (characters)")
    if stats.flags:
        lines.append("flags    " + ", ".join(f"{k} {v}" for k, v in stats.flags.items()))
    if ds.skipped_count:
        lines.append(f"skipped  {ds.skipped_count} invalid line(s), not stored:")
        lines += [
            f"  line {s.line}: " + (f"{s.field}: " if s.field else "") + s.reason
            for s in (ds.skipped or [])[:SKIPPED_SHOWN]
        ]
        if ds.skipped_count > SKIPPED_SHOWN:
            lines.append(f"  ... all of them: GET /v1/datasets/{ds.id}/skipped")
    return "\n".join(lines)


def cmd_datasets_list(args: argparse.Namespace, client: Client) -> int:
    page = client.datasets.list(limit=args.limit)
    if args.json:
        print(page.model_dump_json(indent=2))
        return 0
    print(f"{'ID':36}  {'KIND':10}  {'ROWS':>8}  {'CREATED':16}  NAME")
    for ds in page.data:
        print(f"{ds.id}  {ds.kind:10}  {ds.row_count:>8}  {ds.created_at:%Y-%m-%d %H:%M}  {ds.name}")
    return _more_hint(page.has_more, args.limit)


def _more_hint(has_more: bool, limit: int) -> int:
    """After a listed page: how to see more (on stderr), when there is more; the command's exit code."""
    if has_more:
        print(f"(more: --limit {limit * 2})", file=sys.stderr)
    return 0


# environments


def cmd_environments_create(args: argparse.Namespace, client: Client) -> int:
    """Print the new environment's id (what a spec's ``environment.id`` takes)."""
    path = Path(args.file)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {args.file}: {exc}") from None
    env = client.environments.create(source, name=args.name or path.name)
    print(env.id if args.quiet else f"{env.id}  {env.name}")
    return 0


def cmd_environments_list(args: argparse.Namespace, client: Client) -> int:
    page = client.environments.list(limit=args.limit)
    if args.json:
        print(page.model_dump_json(indent=2))
        return 0
    print(f"{'ID':36}  {'CREATED':16}  NAME")
    for env in page.data:
        print(f"{env.id}  {env.created_at:%Y-%m-%d %H:%M}  {env.name}")
    return _more_hint(page.has_more, args.limit)


def cmd_environments_delete(args: argparse.Namespace, client: Client) -> int:
    client.environments.delete(args.environment_id)
    print(f"deleted {args.environment_id}")
    return 0


# models


def cmd_models_list(args: argparse.Namespace, client: Client) -> int:
    models = client.models.list()
    if args.json:
        print(json.dumps([m.model_dump(mode="json") for m in models], indent=2))
        return 0
    print(f"{'MODEL':44}  {'SOURCE':10}  {'PARAMETERS':>12}  FROM")
    for m in models:
        size = f"{m.parameters:,}" if m.parameters is not None else "-"
        print(f"{m.id:44}  {m.source:10}  {size:>12}  {m.imported_from or m.algorithm or ''}")
    return 0


def cmd_models_import(args: argparse.Namespace, client: Client) -> int:
    """Print the new model's name (what a spec's ``model`` takes), then its size and origin."""
    source = args.source
    local = Path(source).expanduser()
    if not source.startswith(("/", "~")) and (local.exists() or source.startswith(("./", "../"))):
        source = str(local.resolve())  # the server resolves paths itself, not against this directory
    print(f"importing {args.source} (a 135M GGUF takes about 30 s) ...", file=sys.stderr)
    model = client.models.import_model(source, name=args.name)
    print(model.id)
    size = f"{model.parameters:,} parameters" if model.parameters is not None else "size unknown"
    print(f"  {size}; from {model.imported_from}", file=sys.stderr)
    return 0


# runs


def load_spec(path: str, stdin: TextIO | None = None) -> dict[str, Any]:
    """A run spec from a YAML or JSON file (``.json``: JSON; otherwise YAML, which reads JSON too)."""
    import yaml

    text = (stdin or sys.stdin).read() if path == "-" else Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise CliError(f"{path}: invalid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path}: a run spec is a mapping (algorithm, model, dataset_id, ...)")
    return data


def cmd_runs_create(args: argparse.Namespace, client: Client) -> int:
    run = client.runs.create(load_spec(args.file), idempotency_key=args.idempotency_key)
    print(run.id, flush=True)
    if args.watch:
        return watch_run(client, str(run.id), interval=args.interval)
    return 0


def cmd_runs_list(args: argparse.Namespace, client: Client) -> int:
    flagged = True if args.flagged else None
    if args.all:
        runs, more = list(client.runs.iter(status=args.status, flagged=flagged)), False
    else:
        page = client.runs.list(status=args.status, limit=args.limit, flagged=flagged)
        runs, more = page.data, page.has_more
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in runs], indent=2))
        return 0
    print(runs_table(runs))
    if more:
        print(f"(more: --limit {args.limit * 2} or --all)", file=sys.stderr)
    return 0


def runs_table(runs: list[RunRead]) -> str:
    """``runs list``: a header, then one line per run; ``⚠n`` in WARN for a run with n warnings, and
    PROGRESS as :func:`rlrun.terminal.progress_cell` has it (its long phase while one is under way)."""
    lines = [f"{'ID':36}  {'STATUS':9}  {'ALGORITHM':18}  {'PROGRESS':>16}  {'WARN':4}  {'CREATED':16}  NAME"]
    for r in runs:
        p = r.progress
        progress = progress_cell(p.step, p.total_steps, p.phase, p.done, p.total)
        flag = f"⚠{len(r.warnings)}" if r.warnings else ""
        created = f"{r.created_at:%Y-%m-%d %H:%M}"
        line = f"{r.id}  {r.status:9}  {r.algorithm:18}  {progress:>16}  {flag:4}  {created}  {r.name or ''}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def cmd_runs_get(args: argparse.Namespace, client: Client) -> int:
    run = client.runs.get(args.run_id)
    if args.json:
        print(run.model_dump_json(indent=2))
        return 0
    keys = client.runs.metric_keys(run.id)
    shown = key_metrics(keys, KEY_LIMIT) + [k for k in keys if k.startswith("final/")]
    last = {k: v[-1] for k, v in _series(client, str(run.id), shown, max_points=4).items() if v}
    print(run_summary(run, last))
    return 0


def run_summary(run: RunRead, last_metrics: dict[str, float]) -> str:
    """``runs get``: one ``label  value`` line per fact, then the last value of each key metric. Inside a
    long phase a ``phase`` line (``reference log-probs 120/1300``) stands for ``progress`` until the first
    step, and follows it after; each warning is a line (``zero_advantage at step 3: ...``)."""
    progress = run.progress
    steps = progress_cell(progress.step, progress.total_steps)
    progress_rows = [] if progress.phase is not None and progress.step == 0 else [("progress", steps)]
    if progress.phase is not None:
        progress_rows.append(("phase", phase_text(progress.phase, progress.done, progress.total)))
    rows = [
        ("id", str(run.id)),
        ("name", run.name or "-"),
        ("algorithm", run.algorithm),
        ("model", str(run.spec.get("model", "-"))),
        ("dataset", str(run.dataset_id or "-")),
        (
            "status",
            run.status + (" (cancel requested)" if run.cancel_requested and run.status == "running" else ""),
        ),
        *progress_rows,
        ("attempt", str(run.attempt)),
    ]
    if run.pipeline_id:
        rows.append(("pipeline", f"{run.pipeline_id} (stage {run.stage})"))
    for label, at in (
        ("created", run.created_at),
        ("started", run.started_at),
        ("finished", run.finished_at),
    ):
        rows.append((label, f"{at:%Y-%m-%d %H:%M:%S %Z}".strip() if at else "-"))
    if run.output_path:
        rows.append(("output", run.output_path))
    if run.error:
        rows.append(("error", run.error))
    for i, w in enumerate(health_warnings(run)):
        rows.append(("warnings" if i == 0 else "", warning_text(w)))
    lines = [f"{label:<10}{value}" for label, value in rows]
    if last_metrics:
        width = max(len(k) for k in last_metrics)
        lines.append("metrics   (last values)")
        lines += [f"  {k:<{width}}  {format_value(v)}" for k, v in last_metrics.items()]
    return "\n".join(lines)


def health_warnings(run: RunRead) -> list[HealthWarning]:
    return [HealthWarning(w.code, w.step, w.message) for w in run.warnings]


def watch_state(run: RunRead, series: dict[str, list[float]]) -> WatchState:
    """What the ``runs watch`` frame shows of ``run`` and its key ``series``."""
    return WatchState(
        run_id=str(run.id),
        status=run.status,
        step=run.progress.step,
        total_steps=run.progress.total_steps,
        algorithm=run.algorithm,
        model=str(run.spec.get("model", "-")),
        name=run.name,
        error=run.error,
        series=series,
        phase=run.progress.phase,
        phase_done=run.progress.done,
        phase_total=run.progress.total,
        warnings=health_warnings(run),
    )


def cmd_runs_cancel(args: argparse.Namespace, client: Client) -> int:
    run = client.runs.cancel(args.run_id)
    if run.status == "cancelled":
        print(f"run {run.id} cancelled")
    else:
        print(f"run {run.id}: cancel requested ({run.status}); it stops within seconds")
    return 0


def cmd_runs_download(args: argparse.Namespace, client: Client) -> int:
    """Write the run's export tar with a progress bar on stderr; print the file's path."""
    output = Path(args.output or f"{args.run_id}-{args.format}.tar")

    def merging(merge: Any) -> None:
        print(f"merging run {args.run_id}'s adapter into its base (merge run {merge.id})...", file=sys.stderr)

    written = client.runs.download(
        args.run_id,
        output,
        format=args.format,
        progress=upload_progress(output.name, sys.stderr),
        on_merge=merging,
    )
    print(f"{output} ({written} bytes; `tar -xf {output}` gives a folder from_pretrained loads)")
    return 0


EXPORT_PAGE = 10_000  # metric rows a page (the API's largest)


def cmd_runs_export_metrics(args: argparse.Namespace, client: Client) -> int:
    """Send the run's points to each sink named, a page of the API's rows at a time (memory bounded by
    the page, not the run), with the clients the worker's live mirror uses (trainer/metric_sinks.py). A
    sink's failure ends the export with one error line; run it again: MLflow gets only what it lacks."""
    from pydantic import ValidationError

    from trainer.metric_sinks import MlflowSink, RunIdentity, make_sink
    from trainer.specs.sinks import MetricSinkSpec, MlflowSinkSpec, WandbSinkSpec

    specs: list[MetricSinkSpec] = []
    try:
        if args.mlflow_uri:
            specs.append(
                MlflowSinkSpec(type="mlflow", tracking_uri=args.mlflow_uri, experiment=args.mlflow_experiment)
            )
        if args.wandb_project:
            specs.append(
                WandbSinkSpec(
                    type="wandb", project=args.wandb_project, entity=args.wandb_entity, mode=args.wandb_mode
                )
            )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(f"{first['loc'][0] if first['loc'] else 'sink'}: {first['msg']}") from None
    if not specs:
        raise CliError("name a sink: --mlflow-uri and/or --wandb-project")
    run = client.runs.get(args.run_id)
    identity = RunIdentity(run.id, run.algorithm, run.spec, Path(args.wandb_dir))
    sinks = [make_sink(spec, identity) for spec in specs]
    held: list[set[tuple[str, int]]] = []  # per sink: the (key, step) pairs it has already
    for sink in sinks:
        with _sink_failure_as_cli_error(sink):
            sink.open()
            held.append(
                sink.logged(client.runs.metric_keys(run.id)) if isinstance(sink, MlflowSink) else set()
            )
    sent = [0] * len(sinks)
    for points in _metric_pages(client, run.id):
        for i, sink in enumerate(sinks):
            fresh = [p for p in points if (p.key, p.step) not in held[i]]
            with _sink_failure_as_cli_error(sink):
                sink.log(fresh)
            sent[i] += len(fresh)
    for i, sink in enumerate(sinks):
        with _sink_failure_as_cli_error(sink):
            if run.output_path:
                sink.tag("output_path", run.output_path)
            sink.close(run.status)
        print(f"run {run.id}: {sent[i]} points sent to {sink.label} at {sink.where}")
    return 0


def _metric_pages(client: Client, run_id: Any) -> Iterator[list[Point]]:
    """Every metric point of the run, a page of EXPORT_PAGE rows at a time, in step order."""
    from trainer.metric_sinks import Point

    after: str | None = None
    while True:
        page = client.runs.metrics(run_id, limit=EXPORT_PAGE, after=after)
        yield [
            Point(m.key, m.step, m.value, m.logged_at.timestamp() if m.logged_at else time.time())
            for m in page.data
        ]
        if not page.has_more:
            return
        after = page.next_cursor


@contextmanager
def _sink_failure_as_cli_error(sink: Sink) -> Iterator[None]:
    """A sink's client missing or failing: one ``error:`` line naming the sink, never a traceback."""
    try:
        yield
    except ImportError as exc:
        raise CliError(
            f"{sink.label}: {exc.name or exc} is not installed here (pip install {sink.label})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any client's failure: one line, exit 1
        raise CliError(f"{sink.label} at {sink.where}: {type(exc).__name__}: {exc}") from None


def cmd_runs_watch(args: argparse.Namespace, client: Client) -> int:
    return watch_run(client, args.run_id, interval=args.interval)


def _series(client: Client, run_id: str, keys: list[str], max_points: int) -> dict[str, list[float]]:
    """Each key's values in step order (chart mode: at most ``max_points`` per key), in ``keys`` order."""
    if not keys:
        return {}
    points = client.runs.metrics(run_id, keys=keys, max_points=max_points).data
    by_key: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for m in points:
        by_key.setdefault(m.key, []).append((m.step, m.value))
    return {k: [v for _, v in sorted(pts)] for k, pts in by_key.items() if pts}


def watch_run(client: Client, run_id: str, *, interval: float = 1.0, out: TextIO | None = None) -> int:
    """Poll the run and its key metrics until it ends. On a terminal the frame is redrawn in place;
    otherwise one line is printed per change and the full frame at the end. Exit status: 0 if the run
    succeeded, 1 if it failed or was cancelled (its error on stderr)."""
    from rlrun.client import FINISHED

    out = out or sys.stdout
    tty = out.isatty()
    drawn, last_line = 0, ""
    while True:
        run = client.runs.get(run_id)  # status first: once it has ended, the metrics read next are complete
        keys = key_metrics(client.runs.metric_keys(run_id), KEY_LIMIT)
        state = watch_state(run, _series(client, run_id, keys, max_points=2 * SPARK_WIDTH))
        width = shutil.get_terminal_size((120, 24)).columns
        if tty:
            frame = watch_frame(state, width=width, spark_width=SPARK_WIDTH)
            out.write(redraw(frame, drawn))
            drawn = frame.count("\n") + 1
        elif (line := status_line(state)) != last_line:
            out.write(line + "\n")
            last_line = line
        out.flush()
        if run.status in FINISHED:
            break
        time.sleep(interval)
    if not tty:
        out.write(watch_frame(state, width=width, spark_width=SPARK_WIDTH) + "\n")
    if run.status == "succeeded":
        return 0
    reason = f": {run.error}" if run.error else ""
    print(f"error: run {run.id} {run.status}{reason}", file=sys.stderr)
    return 1
