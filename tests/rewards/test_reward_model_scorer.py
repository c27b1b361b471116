"""RewardModelScorer on the tiny model: scores equal the model's own, normalisation by hand, a trained run."""

from __future__ import annotations

import json
import statistics
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rewards.helpers import reward_model_dir
from trainer.loops.reward_model import run_reward_model
from trainer.models import REWARD_STATS_FILE, load_reward_model, resolve_model
from trainer.reporting import LoopContext, MemoryReporter, RunData
from trainer.rewards.reward_model_scorer import RewardModelScorer
from trainer.specs import RewardModelSpec, parse_spec

CPU = torch.device("cpu")
PROMPTS = ["Q1: what is 2+2?", "Q1: what is 2+2?", "Q2:", "Q1: what is 2+2?", "Q3: say yes"]
COMPLETIONS = [" 4", " the answer is four, good", " bad bad bad bad bad bad", "", " yes"]


@pytest.fixture(scope="module")
def rm_dir(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward-model folder: the tiny LM with a seeded score head (tests/rewards/helpers.py)."""
    return reward_model_dir(tiny_cache, tmp_path_factory.mktemp("rm"))


@torch.no_grad()
def _own_score(model: Any, ids: list[int]) -> float:
    """The model's score of one unpadded sequence: the head's output at its last token."""
    return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _hand_ids(tok: Any, prompt: str, completion: str, max_length: int = 10_000) -> list[int]:
    """prompt (with special tokens) + completion + EOS; the completion keeps its head, the prompt its tail."""
    response: list[int] = (tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id])[
        :max_length
    ]
    room = max_length - len(response)
    prompt_ids: list[int] = tok(prompt).input_ids
    return (prompt_ids[-room:] if room > 0 else []) + response


def _hand_scores(rm_dir: Path, prompts: list[str], completions: list[str], **kw: int) -> list[float]:
    model, tok = load_reward_model(str(rm_dir))
    model.eval()
    assert tok.eos_token_id != tok.pad_token_id  # so EOS is appended, as in training
    return [_own_score(model, _hand_ids(tok, p, c, **kw)) for p, c in zip(prompts, completions, strict=True)]


def test_raw_scores_equal_the_models_own_scoring(rm_dir: Path) -> None:
    scorer = RewardModelScorer(str(rm_dir), device=CPU, batch_size=2)  # padded batches, several of them
    assert scorer.normalized is False and (scorer.mean, scorer.std) == (0.0, 1.0)  # no stats file here
    assert scorer.model.training is False
    assert not any(p.requires_grad for p in scorer.model.parameters())

    scores = scorer.score(PROMPTS, COMPLETIONS)
    expected = _hand_scores(rm_dir, PROMPTS, COMPLETIONS)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert all(type(s) is float for s in scores)
    assert max(expected) - min(expected) > 0.1  # different sequences really score differently
    assert scorer.score(list(reversed(PROMPTS)), list(reversed(COMPLETIONS))) == pytest.approx(
        list(reversed(expected)), abs=1e-5
    )


def test_truncation_keeps_the_completion_head_and_the_prompt_tail(rm_dir: Path) -> None:
    prompts = [" ".join(str(i) for i in range(60)), "Q:"]
    completions = [" good answer", " the answer " * 20]
    scorer = RewardModelScorer(str(rm_dir), device=CPU, max_length=12)
    ids = scorer.tokenize(prompts, completions)
    assert [len(s) for s in ids] == [12, 12]
    assert ids[1] == scorer.tokenizer(" the answer " * 20, add_special_tokens=False).input_ids[:12]
    expected = _hand_scores(rm_dir, prompts, completions, max_length=12)
    assert scorer.score(prompts, completions) == pytest.approx(expected, abs=1e-5)


def test_normalisation_with_a_stats_file(rm_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "with_stats"
    folder.mkdir()
    for f in rm_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / REWARD_STATS_FILE).write_text(
        json.dumps({"mean": 0.3, "std": 2.0, "n": 8, "source": "validation"})
    )
    raw = _hand_scores(rm_dir, PROMPTS, COMPLETIONS)

    scorer = RewardModelScorer(str(folder), device=CPU)
    assert scorer.normalized is True and (scorer.mean, scorer.std) == (0.3, 2.0)
    assert scorer.score(PROMPTS, COMPLETIONS) == pytest.approx(
        [(r - 0.3) / (2.0 + 1e-8) for r in raw], abs=1e-5
    )

    plain = RewardModelScorer(str(folder), normalize=False, device=CPU)
    assert plain.normalized is False
    assert plain.score(PROMPTS, COMPLETIONS) == pytest.approx(raw, abs=1e-5)


def test_bad_inputs(rm_dir: Path) -> None:
    scorer = RewardModelScorer(str(rm_dir), device=CPU)
    assert scorer.score([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        scorer.score(["a", "b"], ["x"])
    with pytest.raises(ValueError, match="batch_size"):
        RewardModelScorer(str(rm_dir), device=CPU, batch_size=0)


def test_a_trained_reward_model_run_normalises_its_validation_responses_to_mean_0_std_1(
    tiny_cache: Path, tmp_path: Path
) -> None:
    good, bad = [" good good", " yes good", " good answer"], [" bad bad", " no bad", " bad answer"]
    rows = [{"prompt": f"Q{i}:", "chosen": good[i % 3], "rejected": bad[i % 3]} for i in range(12)]
    spec = parse_spec(
        {
            "algorithm": "reward_model",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-2, "max_length": 32},
        }
    )

    assert isinstance(spec, RewardModelSpec)

    def no_runs(_ref: str) -> Path:
        raise AssertionError("no run refs here")

    ctx = LoopContext(
        cache_dir=tiny_cache,
        checkpoint_dir=tmp_path / "out",
        resume_from=None,
        resolve_model=lambda ref: resolve_model(ref, cache_dir=tiny_cache, run_output=no_runs),
    )
    validation = rows[8:]
    result = run_reward_model(spec, RunData(train=rows[:8], validation=validation), MemoryReporter(), ctx)
    assert result.output_path is not None

    scorer = RewardModelScorer(str(result.output_path), device=CPU, max_length=32)
    assert scorer.normalized is True
    prompts = [r["prompt"] for r in validation for _ in range(2)]
    completions = [c for r in validation for c in (r["chosen"], r["rejected"])]
    scores = scorer.score(prompts, completions)  # the very responses the stored statistics describe
    assert statistics.fmean(scores) == pytest.approx(0.0, abs=1e-4)
    assert statistics.pstdev(scores) == pytest.approx(1.0, abs=1e-4)
