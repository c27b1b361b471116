"""Wire formats the client writes and reads itself: a streamed multipart/form-data body with a known
length, and Server-Sent Events. Pure: bytes and lines in, bytes and events out."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from rlrun.errors import RlrunError

CHUNK = 64 * 1024
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class StreamEvent:
    """One Server-Sent Event of ``/v1/runs/{id}/stream``: ``event`` is ``metrics``, ``event``, ``status``
    or ``end``; ``data`` is its decoded JSON; ``id`` resumes the stream after it (``last_event_id``)."""

    event: str
    data: Any
    id: str | None


def _quote(value: str) -> str:
    """A multipart header parameter value: the HTML form encoding of ``"`` and line breaks."""
    return value.replace("\r", "%0D").replace("\n", "%0A").replace('"', "%22")


@dataclass(frozen=True)
class MultipartFile:
    """A multipart/form-data body of text fields and one file, produced chunk by chunk.

    ``length`` is known up front (Content-Length), and at most one chunk of the file is in memory.
    """

    fields: Mapping[str, str]
    file_field: str
    filename: str
    file_size: int
    boundary: str

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def head(self) -> bytes:
        out = b""
        for name, value in self.fields.items():
            out += (
                f'--{self.boundary}\r\nContent-Disposition: form-data; name="{_quote(name)}"\r\n\r\n'
                f"{value}\r\n"
            ).encode()
        out += (
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="{_quote(self.file_field)}"; '
            f'filename="{_quote(self.filename)}"\r\nContent-Type: application/x-ndjson\r\n\r\n'
        ).encode()
        return out

    def tail(self) -> bytes:
        return f"\r\n--{self.boundary}--\r\n".encode()

    @property
    def length(self) -> int:
        return len(self.head()) + self.file_size + len(self.tail())

    def chunks(
        self, fh: IO[bytes], progress: Progress | None = None, chunk_size: int = CHUNK
    ) -> Iterator[bytes]:
        """The body. ``progress(file_bytes_sent, file_size)`` is called once before the file and after
        each chunk has been handed to the connection."""
        yield self.head()
        sent = 0
        if progress:
            progress(0, self.file_size)
        while sent < self.file_size:
            chunk = fh.read(min(chunk_size, self.file_size - sent))
            if not chunk:  # shorter than its size was: the declared Content-Length would be a lie
                raise RlrunError(f"{self.filename}: the file shrank while it was being uploaded")
            yield chunk
            sent += len(chunk)
            if progress:
                progress(sent, self.file_size)
        yield self.tail()


def parse_sse(lines: Iterator[str]) -> Iterator[StreamEvent]:
    """Server-Sent Events from text lines (WHATWG rules: ``field: value`` lines, ``:`` comments, a blank
    line dispatches; several ``data`` lines join with newlines). Data is decoded as JSON."""
    event, data, last_id = "message", list[str](), None
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield StreamEvent(event, json.loads("\n".join(data)), last_id)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            last_id = value
