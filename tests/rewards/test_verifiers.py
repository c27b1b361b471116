"""Each verifier by value on hand-made cases, the registry, and its sync with the spec's names."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from tests.rewards.helpers import sample
from trainer.rewards import verifiers as v
from trainer.specs import VerifierName


def test_registry_keys_match_the_spec_and_lookup_lists_valid_names() -> None:
    assert set(v.VERIFIERS) == {
        "exact_match",
        "numeric",
        "regex",
        "format",
        "length_penalty",
        "overlong_penalty",
    }
    assert set(get_args(VerifierName)) == set(v.VERIFIERS)
    assert v.get_verifier("numeric") is v.numeric
    with pytest.raises(ValueError, match="unknown verifier 'nope'; valid names: exact_match, format"):
        v.get_verifier("nope")
    with pytest.raises(TypeError):
        v.VERIFIERS["mine"] = v.numeric  # type: ignore[index]


# ------------------------------------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("completion", "answer", "kwargs", "expected"),
    [
        ("Paris", "Paris", {}, 1.0),
        ("  Paris\n", "Paris ", {}, 1.0),  # stripped on both sides by default
        ("  Paris\n", "Paris", {"strip": False}, 0.0),
        ("paris", "Paris", {}, 0.0),  # case-sensitive by default
        ("paris", "PARIS", {"case_sensitive": False}, 1.0),
        ("Paris.", "Paris", {}, 0.0),
        ("18", "Janet sells 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", {}, 1.0),  # after the marker
        ("18", "#### 7\n#### 18 ", {}, 1.0),  # the LAST marker
        ("7", "#### 7\n#### 18", {}, 0.0),
        ("#### 18", "#### 18", {}, 0.0),  # the completion is not reduced
        ("", "", {}, 1.0),
    ],
)
def test_exact_match(completion: str, answer: str, kwargs: dict[str, Any], expected: float) -> None:
    assert v.exact_match(sample(completion, answer), **kwargs) == expected


def test_exact_match_reads_meta_and_other_fields_and_raises_without_a_reference() -> None:
    assert v.exact_match(sample("B", None, meta={"answer": "B"})) == 1.0  # top-level None falls to meta
    assert v.exact_match(sample("B", "A", meta={"label": "B"}), answer_field="label") == 1.0
    assert v.exact_match(sample("3", None, meta={"answer": 3})) == 1.0  # a non-string reference as text
    with pytest.raises(ValueError, match="no reference 'answer'"):
        v.exact_match(sample("B", None))


# ----------------------------------------------------------------------------------------------- numeric


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("I think 7, finally \\boxed{42} (not 9)", "42", 1.0),  # the box wins over the last number
        ("\\boxed{41} then \\boxed{42}", "42", 1.0),  # the last box
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{-\\dfrac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{1{,}234}", "1234", 1.0),
        ("\\boxed{\\text{none}} but 42", "42", 0.0),  # an empty box is the committed answer
        ("She earns 9 * 2 = 18 dollars.\n#### 18", "#### 18", 1.0),
        ("#### 18 dollars, not 20", "18", 1.0),  # the first number after the marker
        ("#### 5\n#### 18", "18", 1.0),  # the last marker
        ("First 3 apples, then 5 more: 8", "8", 1.0),  # the last number
        ("First 3 apples, then 5 more: 8", "5", 0.0),
        ("The temperature is -7 degrees", "-7", 1.0),
        ("The temperature is -7 degrees", "7", 0.0),
        ("x = \u22127", "-7", 1.0),  # unicode minus
        ("10-3=7", "7", 1.0),  # a minus after a digit is an operator, not a sign
        ("x = 5-3", "3", 1.0),
        ("It costs $3.50 each", "3.5", 1.0),
        ("about .5 of it", "0.5", 1.0),
        ("The total is 1,234 dollars.", "1234", 1.0),
        ("The total is 1234.", "1,234", 1.0),  # the reference may carry separators
        ("The total is 1,234,567.89", "1234567.89", 1.0),
        ("lists 1,2,3", "3", 1.0),  # not a thousands separator
        ("three quarters: 3/4", "0.75", 1.0),
        ("no number here", "42", 0.0),
        ("", "42", 0.0),
        ("42", "Reasoning with 7 steps.\n#### 42", 1.0),
    ],
)
def test_numeric(completion: str, answer: str, expected: float) -> None:
    assert v.numeric(sample(completion, answer)) == expected


def test_numeric_tolerance_absolute_and_relative() -> None:
    assert v.numeric(sample("3.1416", "3.14159"), tolerance=1e-3) == 1.0
    assert v.numeric(sample("3.15", "3.14159"), tolerance=1e-3) == 0.0
    assert v.numeric(sample("42.0000001", "42")) == 1.0  # default 1e-6 absolute
    assert v.numeric(sample("42.00001", "42")) == 0.0
    # relative: |p - r| <= tol * |r|
    assert v.numeric(sample("1010", "1000"), tolerance=0.01, relative=True) == 1.0
    assert v.numeric(sample("1011", "1000"), tolerance=0.01, relative=True) == 0.0
    assert v.numeric(sample("1010", "1000"), tolerance=0.01) == 0.0
    assert v.numeric(sample("0", "0"), tolerance=0.5, relative=True) == 1.0
    assert v.numeric(sample("0.001", "0"), tolerance=0.5, relative=True) == 0.0  # r = 0: exact only


def test_numeric_extract_modes_and_errors() -> None:
    text = "\\boxed{1} #### 2 and finally 3"
    assert [v.numeric(sample(text, str(k)), extract="boxed") for k in (1, 2, 3)] == [1.0, 0.0, 0.0]
    assert [v.numeric(sample(text, str(k)), extract="hash") for k in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [v.numeric(sample(text, str(k)), extract="last") for k in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert v.numeric(sample("only 4", "4"), extract="boxed") == 0.0
    assert v.numeric(sample("only 4", "4"), extract="hash") == 0.0
    with pytest.raises(ValueError, match="unknown extract mode"):
        v.numeric(sample("4", "4"), extract="first")
    with pytest.raises(ValueError, match="contains no number"):
        v.numeric(sample("4", "four"))
    with pytest.raises(ValueError, match="no reference"):
        v.numeric(sample("4", None))
    assert v.numeric(sample("4", None, meta={"target": "4"}), answer_field="target") == 1.0


def test_parse_numbers() -> None:
    assert v.parse_numbers("-1,234.5 and 3/4, x2 and 12/0 then +6") == [-1234.5, 0.75, 6.0]
    assert v.parse_numbers("") == []


# ------------------------------------------------------------------------------------------ regex, format


def test_regex_search_full_match_and_flags() -> None:
    s = sample("The answer is 42.")
    assert v.regex(s, pattern=r"answer is \d+") == 1.0  # search: partial match anywhere
    assert v.regex(s, pattern=r"answer is \d+", full_match=True) == 0.0
    assert v.regex(s, pattern=r"The answer is \d+\.", full_match=True) == 1.0
    assert v.regex(s, pattern=r"ANSWER") == 0.0
    assert v.regex(s, pattern=r"ANSWER", flags="i") == 1.0
    assert v.regex(sample("a\nb"), pattern=r"^b$") == 0.0
    assert v.regex(sample("a\nb"), pattern=r"^b$", flags="m") == 1.0
    assert v.regex(sample("a\nb"), pattern=r"a.b") == 0.0
    assert v.regex(sample("a\nb"), pattern=r"a.b", flags="s") == 1.0
    with pytest.raises(ValueError, match="unknown regex flag 'q'"):
        v.regex(s, pattern="a", flags="q")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("<think>line one\nline two</think>\n\n<answer>\n4\n</answer>", 1.0),  # DOTALL, whitespace between
        ("<think></think><answer></answer>", 1.0),
        ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>4</answer> trailing", 0.0),
        ("Sure! <think>x</think><answer>4</answer>", 0.0),
        (" <think>x</think><answer>4</answer>", 0.0),  # even leading whitespace
        ("<think>x</think>", 0.0),
        ("<think>x<answer>4</answer>", 0.0),  # no closing think
        ("", 0.0),
    ],
)
def test_format(completion: str, expected: float) -> None:
    assert v.format(sample(completion)) == expected


def test_format_custom_pattern() -> None:
    assert v.format(sample("Answer: 4"), pattern=r"^Answer: .+$") == 1.0
    assert v.format(sample("answer: 4"), pattern=r"^Answer: .+$") == 0.0


# --------------------------------------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, 0.0),
        (30, 0.0),  # at the target: no penalty
        (31, -2.0 * 1 / 100),  # -scale * (n - target) / max_new_tokens
        (50, -2.0 * 20 / 100),
        (100, -2.0 * 70 / 100),
        (130, -2.0 * 100 / 100),
    ],
)
def test_length_penalty(n: int, expected: float) -> None:
    s = sample(n_tokens=n, max_new_tokens=100)
    assert v.length_penalty(s, target_tokens=30, scale=2.0) == pytest.approx(expected, abs=1e-12)


def test_length_penalty_default_scale_and_errors() -> None:
    assert v.length_penalty(sample(n_tokens=64, max_new_tokens=64), target_tokens=0) == -1.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        v.length_penalty(sample(n_tokens=1, max_new_tokens=0), target_tokens=0)
    with pytest.raises(ValueError, match="target_tokens"):
        v.length_penalty(sample(n_tokens=1), target_tokens=-1)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, 0.0),
        (80, 0.0),  # L_max - L_cache = 100 - 20: the last length without punishment
        (81, -1 / 20),  # ((L_max - L_cache) - n) / L_cache = (80 - 81) / 20
        (90, -10 / 20),
        (99, -19 / 20),
        (100, -1.0),  # n = L_max: (80 - 100) / 20
        (101, -1.0),  # beyond L_max
        (500, -1.0),
    ],
)
def test_overlong_penalty_regions(n: int, expected: float) -> None:
    s = sample(n_tokens=n, max_new_tokens=100)
    assert v.overlong_penalty(s, cache_tokens=20) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_edge_cache_sizes() -> None:
    assert v.overlong_penalty(sample(n_tokens=100, max_new_tokens=100), cache_tokens=0) == 0.0
    assert v.overlong_penalty(sample(n_tokens=101, max_new_tokens=100), cache_tokens=0) == -1.0
    # L_cache = L_max: linear from 0 tokens
    assert v.overlong_penalty(sample(n_tokens=25, max_new_tokens=100), cache_tokens=100) == -0.25
    with pytest.raises(ValueError, match="cache_tokens"):
        v.overlong_penalty(sample(n_tokens=1, max_new_tokens=100), cache_tokens=101)
    with pytest.raises(ValueError, match="cache_tokens"):
        v.overlong_penalty(sample(n_tokens=1, max_new_tokens=100), cache_tokens=-1)


def test_backtracking_user_pattern_times_out_instead_of_hanging() -> None:
    import time

    from trainer.rewards.composite import CompositeReward, RewardComponent

    evil = RewardComponent("regex", params={"pattern": r"^(a+)+$"})
    s = sample(completion="a" * 40 + "b")
    t0 = time.monotonic()
    result = CompositeReward([evil], timeout_s=5.0)([s])
    # With Python's `re` this match backtracks ~2^40 times and would hang; here it ends (no match, or a
    # regex timeout counted as a failure) well within the composite's 5 s budget.
    assert time.monotonic() - t0 < 4.0
    assert result.total == [0.0]
