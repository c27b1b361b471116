"""Specs <-> registries name sync, and the API's independence from torch."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from trainer import specs


def test_spec_literal_names_equal_registry_keys() -> None:
    from trainer.algorithms.advantages import ADVANTAGES
    from trainer.algorithms.aggregation import AGGREGATIONS
    from trainer.algorithms.kl import KL_ESTIMATORS
    from trainer.algorithms.kl_control import KL_CONTROLLERS
    from trainer.algorithms.policy_losses import POLICY_LOSSES
    from trainer.algorithms.preference_losses import PREFERENCE_LOSSES

    assert set(get_args(specs.PreferenceLossName)) == set(PREFERENCE_LOSSES)
    assert set(get_args(specs.AdvantageName)) == set(ADVANTAGES)
    assert set(get_args(specs.PolicyLossName)) == set(POLICY_LOSSES)
    assert set(get_args(specs.KlEstimatorName)) == set(KL_ESTIMATORS)
    assert set(get_args(specs.AggregationName)) == set(AGGREGATIONS)
    assert set(get_args(specs.KlControllerName)) == set(KL_CONTROLLERS)


def test_loops_cover_every_algorithm() -> None:
    from trainer.loops import LOOPS

    assert set(LOOPS) == set(specs.ALGORITHMS)


def test_unknown_loss_name_is_refused_listing_valid_names() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        specs.parse_spec(
            {
                "algorithm": "dpo",
                "model": "tiny:llama-0.4m",
                "dataset_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
                "hyperparameters": {"loss_type": "nope"},
            }
        )
    text = str(err.value)
    assert all(name in text for name in get_args(specs.PreferenceLossName))


def test_importing_the_api_does_not_import_torch() -> None:
    code = "import sys, api.main, api.cli; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
