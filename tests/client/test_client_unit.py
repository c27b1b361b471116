"""The client's own parts without a server: the multipart body byte for byte, the SSE parser, error
bodies, headers and defaults (through httpx's MockTransport), and the CLI's local errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from api.models import FINISHED_STATUSES
from rlrun import ApiError, Client, ConnectionFailed, RlrunError, StreamEvent
from rlrun.cli import main
from rlrun.client import FINISHED
from rlrun.commands import upload_progress
from rlrun.terminal import progress_line
from rlrun.wire import MultipartFile, parse_sse
from trainer.ports import free_port

BODY = MultipartFile(
    fields={"kind": "sft", "name": "my data"},
    file_field="file",
    filename='a"b.jsonl',
    file_size=4,
    boundary="XYZ",
)
EXPECTED = (
    b'--XYZ\r\nContent-Disposition: form-data; name="kind"\r\n\r\nsft\r\n'
    b'--XYZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nmy data\r\n'
    b'--XYZ\r\nContent-Disposition: form-data; name="file"; filename="a%22b.jsonl"\r\n'
    b"Content-Type: application/x-ndjson\r\n\r\n"
    b"{}\n\n"
    b"\r\n--XYZ--\r\n"
)


def test_multipart_body_is_streamed_in_chunks_with_known_length_and_progress() -> None:
    seen: list[tuple[int, int]] = []
    chunks = list(BODY.chunks(io.BytesIO(b"{}\n\n"), lambda s, t: seen.append((s, t)), chunk_size=3))
    assert b"".join(chunks) == EXPECTED
    assert chunks[1:3] == [b"{}\n", b"\n"]  # the file in chunk_size pieces, never whole
    assert BODY.length == len(EXPECTED)
    assert BODY.content_type == "multipart/form-data; boundary=XYZ"
    assert seen == [(0, 4), (3, 4), (4, 4)]


def test_multipart_refuses_a_file_shorter_than_declared() -> None:
    with pytest.raises(RlrunError, match="shrank"):
        list(BODY.chunks(io.BytesIO(b"{}")))


def test_sse_parser_joins_data_lines_skips_comments_and_keeps_the_last_id() -> None:
    lines = [
        "id: c1",
        "event: metrics",
        'data: [{"key":',
        'data: "loss"}]',
        "",
        ": keep-alive",
        "",
        "event: end",
        'data: {"status": "succeeded"}',
        "",
    ]
    assert list(parse_sse(iter(lines))) == [
        StreamEvent("metrics", [{"key": "loss"}], "c1"),
        StreamEvent("end", {"status": "succeeded"}, "c1"),
    ]


def test_client_statuses_match_the_servers() -> None:
    assert set(FINISHED) == set(FINISHED_STATUSES)


def _recording(status: int, body: bytes, seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(status, content=body)

    return httpx.MockTransport(handler)


def test_upload_sends_content_length_not_chunked_and_raises_the_api_error(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1="}\n' * 50)
    error = {
        "error": {
            "code": "dataset_invalid",
            "message": "50 invalid line(s)",
            "field": "file",
            "details": [{"message": "missing field 'chosen'", "field": "chosen", "line": 1}],
        }
    }
    seen: list[httpx.Request] = []
    with Client(
        "http://rl.test", api_key="k1", transport=_recording(422, json.dumps(error).encode(), seen)
    ) as c:
        with pytest.raises(ApiError) as info:
            c.datasets.upload(data, kind="preference", chunk_size=64)
    (request,) = seen
    assert request.headers["content-length"] == str(len(request.content))
    assert "transfer-encoding" not in request.headers
    assert request.headers["authorization"] == "Bearer k1"
    assert request.headers["content-type"].startswith("multipart/form-data; boundary=rlrun-")
    assert data.read_bytes() in request.content
    err = info.value
    assert (err.status, err.code, err.message, err.field) == (
        422,
        "dataset_invalid",
        "50 invalid line(s)",
        "file",
    )
    assert [(d.line, d.field) for d in err.details] == [(1, "chosen")]


def test_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLRUN_URL", "http://env.test:1234/")
    monkeypatch.setenv("RLRUN_API_KEY", "from-env")
    seen: list[httpx.Request] = []
    with Client(transport=_recording(200, b"[]", seen)) as c:
        assert c.base_url == "http://env.test:1234"
        assert c.runs.metric_keys(uuid.UUID(int=1)) == []
    assert str(seen[0].url) == f"http://env.test:1234/v1/runs/{uuid.UUID(int=1)}/metric-keys"
    assert seen[0].headers["authorization"] == "Bearer from-env"
    monkeypatch.delenv("RLRUN_URL")
    monkeypatch.delenv("RLRUN_API_KEY")
    with Client(transport=_recording(200, b"[]", seen)) as c:
        assert c.base_url == "http://127.0.0.1:8000"
        c.runs.metric_keys("x")
    assert "authorization" not in seen[1].headers


def test_an_error_that_is_not_the_api_shape_still_raises_api_error() -> None:
    with Client("http://rl.test", transport=_recording(502, b"<html>Bad Gateway</html>\n", [])) as c:
        with pytest.raises(ApiError) as info:
            c.runs.get("x")
    assert (info.value.status, info.value.code) == (502, "http_error")
    assert info.value.message == "HTTP 502: <html>Bad Gateway</html>"


def test_a_2xx_answer_of_the_wrong_shape_is_a_clear_error() -> None:
    with Client("http://rl.test", transport=_recording(200, b'{"id": 1}', [])) as c:
        with pytest.raises(RlrunError, match="unexpected answer from http://rl.test/v1/runs/x"):
            c.runs.get("x")


def test_connection_refused_is_connection_failed() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url) as c, pytest.raises(ConnectionFailed) as info:
        c.runs.list()
    assert isinstance(info.value, ConnectionError)
    assert info.value.message.startswith(f"cannot reach the rlrun server at {url}: ")


def test_cli_local_errors_are_one_line_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["runs", "list", "--url", url]) == 1
    assert capsys.readouterr().err == (
        f"error: cannot reach the rlrun server at {url}: [Errno 111] Connection refused\n"
    )
    assert main(["runs", "create", "-f", str(tmp_path / "missing.yaml"), "--url", url]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.yaml'}: No such file or directory\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: dpo\nhyperparameters: [1\n")
    assert main(["runs", "create", "-f", str(bad), "--url", url]) == 1
    assert capsys.readouterr().err == (
        f"error: {bad}: invalid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>'\n"
    )
    listed = tmp_path / "list.yaml"
    listed.write_text("- algorithm: dpo\n")
    assert main(["runs", "create", "-f", str(listed), "--url", url]) == 1
    assert "a run spec is a mapping" in capsys.readouterr().err
    broken = tmp_path / "spec.json"
    broken.write_text('{"algorithm": "dpo",}')
    assert main(["runs", "create", "-f", str(broken), "--url", url]) == 1
    expected = "invalid JSON at line 1, column 21: Expecting property name enclosed in double quotes"
    assert capsys.readouterr().err == f"error: {broken}: {expected}\n"  # the "}" is character 21


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def testupload_progress_redraws_one_line_on_a_terminal_and_prints_quarters_elsewhere() -> None:
    tty, log = Tty(), io.StringIO()
    for out in (tty, log):
        report = upload_progress("f", out)
        for sent in (0, 10, 30, 60, 100):
            report(sent, 100)
    line = {n: progress_line("f", n, 100) for n in (0, 10, 30, 60, 100)}
    assert tty.getvalue() == "".join(f"\r{line[n]}\x1b[K" for n in (0, 10, 30, 60, 100)) + "\n"
    # 10 % is still the first quarter: not printed again
    assert log.getvalue() == "".join(f"{line[n]}\n" for n in (0, 30, 60, 100))


def test_the_client_and_its_commands_import_no_server_machinery() -> None:
    code = (
        "import sys, rlrun, rlrun.commands; "
        "print(sorted(m for m in ('torch', 'sqlalchemy', 'celery', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_a_setting_the_server_cannot_use_is_named_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from api.settings import get_settings

    monkeypatch.setenv("RLRUN_HOME", str(tmp_path))
    monkeypatch.setenv("RLRUN_METRIC_SINKS", '[{"type": "mlflow", "tracking_uri": "ftp://x"}]')
    monkeypatch.setenv("RLRUN_WEBHOOK_MAX_ATTEMPTS", "0")
    get_settings.cache_clear()  # read the environment above, not a copy cached by an earlier test
    try:
        assert main(["worker"]) == 2
    finally:
        get_settings.cache_clear()
    assert capsys.readouterr().err.splitlines() == [
        "error: RLRUN_METRIC_SINKS.0.mlflow.tracking_uri: Value error, tracking_uri must start with http://, "
        "https:// or file:",
        "error: RLRUN_WEBHOOK_MAX_ATTEMPTS: Input should be greater than or equal to 1",
    ]
