"""The FastAPI application factory. Run with ``uvicorn api.main:create_app --factory`` or ``rlrun serve``."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.orm import Session, sessionmaker

from api.compression import JsonGzipMiddleware
from api.db import make_engine, make_session_factory
from api.errors import install_error_handlers
from api.queue import CeleryEnqueue, Enqueue
from api.request_log import RequestLog
from api.routers import (
    agent,
    checkpoints,
    datasets,
    environments,
    export,
    graders,
    inference,
    models,
    openai_files,
    openai_jobs,
    pipelines,
    runs,
    stream,
    tinker,
    webhooks,
)
from api.services.tinker import TinkerError
from api.settings import Settings, get_settings

log = logging.getLogger("rlrun.api")


def create_app(
    settings: Settings | None = None,
    *,
    session_factory: sessionmaker[Session] | None = None,
    enqueue: Enqueue | None = None,
) -> FastAPI:
    """Build the app. Nothing connects until the first request; the schema comes from Alembic."""
    settings = settings or get_settings()
    app = FastAPI(
        title="rlrun",
        version="0.1.0",
        summary="LLM post-training (SFT, reward models, DPO, online RL) as managed runs.",
    )
    app.state.settings = settings
    app.state.session_factory = session_factory or make_session_factory(
        make_engine(settings.resolved_database_url)
    )
    app.state.enqueue = enqueue or CeleryEnqueue(settings)
    install_error_handlers(app)
    app.add_exception_handler(TinkerError, tinker.tinker_error_response)
    routers = [
        datasets.router,
        runs.router,
        runs.metrics_router,
        checkpoints.router,
        export.router,
        pipelines.router,
        stream.router,
        webhooks.router,
        environments.router,
        agent.router,
        models.router,
        # The OpenAI-compatible surface (/v1/files, /v1/fine_tuning/jobs), mapped onto datasets and runs.
        openai_files.router,
        openai_jobs.router,
        graders.router,
        inference.router,
        # The Tinker protocol (/api/v1), for the official `tinker` SDK: outside the OpenAPI document.
        tinker.router,
    ]
    for router in routers:  # in this order: it is the order of the OpenAPI document's paths
        app.include_router(router)

    app.add_middleware(JsonGzipMiddleware)

    app.add_middleware(RequestLog)

    static = Path(__file__).resolve().parent / "static"
    app.mount("/static", StaticFiles(directory=static, check_dir=False), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        """The web dashboard (static files; it reads the same /v1 API)."""
        return FileResponse(static / "index.html")

    @app.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, str]:
        """Liveness probe."""
        return {"status": "ok"}

    return app
