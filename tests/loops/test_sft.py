"""SFT loop on a tiny random model: completion-only loss by value, params move, memorises, resumes, evals."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.loop_context import loop_ctx
from trainer.data.sft import TokenizedExample, collate_examples, tokenize_example, truncate
from trainer.loops.sft import completion_sums, run_sft, sft_loss
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

ROWS: list[dict[str, Any]] = [
    {"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(3)
]
ROWS.append({"prompt": [{"role": "user", "content": "what is 2+2?"}], "completion": "4"})
DATA = RunData(train=ROWS)
EXPECTED_KEYS = {"loss", "token_accuracy", "grad_norm", "lr", "perf/tokens_per_s", "tokens/trained"}


_ctx = loop_ctx


def _spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "sft",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 3, "batch_size": 4, "learning_rate": 1e-2, **hp},
        }
    )


def _tiny(tiny_cache: Path) -> tuple[Any, Any]:
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))


@torch.no_grad()
def _hf_token_mean_ce(model: Any, tok: Any, rows: list[dict[str, Any]], max_length: int = 256) -> float:
    """Independent: HF's own ``labels=`` loss per example (mean over its scored tokens), re-weighted by
    each example's scored-token count into one mean over all completion tokens."""
    total, count = 0.0, 0
    for row in rows:
        ex = tokenize_example(row, tok, max_length=max_length)
        ids = torch.tensor([ex.prompt + ex.completion])
        labels = torch.tensor([[-100] * len(ex.prompt) + ex.completion])
        n = len(ex.completion) - (0 if ex.prompt else 1)  # position 0 is never a target
        total += float(model(input_ids=ids, labels=labels).loss) * n
        count += n
    return total / count


def _loss_steps(reporter: MemoryReporter, key: str = "loss") -> list[int]:
    return sorted({s for s, k, _ in reporter.metrics if k == key})


# --- the loss: pure, by value ---------------------------------------------------------------------------


def test_sft_loss_scores_only_completion_tokens_and_matches_hand_cross_entropy() -> None:
    torch.manual_seed(0)
    examples = [
        TokenizedExample(prompt=[5, 6, 7], completion=[8, 9, 2]),
        TokenizedExample(prompt=[3], completion=[4, 2]),  # shorter: padded on the right
    ]
    batch = collate_examples(examples, pad_id=0)
    V = 11
    logits = torch.randn(2, batch.input_ids.shape[1], V)
    loss = sft_loss(logits, batch.input_ids, batch.completion_mask)

    # Hand: CE of each completion token x_t under the logits at t-1, over the 3 + 2 completion tokens.
    terms = [
        F.cross_entropy(logits[i, t - 1 : t], batch.input_ids[i, t : t + 1])
        for i, e in enumerate(examples)
        for t in range(len(e.prompt), len(e.prompt) + len(e.completion))
    ]
    assert len(terms) == 5
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), abs=1e-6)
    # The same through HF-style labels (-100 on prompt and padding) and torch's ignore_index.
    assert batch.labels.tolist() == [[-100, -100, -100, 8, 9, 2], [-100, 4, 2, -100, -100, -100]]
    ignore = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), batch.labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert loss.item() == pytest.approx(ignore.item(), abs=1e-6)

    # Prompt targets and padding carry no loss: other ids there (same logits) change nothing.
    other = batch.input_ids.clone()
    other[0, 1:3] = torch.tensor([1, 10])  # targets of prompt positions 1, 2 (position 0 is never one)
    other[1, 3:] = 7  # padding
    assert torch.equal(sft_loss(logits, other, batch.completion_mask), loss)
    # A completion token is a target: changing it changes the loss.
    other[0, 4] = 3
    assert not torch.allclose(sft_loss(logits, other, batch.completion_mask), loss)
    # And which tokens count as completion matters: scoring one more token changes the loss.
    wider = batch.completion_mask.clone()
    wider[0, 2] = 1
    assert not torch.allclose(sft_loss(logits, batch.input_ids, wider), loss)


def test_completion_sums_count_argmax_hits_on_completion_tokens_only() -> None:
    batch = collate_examples([TokenizedExample(prompt=[1, 2], completion=[3, 4])], pad_id=0)  # ids 1 2 3 4
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 2] = 5.0  # predicts the prompt's 2: right, but a prompt target, so not counted
    logits[0, 1, 3] = 5.0  # predicts 3: right
    logits[0, 2, 0] = 5.0  # predicts 0 instead of 4: wrong
    nll, hits, count = completion_sums(logits, batch.input_ids, batch.completion_mask)
    assert (hits.item(), count.item()) == (1.0, 2.0)
    expected = -(torch.log_softmax(logits[0, 1], -1)[3] + torch.log_softmax(logits[0, 2], -1)[4])
    assert nll.item() == pytest.approx(expected.item(), abs=1e-6)


def test_sft_loss_with_no_completion_tokens_is_zero_not_nan() -> None:
    logits = torch.randn(1, 3, 4)
    assert sft_loss(logits, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 0]])).item() == 0.0


def test_loop_loss_equals_hugging_face_labels_loss_on_the_model(tiny_cache: Path) -> None:
    model, tok = _tiny(tiny_cache)
    examples = [tokenize_example(r, tok, max_length=64) for r in ROWS[:3]]
    batch = collate_examples(examples, tok.pad_token_id)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        ours = sft_loss(out.logits, batch.input_ids, batch.completion_mask)
    assert ours.item() == pytest.approx(out.loss.item(), abs=1e-5)


# --- tokenization and truncation ------------------------------------------------------------------------


def test_truncation_keeps_the_completion_and_the_prompt_tail() -> None:
    p, c = list(range(10)), [100, 101, 102]
    assert truncate(p, c, 13) == (p, c)  # fits: unchanged
    assert truncate(p, c, 8) == (p[-5:], c)  # prompt cut from the left, completion whole
    assert truncate(p, list(range(100, 120)), 8) == ([9], list(range(100, 107)))  # >= 1 prompt token
    assert truncate([], list(range(100, 120)), 8) == ([], list(range(100, 108)))  # nothing to keep
    assert truncate(p, [100], 2) == ([9], [100])  # the smallest max_length: one of each
    for n_p in range(6):
        for n_c in range(1, 6):
            tp, tc = truncate(list(range(n_p)), list(range(100, 100 + n_c)), 4)
            assert len(tp) + len(tc) == min(4, n_p + n_c) and len(tc) >= 1


def test_tokenize_example_renders_prompt_appends_eos_and_truncates(tiny_cache: Path) -> None:
    _, tok = _tiny(tiny_cache)
    ex = tokenize_example({"prompt": "12+3=", "completion": "15"}, tok, max_length=64)
    assert ex.prompt == tok("12+3=").input_ids
    assert ex.completion == tok("15", add_special_tokens=False).input_ids + [tok.eos_token_id]
    # The tiny tokenizer has no chat template: the plain "role: content" fallback.
    chat = tokenize_example(
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "yes"}, tok, max_length=64
    )
    assert chat.prompt == tok("user: hi\nassistant: ").input_ids
    long_prompt = " ".join(str(i) for i in range(200))
    cut = tokenize_example({"prompt": long_prompt, "completion": "15"}, tok, max_length=40)
    assert cut.completion == ex.completion
    assert cut.prompt == tok(long_prompt).input_ids[-(40 - len(ex.completion)) :]
    assert len(cut.prompt) + len(cut.completion) == 40


# --- the loop on the tiny model -------------------------------------------------------------------------


def test_train_changes_every_parameter_and_saves_a_loadable_model(tiny_cache: Path, tmp_path: Path) -> None:
    start, _ = _tiny(tiny_cache)
    reporter = MemoryReporter()
    result = run_sft(_spec(), DATA, reporter, _ctx(tiny_cache, tmp_path / "out"))
    assert result.status == "succeeded" and result.output_path == tmp_path / "out" / "step-00000003"
    assert list(reporter.checkpoints) == [3]
    trained, _ = load_causal_lm(str(result.output_path))
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    unchanged = [n for n, p in before.items() if p.requires_grad and torch.equal(p, after[n])]
    assert unchanged == []
    assert {k for _, k, _ in reporter.metrics if not k.startswith("final/")} == EXPECTED_KEYS
    assert _loss_steps(reporter) == [1, 2, 3]
    assert reporter.series("lr") == [1e-2] * 3
    assert all(0.0 <= a <= 1.0 for a in reporter.series("token_accuracy"))
    assert set(result.final_metrics) == {"final/loss", "final/token_accuracy"}


def test_loss_decreases_on_a_memorisation_task(tiny_cache: Path, tmp_path: Path) -> None:
    rows = ROWS[:8]
    start, tok = _tiny(tiny_cache)
    reporter = MemoryReporter()
    # batch_size = all rows: step 1 scores every row with the starting model, checkable independently.
    spec = _spec(max_steps=40, batch_size=8)
    result = run_sft(spec, RunData(train=rows), reporter, _ctx(tiny_cache, tmp_path / "out"))
    first = reporter.series("loss")[0]
    assert first == pytest.approx(_hf_token_mean_ce(start, tok, rows), abs=1e-4)
    assert first > 4.0  # random init over a 512-token vocab: about log 512 = 6.2
    assert result.final_metrics["final/loss"] < 0.2 * first
    assert reporter.series("token_accuracy")[0] < 0.2 < 0.5 < result.final_metrics["final/token_accuracy"]
    # final/* is the trained model on every training row, again checked through HF's loss.
    trained, _ = load_causal_lm(str(result.output_path))
    assert result.final_metrics["final/loss"] == pytest.approx(
        _hf_token_mean_ce(trained, tok, rows), abs=1e-4
    )


def test_cancel_is_obeyed_before_the_next_step(tiny_cache: Path, tmp_path: Path) -> None:
    reporter = MemoryReporter(stop_after=2)
    result = run_sft(_spec(max_steps=50), DATA, reporter, _ctx(tiny_cache, tmp_path / "out"))
    assert result.status == "cancelled" and result.output_path is None
    assert _loss_steps(reporter) == [1, 2]
    assert list(reporter.checkpoints) == [2]  # the work done so far is kept on stop


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tiny_cache: Path, tmp_path: Path) -> None:
    spec = _spec(max_steps=6, checkpoint_every=3, keep_last_checkpoints=5)
    straight_rep = MemoryReporter()
    straight = run_sft(spec, DATA, straight_rep, _ctx(tiny_cache, tmp_path / "a"))
    # Interrupted: cancel after 4 steps (checkpoint at 3 exists), then resume from step 3 in a fresh call.
    first = MemoryReporter(stop_after=4)
    assert run_sft(spec, DATA, first, _ctx(tiny_cache, tmp_path / "b")).status == "cancelled"
    assert list(first.checkpoints) == [3, 4]  # 4: the checkpoint saved when it stopped
    resumed_rep = MemoryReporter()
    resumed = run_sft(
        spec, DATA, resumed_rep, _ctx(tiny_cache, tmp_path / "b", resume_from=first.checkpoints[3])
    )
    assert _loss_steps(resumed_rep) == [4, 5, 6]
    assert resumed_rep.series("loss") == straight_rep.series("loss")[3:]
    a, _ = load_causal_lm(str(straight.output_path))
    b, _ = load_causal_lm(str(resumed.output_path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # Resuming from the final checkpoint has nothing left to do.
    again = MemoryReporter()
    done = run_sft(spec, DATA, again, _ctx(tiny_cache, tmp_path / "b", resume_from=resumed.output_path))
    assert done.status == "succeeded" and done.output_path == resumed.output_path
    assert again.metrics == [] and again.checkpoints == {}


def test_validation_is_evaluated_every_eval_every_steps_and_at_the_end(
    tiny_cache: Path, tmp_path: Path
) -> None:
    _, tok = _tiny(tiny_cache)
    data = RunData(train=ROWS[:8], validation=ROWS[8:])
    reporter = MemoryReporter()
    result = run_sft(_spec(max_steps=5, eval_every=2), data, reporter, _ctx(tiny_cache, tmp_path))
    evals = {s: v for s, k, v in reporter.metrics if k == "eval/loss"}
    assert sorted(evals) == [2, 4, 5]
    assert _loss_steps(reporter, "eval/token_accuracy") == [2, 4, 5]
    assert all(math.isfinite(v) and v > 0 for v in evals.values())
    # The last eval used the final model: recompute it independently from the saved checkpoint.
    trained, _ = load_causal_lm(str(result.output_path))
    assert evals[5] == pytest.approx(_hf_token_mean_ce(trained, tok, ROWS[8:]), abs=1e-4)
    # Without validation rows there is no eval at all.
    no_val = MemoryReporter()
    run_sft(
        _spec(max_steps=2, eval_every=1), RunData(train=ROWS[:8]), no_val, _ctx(tiny_cache, tmp_path / "n")
    )
    assert not [k for _, k, _ in no_val.metrics if k.startswith("eval/")]


def test_trained_tokens_add_up_every_row_of_every_step(tiny_cache: Path, tmp_path: Path) -> None:
    from trainer.data.prompts import render_prompt

    _, tok = _tiny(tiny_cache)
    # Independent count: each row's rendered prompt, its completion and EOS, no padding.
    per_epoch = sum(
        len(tok(render_prompt(r["prompt"], tok)).input_ids)
        + len(tok(r["completion"], add_special_tokens=False).input_ids)
        + 1
        for r in ROWS
    )
    reporter = MemoryReporter()
    run_sft(_spec(max_steps=2, batch_size=len(ROWS)), DATA, reporter, _ctx(tiny_cache, tmp_path))
    assert reporter.series("tokens/trained") == [per_epoch, 2 * per_epoch]  # cumulative: whole batch twice
