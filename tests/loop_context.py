"""The loop context tests run their training loops in: light to import (no web stack), because the ranks
of a multi-rank test import it in every spawned process."""

from __future__ import annotations

from pathlib import Path

from trainer.reporting import LoopContext


def loop_ctx(
    tiny_cache: Path, out: Path, resume_from: Path | None = None, runs: dict[str, Path] | None = None
) -> LoopContext:
    """A loop context for tests: tiny presets from ``tiny_cache``, ``run:`` references from ``runs``."""
    from trainer.models import resolve_model

    def run_output(ref: str) -> Path:
        assert runs is not None and ref in runs, f"unexpected run reference {ref}"
        return runs[ref]

    return LoopContext(
        cache_dir=tiny_cache,
        checkpoint_dir=out,
        resume_from=resume_from,
        resolve_model=lambda ref: resolve_model(ref, cache_dir=tiny_cache, run_output=run_output),
    )
