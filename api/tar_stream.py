"""A folder as an uncompressed tar stream of known length: produced file by file in 1 MiB chunks (bounded
memory; weights barely compress), with the exact byte count up front so a response carries
``Content-Length`` (clients show progress and can tell a cut download). Format: per file its PAX header
(``tarfile``'s own bytes), the data padded to 512, then two zero blocks."""

from __future__ import annotations

import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from fastapi.responses import StreamingResponse

CHUNK = 1 << 20
Entry = tuple[Path | bytes, tarfile.TarInfo, bytes]  # (a file, or the bytes of one made here; entry; header)


def tar_entries(
    folder: Path, arcname: str, *, skip: frozenset[str] = frozenset(), extra: dict[str, bytes] | None = None
) -> list[Entry]:
    """(file, its tar entry under ``arcname/``, the entry's header bytes) for every file of ``folder``
    but those whose path relative to it, or a folder's above them, is in ``skip``, in a stable order; then
    ``extra``'s files (path relative to the folder: its bytes), which replace the folder's files of the same
    path."""
    extra = extra or {}
    out: list[Entry] = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        skipped = rel.as_posix() in skip or any(parent.as_posix() in skip for parent in rel.parents)
        if skipped or rel.as_posix() in extra:
            continue
        info = tarfile.TarInfo(f"{arcname}/{rel.as_posix()}")
        stat = path.stat()
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        out.append((path, info, info.tobuf(format=tarfile.PAX_FORMAT)))
    for rel_name, data in sorted(extra.items()):
        info = tarfile.TarInfo(f"{arcname}/{rel_name}")
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        out.append((data, info, info.tobuf(format=tarfile.PAX_FORMAT)))
    return out


def tar_length(entries: list[Entry]) -> int:
    """The exact size of the tar ``tar_chunks`` writes: headers, data padded to 512, two zero blocks."""
    return sum(len(header) + -(-info.size // 512) * 512 for _, info, header in entries) + 1024


def tar_chunks(entries: list[Entry]) -> Iterator[bytes]:
    for path, info, header in entries:
        yield header
        if isinstance(path, bytes):
            yield path
            if info.size % 512:
                yield b"\0" * (512 - info.size % 512)
            continue
        sent = 0
        with path.open("rb") as fh:
            while sent < info.size and (chunk := fh.read(min(CHUNK, info.size - sent))):
                sent += len(chunk)
                yield chunk
        if sent < info.size:  # the file shrank while streaming: pad so the length stays true
            yield b"\0" * (info.size - sent)
        if info.size % 512:
            yield b"\0" * (512 - info.size % 512)
    yield b"\0" * 1024


def tar_response(
    folder: Path, name: str, *, skip: frozenset[str] = frozenset(), extra: dict[str, bytes] | None = None
) -> StreamingResponse:
    """``folder`` (plus ``extra``'s files, see ``tar_entries``) as an attachment ``<name>.tar`` (entries
    under ``name/``) with its exact length."""
    entries = tar_entries(folder, name, skip=skip, extra=extra)
    return StreamingResponse(
        tar_chunks(entries),
        media_type="application/x-tar",
        headers={
            "Content-Disposition": f'attachment; filename="{name}.tar"',
            "Content-Length": str(tar_length(entries)),
        },
    )
