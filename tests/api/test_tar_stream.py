"""api/tar_stream.py: the announced length is the streamed length, and Python's tarfile reads the stream
back byte for byte, long and non-ASCII names (PAX headers) and skipped files included."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from api.tar_stream import tar_chunks, tar_entries, tar_length


def test_the_stream_is_a_tar_of_the_announced_length(tmp_path: Path) -> None:
    files = {
        "config.json": b"{}",
        "model.safetensors": bytes(range(256)) * 41,  # not a multiple of 512
        "sub/" + "ü" * 120 + ".txt": b"x" * 512,  # a name past ustar's 100 characters, non-ASCII
        "trainer_state.pt": b"pickle",
        "optimizer/__0_0.distcp": b"shard",  # a skipped folder: all of it
        "optimizer/.metadata": b"plan",
        "optimizers/kept.txt": b"a folder whose name only starts like it",
    }
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    entries = tar_entries(tmp_path, "model", skip=frozenset({"trainer_state.pt", "optimizer"}))
    stream = b"".join(tar_chunks(entries))
    assert len(stream) == tar_length(entries)
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    kept = {k: v for k, v in files.items() if k != "trainer_state.pt" and not k.startswith("optimizer/")}
    assert got == {f"model/{k}": v for k, v in kept.items()} and len(kept) == 4


def test_files_made_here_join_the_stream_and_replace_the_folders_own(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"{}")
    (tmp_path / "README.md").write_bytes(b"the folder's own card")
    card = "# a card made at export: é\n".encode() * 30  # not a multiple of 512
    entries = tar_entries(tmp_path, "model", extra={"README.md": card})
    stream = b"".join(tar_chunks(entries))
    assert len(stream) == tar_length(entries)
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert got == {"model/config.json": b"{}", "model/README.md": card}
