"""The API's own cost per request, in process: no network, no server, one asyncio loop sending requests
back to back through ``httpx.ASGITransport`` to ``create_app`` on a fresh SQLite home (auth off, a
recording enqueue). What it shows is the framework work per request (routing, middleware, dependencies,
validation, error rendering, the thread hand-offs of sync dependencies and routes), which every client,
the dashboard and the schema fuzzer (tests/fuzz) pay on top of the database.

Three requests: ``GET /healthz`` (no database), ``GET /v1/runs`` (an empty page from the database) and
``POST /v1/runs`` with a spec that fails validation (a 422, as most fuzzed requests are).

Run: ``.venv/bin/python bench/api_requests.py [--requests 2000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from api.db import make_engine, make_session_factory
from api.main import create_app
from api.migrate import upgrade_head
from api.settings import Settings

CASES: list[tuple[str, str, Any]] = [
    ("GET /healthz", "/healthz", None),
    ("GET /v1/runs", "/v1/runs", None),
    ("POST /v1/runs (422)", "/v1/runs", {"kind": "dpo", "model": 3}),
]


async def per_request_ms(app: Any, path: str, body: Any, n: int) -> float:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:

        async def send() -> None:
            resp = await (client.get(path) if body is None else client.post(path, json=body))
            assert resp.status_code in (200, 422), resp.text

        for _ in range(min(100, n)):  # warm-up
            await send()
        start = time.perf_counter()
        for _ in range(n):
            await send()
        return (time.perf_counter() - start) / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="rlrun-bench-api-")))
    upgrade_head(settings.resolved_database_url)
    app = create_app(
        settings,
        session_factory=make_session_factory(make_engine(settings.resolved_database_url)),
        enqueue=lambda run_id, queue=None: None,  # nothing is submitted: no broker needed
    )
    print(f"{'request':<22} {'ms/request':>10}")
    for label, path, body in CASES:
        print(f"{label:<22} {asyncio.run(per_request_ms(app, path, body, args.requests)):>10.2f}")


if __name__ == "__main__":
    main()
