"""Shared by the served client and CLI tests."""

from __future__ import annotations

from typing import Any

from tests.factories import dpo_spec


def dpo(dataset_id: object, steps: int, **hp: Any) -> dict[str, Any]:
    """A tiny DPO spec (flow.submit_dpo's hyperparameters) of ``steps`` steps."""
    return dpo_spec(dataset_id, max_steps=steps, batch_size=8, **hp)
