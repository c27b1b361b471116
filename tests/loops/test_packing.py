"""Padding-free packing (trainer/data/packing.py): first-fit decreasing checked by hand; packed rows restart
positions per sequence and never score a sequence's first token; a packed forward gives each sequence its
logits alone (1e-5); SFT and DPO runs with ``packing`` give the padded runs' losses and gradient norms
(1e-5) on real HH-RLHF dialogues, with and without an adapter, in fewer token cells."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from rlrun.formats import normalize_preference
from tests.loop_context import loop_ctx
from trainer.completion_logps import packed_completion_logits
from trainer.data.packing import first_fit_decreasing, pack_sequences
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

HH = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"


def test_first_fit_decreasing_by_hand() -> None:
    # Longest first: 5 -> bin 0 (1 left), 4 -> bin 1 (2 left), 3 -> bin 2 (3 left), 3 -> bin 2 (full),
    # 2 -> bin 1 (full), 1 -> bin 0 (full).
    assert first_fit_decreasing([5, 4, 3, 3, 2, 1], 6) == [[0, 5], [1, 4], [2, 3]]
    assert first_fit_decreasing([7, 2], 6) == [[0], [1]]  # too long for the capacity: a bin of its own
    assert first_fit_decreasing([], 6) == []


def test_packed_rows_restart_positions_and_never_score_a_first_token() -> None:
    seqs = [([1, 2, 3, 4], 2), ([5, 6], 0), ([7, 8, 9], 1)]  # (tokens, first completion token)
    batch = pack_sequences(seqs, capacity=6, pad_id=0)
    # FFD: [4 tokens] + [2 tokens] fill row 0; the 3-token sequence starts row 1, padded to width 6.
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert batch.sequence.tolist() == [[0, 0, 0, 0, 1, 1], [2, 2, 2, -1, -1, -1]]
    # Sequence 1 scores from token 0 on, but its first token has nothing before it in its sequence.
    assert batch.scored.int().tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert batch.n_tokens == 9 and batch.n_scored == 5


def test_a_packed_forward_gives_each_sequence_its_own_logits(tiny_cache: Path) -> None:
    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 500, (n,), generator=gen).tolist(), n // 2) for n in (9, 4, 13, 6, 2)]
    batch = pack_sequences(seqs, capacity=16, pad_id=0)
    assert batch.input_ids.shape[0] < len(seqs)  # really packed: several sequences share a row
    logits, targets, mask, sequence = packed_completion_logits(model, batch, torch.device("cpu"))
    with torch.no_grad():
        for i, (tokens, start) in enumerate(seqs):
            alone = model(input_ids=torch.tensor([tokens])).logits[0]
            got = logits[mask & (sequence == i)]  # row-major: the sequence's scored tokens in order
            expected = alone[max(start, 1) - 1 : len(tokens) - 1]  # position t predicts token t + 1
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert targets[mask & (sequence == i)].tolist() == tokens[max(start, 1) :]


def hh_rows(n: int) -> list[dict[str, Any]]:
    lines = HH.read_text().splitlines()[:n]
    return [normalize_preference(json.loads(line))[0] for line in lines]


def train(
    algorithm: str, packing: bool, adapter: bool, tiny_cache: Path, out: Path
) -> tuple[MemoryReporter, Any]:
    pairs = hh_rows(12)
    rows = (
        pairs if algorithm == "dpo" else [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs]
    )
    hp: dict[str, Any] = {
        "max_steps": 3,
        "batch_size": 4,
        "micro_batch_size": 2,
        "max_length": 128,
        "learning_rate": 1e-3,
        "packing": packing,
    }
    if algorithm == "dpo":
        hp["max_prompt_length"] = 64
    spec = parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "adapter": {"r": 4, "alpha": 8} if adapter else None,
            "hyperparameters": hp,
        }
    )
    reporter = MemoryReporter()
    result = LOOPS[algorithm](spec, RunData(train=rows), reporter, loop_ctx(tiny_cache, out))
    assert result.status == "succeeded"
    return reporter, result


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_packing_gives_the_padded_losses(
    algorithm: str, adapter: bool, tiny_cache: Path, tmp_path: Path
) -> None:
    padded, _ = train(algorithm, False, adapter, tiny_cache, tmp_path / "padded")
    packed, result = train(algorithm, True, adapter, tiny_cache, tmp_path / "packed")
    assert len(packed.series("loss")) == 3
    assert packed.series("loss") == pytest.approx(padded.series("loss"), abs=1e-5)
    assert packed.series("grad_norm") == pytest.approx(padded.series("grad_norm"), rel=1e-5)  # norms ~7
    final = "final/loss"
    assert packed.series(final) == pytest.approx(padded.series(final), abs=1e-5)


def test_packing_spends_far_fewer_token_cells_on_hh_dialogues(tiny_cache: Path) -> None:
    """The point of packing, on real data: a padded batch of HH dialogues is mostly padding."""
    from trainer.data.sft import collate_examples, tokenize_example

    _, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in hh_rows(32)]
    examples = [tokenize_example(r, tokenizer, max_length=512) for r in rows]
    padded = collate_examples(examples, tokenizer.pad_token_id)
    packed = pack_sequences([(e.prompt + e.completion, len(e.prompt)) for e in examples], 512, 0)
    real = padded.n_tokens
    assert packed.n_tokens == real and packed.n_scored == int(padded.completion_mask[:, 1:].sum())
    assert packed.input_ids.numel() < 0.75 * padded.input_ids.numel()
    assert packed.input_ids.numel() <= real * 1.25  # the rows are nearly full


def test_a_model_that_mixes_packed_sequences_is_refused(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose layers ignore the boundaries (here: transformers made blind to them, as linear
    attention is) would train on sequences that see each other: the run refuses packing before step 1."""
    from transformers import masking_utils

    from trainer.completion_logps import PackingUnsupported, check_packing

    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    check_packing(model, torch.device("cpu"))  # standard attention: accepted
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(PackingUnsupported, match="run it without packing"):
        check_packing(model, torch.device("cpu"))
    with pytest.raises(PackingUnsupported):
        train("sft", True, False, tiny_cache, tmp_path)
