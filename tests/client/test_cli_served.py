"""The `rlrun datasets ...` / `rlrun runs ...` commands against a real `rlrun serve` (API + one worker)
with auth on: `rlrun.cli.main` called in-process, and the entry point in real processes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlrun import Client
from rlrun.cli import main
from rlrun.commands import watch_run
from rlrun.demo import addition_pairs
from rlrun.schemas import DatasetRead, RunRead
from rlrun.terminal import progress_line
from tests.client.helpers import dpo
from tests.factories import jsonl
from tests.integration.flow import create_key, embedded_server
from tests.models.gguf_files import write_llama_gguf
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.ports import free_port

pytestmark = [pytest.mark.slow]
SPARK = "[▁▂▃▄▅▆▇█]"
MAX_UPLOAD = 1 << 20


@dataclass(frozen=True)
class Served:
    url: str
    key: str
    home: Path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLRUN_")}
    return env | extra


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("cli")
    with embedded_server(home, env={"RLRUN_AUTH": "on", "RLRUN_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}) as http:
        yield Served(url=str(http.base_url).rstrip("/"), key=create_key(home, "cli-tests"), home=home)


@pytest.fixture(autouse=True)
def api_key(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands read the key from RLRUN_API_KEY; each call below passes --url explicitly."""
    monkeypatch.delenv("RLRUN_URL", raising=False)
    monkeypatch.setenv("RLRUN_API_KEY", served.key)


@pytest.fixture(scope="module")
def rl(served: Served) -> Iterator[Client]:
    with Client(served.url, api_key=served.key) as client:
        yield client


@pytest.fixture(scope="module")
def finished_run(rl: Client, pairs: DatasetRead) -> RunRead:
    return rl.runs.wait(rl.runs.create(dpo(pairs.id, 10)).id, timeout=120, interval=0.2)


def test_datasets_upload_prints_progress_then_the_id_and_stats(
    served: Served, rl: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(jsonl(addition_pairs(64)))
    size = path.stat().st_size
    assert main(["datasets", "upload", str(path), "--name", "adds", "--url", served.url]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    dataset_id = uuid.UUID(lines[0])
    assert "kind     preference" in lines and "rows     64 (0 exact duplicates)" in lines
    # Not a terminal: a line at 0 % and at 100 % (the file is one chunk).
    assert err.splitlines() == [
        progress_line("pairs.jsonl", 0, size),
        progress_line("pairs.jsonl", size, size),
    ]
    assert "100%" in err and "█" * 24 in err
    assert rl.datasets.get(dataset_id).row_count == 64
    assert main(["datasets", "list", "--url", served.url]) == 0
    assert re.search(rf"^{dataset_id}  preference\s+64  .*  adds$", capsys.readouterr().out, re.M)


def test_create_from_yaml_then_watch_until_it_succeeds(
    served: Served, pairs: DatasetRead, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "algorithm: dpo\n"
        "model: tiny:llama-0.4m\n"
        f"dataset_id: {pairs.id}\n"
        "hyperparameters:\n"
        "  learning_rate: 0.001\n"
        "  max_steps: 10\n"
        "  batch_size: 8\n"
    )
    assert main(["runs", "create", "-f", str(spec), "--url", served.url]) == 0
    run_id = uuid.UUID(capsys.readouterr().out.strip())
    assert main(["runs", "watch", str(run_id), "--interval", "0.2", "--url", served.url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert re.search(r"^succeeded  step 10/10  rewards/accuracy=\S+  rewards/margin=\S+  loss=\S+", out, re.M)
    assert f"run {run_id}  dpo  tiny:llama-0.4m\nstatus  succeeded\nstep    10/10  {'█' * 24}  100%\n" in out
    for key in ("rewards/accuracy", "rewards/margin", "loss", "rewards/chosen"):
        # name, last value, a sparkline of the 10 steps (constant series are allowed: ▄▄▄...)
        assert re.search(rf"^{key}\s+-?[\d.e+-]+  {SPARK}{{10}}$", out, re.M), (key, out)


def test_runs_list_and_get(served: Served, finished_run: RunRead, capsys: pytest.CaptureFixture[str]) -> None:
    run_id = finished_run.id
    assert main(["runs", "list", "--url", served.url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ID  ") and re.search(rf"^{run_id}  succeeded  dpo\s+10/10  ", out, re.M)
    assert main(["runs", "list", "--status", "cancelled", "--url", served.url]) == 0
    assert str(run_id) not in capsys.readouterr().out
    assert main(["runs", "get", str(run_id), "--url", served.url]) == 0
    out = capsys.readouterr().out
    assert f"id        {run_id}\n" in out and "status    succeeded\n" in out and "progress  10/10\n" in out
    assert "model     tiny:llama-0.4m\n" in out
    assert re.search(r"^  final/rewards/accuracy\s+[\d.]+$", out, re.M)
    assert main(["runs", "get", str(run_id), "--json", "--url", served.url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["id"], body["status"]) == (str(run_id), "succeeded")


def test_runs_download_writes_the_tar(
    served: Served, finished_run: RunRead, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "m.tar"
    assert main(["runs", "download", str(finished_run.id), "-o", str(target), "--url", served.url]) == 0
    out, err = capsys.readouterr()
    assert (
        out.startswith(f"{target} ({target.stat().st_size} bytes;") and "m.tar" in err
    )  # progress on stderr
    assert main(["runs", "download", str(finished_run.id), "--format", "adapter", "--url", served.url]) == 1
    assert "format=hf" in capsys.readouterr().err


def test_create_with_watch_reports_a_failed_run_and_exits_1(
    served: Served, rl: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one_row = rl.datasets.create("one", addition_pairs(1))
    spec = tmp_path / "spec.json"  # JSON this time; half of one row leaves nothing to train on
    spec.write_text(json.dumps(dpo(one_row.id, 10) | {"validation_fraction": 0.5}))
    assert main(["runs", "create", "-f", str(spec), "--watch", "--interval", "0.2", "--url", served.url]) == 1
    out, err = capsys.readouterr()
    run_id = uuid.UUID(out.splitlines()[0])
    reason = "ValueError: validation_fraction 0.5 leaves no training rows out of 1"
    assert "status  failed\n" in out and f"error   {reason}" in out
    assert err == f"error: run {run_id} failed: {reason}\n"


def test_cancel_then_watch_exits_1(
    served: Served, rl: Client, pairs: DatasetRead, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = rl.runs.create(dpo(pairs.id, 1_000_000)).id
    assert main(["runs", "cancel", str(run_id), "--url", served.url]) == 0
    assert capsys.readouterr().out in (
        f"run {run_id} cancelled\n",
        f"run {run_id}: cancel requested (running); it stops within seconds\n",
    )
    assert main(["runs", "watch", str(run_id), "--interval", "0.2", "--url", served.url]) == 1
    out, err = capsys.readouterr()
    assert "status  cancelled\n" in out and err == f"error: run {run_id} cancelled\n"
    assert main(["runs", "cancel", str(run_id), "--url", served.url]) == 1
    assert capsys.readouterr().err == f"error: run {run_id} already ended cancelled (field: status)\n"


def test_api_errors_print_the_message_and_field(
    served: Served,
    pairs: DatasetRead,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(json.dumps(dpo(pairs.id, 10, learning_rate=-0.001)))
    assert main(["runs", "create", "-f", str(spec), "--url", served.url]) == 1
    assert capsys.readouterr().err == (
        "error: hyperparameters.learning_rate: Input should be greater than 0 "
        "(field: hyperparameters.learning_rate)\n"
    )
    spec.write_text(json.dumps(dpo(pairs.id, 10, lr=0.1)))
    assert main(["runs", "create", "-f", str(spec), "--url", served.url]) == 1
    assert capsys.readouterr().err == (
        "error: hyperparameters.lr: Extra inputs are not permitted (field: hyperparameters.lr)\n"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n' + json.dumps(addition_pairs(1)[0]) + "\nnot json\n")
    assert main(["datasets", "upload", str(bad), "-q", "--url", served.url]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-3].startswith("error: 2 invalid line(s)")
    assert err[-2:] == [
        "  line 1: chosen: missing field 'chosen'",
        "  line 3: invalid JSON: Expecting value at column 1",
    ]
    big = tmp_path / "big.jsonl"
    big.write_bytes(jsonl(addition_pairs(40_000)))  # > 1 MiB + the server's 64 KiB of framing room
    assert main(["datasets", "upload", str(big), "--url", served.url]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: upload is larger than the limit of {MAX_UPLOAD} bytes (field: file)"
    )
    assert main(["runs", "list", "--api-key", "rlrun_0000_wrong", "--url", served.url]) == 1
    assert capsys.readouterr().err == "error: invalid or revoked API key\n"
    monkeypatch.delenv("RLRUN_API_KEY")
    assert main(["runs", "list", "--url", served.url]) == 1
    assert capsys.readouterr().err.startswith("error: send `Authorization: Bearer <API key>`")


def test_environments_create_list_and_delete(
    served: Served, rl: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tmp_path / "guess.py"
    code.write_text(
        "def reset(row):\n    return 'hi'\n\ndef step(messages, row):\n    return {'done': True}\n"
    )
    assert main(["environments", "create", str(code), "-q", "--url", served.url]) == 0
    env_id = uuid.UUID(capsys.readouterr().out.strip())
    assert (
        rl.environments.get(env_id).source == code.read_text()
        and rl.environments.get(env_id).name == "guess.py"
    )
    assert main(["environments", "list", "--url", served.url]) == 0
    assert re.search(rf"^{env_id}  .*  guess.py$", capsys.readouterr().out, re.M)
    bad = tmp_path / "bad.py"
    bad.write_text("def reset(row):\n    return 'hi'\n")
    assert main(["environments", "create", str(bad), "--url", served.url]) == 1
    assert capsys.readouterr().err == "error: source: defines no top-level function `step` (field: source)\n"
    assert main(["environments", "delete", str(env_id), "--url", served.url]) == 0
    assert capsys.readouterr().out == f"deleted {env_id}\n"
    assert main(["environments", "delete", str(env_id), "--url", served.url]) == 1
    assert f"environment {env_id} does not exist" in capsys.readouterr().err


def test_models_import_turns_a_gguf_into_a_listed_model_and_a_second_import_names_the_clash(
    served: Served, tiny_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    drop = served.home / "models" / "drop"
    drop.mkdir(parents=True)
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    write_llama_gguf(model, tokenizer, drop / "Chat-Tiny.gguf")
    numel = sum(p.numel() for p in model.parameters())
    monkeypatch.chdir(drop)  # a relative path that exists here goes to the server as an absolute one
    assert main(["models", "import", "Chat-Tiny.gguf", "--name", "chat-tiny", "--url", served.url]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["chat-tiny"]
    assert f"{numel:,} parameters; from {drop / 'Chat-Tiny.gguf'}" in err
    assert main(["models", "list", "--url", served.url]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["chat-tiny", "folder", f"{numel:,}", str(drop / "Chat-Tiny.gguf")] in rows
    assert main(["models", "import", "Chat-Tiny.gguf", "--name", "chat-tiny", "--url", served.url]) == 1
    assert "error: a model named 'chat-tiny' already exists" in capsys.readouterr().err


def test_the_entry_point_in_real_processes(served: Served, finished_run: RunRead) -> None:
    def rlrun(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "rlrun.cli", *args]
        return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=60)

    listed = rlrun("runs", "list", "--url", served.url, RLRUN_API_KEY=served.key)
    assert (listed.returncode, listed.stderr) == (0, "")  # no log lines on stderr
    assert f"{finished_run.id}  succeeded" in listed.stdout
    got = rlrun("runs", "get", str(finished_run.id), RLRUN_URL=served.url, RLRUN_API_KEY=served.key)
    assert got.returncode == 0 and "status    succeeded" in got.stdout
    url = f"http://127.0.0.1:{free_port()}"
    down = rlrun("runs", "list", "--url", url)
    assert down.returncode == 1
    assert down.stderr == f"error: cannot reach the rlrun server at {url}: [Errno 111] Connection refused\n"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_redraws_in_place_on_a_terminal(served: Served, rl: Client, pairs: DatasetRead) -> None:
    run_id = rl.runs.create(dpo(pairs.id, 1_000_000)).id
    deadline = time.monotonic() + 60
    while (run := rl.runs.get(run_id)).progress.step == 0:
        assert time.monotonic() < deadline, run
        time.sleep(0.1)
    with Client(served.url, api_key=served.key) as other:  # cancels while the watch is drawing
        timer = threading.Timer(1.0, other.runs.cancel, [run_id])
        timer.start()
        out = Tty()
        try:
            assert watch_run(rl, str(run_id), interval=0.2, out=out) == 1
        finally:
            timer.join()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) >= 3 and frames[0].startswith("\x1b[J")  # the first frame moves over nothing
    for previous, frame in zip(frames, frames[1:], strict=False):
        up = re.match(r"\x1b\[(\d+)A\x1b\[J", frame)
        assert up and int(up.group(1)) == previous.count("\n"), (previous, frame)  # exactly over the last
    assert "status  running\n" in frames[0] and "status  cancelled\n" in frames[-1]
    assert re.search(rf"^loss\s+\S+  {SPARK}+$", frames[-1], re.M)


def test_stream_with_auth_on_does_not_hold_the_sqlite_write_lock(rl: Client, tmp_path: Path) -> None:
    """Regression: the stream's key lookup once kept a request transaction (a SQLite write lock) open for
    the whole response, so its own polls and the worker's writes waited until "database is locked"."""
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(jsonl(addition_pairs(32)))
    dataset = rl.datasets.upload(path)
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset.id),
        "hyperparameters": {"learning_rate": 1e-3, "max_steps": 8, "batch_size": 8},
    }
    run = rl.runs.create(spec)
    start = time.monotonic()
    messages = list(rl.runs.stream(run.id, poll_seconds=0.1))  # live: the worker writes meanwhile
    assert time.monotonic() - start < 25
    assert messages[-1].event == "end" and messages[-1].data == {"status": "succeeded"}
    loss_steps = {p["step"] for m in messages if m.event == "metrics" for p in m.data if p["key"] == "loss"}
    assert loss_steps == set(range(1, 9))
