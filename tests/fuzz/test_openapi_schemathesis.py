"""schemathesis against the API's own OpenAPI schema: no 5xx on any endpoint, and every documented
response matches its schema. Runs in process on a real (SQLite) database with a recording enqueue and a
real inference process.

One test per API operation (its label is the test id). Each operation's Hypothesis test (schemathesis'
coverage cases, then fuzzing) is built when that test runs, by the same builder as
``schema.parametrize()``. ``parametrize()`` builds all 49 at collection, and the coverage cases of the
run and pipeline specs alone took ~18 s of CPU there, in every pytest-xdist worker, whether or not it
then ran this file. Collection now only lists the operations from the app's schema (~1 s).
"""

from __future__ import annotations

import tempfile
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, seed, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.errors import UnsupportedSchema  # noqa: E402
from schemathesis.generation.feedback import FeedbackSources  # noqa: E402

# The builder schema.parametrize() and schemathesis' lazy schemas use (private: schemathesis is pinned
# in pyproject.toml).
from schemathesis.pytest._test_builder import build_operation_test  # noqa: E402
from schemathesis.python._constants.orchestrator import make_constants_value_source  # noqa: E402
from schemathesis.python.asgi import ASGIClient, get_client  # noqa: E402
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

STREAMS = r".*/stream$"  # endless SSE responses by design (covered by their own tests)
# No example database: a draw that failed is not replayed first by the next attempt (each attempt below
# has a seed of its own, so a run is the same wherever it runs, CI's derandomizing profile or not).
HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
GENERATOR_TRIES = 5  # draws of an operation's test when schemathesis' generator hits its `not` limit
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance, unsupported_method]


def operation_labels() -> list[str]:
    """``METHOD /path`` of every operation the fuzzer covers, from an app built for its schema only."""
    with tempfile.TemporaryDirectory(prefix="rlrun-fuzz-schema-") as home:
        app = create_app(Settings(home=Path(home)))
        schema = schemathesis.openapi.from_dict(app.openapi()).exclude(path_regex=STREAMS)
        return [result.ok().label for result in schema.get_all_operations()]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, FeedbackSources, ASGIClient]]:
    """The served schema (the app on a fresh SQLite home, with a real inference process: without one
    the chat and completion routes answer a documented 503, which the no-5xx check would flag), the
    feedback sources schema.parametrize() gives every operation's test, and one in-process client for
    every case.

    schemathesis' ASGI transport builds a requests session per case when none is given, and requests
    reads the proxy settings of the environment on every call (py-spy: ~15% of the main thread on
    POST /v1/runs). The shared client skips both (POST /v1/runs alone: 63.2 -> 56.3 s on a 2-core AMD
    EPYC, 2026-12-06); its cookies are cleared after each case, as schemathesis clears those of a
    session it manages."""
    home = tmp_path_factory.mktemp("fuzz")
    settings_ = Settings(home=home, max_upload_bytes=64 * 1024)
    with ExitStack() as stack:
        inference_url = stack.enter_context(serving(inference_app(settings_)))
        settings_ = settings_.model_copy(update={"inference_url": inference_url})
        upgrade_head(settings_.resolved_database_url)
        factory = make_session_factory(make_engine(settings_.resolved_database_url))
        app = create_app(settings_, session_factory=factory, enqueue=FakeEnqueue())
        schema = schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path_regex=STREAMS)
        client = stack.enter_context(get_client(app))
        client.trust_env = False  # no proxies in process: nothing to read from the environment per call
        yield schema, FeedbackSources(constants_value_source=make_constants_value_source(schema)), client


@pytest.mark.parametrize("label", operation_labels())
def test_no_server_errors_and_responses_match_the_schema(
    label: str, fuzzed: tuple[Any, FeedbackSources, ASGIClient]
) -> None:
    schema, feedback, client = fuzzed

    def call_and_validate(case: Any) -> None:
        try:
            case.call_and_validate(session=client, checks=CHECKS)
        finally:
            client.cookies.clear()

    operation = schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is listed at collection but not served"
    hypothesis_test = build_operation_test(
        config=schema.config,
        operation=operation,
        test_func=call_and_validate,
        given_kwargs={},
        feedback=feedback,
        explicit_settings=HYPOTHESIS,
    )
    for attempt in range(1, GENERATOR_TRIES + 1):
        try:
            seed(zlib.crc32(f"{label} {attempt}".encode()))(hypothesis_test)()
            return
        except UnsupportedSchema as exc:
            # schemathesis' negative mode sometimes mutates a part of a schema into a `not` it cannot
            # draw from (seen on 2026-12-06, on POST /v1/fine_tuning/alpha/graders/run, twice in a row in
            # one run): a limit of the generator, raised before any request, not an answer of the API.
            # Draw again with the next seed; any other unsupported schema, or the limit every time, fails.
            # (On 2026-12-07 POST /v1/pipelines failed all 5 attempts in 179 s: with Hypothesis' example
            # database each attempt replayed the draw that had failed, and under CI's derandomizing
            # profile every attempt would draw the same cases; hence a seed per attempt and no database.)
            if "`not` whose complement" not in str(exc) or attempt == GENERATOR_TRIES:
                raise
