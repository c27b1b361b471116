"""Upload limits and hostile text, on SQLite and PostgreSQL (issue 12 items 5, 6 and 7).

- A body without Content-Length (chunked) is counted as it streams and refused with 413 once it passes the
  limit: the app stops reading, the form parser never spools the rest, nothing is stored.
- Text that a backend cannot store (NUL, lone surrogates) and rows nested deeper than ``MAX_ROW_DEPTH`` are
  a 4xx naming the line and field, never a 500; a stored row too deep to serialise never 500s either.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.deps import get_session, get_session_factory
from api.main import create_app
from api.models import Dataset
from api.settings import Settings
from rlrun.formats import MAX_ROW_DEPTH
from tests.factories import FakeEnqueue, api_client, jsonl, make_dataset, pair_rows, serving

LIMIT = 1024 * 1024  # max_upload_bytes in these tests
CHUNK = 64 * 1024
TOTAL = 16 * 1024 * 1024  # what the client would send if the server let it
BOUNDARY = "rlrunboundary"


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Dataset)) or 0)


def make_app(session: Session, settings: Settings) -> Any:
    app = create_app(settings, session_factory=None, enqueue=FakeEnqueue())

    def _session() -> Iterator[Session]:
        yield session

    app.dependency_overrides[get_session] = _session
    app.dependency_overrides[get_session_factory] = lambda: lambda: nullcontext(session)
    return app


def lines(total: int) -> Iterator[bytes]:
    """Valid JSONL preference pairs, about CHUNK bytes at a time, ``total`` bytes in all."""
    line = json.dumps({"prompt": "p" * 100, "chosen": "c" * 100, "rejected": "r" * 100}).encode() + b"\n"
    chunk = line * (CHUNK // len(line))
    for _ in range(total // len(chunk)):
        yield chunk


def part(name: str, value: str = "", filename: str | None = None) -> bytes:
    """One multipart part's head (and ``value``); a file part's content follows it."""
    file = "" if filename is None else f'; filename="{filename}"'
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"{file}\r\n\r\n'
    return (head if filename is not None else f"{head}{value}\r\n").encode()


END = f"\r\n--{BOUNDARY}--\r\n".encode()


def multipart_body(fields: dict[str, str], total: int) -> Iterator[bytes]:
    for name, value in fields.items():
        yield part(name, value)
    yield part("file", filename="d.jsonl")
    yield from lines(total)
    yield END


def json_body(total: int) -> Iterator[bytes]:
    yield b'{"name": "big", "kind": "preference", "rows": ['
    sep = b""
    for chunk in lines(total):
        yield sep + chunk.rstrip(b"\n").replace(b"\n", b", ")
        sep = b", "
    yield b"]}"


MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
UPLOADS: dict[str, tuple[str, str, Callable[[int], Iterator[bytes]]]] = {
    "datasets multipart": ("/v1/datasets", MULTIPART, partial(multipart_body, {"kind": "preference"})),
    "datasets json": ("/v1/datasets", "application/json", json_body),
    "files multipart": ("/v1/files", MULTIPART, partial(multipart_body, {"purpose": "fine-tune"})),
}


def asgi_post(app: Any, path: str, headers: dict[str, str], chunks: Iterator[bytes]) -> tuple[int, Any, int]:
    """POST through the ASGI interface with a body that arrives chunk by chunk; returns the status, the
    JSON answer and how many body bytes the app pulled through ``receive()``."""
    consumed = 0
    answered = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal consumed
        if answered:  # as a server does once the response is out
            return {"type": "http.disconnect"}
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        consumed += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        nonlocal answered
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered = True

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), consumed


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_chunked_upload_is_refused_as_it_streams(session: Session, tmp_path: Path, upload: str) -> None:
    path, content_type, body = UPLOADS[upload]
    before = count(session)
    app = make_app(session, Settings(home=tmp_path, max_upload_bytes=LIMIT))
    status, answer, consumed = asgi_post(app, path, {"content-type": content_type}, body(TOTAL))
    assert status == 413, (upload, status, answer)
    assert "limit" in json.dumps(answer)
    assert consumed < 2 * LIMIT, (upload, consumed)  # stopped near the limit, not at the 16 MB end
    assert count(session) == before


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_declared_length_over_the_limit_is_refused_before_reading(
    session: Session, tmp_path: Path, upload: str
) -> None:
    path, content_type, body = UPLOADS[upload]
    app = make_app(session, Settings(home=tmp_path, max_upload_bytes=LIMIT))
    headers = {"content-type": content_type, "content-length": str(TOTAL)}
    status, _, consumed = asgi_post(app, path, headers, body(TOTAL))
    assert (status, consumed) == (413, 0)


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_chunked_upload_under_the_limit_is_stored(session: Session, tmp_path: Path, upload: str) -> None:
    """The counting must not refuse what fits: the same bodies, a quarter of the limit."""
    path, content_type, body = UPLOADS[upload]
    app = make_app(session, Settings(home=tmp_path, max_upload_bytes=LIMIT))
    status, answer, consumed = asgi_post(app, path, {"content-type": content_type}, body(LIMIT // 4))
    assert status in (200, 201), (upload, status, answer)
    assert consumed >= LIMIT // 4 - CHUNK
    assert answer.get("row_count", answer.get("bytes")) > 0


# --- a real server: chunked transfer over a socket ------------------------------------------------------


class Counting:
    """ASGI wrapper that counts the body bytes the app pulls and records each request's client address."""

    def __init__(self, app: Any):
        self.app = app
        self.consumed = 0
        self.clients: list[tuple[str, int]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, port = scope["client"]
        self.clients.append((host, port))

        async def counted() -> Any:
            message = await receive()
            self.consumed += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def test_chunked_upload_to_a_real_server_is_refused_and_the_connection_kept(
    session: Session, tmp_path: Path
) -> None:
    app = Counting(make_app(session, Settings(home=tmp_path, max_upload_bytes=LIMIT)))
    before = count(session)
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        headers = {"content-type": MULTIPART}
        resp = client.post(
            "/v1/datasets", content=multipart_body({"kind": "preference"}, TOTAL), headers=headers
        )
        read = app.consumed
        bad = client.post(
            "/v1/datasets",
            files={"file": ("d.jsonl", jsonl(pair_rows(1)) + b'{"prompt": "a\\ud800", "chosen": "b"}\n')},
        )
        health = client.get("/healthz")
    assert "content-length" not in resp.request.headers  # really chunked
    assert resp.status_code == 413, resp.text
    assert read < 2 * LIMIT, read
    assert bad.status_code == 422 and bad.json()["error"]["details"][0]["line"] == 2, bad.text
    assert health.status_code == 200
    assert len(set(app.clients)) == 1, app.clients  # neither refusal dropped the keep-alive connection
    assert count(session) == before


# --- text a backend cannot store, and nesting -------------------------------------------------------------


def upload(client, data: bytes, kind: str = "preference", **form: str):  # type: ignore[no-untyped-def]
    return client.post("/v1/datasets", files={"file": ("d.jsonl", data)}, data={"kind": kind, **form})


def nested(depth: int) -> dict[str, Any]:
    """An object ``depth`` containers deep, counting itself."""
    obj: dict[str, Any] = {"leaf": "x"}
    for _ in range(depth - 1):
        obj = {"a": obj}
    return obj


GOOD = jsonl(pair_rows(2))

HOSTILE_LINES = [
    ("lone surrogate", b'{"prompt": "a\\ud800", "chosen": "b", "rejected": "c"}', "preference", "prompt"),
    (
        "lone surrogate in a message",
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udfff"}]}',
        "sft",
        "messages[1].content",
    ),
    ("lone surrogate in a key", b'{"prompt": "q", "\\ud800": 1}', "prompts", None),
    ("escaped NUL", b'{"prompt": "q", "chosen": "a\\u0000", "rejected": "c"}', "preference", "chosen"),
    ("escaped NUL in a key", b'{"prompt": "q", "\\u0000": 1}', "prompts", None),
    (
        "nested too deep",
        json.dumps({"prompt": "q", "deep": nested(MAX_ROW_DEPTH)}).encode(),
        "prompts",
        "deep",
    ),
    ("nested 255 deep", json.dumps({"prompt": "q", "deep": nested(254)}).encode(), "prompts", "deep"),
    ("NaN", b'{"prompt": "q", "score": NaN}', "prompts", "score"),
    ("Infinity in a list", b'{"prompt": "q", "scores": [1, -Infinity]}', "prompts", "scores[1]"),
    (
        "a float that overflows",
        b'{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1e400}',
        "preference",
        "margin",
    ),
    ("an integer of 5000 digits", b'{"prompt": "q", "n": ' + b"7" * 5000 + b"}", "prompts", None),
]


@pytest.mark.parametrize(("label", "line", "kind", "field"), HOSTILE_LINES, ids=[c[0] for c in HOSTILE_LINES])
def test_hostile_line_is_422_naming_line_and_field(
    session: Session, label: str, line: bytes, kind: str, field: str | None
) -> None:
    before = count(session)
    good = {"preference": GOOD, "sft": jsonl([{"prompt": "p", "completion": "c"}] * 2), "prompts": GOOD}[kind]
    with api_client(session) as client:
        resp = upload(client, good + line + b"\n", kind=kind)
        files = client.post(
            "/v1/files",
            files={"file": ("f.jsonl", line + b"\n")},
            data={"purpose": "fine-tune"},
        )
    assert resp.status_code == 422, (label, resp.status_code, resp.text[:300])
    detail = resp.json()["error"]["details"][0]
    assert detail["line"] == 3 and detail.get("field") == field, (label, detail)
    assert files.status_code == 400, (label, files.status_code, files.text[:300])
    assert "line 1" in files.json()["error"]["message"], files.text
    assert count(session) == before


def test_limits_keep_what_real_rows_need(session: Session) -> None:
    """Depth exactly MAX_ROW_DEPTH, a surrogate pair, and the text ``\\u0000`` (an escaped backslash, not
    NUL) are all stored as sent, on both backends."""
    rows = [
        {"prompt": "q", "deep": nested(MAX_ROW_DEPTH - 1)},  # the row itself is one more level
        {"prompt": "emoji \ud83d\ude00 as a pair", "answer": "1"},  # json.dumps escapes both halves
        {"prompt": "the escape \\u0000 as text"},
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    with api_client(session) as client:
        resp = upload(client, data, kind="prompts")
        assert resp.status_code == 201, resp.text
        got = client.get(f"/v1/datasets/{resp.json()['id']}/rows").json()["data"]
    assert got[0]["data"]["meta"]["deep"] == nested(MAX_ROW_DEPTH - 1)
    assert got[1]["data"]["prompt"] == "emoji \U0001f600 as a pair"
    assert got[2]["data"]["prompt"] == "the escape \\u0000 as text"


def test_json_body_rows_are_checked_like_lines(session: Session) -> None:
    before = count(session)
    with api_client(session) as client:
        nul = client.post(
            "/v1/datasets", json={"name": "n", "rows": [*pair_rows(1), {**pair_rows(1)[0], "prompt": "\x00"}]}
        )
        deep = client.post(
            "/v1/datasets", json={"name": "n", "kind": "prompts", "rows": [{"prompt": "q", "m": nested(100)}]}
        )
        surrogate = client.post(
            "/v1/datasets",
            content=b'{"name": "n", "rows": [{"prompt": "\\ud800", "chosen": "b", "rejected": "c"}]}',
            headers={"content-type": "application/json"},
        )
    detail = nul.json()["error"]["details"][0]
    assert (nul.status_code, detail["line"], detail["field"]) == (422, 2, "prompt"), nul.text
    assert "NUL" in detail["message"]
    assert deep.status_code == 422 and deep.json()["error"]["details"][0]["field"] == "m", deep.text
    # The JSON parser refuses a lone surrogate before any row exists: it names the column, not a field.
    assert surrogate.status_code == 422 and surrogate.json()["error"]["field"] == "body", surrogate.text
    assert "column" in surrogate.json()["error"]["message"]
    assert count(session) == before


@pytest.mark.parametrize(("name", "problem"), [("a\x00b", "NUL"), ("x" * 201, "200")])
def test_bad_dataset_name_is_422_naming_it(session: Session, name: str, problem: str) -> None:
    before = count(session)
    with api_client(session) as client:
        multipart = upload(client, GOOD, name=name)
        body = client.post("/v1/datasets", json={"name": name, "rows": pair_rows(1)})
    for resp in (multipart, body):
        assert resp.status_code == 422, (name[:10], resp.status_code, resp.text[:300])
        assert resp.json()["error"]["field"] == "name", resp.text
    assert problem in multipart.json()["error"]["message"]
    assert count(session) == before


def test_file_name_with_nul_is_refused_naming_the_file(session: Session) -> None:
    """httpx would percent-encode the NUL, so the multipart body is written by hand."""
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    body = part("purpose", "fine-tune") + part("file", filename="a\x00.jsonl") + jsonl([chat]) + END
    before = count(session)
    with api_client(session) as client:
        resp = client.post("/v1/files", content=body, headers={"content-type": MULTIPART})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "file" and "NUL" in resp.json()["error"]["message"]
    assert count(session) == before


def test_stored_rows_too_deep_to_serialise_never_500(session: Session) -> None:
    """Rows stored before the depth limit: those the encoder can write are returned as stored; one it
    cannot is a 409 naming the row, not a 500."""
    ds = make_dataset(
        session, rows=[{"prompt": "q", "m": nested(100)}, {"prompt": "q", "m": nested(300)}], kind="prompts"
    )
    with api_client(session) as client:
        first = client.get(f"/v1/datasets/{ds.id}/rows", params={"limit": 1})
        both = client.get(f"/v1/datasets/{ds.id}/rows")
        second = client.get(f"/v1/datasets/{ds.id}/rows", params={"after": first.json()["next_cursor"]})
    assert first.status_code == 200 and first.json()["data"][0]["data"]["m"] == nested(100)
    for resp in (both, second):
        assert resp.status_code == 409, resp.text
        err = resp.json()["error"]
        assert err["field"] == "row 1" and "nested" in err["message"], err
