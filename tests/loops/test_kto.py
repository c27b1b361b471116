"""The KTO loop on a tiny model: the first step's loss equals eq. 8 of Ethayarajh et al. 2024 computed here
from the two models one unpadded sequence at a time (mismatched pairs for z_0 built here too), training
moves the desirable answers above the undesirable ones, and an unpaired upload trains through the API."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.data.sft import tokenize_example
from trainer.loops.kto import run_kto
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

ROWS = [
    {
        "prompt": f"{a}+{b}=",
        "completion": str(a + b) if (a + b) % 3 else f"{a + b + 1}",
        "label": bool((a + b) % 3),
    }
    for a in range(3)
    for b in range(3)
]
REF_RUN = f"run:{uuid.uuid4()}"


def spec(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "kto",
            "model": "tiny:llama-0.4m",
            "reference_model": REF_RUN,
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "batch_size": len(ROWS), "learning_rate": 1e-2, **hp},
        }
    )


@pytest.fixture
def reference(tiny_cache: Path, tmp_path: Path) -> Path:
    """The starting model with every weight nudged: a reference the policy differs from at step 1."""
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder = tmp_path / "reference"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def logp_sum(model: Any, prompt: list[int], answer: list[int]) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0].double(), dim=-1)
    return sum(float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(answer))


def sigma(x: float) -> float:
    return 1 / (1 + math.exp(-x))


TWO = [  # two rows, one batch: the mismatched pairs are (0, 1) and (1, 0) whatever order the batch is in
    {"prompt": "12+30=", "completion": "42", "label": True},
    {"prompt": "7+8=", "completion": "16", "label": False},
]


def test_first_loss_is_eq_8_with_the_mismatched_kl(tiny_cache: Path, tmp_path: Path, reference: Path) -> None:
    run = spec(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5, batch_size=2)
    reporter = MemoryReporter()
    ctx = loop_ctx(tiny_cache, tmp_path / "out", runs={REF_RUN: reference})
    result = run_kto(run, RunData(train=TWO), reporter, ctx)
    assert result.status == "succeeded"

    policy, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    ref, _ = load_causal_lm(str(reference))
    policy.eval(), ref.eval()
    hp = run.hyperparameters
    (e0, e1) = [tokenize_example(r, tokenizer, max_length=hp.max_length) for r in TWO]

    def log_ratio(prompt: list[int], answer: list[int]) -> float:
        return logp_sum(policy, prompt, answer) - logp_sum(ref, prompt, answer)

    # z_0 (eq. 8, estimated on mismatched pairs): each prompt with the other row's answer, clamped at 0
    z0 = max(0.0, (log_ratio(e0.prompt, e1.completion) + log_ratio(e1.prompt, e0.completion)) / 2)
    desirable = 1.0 - sigma(hp.beta * (log_ratio(e0.prompt, e0.completion) - z0))
    undesirable = 1.5 * (1.0 - sigma(hp.beta * (z0 - log_ratio(e1.prompt, e1.completion))))
    assert reporter.series("kl")[0] == pytest.approx(z0, rel=1e-4, abs=1e-6)
    assert reporter.series("loss")[0] == pytest.approx((desirable + undesirable) / 2, rel=1e-4)


def test_mismatched_pairs_shift_answers_by_one() -> None:
    from trainer.data.sft import TokenizedExample
    from trainer.loops.kto import mismatched

    rows = [TokenizedExample(prompt=[i], completion=[10 + i, 20 + i]) for i in range(3)]
    assert [(m.prompt, m.completion) for m in mismatched(rows, 64)] == [
        ([0], [11, 21]),
        ([1], [12, 22]),
        ([2], [10, 20]),
    ]
    assert mismatched(rows, 2)[0].completion == [11]  # cut to fit max_length


def test_mismatched_pairs_never_pair_an_example_with_its_own_answer() -> None:
    from trainer.data.sft import TokenizedExample
    from trainer.loops.kto import mismatched

    a, b, c = (TokenizedExample(prompt=[i], completion=[10 + i]) for i in range(3))
    # a batch that holds one example twice (an epoch's end meeting the next start) skips the repeat
    assert [m.completion for m in mismatched([a, a, b], 64)] == [[11], [11], [10]]
    # a set of one (a held-out set of one row) borrows the first other answer of the spare examples
    assert [m.completion for m in mismatched([c], 64, spare=[c, a])] == [[10]]
    assert [m.completion for m in mismatched([a, a], 64, spare=[a, b])] == [[11], [11]]
    with pytest.raises(ValueError, match="at least 2 different examples"):
        mismatched([a, a], 64, spare=[a])


def test_a_held_out_set_of_one_row_takes_z0_from_a_training_answer(
    tiny_cache: Path, tmp_path: Path, reference: Path
) -> None:
    """z_0 of one held-out row is its prompt with the first training example's answer (never its own
    answer, whose log-ratio the loss would then cancel: the KTO loss of that row would be lambda/2)."""
    policy, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    ref, _ = load_causal_lm(str(reference))
    policy.eval(), ref.eval()
    hp = spec().hyperparameters
    first = tokenize_example(TWO[0], tokenizer, max_length=hp.max_length)

    def log_ratio(prompt: list[int], answer: list[int]) -> float:
        return logp_sum(policy, prompt, answer) - logp_sum(ref, prompt, answer)

    def z0s(row: dict[str, Any]) -> tuple[float, float]:  # (borrowed, own) reference points
        e = tokenize_example(row, tokenizer, max_length=hp.max_length)
        return max(0.0, log_ratio(e.prompt, first.completion)), max(0.0, log_ratio(e.prompt, e.completion))

    # a held-out row where the two differ, so the test tells them apart (the nudged reference is fixed)
    held = next((r for r in ROWS if abs(z0s(r)[0] - z0s(r)[1]) > 1e-3), None)
    assert held is not None
    borrowed, _ = z0s(held)
    # a learning rate so small that the evaluation after step 1 sees the starting policy
    run = spec(batch_size=2, learning_rate=1e-12, eval_every=1)
    reporter = MemoryReporter()
    ctx = loop_ctx(tiny_cache, tmp_path / "out", runs={REF_RUN: reference})
    result = run_kto(run, RunData(train=TWO, validation=[held]), reporter, ctx)
    assert result.status == "succeeded"
    assert reporter.series("eval/kl")[0] == pytest.approx(borrowed, rel=1e-4, abs=1e-6)


def test_a_batch_of_one_is_refused_naming_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="batch_size") as caught:
        spec(batch_size=1)
    assert "another example's answer" in str(caught.value)


def test_training_moves_desirable_answers_above_undesirable(tiny_cache: Path, tmp_path: Path) -> None:
    run = parse_spec(
        {
            "algorithm": "kto",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 12, "batch_size": 3, "learning_rate": 1e-2},
        }
    )
    reporter = MemoryReporter()
    result = run_kto(run, RunData(train=ROWS, validation=ROWS[:4]), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    assert reporter.series("loss")[0] == pytest.approx(
        0.5, abs=1e-5
    )  # policy = reference: every loss is lambda/2
    assert result.final_metrics["final/rewards/margin"] > 0
    keys = {k for _, k, _ in reporter.metrics}
    assert {"loss", "kl", "grad_norm", "lr", "tokens/trained", "eval/loss", "eval/kl"} <= keys


def test_each_example_is_scored_by_the_reference_once_per_run(
    tiny_cache: Path, tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three epochs over two examples: the frozen reference scores each training example once (its value
    is kept), and the mismatched pairs of every step (they change with the batch)."""
    import trainer.loops.kto as kto_loop

    ref_model, _ = load_causal_lm(str(reference))
    scored: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = kto_loop.no_grad_logps

    def counting(model: Any, examples: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = next(model.parameters())
        if not torch.equal(first, next(ref_model.parameters())):  # the policy's passes are not counted
            return real(model, examples, *args, **kwargs)
        scored.extend((tuple(e.prompt), tuple(e.completion)) for e in examples)
        return real(model, examples, *args, **kwargs)

    monkeypatch.setattr(kto_loop, "no_grad_logps", counting)
    run = spec(batch_size=2, max_steps=3, eval_every=0)
    ctx = loop_ctx(tiny_cache, tmp_path / "out", runs={REF_RUN: reference})
    result = run_kto(run, RunData(train=TWO), MemoryReporter(), ctx)
    assert result.status == "succeeded"
    _, tokenizer = load_causal_lm(str(reference))
    hp = run.hyperparameters
    e0, e1 = [tokenize_example(r, tokenizer, max_length=hp.max_length) for r in TWO]
    own = [(tuple(e.prompt), tuple(e.completion)) for e in (e0, e1)]
    crossed = [(tuple(e0.prompt), tuple(e1.completion)), (tuple(e1.prompt), tuple(e0.completion))]
    steps_and_final = 3 + 1  # the final metrics score the examples and their pairs once more
    assert sorted(s for s in scored if s in own) == sorted(own * (1 + 1))  # training once, final once
    assert sum(s in crossed for s in scored) == 2 * steps_and_final
