"""A training session's loop (issue 40) on its own: it ends after its idle timeout with the adapter as
the run's model, and a second attempt of the same run (its worker was lost) refuses to start over from a
fresh adapter, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loop_context import loop_ctx
from trainer.loops.training_session import run_training_session
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec


def test_an_idle_session_ends_with_its_adapter_and_a_second_attempt_refuses(
    tiny_cache: Path, tmp_path: Path
) -> None:
    spec = parse_spec(
        {
            "algorithm": "training_session",
            "model": "tiny:llama-0.4m",
            "hyperparameters": {"lora_rank": 4, "idle_timeout_s": 0.5},
        }
    )
    ctx = loop_ctx(tiny_cache, tmp_path)
    reporter = MemoryReporter()
    with ctx.cleanup:  # what the worker's wrapper does (trainer/loops/__init__.py)
        result = run_training_session(spec, RunData(train=[]), reporter, ctx)
    assert result.status == "succeeded" and result.output_path is not None
    assert (result.output_path / "adapter_config.json").exists()
    assert reporter.gateway is None  # the address was taken down with the gateway
    assert any("idle for 0.5 s" in message for _, message, _ in reporter.events)
    with pytest.raises(RuntimeError, match="cannot continue after its worker was lost"):
        run_training_session(spec, RunData(train=[]), MemoryReporter(), loop_ctx(tiny_cache, tmp_path))
