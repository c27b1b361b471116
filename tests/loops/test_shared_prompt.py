"""DPO's shared-prompt layout (trainer/data/shared_prompt.py): the row layout and the attention rule worked
out by hand; every sequence log-prob and gradient the padded layout's on real HH-RLHF pairs (SDPA and eager
attention); a DPO run the padded run's, step for step; and a model whose attention ignores the 4D mask is
caught at start and trained on the padded layout, saying so."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from rlrun.formats import normalize_preference
from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PAIRS
from trainer import completion_logps as dpo_loop
from trainer.completion_logps import sequence_logps
from trainer.data.preference import TokenizedPair, collate_pairs, tokenize_pair
from trainer.data.shared_prompt import CHOSEN, PAD, PROMPT, REJECTED, collate_shared, shared_attention
from trainer.loops.dpo import run_dpo
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

HH = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"
EOS = 99


def test_the_row_layout_by_hand() -> None:
    """prompt [5, 6], chosen [7, 8, EOS], rejected [9, EOS]; a second pair [3] / [4] / [2, EOS] is shorter."""
    pairs = [TokenizedPair([5, 6], [7, 8, EOS], [9, EOS]), TokenizedPair([3], [4], [2, EOS])]
    b = collate_shared(pairs, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, EOS, 9, EOS], [3, 4, 2, EOS, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 1, 2, 0, 0, 0]]
    P, C, R = PROMPT, CHOSEN, REJECTED
    assert b.segment.tolist() == [[P, P, C, C, C, R, R], [P, C, R, R, PAD, PAD, PAD]]
    # Logits needed: pair 1 at 1 (-> 7 and -> 9), 2 (-> 8), 3 (-> EOS), 5 (-> EOS);
    # pair 2 at 0 (-> 4 and -> 2), 2 (-> EOS). Union: 0, 1, 2, 3, 5.
    assert b.keep.tolist() == [0, 1, 2, 3, 5]
    assert (b.chosen_targets * b.chosen_mask.long()).tolist() == [[0, 7, 8, EOS, 0], [4, 0, 0, 0, 0]]
    assert b.chosen_mask.tolist() == [[0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert (b.rejected_targets * b.rejected_mask.long()).tolist() == [[0, 9, 0, 0, EOS], [2, 0, EOS, 0, 0]]
    assert b.rejected_mask.tolist() == [[0, 1, 0, 0, 1], [1, 0, 1, 0, 0]]
    assert b.n_tokens == (2 * 2 + 3 + 2) + (2 * 1 + 1 + 2)  # what the padded layout counts


def test_the_attention_rule_by_hand() -> None:
    """Row 1 of the layout above: the rejected tokens (5, 6) see the prompt (0, 1) and each other, never
    the chosen ones (2, 3, 4); padding sees only itself."""
    pairs = [TokenizedPair([5, 6], [7, 8, EOS], [9, EOS]), TokenizedPair([3], [4], [2, EOS])]
    allowed = shared_attention(collate_shared(pairs, 0).segment)
    assert allowed.shape == (2, 1, 7, 7)
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1, 1],
    ]
    assert allowed[0, 0].int().tolist() == expected
    assert allowed[1, 0, 3].int().tolist() == [1, 0, 1, 1, 0, 0, 0]  # rejected EOS: prompt, rejected
    assert allowed[1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0]  # padding: itself


def hh_pairs(tokenizer: Any, n: int) -> list[TokenizedPair]:
    if not HH.is_file():
        pytest.skip(f"{HH} is missing")
    rows = [normalize_preference(json.loads(line))[0] for line in HH.read_text().splitlines()[:n]]
    return [tokenize_pair(r, tokenizer, max_length=256, max_prompt_length=128) for r in rows]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_log_probs_and_gradients_are_the_padded_layouts(attention: str, tiny_cache: Path) -> None:
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    model.config._attn_implementation = attention
    pairs = hh_pairs(tokenizer, 6)
    assert sum(len(p.prompt) for p in pairs) > sum(len(p.chosen) for p in pairs) / 2  # prompts matter here
    cpu = torch.device("cpu")
    grads = []
    values = []
    for batch in (
        collate_pairs(pairs, tokenizer.pad_token_id),
        collate_shared(pairs, tokenizer.pad_token_id),
    ):
        model.zero_grad()
        logps = sequence_logps(model, batch, cpu)
        (logps * torch.linspace(-1, 1, len(logps))).sum().backward()
        values.append(logps.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    # Sums of up to ~250 token log-probs of about -3: float32 rounding of each is ~1e-6.
    torch.testing.assert_close(values[1], values[0], rtol=1e-6, atol=5e-4 if attention == "eager" else 1e-4)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def dpo(tiny_cache: Path, out: Path, shared: bool) -> MemoryReporter:
    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {
                "max_steps": 6,
                "batch_size": 4,
                "learning_rate": 1e-3,
                "shared_prompt": shared,
            },
        }
    )
    reporter = MemoryReporter()
    assert run_dpo(spec, RunData(train=PAIRS), reporter, loop_ctx(tiny_cache, out)).status == "succeeded"
    return reporter


def test_a_dpo_run_is_the_padded_runs_step_for_step(tiny_cache: Path, tmp_path: Path) -> None:
    padded = dpo(tiny_cache, tmp_path / "padded", shared=False)
    shared = dpo(tiny_cache, tmp_path / "shared", shared=True)
    for key in ("loss", "rewards/margin", "logps/chosen", "final/loss"):
        assert shared.series(key) == pytest.approx(padded.series(key), abs=1e-5), key
    assert shared.series("grad_norm") == pytest.approx(padded.series("grad_norm"), rel=1e-5)
    assert not [e for e in shared.events if e[0] == "warning"]


def test_a_model_that_ignores_the_mask_trains_on_the_padded_layout_saying_so(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the 4D mask dropped the model attends causally over the whole row (the rejected answer sees the
    chosen one): the start-up probe sees the log-probs move and the run uses the padded layout."""
    monkeypatch.setattr(dpo_loop, "attention_mask_for", lambda model, allowed: None)
    blind = dpo(tiny_cache, tmp_path / "blind", shared=True)
    padded = dpo(tiny_cache, tmp_path / "padded", shared=False)
    warnings = [e[1] for e in blind.events if e[0] == "warning"]
    assert any("does not follow a custom 4D mask" in w and "padded layout" in w for w in warnings), warnings
    assert blind.series("loss") == pytest.approx(padded.series("loss"), abs=1e-6)
