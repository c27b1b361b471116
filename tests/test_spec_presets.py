"""Presets are resolved before validation: a validated online-RL spec is complete, what the user gave
wins, the stored JSON is the resolved spec, and the schema names no misleading default for preset fields."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from trainer.specs import GROUP_PRESETS, PPO_PRESETS, PRESET_MARK, RUN_SPEC_ADAPTER, parse_spec

PRESETS = GROUP_PRESETS | PPO_PRESETS


def spec(algorithm: str, **hp: Any) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "model": "tiny:llama-0.4m",
        "dataset_id": str(uuid.uuid4()),
        "rewards": [{"name": "numeric"}],
        "hyperparameters": hp,
    }


@pytest.mark.parametrize("algorithm", sorted(PRESETS))
def test_every_preset_value_lands_in_the_validated_spec(algorithm: str) -> None:
    hp = parse_spec(spec(algorithm)).hyperparameters
    assert {k: getattr(hp, k) for k in PRESETS[algorithm]} == PRESETS[algorithm]


def test_given_values_win_over_the_preset_and_null_means_the_preset() -> None:
    hp = parse_spec(spec("dapo", clip_high=0.5, kl_coef=None)).hyperparameters
    assert hp.clip_high == 0.5 and hp.kl_coef == GROUP_PRESETS["dapo"]["kl_coef"]
    assert hp.dynamic_sampling is True  # DAPO's, not the field's stand-alone default


def test_the_stored_json_is_resolved_and_validates_to_the_same_spec() -> None:
    first = parse_spec(spec("vc_ppo", lam=0.9))
    stored = first.model_dump(mode="json")
    assert stored["hyperparameters"]["critic_lam"] == 1.0 and stored["hyperparameters"]["lam"] == 0.9
    assert parse_spec(stored) == first


def test_a_preset_that_breaks_a_rule_is_refused_naming_the_rule() -> None:
    with pytest.raises(ValidationError, match="dynamic_sampling needs samples_per_prompt >= 2"):
        parse_spec(spec("dapo", samples_per_prompt=1, advantage="reinforce"))
    assert parse_spec(spec("dapo", samples_per_prompt=1, dynamic_sampling=False, advantage="reinforce"))


def test_ppo_refuses_a_group_advantage() -> None:
    with pytest.raises(ValidationError, match="PPO takes its advantages from GAE"):
        parse_spec(spec("ppo", advantage="grpo"))


def test_preset_fields_carry_the_mark_and_no_default_in_the_schema() -> None:
    defs = RUN_SPEC_ADAPTER.json_schema()["$defs"]
    marked = {
        (model, name)
        for model in ("GroupRlHyperparameters", "PpoHyperparameters")
        for name, prop in defs[model]["properties"].items()
        if prop.get(PRESET_MARK)
    }
    for model, presets in (("GroupRlHyperparameters", GROUP_PRESETS), ("PpoHyperparameters", PPO_PRESETS)):
        keys = {k for p in presets.values() for k in p}
        assert {n for m, n in marked if m == model} == keys
        assert all("default" not in defs[model]["properties"][k] for k in keys)
