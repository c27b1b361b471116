"""Scoring a batch of samples with one grader (trainer/specs/graders.py): a score per sample, the failures,
and for a multi grader each sub-grader's scores.

A sample is the model's answer text; an item is the dataset row's fields (``item_of``: a prompts row's
extra fields and its ``answer``). A sample a grader cannot score (a template naming a field the item lacks,
a python grader's error or timeout, a formula that divides by zero) scores 0 and counts in ``failures``
with its first error kept, so training goes on and the run's metrics show the failures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.graders.arithmetic import ArithmeticError_, parse_formula
from trainer.graders.sandbox import DEFAULT_LIMITS, Limits, run_grader
from trainer.graders.similarity import similarity
from trainer.graders.templates import TemplateError, render, sample_json
from trainer.specs.graders import (
    AnyGrader as AnyGrader,
)
from trainer.specs.graders import (
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)

NO_JUDGE = (
    "score_model graders run in training runs, where the worker loads the judge model; the API loads no "
    "models, so graders/run cannot score them"
)


class JudgeScorer(Protocol):
    """What a score_model grader needs (trainer/graders/judges.py ``Judges``): per sample (score, None)
    or (None, why), for the rendered ``input`` conversation of each sample and its text."""

    def __call__(
        self, grader: ScoreModelGrader, conversations: Sequence[list[dict[str, str]]], texts: Sequence[str]
    ) -> list[tuple[float | None, str | None]]: ...


@dataclass
class Graded:
    """A batch's scores (0 where failed), which samples failed, the first error, sub-grader scores."""

    scores: list[float]
    failed: list[bool]
    first_error: str | None = None
    sub_scores: dict[str, list[float]] = field(default_factory=dict)

    @property
    def failures(self) -> int:
        return sum(self.failed)


def item_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """The grader's ``item`` for a prompts dataset row: its extra fields, and ``answer`` when it has one."""
    item = dict(row.get("meta") or {})
    if row.get("answer") is not None:
        item["answer"] = row["answer"]
    return item


def string_check(grader: StringCheckGrader, text: str, item: Mapping[str, Any]) -> float:
    given, reference = render(grader.input, item, text), render(grader.reference, item, text)
    op = grader.operation
    if op == "eq":
        return float(given == reference)
    if op == "ne":
        return float(given != reference)
    if op == "like":
        return float(reference in given)
    return float(reference.lower() in given.lower())


def text_similarity(grader: TextSimilarityGrader, text: str, item: Mapping[str, Any]) -> float:
    score = min(
        1.0,
        max(
            0.0,
            similarity(
                grader.evaluation_metric,
                render(grader.input, item, text),
                render(grader.reference, item, text),
            ),
        ),
    )
    if grader.pass_threshold is not None:
        return float(score >= grader.pass_threshold)
    return score


def score_model(
    grader: ScoreModelGrader,
    texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    judges: JudgeScorer | None,
) -> Graded:
    """Each sample's conversation (``input`` with its templates filled) judged by ``judges``."""
    scores, failed, first = [0.0] * len(texts), [True] * len(texts), None
    conversations, where = [], []
    for i, (text, item) in enumerate(zip(texts, items, strict=True)):
        try:
            conversations.append(
                [{"role": m.role, "content": render(m.content, item, text)} for m in grader.input]
            )
            where.append(i)
        except TemplateError as exc:
            first = first or f"TemplateError: {exc}"
    if judges is None:
        return Graded(scores, failed, NO_JUDGE)
    if where:
        for i, (value, why) in zip(
            where, judges(grader, conversations, [texts[i] for i in where]), strict=True
        ):
            if value is not None:
                scores[i], failed[i] = value, False
            else:
                first = first or why
    return Graded(scores, failed, first)


def grade_batch(
    grader: AnyGrader,
    texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    limits: Limits = DEFAULT_LIMITS,
    judges: JudgeScorer | None = None,
) -> Graded:
    """Score every ``texts[i]`` against ``items[i]`` (``judges``: for score_model graders)."""
    if len(texts) != len(items):
        raise ValueError(f"{len(texts)} samples for {len(items)} items")
    if isinstance(grader, ScoreModelGrader):
        return score_model(grader, texts, items, judges)
    if isinstance(grader, PythonGrader):
        calls = [
            ({"output_text": t, "output_json": sample_json(t)}, dict(i))
            for t, i in zip(texts, items, strict=True)
        ]
        results = run_grader(grader.source, calls, limits)
        errors = [r.error for r in results if r.score is None]
        return Graded(
            scores=[r.score if r.score is not None else 0.0 for r in results],
            failed=[r.score is None for r in results],
            first_error=errors[0] if errors else None,
        )
    if isinstance(grader, MultiGrader):
        return _multi(grader, texts, items, limits, judges)
    scores, failed, first = [], [], None
    for text, item in zip(texts, items, strict=True):
        try:
            if isinstance(grader, StringCheckGrader):
                scores.append(string_check(grader, text, item))
            else:
                scores.append(text_similarity(grader, text, item))
            failed.append(False)
        except (TemplateError, ValueError) as exc:
            scores.append(0.0)
            failed.append(True)
            first = first or f"{type(exc).__name__}: {exc}"
    return Graded(scores, failed, first)


def _multi(
    grader: MultiGrader,
    texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    limits: Limits,
    judges: JudgeScorer | None,
) -> Graded:
    formula = parse_formula(grader.calculate_output)
    parts = {name: grade_batch(sub, texts, items, limits, judges) for name, sub in grader.graders.items()}
    scores, failed = [], []
    first = next((p.first_error for p in parts.values() if p.first_error), None)
    for i in range(len(texts)):
        if any(p.failed[i] for p in parts.values()):
            scores.append(0.0)
            failed.append(True)
            continue
        try:
            value = formula.evaluate({name: p.scores[i] for name, p in parts.items()})
        except ArithmeticError_ as exc:
            scores.append(0.0)
            failed.append(True)
            first = first or f"calculate_output: {exc}"
            continue
        scores.append(value if math.isfinite(value) else 0.0)
        failed.append(False)
    sub = {name: p.scores for name, p in parts.items()}
    for name, p in parts.items():
        for key, values in p.sub_scores.items():
            sub[f"{name}.{key}"] = values
    return Graded(scores, failed, first, sub)
