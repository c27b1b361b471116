"""The API logs one line per request (api/request_log.py): method, path, status and milliseconds."""

from __future__ import annotations

import logging
import re

import pytest
from sqlalchemy.orm import Session

from tests.factories import api_client


def test_each_request_is_logged_once_with_its_status(
    session: Session, caplog: pytest.LogCaptureFixture
) -> None:
    with api_client(session) as client, caplog.at_level(logging.INFO, logger="rlrun.api"):
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/runs/not-a-uuid").status_code == 422
        assert client.get("/v1/nowhere").status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "rlrun.api"]
    assert len(lines) == 3, lines
    expected = [
        ("GET", "/healthz", "200"),
        ("GET", "/v1/runs/not-a-uuid", "422"),
        ("GET", "/v1/nowhere", "404"),
    ]
    for line, (method, path, status) in zip(lines, expected, strict=True):
        match = re.fullmatch(r"(\S+) (\S+) (\d{3}) (\d+\.\d)ms", line)
        assert match, line
        assert match.groups()[:3] == (method, path, status)
