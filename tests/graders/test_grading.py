"""Graders scoring samples (trainer/graders/grade.py): string checks, templates, similarity metrics against
values worked out by hand from each metric's definition, multi formulas, and failures counted as 0."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from trainer.graders.grade import grade_batch, item_of
from trainer.graders.similarity import similarity
from trainer.graders.templates import TemplateError, render
from trainer.specs.graders import Grader

GRADER: TypeAdapter[Any] = TypeAdapter(Grader)


def grader(**spec: Any) -> Any:
    return GRADER.validate_python({"name": "g", **spec})


def check(op: str) -> Any:
    return grader(
        type="string_check", input="{{sample.output_text}}", reference="{{item.answer}}", operation=op
    )


@pytest.mark.parametrize(
    "op, text, answer, expected",
    [
        ("eq", "42", "42", 1.0),
        ("eq", "42 ", "42", 0.0),
        ("ne", "41", "42", 1.0),
        ("like", "the answer is 42.", "42", 1.0),
        ("like", "The Answer", "answer", 0.0),
        ("ilike", "The ANSWER", "answer", 1.0),
    ],
)
def test_string_check_operations(op: str, text: str, answer: str, expected: float) -> None:
    assert grade_batch(check(op), [text], [{"answer": answer}]).scores == [expected]


def test_templates_read_items_nested_fields_and_the_sample_as_json() -> None:
    item = {"answer": "7", "meta": {"tags": ["a", "b"]}, "n": 3}
    assert render("{{ item.answer }}|{{item.meta.tags.1}}|{{item.n}}", item, "") == "7|b|3"
    assert render("{{sample.output_json.city}}", {}, '{"city": "Oslo"}') == "Oslo"
    assert render("{{item.meta}}", item, "") == '{"tags": ["a", "b"]}'
    with pytest.raises(TemplateError, match="no 'missing'"):
        render("{{item.missing}}", item, "")
    with pytest.raises(TemplateError, match="not JSON"):
        render("{{sample.output_json.city}}", {}, "Oslo")


def test_templates_naming_anything_else_are_refused_at_validation() -> None:
    with pytest.raises(ValidationError, match="a template reads item"):
        grader(type="string_check", input="{{os.environ}}", reference="x", operation="eq")


def test_a_missing_field_fails_that_sample_only() -> None:
    graded = grade_batch(check("eq"), ["1", "2"], [{"answer": "1"}, {}])
    assert graded.scores == [1.0, 0.0] and graded.failed == [False, True] and graded.failures == 1
    assert "item.answer" in (graded.first_error or "")


def test_item_of_a_prompts_row_is_its_extra_fields_and_answer() -> None:
    assert item_of({"prompt": "p", "answer": "3", "meta": {"topic": "sums"}}) == {
        "topic": "sums",
        "answer": "3",
    }
    assert item_of({"prompt": "p", "answer": None, "meta": {}}) == {}


# Hand values from each metric's definition, on whitespace words:
# "the cat sat" vs "the cat ran": unigrams match 2 of 3 each way, bigrams 1 of 2, trigrams 0 of 1.
HYP, REF = "the cat sat", "the cat ran"


def test_rouge_is_the_f_measure_of_n_gram_overlap() -> None:
    assert similarity("rouge_1", HYP, REF) == pytest.approx(2 / 3)  # P = R = 2/3
    assert similarity("rouge_2", HYP, REF) == pytest.approx(1 / 2)  # P = R = 1/2
    assert similarity("rouge_3", HYP, REF) == 0.0
    assert similarity("rouge_l", HYP, REF) == pytest.approx(2 / 3)  # LCS "the cat": 2 of 3 each way


def test_gleu_is_the_lesser_of_n_gram_precision_and_recall() -> None:
    # 1..4-grams: 3 + 2 + 1 = 6 in each; matching: 2 + 1 + 0 = 3 -> min(3/6, 3/6)
    assert similarity("gleu", HYP, REF) == pytest.approx(0.5)


def test_meteor_without_synonyms_follows_its_formula() -> None:
    # 4 of 4 words match in one chunk: P = R = 1, Fmean = 1; penalty = 0.5 * (1 chunk / 4 matches)^3.
    assert similarity("meteor", "a b c d", "a b c d") == pytest.approx(1 - 0.5 * (1 / 4) ** 3)
    # 2 of 3 match ("the", "cat") in one chunk: P = R = 2/3; Fmean = 10PR/(R + 9P) = 2/3;
    # penalty = 0.5 * (1/2)^3 (NLTK's defaults alpha 0.9, beta 3, gamma 0.5 with this form)
    fmean = 10 * (2 / 3) * (2 / 3) / ((2 / 3) + 9 * (2 / 3))
    assert similarity("meteor", HYP, REF) == pytest.approx(fmean * (1 - 0.5 * (1 / 2) ** 3))


def test_bleu_and_fuzzy_match_ends_of_the_scale() -> None:
    sentence = "the quick brown fox jumps over the lazy dog"
    assert similarity("bleu", sentence, sentence) == pytest.approx(1.0)
    assert similarity("bleu", "alpha beta gamma delta", sentence) == 0.0
    assert similarity("fuzzy_match", "Hello WORLD", "hello world") == 1.0  # case dropped
    assert similarity("fuzzy_match", "abc", "xyz") == 0.0


def test_cosine_is_refused_without_an_embedding_model() -> None:
    with pytest.raises(ValidationError, match="embedding model"):
        grader(type="text_similarity", input="a", reference="b", evaluation_metric="cosine")


def test_text_similarity_with_a_pass_threshold_is_pass_or_fail() -> None:
    base = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}
    rouge = grader(**base, evaluation_metric="rouge_1")
    assert grade_batch(rouge, [HYP], [{"answer": REF}]).scores == [pytest.approx(2 / 3)]
    strict = grader(**base, evaluation_metric="rouge_1", pass_threshold=0.7)
    loose = grader(**base, evaluation_metric="rouge_1", pass_threshold=0.6)
    assert grade_batch(strict, [HYP], [{"answer": REF}]).scores == [0.0]
    assert grade_batch(loose, [HYP], [{"answer": REF}]).scores == [1.0]


def test_multi_combines_its_graders_by_the_formula() -> None:
    multi = grader(
        type="multi",
        graders={
            "exact": {
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "operation": "eq",
            },
            "words": {
                "type": "text_similarity",
                "name": "words",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "evaluation_metric": "rouge_1",
            },
        },
        calculate_output="0.5 * exact + 0.5 * words^2",
    )
    graded = grade_batch(multi, [REF, HYP], [{"answer": REF}, {"answer": REF}])
    assert graded.scores == [pytest.approx(1.0), pytest.approx(0.5 * (2 / 3) ** 2)]
    assert graded.sub_scores == {"exact": [1.0, 0.0], "words": [pytest.approx(1.0), pytest.approx(2 / 3)]}


def test_multi_accepts_the_sdks_single_grader_and_refuses_unknown_names() -> None:
    one = {"type": "string_check", "name": "exact", "input": "a", "reference": "a", "operation": "eq"}
    assert set(grader(type="multi", graders=one, calculate_output="exact * 2").graders) == {"exact"}
    with pytest.raises(ValidationError, match="names no grader: other"):
        grader(type="multi", graders={"exact": one}, calculate_output="exact + other")
    with pytest.raises(ValidationError, match="position"):
        grader(type="multi", graders={"exact": one}, calculate_output="exact +* 2")


def test_a_formula_that_cannot_be_evaluated_fails_the_sample() -> None:
    one = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "1",
        "operation": "eq",
    }
    multi = grader(type="multi", graders={"exact": one}, calculate_output="1 / exact")
    graded = grade_batch(multi, ["1", "0"], [{}, {}])
    assert graded.scores == [1.0, 0.0] and graded.failed == [False, True]
    assert "calculate_output" in (graded.first_error or "")


def test_python_sources_must_define_grade() -> None:
    with pytest.raises(ValidationError, match="defines no top-level function"):
        grader(type="python", source="def score(sample, item):\n    return 1\n")
    with pytest.raises(ValidationError, match="not valid Python"):
        grader(type="python", source="def grade(:\n")
