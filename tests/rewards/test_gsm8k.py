"""The verifiers on real data: every GSM8K test reference solution scores correct against itself.

The file is the GSM8K test split (1,319 rows of ``{"question", "answer"}``, the answer ending in
``#### N``), copied from ``shared/data/gsm8k/`` into ``tests/data/gsm8k/`` with its licence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.rewards.verifiers import Sample, exact_match, numeric

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"  # copied from shared/data


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]


def _sample(row: dict[str, Any], completion: str) -> Sample:
    return Sample(
        prompt=row["question"],
        completion=completion,
        row={"prompt": row["question"], "answer": row["answer"], "meta": {}},
        n_tokens=len(completion.split()),
        max_new_tokens=512,
        truncated=False,
    )


def _final(answer: str) -> tuple[str, str]:
    """(solution text before the marker, final answer text after it), split independently of the code."""
    body, sep, final = answer.rpartition("#### ")
    assert sep, "every GSM8K answer ends in '#### N'"
    return body, final.strip()


def test_every_reference_solution_is_correct_and_an_off_by_one_answer_is_not(
    rows: list[dict[str, Any]],
) -> None:
    assert len(rows) == 1319
    finals = [_final(r["answer"])[1] for r in rows]
    assert any("," in f for f in finals) and any(f.startswith("-") for f in finals)  # the hard cases occur

    wrong_right, right_wrong = [], []
    for i, (row, final) in enumerate(zip(rows, finals, strict=True)):
        body = _final(row["answer"])[0]
        plus_one = int(final.replace(",", "")) + 1
        if numeric(_sample(row, row["answer"])) != 1.0:
            wrong_right.append(i)
        if numeric(_sample(row, f"{body}#### {plus_one}")) != 0.0:
            right_wrong.append(i)
    assert wrong_right == [] and right_wrong == []


def test_a_final_sentence_instead_of_the_marker_uses_the_last_number(rows: list[dict[str, Any]]) -> None:
    """Real solution text full of intermediate numbers, the answer stated last (as a model might)."""
    failures = []
    for i, row in enumerate(rows):
        body, final = _final(row["answer"])
        plus_one = int(final.replace(",", "")) + 1
        if numeric(_sample(row, f"{body}So the answer is {final}.")) != 1.0:
            failures.append(i)
        if numeric(_sample(row, f"{body}So the answer is {plus_one}.")) != 0.0:
            failures.append(i)
    assert failures == []


def test_exact_match_against_the_marker(rows: list[dict[str, Any]]) -> None:
    picked = [rows[0], rows[2]] + [r for r in rows if "," in _final(r["answer"])[1]][:2]
    picked += [r for r in rows if _final(r["answer"])[1].startswith("-")][:1]
    for row in picked:
        final = _final(row["answer"])[1]
        assert exact_match(_sample(row, final)) == 1.0
        assert exact_match(_sample(row, f"  {final}\n")) == 1.0
        assert exact_match(_sample(row, final + "0")) == 0.0
        assert exact_match(_sample(row, row["answer"])) == 0.0  # the whole solution is not the answer
    assert _final(rows[0]["answer"])[1] == "18" and _final(rows[2]["answer"])[1] == "70000"
