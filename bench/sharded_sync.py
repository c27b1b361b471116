"""A sharded (FSDP2) policy's weight sync to the engine, on 2 gloo ranks of this machine: rank 0's memory
and time, gathering the whole state dict first (how syncs were made before 2026-12-07:
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on every rank, then ``save_file`` on rank 0)
against streaming it a parameter at a time (``SafetensorsStream`` over the sharded state dict, each
``DTensor`` gathered when the file reaches it: trainer/rollout/rank_engine.py), side by side.

Both write the same ``model.safetensors`` into a folder in /dev/shm (the file a local engine reloads; its
pages are shared memory, not the process's), which is all a sync does before the engine's reload, and
neither loads an engine. The model is a Llama of ``--hidden`` x ``--layers`` (default ~134M parameters,
536 MB in fp32) built on the meta device and sharded before its weights exist, so no rank ever holds it
whole before the sync. Printed per way: rank 0's resident memory at its highest during the sync over what
it held before (``/proc/self/statm`` read every 2 ms by a thread) in its first sync (glibc keeps some of
what a sync freed, which a later sync reuses unseen), and the sync's seconds (the best of ``--rounds``
after it), each way in fresh rank processes.

Run: ``.venv/bin/python bench/sharded_sync.py [--hidden 768] [--layers 12] [--vocab 32000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


class PeakResident:
    """The highest resident memory seen while the block runs, over what the process held at its start."""

    def __enter__(self) -> PeakResident:
        self.start = self.peak = resident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def sharded_model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.distributed import Ranks, wrap

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = wrap(model, Ranks(dist.get_rank(), dist.get_world_size(), "fsdp"))
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model


def gathered_first(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def streamed(model: torch.nn.Module, folder: Path) -> None:
    from trainer.rollout.safetensors_stream import SafetensorsStream, tied_names

    stream = SafetensorsStream(model.state_dict(), shared=tied_names(model))
    if dist.get_rank() == 0:
        with (folder / "model.safetensors").open("wb") as out:
            for block in stream:
                out.write(block)
    stream.gather_rest()


WAYS = {"gathered first": gathered_first, "streamed": streamed}


def rank(rank_: int, way: str, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank_, world_size=2)
    try:
        model = sharded_model(args.hidden, args.layers, args.vocab)
        params = sum(p.numel() for p in model.parameters())
        shm = Path("/dev/shm")
        with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as folder:
            # memory: the first sync (the allocator keeps some of what a sync freed, and a later sync
            # reuses it unseen); time: the best of the later ones
            dist.barrier()
            with PeakResident() as peak:
                WAYS[way](model, Path(folder))
                dist.barrier()
            growth, times = peak.growth, []
            for _ in range(args.rounds):
                dist.barrier()
                began = time.perf_counter()
                WAYS[way](model, Path(folder))
                dist.barrier()
                times.append(time.perf_counter() - began)
            size = (Path(folder) / "model.safetensors").stat().st_size if rank_ == 0 else 0
        if rank_ == 0:
            Path(out).write_text(
                json.dumps({"params": params, "growth": growth, "s": min(times), "file": size})
            )
    finally:
        dist.destroy_process_group()


def measure(way: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        store, out = f"{folder}/store", f"{folder}/out.json"
        mp.spawn(rank, args=(way, args, store, out), nprocs=2)
        return dict(json.loads(Path(out).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {way: measure(way, args) for way in WAYS}
    first = next(iter(results.values()))
    print(
        f"FSDP2 on 2 gloo ranks, {first['params'] / 1e6:.0f}M parameters, file {first['file'] / 1e6:.0f} MB"
    )
    print(f"{'way':<16} {'rank 0 memory growth':>22} {'sync s':>8}")
    for way, r in results.items():
        print(f"{way:<16} {r['growth'] / 1e6:>19.0f} MB {r['s']:>8.2f}")
    old, new = results["gathered first"], results["streamed"]
    print(
        f"ratio (gathered first / streamed): memory {old['growth'] / max(new['growth'], 1):.1f}x, "
        f"time {old['s'] / new['s']:.2f}x"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
