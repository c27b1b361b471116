"""A typed Python client for the rlrun REST API.

Responses are parsed into the server's own pydantic models (``rlrun.schemas``, which the API answers
with), so the client cannot drift from the API it talks to::

    from rlrun import Client

    with Client() as rl:  # RLRUN_URL (default http://127.0.0.1:8000), RLRUN_API_KEY
        ds = rl.datasets.upload("pairs.jsonl")  # kind detected; or kind="preference"
        run = rl.runs.create({"algorithm": "dpo", "model": "tiny:llama-0.4m", "dataset_id": str(ds.id)})
        run = rl.runs.wait(run.id, timeout=600)

Every non-2xx answer raises :class:`ApiError` (status, code, message, field from the API's error body);
a server that cannot be reached raises :class:`ConnectionFailed`.
"""

from __future__ import annotations

import builtins
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from rlrun.errors import ApiError, ConnectionFailed, RlrunError, WaitTimeout
from rlrun.schemas import (
    CheckpointRead,
    DatasetKind,
    DatasetRead,
    DatasetRowRead,
    EnvironmentRead,
    ErrorBody,
    EventRead,
    MetricRead,
    ModelImport,
    ModelList,
    ModelRead,
    Page,
    PipelineRead,
    RunRead,
    SampleRead,
    SkippedLineRead,
)
from rlrun.wire import CHUNK, MultipartFile, Progress, StreamEvent, parse_sse

DEFAULT_URL = "http://127.0.0.1:8000"
FINISHED = ("succeeded", "failed", "cancelled")  # = api.models.FINISHED_STATUSES (a test keeps them equal)

Id = str | uuid.UUID
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_CHECKPOINTS = TypeAdapter(list[CheckpointRead])
_KEYS = TypeAdapter(list[str])


def _error_from(resp: httpx.Response) -> ApiError:
    try:
        info = ErrorBody.model_validate_json(resp.content).error
    except ValidationError:
        openai_error = _openai_error(resp)  # /v1/models and the other OpenAI paths answer in OpenAI's shape
        if openai_error is not None:
            return openai_error
        # not an API's shape (a proxy's page, a crash before the app): keep it short
        text = resp.text.strip().splitlines()[0][:200] if resp.text.strip() else resp.reason_phrase
        return ApiError(resp.status_code, "http_error", f"HTTP {resp.status_code}: {text}")
    return ApiError(resp.status_code, info.code, info.message, info.field, info.details)


def _openai_error(resp: httpx.Response) -> ApiError | None:
    """``{"error": {"message", "type", "param", "code"}}`` as an ApiError, or None for another body."""
    try:
        info = resp.json()["error"]
        message, code, param = info["message"], info.get("code"), info.get("param")
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(message, str):
        return None
    return ApiError(resp.status_code, str(code or "http_error"), message, str(param) if param else None, None)


class Unset:
    """A keyword left out (where None means something: ``note=None`` removes a note)."""


UNSET = Unset()


def _params(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class _Namespace:
    def __init__(self, client: Client):
        self._client = client


class Datasets(_Namespace):
    """``/v1/datasets``."""

    def upload(
        self,
        path: str | os.PathLike[str],
        *,
        kind: DatasetKind | None = None,
        name: str | None = None,
        skip_invalid: bool = False,
        progress: Progress | None = None,
        chunk_size: int = CHUNK,
    ) -> DatasetRead:
        """Upload a JSONL file, streamed (bounded memory) with a known Content-Length; ``name`` defaults
        to the file's name, ``kind`` (None) to the one the server detects from the first lines
        (``kind_detected``). ``progress(bytes_sent, total)`` reports the file's bytes. The server
        validates every line and stores all rows or none (422 with line-numbered ``details``); with
        ``skip_invalid`` it stores the valid rows and lists the others (``skipped_count``, ``skipped``,
        :meth:`skipped`)."""
        file = Path(path)
        given = {"kind": kind, "name": name, "skip_invalid": "true" if skip_invalid else None}
        # left out: the server detects the kind, names the dataset after the file, refuses bad lines
        fields = {k: v for k, v in given.items() if v is not None}
        with file.open("rb") as fh:
            body = MultipartFile(
                fields=fields,
                file_field="file",
                filename=file.name,
                file_size=os.fstat(fh.fileno()).st_size,
                boundary=f"rlrun-{secrets.token_hex(16)}",
            )
            resp = self._client.request(
                "POST",
                "/v1/datasets",
                content=body.chunks(fh, progress, chunk_size),
                headers={"Content-Type": body.content_type, "Content-Length": str(body.length)},
            )
        return _parse(DatasetRead, resp)

    def create(
        self,
        name: str,
        rows: builtins.list[dict[str, Any]],
        *,
        kind: DatasetKind | None = None,
        skip_invalid: bool = False,
    ) -> DatasetRead:
        """A small dataset as one JSON body (``kind`` None: detected, as for :meth:`upload`)."""
        body: dict[str, Any] = {"name": name, "rows": rows, "skip_invalid": skip_invalid}
        if kind is not None:
            body["kind"] = kind
        return _parse(DatasetRead, self._client.request("POST", "/v1/datasets", json=body))

    def list(self, *, limit: int | None = None, after: str | None = None) -> Page[DatasetRead]:
        """One page, newest first; pass ``next_cursor`` as ``after`` for the next."""
        resp = self._client.request("GET", "/v1/datasets", params=_params(limit=limit, after=after))
        return _parse(Page[DatasetRead], resp)

    def get(self, dataset_id: Id) -> DatasetRead:
        return _parse(DatasetRead, self._client.request("GET", f"/v1/datasets/{dataset_id}"))

    def rows(
        self, dataset_id: Id, *, limit: int | None = None, after: str | None = None
    ) -> Page[DatasetRowRead]:
        """Normalised rows in upload order."""
        resp = self._client.request(
            "GET", f"/v1/datasets/{dataset_id}/rows", params=_params(limit=limit, after=after)
        )
        return _parse(Page[DatasetRowRead], resp)

    def skipped(
        self, dataset_id: Id, *, limit: int | None = None, after: str | None = None
    ) -> Page[SkippedLineRead]:
        """Lines an upload with ``skip_invalid`` left out, in line order (number, reason, field)."""
        resp = self._client.request(
            "GET", f"/v1/datasets/{dataset_id}/skipped", params=_params(limit=limit, after=after)
        )
        return _parse(Page[SkippedLineRead], resp)


class Runs(_Namespace):
    """``/v1/runs`` and a run's metrics, events, checkpoints, samples and stream."""

    def create(self, spec: Mapping[str, Any] | BaseModel, *, idempotency_key: str | None = None) -> RunRead:
        """Submit a run spec. With ``idempotency_key``, a retry returns the same run (409 if the key was
        used for a different spec)."""
        body = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else dict(spec)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return _parse(RunRead, self._client.request("POST", "/v1/runs", json=body, headers=headers))

    def list(
        self,
        *,
        status: str | None = None,
        limit: int | None = None,
        after: str | None = None,
        flagged: bool | None = None,
        sort: str | None = None,
        q: str | None = None,
        tags: Sequence[str] = (),
        algorithm: str | None = None,
    ) -> Page[RunRead]:
        """One page, newest first, optionally only runs in ``status``; ``flagged`` True: only runs with
        health warnings (``warnings`` not empty), False: only runs without, None: both. ``sort``: a column
        of created_at, name, status, algorithm, ``-`` first for descending; ``q``: a search of name,
        algorithm, model, tags, note and id prefix; ``tags``: only runs with all of them; ``algorithm``:
        only runs of that type."""
        params = _params(
            status=status, limit=limit, after=after, flagged=flagged, sort=sort, q=q, algorithm=algorithm
        )
        if tags:
            params["tag"] = list(tags)
        return _parse(Page[RunRead], self._client.request("GET", "/v1/runs", params=params))

    def iter(
        self,
        *,
        status: str | None = None,
        flagged: bool | None = None,
        page_size: int = 100,
        sort: str | None = None,
        q: str | None = None,
        tags: Sequence[str] = (),
        algorithm: str | None = None,
    ) -> Iterator[RunRead]:
        """Every run (filters and order as for :meth:`list`), fetching pages as it goes."""
        after: str | None = None
        while True:
            page = self.list(
                status=status,
                limit=page_size,
                after=after,
                flagged=flagged,
                sort=sort,
                q=q,
                tags=tags,
                algorithm=algorithm,
            )
            yield from page.data
            if not page.has_more:
                return
            after = page.next_cursor

    def update(
        self, run_id: Id, *, tags: Sequence[str] | None = None, note: str | None | Unset = UNSET
    ) -> RunRead:
        """Replace the run's tags and/or note (``note=None`` removes it); what is left out stays."""
        body: dict[str, Any] = {}
        if tags is not None:
            body["tags"] = list(tags)
        if not isinstance(note, Unset):
            body["note"] = note
        return _parse(RunRead, self._client.request("PATCH", f"/v1/runs/{run_id}", json=body))

    def get(self, run_id: Id) -> RunRead:
        return _parse(RunRead, self._client.request("GET", f"/v1/runs/{run_id}"))

    def cancel(self, run_id: Id) -> RunRead:
        """Queued: cancelled at once; running: within seconds (``cancel_requested``); ended: 409."""
        return _parse(RunRead, self._client.request("POST", f"/v1/runs/{run_id}/cancel"))

    def pause(self, run_id: Id) -> RunRead:
        return _parse(RunRead, self._client.request("POST", f"/v1/runs/{run_id}/pause"))

    def resume(self, run_id: Id) -> RunRead:
        return _parse(RunRead, self._client.request("POST", f"/v1/runs/{run_id}/resume"))

    def wait(self, run_id: Id, timeout: float | None = None, *, interval: float = 0.5) -> RunRead:
        """Poll until the run has ended (succeeded, failed or cancelled) and return it.

        Raises :class:`WaitTimeout` after ``timeout`` seconds (``None``: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.get(run_id)
            if run.status in FINISHED:
                return run
            if deadline is not None and time.monotonic() + interval > deadline:
                raise WaitTimeout(f"run {run_id} is still {run.status} after {timeout} s")
            time.sleep(interval)

    def metrics(
        self,
        run_id: Id,
        *,
        keys: builtins.list[str] | None = None,
        max_points: int | None = None,
        min_step: int | None = None,
        max_step: int | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> Page[MetricRead]:
        """Values ordered by step then key; with ``max_points`` (>= 4), a downsampled series per key
        (first, last and each bucket's extremes kept) in one page."""
        params = _params(
            key=keys, max_points=max_points, min_step=min_step, max_step=max_step, limit=limit, after=after
        )
        resp = self._client.request("GET", f"/v1/runs/{run_id}/metrics", params=params)
        return _parse(Page[MetricRead], resp)

    def metric_keys(self, run_id: Id) -> builtins.list[str]:
        """The keys the run has logged, sorted."""
        resp = self._client.request("GET", f"/v1/runs/{run_id}/metric-keys")
        return _parse_adapter(_KEYS, resp)

    def events(self, run_id: Id, *, limit: int | None = None, after: str | None = None) -> Page[EventRead]:
        resp = self._client.request(
            "GET", f"/v1/runs/{run_id}/events", params=_params(limit=limit, after=after)
        )
        return _parse(Page[EventRead], resp)

    def checkpoints(self, run_id: Id) -> builtins.list[CheckpointRead]:
        return _parse_adapter(_CHECKPOINTS, self._client.request("GET", f"/v1/runs/{run_id}/checkpoints"))

    def download(
        self,
        run_id: Id,
        path: str | os.PathLike[str],
        *,
        format: Literal["hf", "adapter"] = "hf",
        progress: Progress | None = None,
        merge: bool = True,
        on_merge: Callable[[RunRead], None] | None = None,
    ) -> int:
        """Write a succeeded run's model to ``path`` as a tar (``/v1/runs/{id}/export``): a Hugging Face
        folder (``hf``) or an adapter run's adapter (``adapter``). ``progress(bytes_written, total)``
        after each chunk. Written to ``path + ".part"`` and renamed when complete, so a broken download
        leaves no file that looks whole. ``hf`` of an adapter run needs a merge run of it: with ``merge``
        one is made (``merge_adapter``; ``on_merge`` is told of it) and waited for. Returns the bytes
        written."""
        try:
            return self._download(run_id, path, format, progress)
        except ApiError as exc:
            if exc.code != "merge_required" or not merge:
                raise
        self.merge_adapter(run_id, on_merge=on_merge)
        return self._download(run_id, path, format, progress)

    def merge_adapter(
        self, run_id: Id, *, on_merge: Callable[[RunRead], None] | None = None, timeout: float | None = None
    ) -> RunRead:
        """Merge an adapter run's adapter into its base with a ``merge`` run (one per adapter run: the
        request is idempotent) and wait for it. Raises :class:`RlrunError` if the merge did not succeed."""
        spec = {"algorithm": "merge", "model": f"run:{run_id}"}
        merge = self.create(spec, idempotency_key=f"merge-{run_id}")
        if on_merge is not None:
            on_merge(merge)
        done = self.wait(merge.id, timeout)
        if done.status != "succeeded":
            raise RlrunError(f"merging run {run_id}'s adapter (run {done.id}) {done.status}: {done.error}")
        return done

    def _download(
        self, run_id: Id, path: str | os.PathLike[str], format: str, progress: Progress | None
    ) -> int:
        target = Path(path)
        partial = target.with_name(target.name + ".part")
        written = 0
        with self._client.stream("GET", f"/v1/runs/{run_id}/export", params={"format": format}) as resp:
            total = int(resp.headers.get("content-length", 0))
            try:
                with partial.open("wb") as fh:
                    for chunk in resp.iter_bytes(CHUNK):
                        fh.write(chunk)
                        written += len(chunk)
                        if progress is not None:
                            progress(written, total)
            except httpx.TransportError as exc:
                partial.unlink(missing_ok=True)
                raise self._client._connection_failed(exc) from exc
        if total and written != total:
            partial.unlink(missing_ok=True)
            raise RlrunError(f"the download of run {run_id} stopped at {written} of {total} bytes")
        partial.replace(target)
        return written

    def samples(
        self, run_id: Id, *, step: int | None = None, limit: int | None = None, after: str | None = None
    ) -> Page[SampleRead]:
        """Online RL: stored completions with their rewards."""
        resp = self._client.request(
            "GET", f"/v1/runs/{run_id}/samples", params=_params(step=step, limit=limit, after=after)
        )
        return _parse(Page[SampleRead], resp)

    def stream(
        self, run_id: Id, *, last_event_id: str | None = None, poll_seconds: float | None = None
    ) -> Iterator[StreamEvent]:
        """The run's Server-Sent Events as they land, ending after the ``end`` event."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else None
        params = _params(poll_seconds=poll_seconds)
        with self._client.stream("GET", f"/v1/runs/{run_id}/stream", params=params, headers=headers) as resp:
            try:
                for message in parse_sse(resp.iter_lines()):
                    yield message
                    if message.event == "end":
                        return
            except httpx.TransportError as exc:  # the connection broke mid-stream
                raise self._client._connection_failed(exc) from exc


class Pipelines(_Namespace):
    """``/v1/pipelines``: chained runs."""

    def create(self, body: Mapping[str, Any] | BaseModel) -> PipelineRead:
        payload = body.model_dump(mode="json") if isinstance(body, BaseModel) else dict(body)
        return _parse(PipelineRead, self._client.request("POST", "/v1/pipelines", json=payload))

    def get(self, pipeline_id: Id) -> PipelineRead:
        return _parse(PipelineRead, self._client.request("GET", f"/v1/pipelines/{pipeline_id}"))

    def cancel(self, pipeline_id: Id) -> PipelineRead:
        return _parse(PipelineRead, self._client.request("POST", f"/v1/pipelines/{pipeline_id}/cancel"))


class Environments(_Namespace):
    """``/v1/environments``: environment code (``reset``/``step``) stored once, named by id in run specs."""

    def create(self, source: str, *, name: str) -> EnvironmentRead:
        body = {"name": name, "source": source}
        return _parse(EnvironmentRead, self._client.request("POST", "/v1/environments", json=body))

    def list(self, *, limit: int | None = None, after: str | None = None) -> Page[EnvironmentRead]:
        """A page of the project's environments, newest first."""
        resp = self._client.request("GET", "/v1/environments", params=_params(limit=limit, after=after))
        return _parse(Page[EnvironmentRead], resp)

    def get(self, environment_id: Id) -> EnvironmentRead:
        return _parse(EnvironmentRead, self._client.request("GET", f"/v1/environments/{environment_id}"))

    def delete(self, environment_id: Id) -> None:
        """Remove it; runs that used it keep its code in their specs."""
        self._client.request("DELETE", f"/v1/environments/{environment_id}")


class Models(_Namespace):
    """``/v1/models``: presets, model folders and run models; importing a GGUF file or a folder."""

    def list(self) -> builtins.list[ModelRead]:
        return _parse(ModelList, self._client.request("GET", "/v1/models")).data

    def get(self, model: str) -> ModelRead:
        return _parse(ModelRead, self._client.request("GET", f"/v1/models/{model}"))

    def import_model(self, source: str, *, name: str | None = None, timeout: float = 3600.0) -> ModelRead:
        """Import a catalog model (``smollm2-135m-instruct``) or a GGUF file / safetensors folder on the
        server (inside its model roots) as a model folder; returns when the folder is complete."""
        body = ModelImport(source=source, name=name).model_dump(mode="json", exclude_none=True)
        resp = self._client.request("POST", "/v1/models/import", json=body, timeout=timeout)
        return _parse(ModelRead, resp)


class Client:
    """The rlrun API over HTTP: ``datasets``, ``runs``, ``pipelines``, ``environments`` and ``models``
    namespaces.

    ``base_url`` defaults to ``$RLRUN_URL`` (else http://127.0.0.1:8000) and ``api_key`` to
    ``$RLRUN_API_KEY``, sent as ``Authorization: Bearer``. Use it as a context manager, or ``close()``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 30.0,
        *,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = (base_url or os.environ.get("RLRUN_URL") or DEFAULT_URL).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("RLRUN_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )
        self.datasets = Datasets(self)
        self.runs = Runs(self)
        self.pipelines = Pipelines(self)
        self.environments = Environments(self)
        self.models = Models(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; raises :class:`ApiError` on a non-2xx answer, :class:`ConnectionFailed` when the
        server cannot be reached."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._connection_failed(exc) from exc
        if resp.is_error:
            raise _error_from(resp)
        return resp

    def stream(self, method: str, path: str, **kwargs: Any) -> _Stream:
        """A streamed response (context manager) with the same error handling as :meth:`request`."""
        return _Stream(self, method, path, kwargs)

    def _connection_failed(self, exc: httpx.TransportError) -> ConnectionFailed:
        if isinstance(exc, httpx.TimeoutException):
            return ConnectionFailed(f"the rlrun server at {self.base_url} did not answer in time ({exc})")
        reason = str(exc) or type(exc).__name__
        return ConnectionFailed(f"cannot reach the rlrun server at {self.base_url}: {reason}")


class _Stream:
    def __init__(self, client: Client, method: str, path: str, kwargs: dict[str, Any]):
        self._client, self._method, self._path, self._kwargs = client, method, path, kwargs
        self._resp: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        http = self._client._http
        try:
            resp = http.send(http.build_request(self._method, self._path, **self._kwargs), stream=True)
        except httpx.TransportError as exc:
            raise self._client._connection_failed(exc) from exc
        if resp.is_error:
            try:
                resp.read()
            finally:
                resp.close()
            raise _error_from(resp)
        self._resp = resp
        return resp

    def __exit__(self, *_exc: object) -> None:
        if self._resp is not None:
            self._resp.close()


def _parse(model: type[M], resp: httpx.Response) -> M:
    try:
        return model.model_validate_json(resp.content)
    except ValidationError as exc:
        raise _unexpected(resp, exc) from exc


def _parse_adapter(adapter: TypeAdapter[T], resp: httpx.Response) -> T:
    try:
        return adapter.validate_json(resp.content)
    except ValidationError as exc:
        raise _unexpected(resp, exc) from exc


def _unexpected(resp: httpx.Response, exc: ValidationError) -> RlrunError:
    """A 2xx answer that is not what this client's schemas say: a server of another version."""
    return RlrunError(f"unexpected answer from {resp.request.url}: {exc.error_count()} invalid field(s)")
