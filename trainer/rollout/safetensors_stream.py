"""A safetensors file as a stream of blocks made from tensors in memory: the body of a weight upload to a
remote engine's front (``PUT /rlrun/weights``) that is never written to disk or shared memory first.

The format (https://huggingface.co/docs/safetensors, "Format"): 8 bytes, the header's length N as a
little-endian u64; N bytes of JSON, ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}`` with
an optional ``"__metadata__"`` map of strings, padded with spaces to a multiple of 8; then the tensors'
bytes, row-major, little-endian, each at its offsets (relative to the end of the header), back to back.
The header is computed from shapes and dtypes alone, so the length is known before the first byte is sent
(the upload's ``Content-Length``), and each tensor is read (moved to the CPU, made contiguous) only when the
stream reaches it: at most one tensor's copy is held at a time, where writing the file first held the whole
model twice (7B in bf16: 14 GB of ``/dev/shm`` per sync on the worker).

Tensors that share storage (an LM head tied to the embedding) are sent once, under the name
``safetensors.torch.save_model`` keeps (the first in sorted order of those covering the whole storage),
with the same ``{dropped: kept}`` metadata, and the tensors are laid out in safetensors' own order (widest
dtype first, each aligned to its element size): the stream's bytes are the file ``save_model`` writes.

Sharded tensors (FSDP2's ``DTensor`` parameters) are streamed whole without the whole model ever being
gathered: the header comes from their global shapes, and each is gathered (``full_tensor()``, a collective)
only when the stream reaches it, so a rank holds one whole parameter at a time, where gathering the full
state dict first held the whole model on rank 0 (7B in fp32: 28 GB of host memory per sync, plus the file
written from it). Every rank of the mesh must join each gather in the same order: the ranks that send the
stream iterate it, and every rank then calls ``gather_rest()``, which joins the gathers its own iteration
did not reach (all of them on a rank that sends nothing, the rest after a send cut short). Which names are
tied must then be the same on every rank, so the caller names them (``shared``: from the module's
parameters, ``tied_names``): a shard's storage differs from rank to rank (it may even be empty).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# safetensors' own order of the tensors in a file (its Rust writer: widest dtype first, then by name), so
# that each tensor starts aligned to its element size and the bytes are the ones ``save_file`` writes.
WIDEST_FIRST = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Deferred:
    """A tensor made only when the stream reaches it (``make()``, which may run collectives: every rank then
    makes it in the stream's order), known before that by its shape and dtype alone (a layer's weight with an
    adapter merged into it, gathered first where it is sharded: trainer/rollout/weight_streams.py)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _covers_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return tensor.data_ptr() == storage.data_ptr() and tensor.nbytes == storage.nbytes()


def without_shared(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``tensors`` with each group sharing one storage reduced to one name (as ``save_model`` does), and
    the ``{dropped: kept}`` map of the names left out.

    Raises:
        ValueError: a group in which no tensor covers the whole storage (slices of one buffer): sending
            each would send more than the model holds, and ``save_model`` refuses it too.
    """
    groups: dict[tuple[torch.device, int], list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.nbytes:
            groups.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(name)
    dropped: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        whole = sorted(n for n in names if _covers_storage(tensors[n]))
        if not whole:
            raise ValueError(f"tensors {sorted(names)} share one storage and none covers all of it")
        dropped |= {name: whole[0] for name in names if name != whole[0]}
    return {name: t for name, t in tensors.items() if name not in dropped}, dropped


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """The ``{dropped: kept}`` names of ``module``'s state dict that are one parameter or buffer under
    several names (an LM head tied to the embedding), keeping the first in sorted order as ``save_model``
    does; read from the module's structure, so the same on every rank of a sharded model."""
    keys = set(module.state_dict())
    groups: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if name in keys:
            groups.setdefault(id(tensor), []).append(name)
    dropped: dict[str, str] = {}
    for names in groups.values():
        kept = min(names)
        dropped |= {name: kept for name in names if name != kept}
    return dropped


class SafetensorsStream:
    """The bytes of the safetensors file holding ``tensors``, produced a block at a time.

    ``len(stream)`` is the file's size; iterating yields its bytes in blocks of at most ``block`` bytes
    (one tensor's bytes are never joined to the next's). Iterating twice yields the same bytes as long as
    the tensors did not change in between; a stream of sharded tensors is read once (its gathers are
    collectives: see the module doc and ``gather_rest``).

    Args:
        tensors: name -> tensor; ``DTensor`` values are gathered whole as the stream reaches them,
            ``Deferred`` ones made then.
        block: the largest block yielded.
        shared: the ``{dropped: kept}`` names of tensors that are one (``tied_names``); default: found from
            the tensors' storages, which sharded tensors need named instead.

    Raises:
        ValueError: a tensor of a dtype safetensors has no name for, tensors sharing storage in pieces, or
            sharded tensors without ``shared``.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor | Deferred],
        block: int = BLOCK_BYTES,
        *,
        shared: Mapping[str, str] | None = None,
    ) -> None:
        self.collective = any(isinstance(t, DTensor | Deferred) for t in tensors.values())
        if shared is None:
            if self.collective:
                raise ValueError("sharded tensors need their tied names given (shared=tied_names(module))")
            plain, dropped = without_shared(tensors)  # type: ignore[arg-type]  # not collective: no Deferred
            self._tensors: dict[str, torch.Tensor | Deferred] = dict(plain)
        else:
            dropped = dict(shared)
            self._tensors = {name: t for name, t in tensors.items() if name not in dropped}
        self._block = block
        self._gathered = 0  # of a collective stream: the tensors (in order) this rank has gathered
        for name, tensor in self._tensors.items():
            if tensor.dtype not in DTYPES:
                raise ValueError(f"tensor {name!r} is {tensor.dtype}, which safetensors cannot hold")
        self._order = sorted(
            self._tensors, key=lambda n: (WIDEST_FIRST.index(DTYPES[self._tensors[n].dtype]), n)
        )
        header: dict[str, object] = {"__metadata__": dropped} if dropped else {}
        offset = 0
        for name in self._order:
            tensor = self._tensors[name]
            size = tensor.numel() * tensor.element_size()
            header[name] = {
                "dtype": DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._head = struct.pack("<Q", len(encoded)) + encoded
        self._size = len(self._head) + offset

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[bytes]:
        if self.collective and self._gathered:
            raise RuntimeError("a stream of sharded tensors is read once: its gathers are collectives")
        yield self._head
        for index, name in enumerate(self._order):
            tensor = self._whole(index, name)
            if tensor.numel() == 0:
                continue
            flat = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            for start in range(0, len(flat), self._block):
                yield flat[start : start + self._block].tobytes()

    def gather_rest(self) -> None:
        """Join the gathers of a collective stream that this rank's iteration did not reach (every one,
        where it did not iterate), so that every rank of the mesh has joined all of them; nothing for a
        stream of plain tensors. Every rank calls it once its own sending (if any) is over."""
        for index in range(self._gathered, len(self._order)):
            self._whole(index, self._order[index])

    def _whole(self, index: int, name: str) -> torch.Tensor:
        value = self._tensors[name]
        tensor = (value.make() if isinstance(value, Deferred) else value).detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # a collective: every rank of the mesh, in this order
        self._gathered = index + 1
        return tensor
