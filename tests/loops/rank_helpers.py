"""Module-level pieces of a multi-rank test job (pickled to each spawned rank, so not in a test file)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tests.loop_context import loop_ctx
from trainer.distributed import Ranks
from trainer.reporting import LoopContext, LoopResult, MemoryReporter, Reporter


def rank_context(tiny_cache: str, out: str, ranks: Ranks) -> LoopContext:
    return dataclasses.replace(loop_ctx(Path(tiny_cache), Path(out)), ranks=ranks)


def resuming_context(tiny_cache: str, out: str, resume_from: str, ranks: Ranks) -> LoopContext:
    """``rank_context`` of a run resumed from the checkpoint folder ``resume_from``."""
    return dataclasses.replace(
        loop_ctx(Path(tiny_cache), Path(out), resume_from=Path(resume_from)), ranks=ranks
    )


def own_disk_context(tiny_cache: str, out: str, ranks: Ranks) -> LoopContext:
    """``rank_context`` with each rank's checkpoints in a folder of its own (``out/rank<N>``): ranks on
    hosts that do not share the artifacts folder."""
    return rank_context(tiny_cache, str(Path(out) / f"rank{ranks.rank}"), ranks)


def memory_reporter() -> Reporter:
    return MemoryReporter()


def metrics_and_result(reporter: Reporter, result: LoopResult) -> dict[str, Any]:
    assert isinstance(reporter, MemoryReporter)
    return {
        "status": result.status,
        "output": str(result.output_path),
        "metrics": reporter.metrics,
        "checkpoints": sorted(reporter.checkpoints),
    }


def failing_context(tiny_cache: str, out: str, ranks: Ranks) -> LoopContext:
    """Rank 1 raises once training has begun on rank 0's side of the rendezvous."""
    if ranks.rank == 1:
        raise OSError("rank 1 lost its disk")
    return rank_context(tiny_cache, out, ranks)


def recording_context(folder: str, ranks: Ranks) -> LoopContext:
    """Write what this rank sees of its start (environment mark, working folder, threads, pid) to
    ``folder/rank<N>.json``, then refuse to train: the launch ends with ``RankFailed`` at once."""
    import json
    import os

    import torch

    seen = {
        "mark": os.environ.get("RLRUN_RANK_MARK"),
        "gone": os.environ.get("RLRUN_RANK_GONE"),
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    (Path(folder) / f"rank{ranks.rank}.json").write_text(json.dumps(seen))
    raise RuntimeError("recorded")


def hanging_context(folder: str, ranks: Ranks) -> LoopContext:
    """Write this rank's pid to ``folder/rank<N>.pid``, then hang (until the rank is killed)."""
    import os
    import time

    (Path(folder) / f"rank{ranks.rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
