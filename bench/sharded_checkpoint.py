"""A sharded (FSDP2) run's optimizer state in a checkpoint, on 2 gloo ranks of this machine: each rank's
memory and time to save it and to load it back, the way checkpoints did it before 2026-12-07 against the
shards, side by side.

- gathered: ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`` gathers the whole state
  (AdamW's two moments: twice the model) onto rank 0, which ``torch.save``s it into ``trainer_state.pt``; on
  resume every rank ``torch.load``s that file whole and ``set_optimizer_state_dict`` shards it again.
- shards: ``save_optimizer_shards`` / ``load_optimizer_shards`` (trainer/distributed.py): each rank writes
  and reads only its own shards (torch.distributed.checkpoint).

The model is bench/sharded_sync.py's Llama of ``--hidden`` x ``--layers`` (default ~134M parameters),
built on the meta device and sharded before its weights exist; one AdamW step with gradients of ones gives
its optimizer state. The files go to a temporary folder on disk. Printed per way: the highest resident
memory over what the rank held before (``PeakResident``, bench/sharded_sync.py) while it saves and while it
loads, for rank 0 and rank 1, and the seconds of each (fresh rank processes per way).

Run: ``.venv/bin/python bench/sharded_checkpoint.py [--hidden 768] [--layers 12] [--vocab 32000]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharded_sync import PeakResident, sharded_model  # a sibling module: bench/ is first on sys.path


def save_gathered(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if dist.get_rank() == 0:
        torch.save({"optimizer": state}, folder / "trainer_state.pt")
    dist.barrier()


def load_gathered(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    from trainer.distributed import load_optimizer_state

    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    load_optimizer_state(model, optimizer, state["optimizer"])


def save_shards(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    from trainer.distributed import save_optimizer_shards

    save_optimizer_shards(model, optimizer, folder / "optimizer")


def load_shards(model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    from trainer.distributed import load_optimizer_shards

    load_optimizer_shards(model, optimizer, folder / "optimizer")


WAYS = {"gathered": (save_gathered, load_gathered), "shards": (save_shards, load_shards)}


def stepped_optimizer(model: Any) -> torch.optim.Optimizer:
    from trainer.loops.session import make_optimizer

    optimizer = make_optimizer(model, 1e-4, 0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def measured(way: Any, model: Any, optimizer: torch.optim.Optimizer, folder: Path) -> tuple[int, float]:
    """``way(model, optimizer, folder)`` on every rank at once: this rank's memory growth and the seconds."""
    dist.barrier()
    with PeakResident() as peak:
        began = time.perf_counter()
        way(model, optimizer, folder)
        dist.barrier()
        seconds = time.perf_counter() - began
    return peak.growth, seconds


def rank(rank_: int, way: str, args: argparse.Namespace, store: str, out: str, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank_, world_size=2)
    try:
        model = sharded_model(args.hidden, args.layers, args.vocab)
        params = sum(p.numel() for p in model.parameters())
        save, load = WAYS[way]
        saved, save_s = measured(save, model, stepped_optimizer(model), Path(folder))
        # a resumed run's optimizer, before its state is read
        loaded, load_s = measured(load, model, stepped_optimizer(model), Path(folder))
        figures = {"params": params, "save": saved, "load": loaded, "save_s": save_s, "load_s": load_s}
        Path(f"{out}.{rank_}").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def measure(way: str, args: argparse.Namespace) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as folder:
        store, out = f"{folder}/store", f"{folder}/out.json"
        checkpoint = Path(folder) / "checkpoint"
        checkpoint.mkdir()
        mp.spawn(rank, args=(way, args, store, out, str(checkpoint)), nprocs=2)
        return [dict(json.loads(Path(f"{out}.{r}").read_text())) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    results = {way: measure(way, args) for way in WAYS}
    params = results["shards"][0]["params"]
    print(
        f"FSDP2 on 2 gloo ranks, {params / 1e6:.0f}M parameters, AdamW moments {8 * params / 1e6:.0f} MB "
        f"(fp32), torch {torch.__version__}"
    )
    print(
        f"{'way':<10} {'rank':>4} {'save: memory growth':>20} {'save s':>7} "
        f"{'load: memory growth':>20} {'load s':>7}"
    )
    for way, ranks in results.items():
        for r, m in enumerate(ranks):
            print(
                f"{way:<10} {r:>4} {m['save'] / 1e6:>17.0f} MB {m['save_s']:>7.2f} "
                f"{m['load'] / 1e6:>17.0f} MB {m['load_s']:>7.2f}"
            )
    old, new = results["gathered"], results["shards"]
    worst = {k: max(r[k] for r in old) / max(max(r[k] for r in new), 1) for k in ("save", "load")}
    print(
        f"ratio (gathered / shards), the larger rank's memory: save {worst['save']:.1f}x, "
        f"load {worst['load']:.1f}x; time: save {old[0]['save_s'] / new[0]['save_s']:.2f}x, "
        f"load {old[0]['load_s'] / new[0]['load_s']:.2f}x"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
