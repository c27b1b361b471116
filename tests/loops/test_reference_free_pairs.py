"""SimPO (dpo with loss_type simpo) and ORPO (algorithm orpo) through the DPO loop: no reference model is
loaded, the first step's loss equals the papers' objectives computed here from the starting model one
sequence at a time (plain log-softmax, no padding, no loop code), and training moves the margin."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.loop_context import loop_ctx
from trainer.data.preference import tokenize_pair
from trainer.loops.dpo import run_dpo
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

ROWS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b + 1}0"}
    for a in range(3)
    for b in range(3)
]


def spec(algorithm: str, **hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "batch_size": len(ROWS), "learning_rate": 1e-2, **hp},
        }
    )


def answer_logps(model: Any, prompt: list[int], answer: list[int]) -> tuple[float, int]:
    """Sum of log pi(answer token | everything before it) and how many tokens: one unpadded sequence."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    total = sum(float(logp[len(prompt) + i - 1, tok]) for i, tok in enumerate(answer))
    return total, len(answer)


def neg_log_sigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def pair_values(tiny_cache: Path, hp: dict[str, Any]) -> list[tuple[float, int, float, int]]:
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    model.eval()
    out = []
    for row in ROWS:
        pair = tokenize_pair(
            row, tokenizer, max_length=hp["max_length"], max_prompt_length=hp["max_prompt_length"]
        )
        out.append(
            (*answer_logps(model, pair.prompt, pair.chosen), *answer_logps(model, pair.prompt, pair.rejected))
        )
    return out


def test_simpo_first_loss_is_the_papers_objective_without_a_reference(
    tiny_cache: Path, tmp_path: Path
) -> None:
    run = spec("dpo", loss_type="simpo", gamma=0.3)
    hp = run.hyperparameters
    assert hp.beta == 2.0  # SimPO's beta when left out
    reporter = MemoryReporter()
    result = run_dpo(run, RunData(train=ROWS), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    assert any("no reference model" in message for _, message, _ in reporter.events)
    expected = [
        neg_log_sigmoid(hp.beta * (lw / nw) - hp.beta * (ll / nl) - hp.gamma)  # Meng et al. 2024, eq. 6
        for lw, nw, ll, nl in pair_values(tiny_cache, hp.model_dump())
    ]
    assert reporter.series("loss")[0] == pytest.approx(sum(expected) / len(expected), rel=1e-4)


def test_orpo_first_loss_is_nll_plus_lambda_odds_ratio(tiny_cache: Path, tmp_path: Path) -> None:
    run = spec("orpo", beta=0.25)
    reporter = MemoryReporter()
    result = run_dpo(run, RunData(train=ROWS), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    assert any("no reference model" in message for _, message, _ in reporter.events)
    expected = []
    for lw, nw, ll, nl in pair_values(tiny_cache, run.hyperparameters.model_dump()):
        p_w, p_l = math.exp(lw / nw), math.exp(ll / nl)  # Hong et al. 2024, eqs. 4-7
        l_or = neg_log_sigmoid(math.log((p_w / (1 - p_w)) / (p_l / (1 - p_l))))
        expected.append(-lw / nw + 0.25 * l_or)
    assert reporter.series("loss")[0] == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert reporter.series("nll/chosen")[0] == pytest.approx(
        sum(-lw / nw for lw, nw, _, _ in pair_values(tiny_cache, run.hyperparameters.model_dump()))
        / len(ROWS),
        rel=1e-4,
    )


@pytest.mark.parametrize("algorithm, hp", [("dpo", {"loss_type": "simpo"}), ("orpo", {})])
def test_training_widens_the_margin(
    algorithm: str, hp: dict[str, Any], tiny_cache: Path, tmp_path: Path
) -> None:
    reporter = MemoryReporter()
    run = spec(algorithm, **(hp | {"max_steps": 12, "batch_size": 3}))
    result = run_dpo(run, RunData(train=ROWS), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    margins = reporter.series("rewards/margin")
    assert sum(margins[-3:]) / 3 > sum(margins[:3]) / 3


def test_simpo_refuses_a_reference_model_and_orpo_has_none() -> None:
    with pytest.raises(ValidationError, match="reference-free"):
        parse_spec(
            {
                "algorithm": "dpo",
                "model": "tiny:llama-0.4m",
                "reference_model": "tiny:llama-0.4m",
                "dataset_id": str(uuid.uuid4()),
                "hyperparameters": {"loss_type": "simpo"},
            }
        )
    with pytest.raises(ValidationError, match="reference_model"):
        parse_spec(
            {
                "algorithm": "orpo",
                "model": "tiny:llama-0.4m",
                "reference_model": "tiny:llama-0.4m",
                "dataset_id": str(uuid.uuid4()),
            }
        )
