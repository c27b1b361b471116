"""`rlrun datasets upload` against the real app served by uvicorn (SQLite, no worker): a `--kind` the
file's first lines plainly do not fit is refused before any request, `--skip-invalid` stores the good
rows and prints the skipped lines, and an omitted kind is detected by the server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import pytest

from api.db import make_engine, make_session_factory
from api.main import create_app
from api.settings import Settings
from rlrun import Client
from rlrun.cli import main
from rlrun.commands import KINDS
from rlrun.formats import kind_mismatch
from rlrun.schemas import DatasetKind
from tests.factories import FakeEnqueue, jsonl, pair_rows, serving

HH_FILE = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf" / "quirks.jsonl"  # real HH lines
SFT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@dataclass
class Recording:
    """The app, noting every HTTP request it receives."""

    app: Any
    requests: list[tuple[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def served(sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Recording]]:
    settings = Settings(home=tmp_path_factory.mktemp("cli-upload"), database_url=sqlite_url)
    engine = make_engine(sqlite_url)
    app = Recording(create_app(settings, session_factory=make_session_factory(engine), enqueue=FakeEnqueue()))
    try:
        with serving(app) as url:
            yield url, app
    finally:
        engine.dispose()


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLRUN_API_KEY", raising=False)


def test_the_cli_kinds_are_the_apis() -> None:
    assert set(KINDS) == set(get_args(DatasetKind))


def test_a_kind_the_file_does_not_fit_is_refused_before_any_request(
    served: tuple[str, Recording], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, app = served
    sft = tmp_path / "chat.jsonl"
    sft.write_bytes(b"\n" + jsonl([SFT] * 3))
    before = len(app.requests)
    assert main(["datasets", "upload", str(HH_FILE), "--kind", "sft", "--url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {HH_FILE}: line 1 is not sft data (missing field 'prompt') but reads as ")
    assert "preference data: pass --kind preference, or leave --kind out" in err
    assert main(["datasets", "upload", str(sft), "--kind", "preference", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "line 2 is not preference data (missing field 'chosen') but reads as sft data" in err
    assert main(["datasets", "upload", str(sft), "--kind", "prompts", "--url", url]) == 1
    assert "reads as sft data: pass --kind sft" in capsys.readouterr().err
    assert app.requests[before:] == []  # the server heard nothing of any of them


def test_kind_mismatch_spares_files_that_fit_or_fit_nothing() -> None:
    pairs = jsonl(pair_rows(2)).splitlines()
    assert kind_mismatch(pairs, "preference") is None
    assert kind_mismatch(pairs, "prompts") is None  # prompts may carry other fields (kept as meta)
    assert kind_mismatch([b"not json", jsonl([SFT])], "preference") is not None
    assert kind_mismatch([b"not json", b'{"text": "a"}'], "preference") is None  # the server reports those
    assert kind_mismatch([jsonl([SFT]), *pairs], "preference") is None  # one line fits: not plainly wrong


def test_a_fitting_kind_and_skip_invalid_upload_the_good_rows_and_print_the_skipped(
    served: tuple[str, Recording], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, app = served
    path = tmp_path / "hh.jsonl"
    lines = HH_FILE.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], b'{"chosen": "x"', *lines[1:], b"[]"]) + b"\n")
    argv = ["datasets", "upload", str(path), "--kind", "preference", "--url", url]
    assert main(argv) == 1  # atomic without the flag
    assert "2 invalid line(s); first at line 2: invalid JSON" in capsys.readouterr().err
    assert main([*argv, "--skip-invalid"]) == 0
    out = capsys.readouterr().out.splitlines()
    dataset_id = uuid.UUID(out[0])
    assert out[2:4] == ["kind     preference", "rows     4 (0 exact duplicates)"]  # given, not detected
    assert out[-3:] == [
        "skipped  2 invalid line(s), not stored:",
        "  line 2: invalid JSON: Expecting ',' delimiter at column 15",
        "  line 6: expected a JSON object, got list",
    ]
    with Client(url) as rl:
        skipped = rl.datasets.skipped(dataset_id)
        assert [(s.line, s.field) for s in skipped.data] == [(2, None), (6, None)]
        first = rl.datasets.rows(dataset_id, limit=1).data[0].data
        assert first["prompt"] + first["chosen"] == json.loads(lines[0])["chosen"]
    assert ("POST", "/v1/datasets") in app.requests


def test_an_omitted_kind_is_detected_by_the_server(
    served: tuple[str, Recording], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = served
    path = tmp_path / "chat.jsonl"
    path.write_bytes(jsonl([SFT] * 2))
    assert main(["datasets", "upload", str(path), "--url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:4] == ["kind     sft", "         (detected from the first lines: no --kind given)"]
    with Client(url) as rl:
        ds = rl.datasets.create("rows", [SFT], skip_invalid=True)
        assert (ds.kind, ds.kind_detected, ds.skipped_count, ds.skipped) == ("sft", True, 0, [])
