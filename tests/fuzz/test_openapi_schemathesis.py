"""schemathesis against the API's own OpenAPI schema: no 5xx on any endpoint, and every documented
response matches its schema. Runs in process on a real (SQLite) database with a recording enqueue and a
real inference process."""

from __future__ import annotations

from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    unsupported_method,
)

from api.db import make_engine, make_session_factory  # noqa: E402
from api.main import create_app  # noqa: E402
from api.migrate import upgrade_head  # noqa: E402
from api.settings import Settings  # noqa: E402
from tests.factories import FakeEnqueue, serving  # noqa: E402
from trainer.inference.server import create_app as inference_app  # noqa: E402

pytestmark = pytest.mark.slow


def _app() -> object:
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="rlrun-fuzz-"))
    settings = Settings(home=home, max_upload_bytes=64 * 1024)
    # A real inference process (uvicorn in a daemon thread for the module's life): without one the chat
    # and completion routes answer a documented 503, which the no-5xx check would flag.
    inference = serving(inference_app(settings))
    settings = settings.model_copy(update={"inference_url": inference.__enter__()})
    upgrade_head(settings.resolved_database_url)
    factory = make_session_factory(make_engine(settings.resolved_database_url))
    return create_app(settings, session_factory=factory, enqueue=FakeEnqueue())


schema = schemathesis.openapi.from_asgi("/openapi.json", _app()).exclude(
    path_regex=r".*/stream$"  # an endless SSE response by design (covered by its own tests)
)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_responses_match_the_schema(case: object) -> None:
    case.call_and_validate(  # type: ignore[attr-defined]
        checks=[not_a_server_error, response_schema_conformance, content_type_conformance, unsupported_method]
    )
