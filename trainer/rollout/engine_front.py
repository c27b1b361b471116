"""The engine's front for workers on other hosts (``rlrun engine --remote``): a token-checked HTTP server
in front of the engine process that takes weights over HTTP.

A worker on the engine's own host syncs by writing the weights into ``/dev/shm`` and asking the engine to
reload that folder (``/collective_rpc``, one of the dev-mode routes that must never leave loopback:
trainer/rollout/engine_process.py). A worker elsewhere shares no folder with the engine, so the front:

- listens where workers reach it and answers only requests carrying its token
  (``Authorization: Bearer <RLRUN_ENGINE_TOKEN>``; ``/health`` answers anyone, for probes);
- passes on to the engine, unchanged, the routes a rollout needs: ``/v1/completions``, ``/v1/models``,
  ``/server_info``, ``/abort_requests``, ``/reset_prefix_cache``, ``/v1/unload_lora_adapter``. No other
  engine route is reachable through it (``/collective_rpc`` runs any method of the engine's workers);
- ``PUT /rlrun/weights``: the body is a whole model's ``model.safetensors``, streamed into the front's own
  folder in shared memory, checked to be a complete safetensors file (header and data lengths), then
  reloaded in place; a cut or corrupt upload is refused (400) and the engine keeps the weights it had;
- ``PUT /rlrun/adapters/{name}``: the body is an adapter folder as a tar stream (peft's
  ``adapter_config.json`` and ``adapter_model.safetensors``), unpacked into the front's folder and loaded
  as the LoRA ``name``; unloading it removes the folder;
- ``GET /rlrun/front`` tells a client that weights go by upload (trainer/rollout/served_engine.py's
  ``attach_served_engine`` asks).

Weights then cross the network at every sync: a whole model's bytes, or an adapter's few MB (a LoRA run
on a GPU). Given a certificate and its key (``rlrun engine --remote --tls-cert F --tls-key F``) the front
speaks https only, so the token and the weights cross the network encrypted; workers check the
certificate against ``RLRUN_ENGINE_CA`` (a self-signed front's own certificate) or their default trust.
Without one it speaks plain HTTP: a private network, or a tunnel. Broadcasting the weights over NCCL from
the trainer's GPUs into the engine's (TRL's ``vllm-serve``, verl) is not built.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import shutil
import struct
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from trainer.rollout.engine_process import (
    ADAPTERS_ROUTE,
    ENGINE_TOKEN_VARIABLE,
    FRONT_ROUTE,
    WEIGHTS_ROUTE,
    token_headers,
)

PASSED_ON = (
    ("GET", "/v1/models"),
    ("GET", "/server_info"),
    ("POST", "/v1/completions"),
    ("POST", "/abort_requests"),
    ("POST", "/reset_prefix_cache"),
)
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")  # a folder name: never "." or ".."
CHUNK = 1 << 20


def error(status: int, message: str) -> JSONResponse:
    """An answer in the engine's (OpenAI's) error shape, which ``engine_message`` reads."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


def passed_back(resp: httpx.Response) -> Response:
    """The engine's answer as it came: status, body and content type."""
    return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))


def check_safetensors(path: Path) -> None:
    """Raise ValueError unless ``path`` is a whole safetensors file: an 8-byte little-endian header length,
    a JSON header of tensors (dtype, shape, data_offsets), and exactly the data bytes the header names."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes is no safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"the safetensors header claims {header_len} bytes; the upload has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    if not ends:
        raise ValueError("the safetensors file holds no tensors")
    data = size - 8 - header_len
    if max(ends) != data:
        raise ValueError(f"the safetensors header names {max(ends)} bytes of tensors; the upload has {data}")


def bearer_check(token: str) -> Callable[[Request], None]:
    """A dependency refusing (401) a request without ``Authorization: Bearer <token>``."""

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, token_headers(token)["Authorization"].encode()):
            raise FrontRefusal(
                401,
                f"this engine needs its token: set {ENGINE_TOKEN_VARIABLE} to what "
                "`rlrun engine --remote` printed",
            )

    return check


class FrontRefusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def front_app(upstream: str, token: str, weights_dir: Path) -> FastAPI:
    """The front's app: the engine at ``upstream`` (loopback), requests checked against ``token``, uploads
    kept under ``weights_dir``."""
    engine = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.aclose()  # on the server's loop, as it shuts down: its connections closed

    app = FastAPI(
        title="rlrun engine front", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.engine = engine
    guarded = [Depends(bearer_check(token))]
    adapters = weights_dir / "adapters"
    uploads = asyncio.Lock()  # one weights upload at a time: it goes to a fixed name

    @app.exception_handler(FrontRefusal)
    async def refused(_: Request, exc: FrontRefusal) -> JSONResponse:
        return error(exc.status, exc.message)

    @app.get("/health")
    async def health() -> Response:
        try:
            return passed_back(await engine.get("/health"))
        except httpx.TransportError as exc:
            return error(503, f"the engine behind this front does not answer: {exc}")

    async def pass_on(request: Request) -> Response:
        try:
            resp = await engine.request(
                request.method,
                request.url.path,
                params=request.query_params,
                content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        except httpx.TransportError as exc:
            return error(503, f"the engine behind this front does not answer: {exc}")
        return passed_back(resp)

    for method, path in PASSED_ON:
        app.add_api_route(path, pass_on, methods=[method], dependencies=guarded)

    @app.get(FRONT_ROUTE, dependencies=guarded)
    async def front() -> dict[str, Any]:
        return {"weights": "upload", "adapters": "upload"}

    @app.put(WEIGHTS_ROUTE, dependencies=guarded)
    async def put_weights(request: Request) -> Response:
        partial, target = weights_dir / ".model.safetensors.partial", weights_dir / "model.safetensors"
        async with uploads:
            try:
                with partial.open("wb") as f:
                    async for chunk in request.stream():
                        f.write(chunk)
                check_safetensors(partial)
            except ValueError as exc:
                partial.unlink(missing_ok=True)
                return error(400, f"the weights upload is not a whole model.safetensors: {exc}")
            except ClientDisconnect:  # the worker went away mid-upload: nothing half-written stays
                partial.unlink(missing_ok=True)
                return error(400, "the weights upload was cut off")
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            partial.replace(target)
            reload = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
            return passed_back(await engine.post("/collective_rpc", json=reload))

    @app.put(ADAPTERS_ROUTE + "/{name}", dependencies=guarded)
    async def put_adapter(name: str, request: Request) -> Response:
        if not ADAPTER_NAME.match(name):
            return error(
                400,
                f"adapter name {name!r}: letters, digits, '.', '_' and '-' (1-128), not starting with '.'",
            )
        folder = adapters / name
        if folder.exists():
            return error(409, f"an adapter named {name!r} is loaded; unload it first")
        with tempfile.TemporaryFile(dir=weights_dir) as body:  # on disk, not in memory, however large
            try:
                async for chunk in request.stream():
                    body.write(chunk)
            except ClientDisconnect:
                return error(400, "the adapter upload was cut off")
            body.seek(0)
            try:
                with tarfile.open(fileobj=body, mode="r:") as tar:
                    tar.extractall(folder, filter="data")  # no paths outside the folder, no links out
            except (tarfile.TarError, OSError) as exc:
                shutil.rmtree(folder, ignore_errors=True)
                return error(400, f"the adapter upload is not a tar of an adapter folder: {exc}")
        if not (folder / "adapter_config.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            return error(400, "the adapter upload holds no adapter_config.json")
        resp = await engine.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        if resp.status_code != 200:
            shutil.rmtree(folder, ignore_errors=True)
        return passed_back(resp)

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload_adapter(request: Request) -> Response:
        body = await request.body()
        resp = await engine.post(
            "/v1/unload_lora_adapter", content=body, headers={"content-type": "application/json"}
        )
        try:
            name = str(json.loads(body).get("lora_name", ""))
        except (ValueError, AttributeError):
            name = ""
        if resp.status_code == 200 and ADAPTER_NAME.match(name):
            shutil.rmtree(adapters / name, ignore_errors=True)
        return passed_back(resp)

    return app


def check_tls_pair(cert: Path, key: Path) -> None:
    """Raise ValueError (both files named) unless ``cert`` is a PEM certificate (chain) and ``key`` its
    unencrypted private key."""
    import ssl

    def no_password() -> str:  # OpenSSL would ask at the terminal: a front starts unattended
        raise ValueError("the key is encrypted")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=no_password)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ValueError(
            f"{cert} and {key} are not a PEM certificate and its unencrypted key: {exc}"
        ) from None


class EngineFront:
    """The front served by uvicorn in a thread of this process until ``close()``.

    Args:
        upstream: the engine's loopback URL.
        token: what every request but ``/health`` must carry.
        weights_dir: the front's own folder for uploads (the caller creates and removes it).
        host, port: where to listen (port 0: a free one; ``port`` then holds it).
        tls: a PEM certificate (chain) and its private key: the front then speaks https only.

    Raises:
        ValueError: ``tls``'s files are not a certificate and its matching key (the files named).
        RuntimeError: the front could not listen.
    """

    def __init__(
        self,
        upstream: str,
        token: str,
        weights_dir: Path,
        *,
        host: str,
        port: int = 0,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        import socket

        import uvicorn

        self.host = host
        self.scheme = "https" if tls else "http"
        files: dict[str, Any] = {}
        if tls is not None:
            check_tls_pair(*tls)  # uvicorn would load them in its thread, which then just ends
            files = {"ssl_certfile": str(tls[0]), "ssl_keyfile": str(tls[1])}
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = int(sock.getsockname()[1])
        self._socket = sock
        self.app = front_app(upstream, token, weights_dir)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            **files,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="engine-front", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the engine's front could not listen on {host}:{self.port}")
            self._thread.join(0.05)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
