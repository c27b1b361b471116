"""One run on N processes (ranks) with torch.distributed: DDP or FSDP2, torch's own engines.

Every rank runs the same loop on the same data order (the sampler is seeded, so each draws the same global
batch) and takes its contiguous share of each batch (``share``). Each rank's loss is normalised by the
*global* batch (its rows' losses sum over the global count), so the ranks' gradients add up to the whole
batch's; DDP and FSDP2 average gradients over ranks, so the backward is scaled by the world size
(``GRAD_SUM_FACTOR``, read by ``accumulate_and_step``). The update is then the single-process update of
the same global batch, which the tests check to 1e-5 with 2 gloo ranks.

- ``ddp``: ``DistributedDataParallel``, every rank holds the whole model; gradients all-reduced in the
  backward (Li et al. 2020, "PyTorch Distributed").
- ``fsdp``: FSDP2 ``fully_shard`` on every transformer block, then the root: parameters, gradients and
  optimizer state are sharded over the ranks and gathered block by block for each forward and backward
  (Zhao et al. 2023, "PyTorch FSDP"). A checkpoint's model is gathered onto rank 0 for
  ``save_pretrained`` (an adapter's trained tensors only, under LoRA); its optimizer state is not: every
  rank writes its own shards (``save_optimizer_shards``, torch.distributed.checkpoint) and reads back only
  its own on resume, since Adam's two moments are twice the model (7B in fp32: 56 GB).

Rank 0 alone talks to the outside (its reporter writes metrics, events and checkpoints); the others get a
silent one. Decisions every rank must share (stop or go, a non-finite loss) are taken collectively.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.ranks import Ranks as Ranks  # re-exported: the loops name it with the rest of this module
from trainer.ranks import Sharding as Sharding

T = TypeVar("T")


ONE = Ranks()  # a run on one process


def current(sharding: Sharding = "ddp") -> Ranks:
    """The ranks of the initialised process group (one rank when there is none)."""
    if not dist.is_available() or not dist.is_initialized():
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), sharding)


def grad_sum_factor() -> int:
    """What each rank's backward is scaled by so that the averaged gradient is the ranks' sum: the world
    size in a process group, else 1."""
    return current().world


def share(items: Sequence[T], ranks: Ranks) -> list[T]:
    """This rank's contiguous share of ``items`` (the ranks' shares in rank order are ``items``). The count
    must divide evenly (the spec checks the batch sizes), so every rank runs the same number of passes."""
    if len(items) % ranks.world:
        raise ValueError(f"{len(items)} rows do not split evenly over {ranks.world} ranks")
    size = len(items) // ranks.world
    return list(items[ranks.rank * size : (ranks.rank + 1) * size])


def padded_share(n: int, ranks: Ranks) -> list[int]:
    """This rank's share of ``range(n)`` when ``n`` need not divide evenly: every index is in some share
    and each share has ``ceil(n / world)`` indices (the last wraps around to the first), so every rank runs
    the same number of passes, as a sharded model's collective forwards need."""
    size = -(-n // ranks.world)
    return [(ranks.rank * size + k) % n for k in range(size)] if n else []


def gather_rows(t: Tensor, ranks: Ranks) -> Tensor:
    """The ranks' equal-sized tensors concatenated along dim 0 in rank order (``t`` alone on one rank)."""
    if not ranks.active:
        return t
    parts = [torch.empty_like(t) for _ in range(ranks.world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def gather_objects(obj: T, ranks: Ranks) -> list[T]:
    """Every rank's ``obj`` (anything picklable) in rank order, on every rank (``[obj]`` on one rank)."""
    if not ranks.active:
        return [obj]
    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def sum_over_ranks(t: Tensor, ranks: Ranks) -> Tensor:
    if not ranks.active:
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_true(flag: bool, ranks: Ranks) -> bool:
    """True when ``flag`` is True on every rank (one collective)."""
    if not ranks.active:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def from_main(flag: bool, ranks: Ranks) -> bool:
    """Rank 0's ``flag`` on every rank (a decision only rank 0 can take, such as "a stop was asked")."""
    if not ranks.active:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.broadcast(t, src=0)
    return bool(t.item())


def wrap(model: Any, ranks: Ranks) -> Any:
    """``model`` spread over the ranks: DDP (a wrapper; the model is ``.module``) or FSDP2 (sharded in
    place, every transformer block then the root). Unchanged on one rank."""
    if not ranks.active:
        return model
    if ranks.sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (ranks.world,))
    blocks = [m for m in model.modules() if type(m).__name__ in _block_classes(model)]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _block_classes(model: Any) -> set[str]:
    """The transformer block classes of a transformers model (its ``_no_split_modules``)."""
    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    names = set(getattr(base, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(base).__name__} names no transformer block class (_no_split_modules)")
    return names


def unwrap(model: Any) -> Any:
    """The model under a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def whole(t: Tensor) -> Tensor:
    """``t`` gathered whole (a collective, for a ``DTensor``), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: Any, ranks: Ranks) -> dict[str, Tensor] | None:
    """What ``save_pretrained`` writes of a sharded model, on rank 0 (None on the others, and when nothing
    needs gathering: the model saves itself). Under FSDP2 every rank must call it (it gathers the shards).
    An adapter model (peft) gets only what peft's ``save_pretrained`` can take from it: its trained tensors
    (the LoRA weights, any head it trains) and the embedding layers' weights (peft saves those too when the
    adapter targets them), a tensor at a time; the frozen base is never gathered."""
    if not is_sharded(model):
        return None
    from trainer.adapters import has_adapter

    if has_adapter(model):
        from peft.utils.constants import EMBEDDING_LAYER_NAMES

        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        embedding = re.compile(rf"(^|\.)({'|'.join(EMBEDDING_LAYER_NAMES)})(\.base_layer)?\.weight$")
        gathered = {}
        for name, t in model.state_dict().items():
            if name in trained or embedding.search(name):
                gathered_t = whole(t.detach())  # every rank gathers (a collective); rank 0 keeps it
                if ranks.main:
                    gathered[name] = gathered_t.cpu()
        return gathered if ranks.main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in state.items() if isinstance(v, Tensor)} if ranks.main else None


def save_optimizer_shards(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its own shards of the optimizer's state into ``folder``
    (torch.distributed.checkpoint: a file per rank, and the plan's ``.metadata`` from rank 0), so no rank
    ever holds the whole state. Every rank must call it, and each returns once all the files are written.

    ``folder``'s parent is the checkpoint's temporary folder, which rank 0 clears and makes before it calls
    this: the barrier keeps every rank's writes after that, and a rank that then does not see the folder is
    on a host without the shared artifacts folder (its shard would land on its own disk, and the checkpoint
    would look whole without it), so it fails saying so."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    dist.barrier()
    if not folder.parent.is_dir():
        raise RuntimeError(
            f"rank {dist.get_rank()} does not see {folder.parent}, which rank 0 made for a checkpoint: every "
            "host of a run must see the artifacts folder at the same path (RLRUN_ARTIFACTS_DIR on shared "
            "storage, docs/runs.md)"
        )
    state = get_optimizer_state_dict(model, optimizer)  # each rank's own shards (DTensors), not gathered
    save({"optimizer": state}, storage_writer=FileSystemWriter(folder))


def load_optimizer_shards(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Restore what ``save_optimizer_shards`` wrote: each rank reads the parts of the files its own shards
    need (the ranks may even be more or fewer than those that wrote them: torch.distributed.checkpoint
    reshards). Every rank must call it. A process of its own (no process group) reads the whole state."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    # the state to read into: a fresh optimizer's, made by a step of lr 0 (torch's own initialisation)
    state = get_optimizer_state_dict(model, optimizer)
    alone = not dist.is_initialized()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load({"optimizer": state}, storage_reader=FileSystemReader(folder), no_dist=alone)
    set_optimizer_state_dict(model, optimizer, state)


def load_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore a whole optimizer state: an unsharded run's ``optimizer.state_dict()``, or under FSDP2
    (sharded again here) one a sharded run's checkpoint held before its optimizer state was kept in
    shards."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def local_norm(norm: Tensor) -> Tensor:
    """A gradient norm as a plain tensor (FSDP2's ``clip_grad_norm_`` returns a DTensor)."""
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm
