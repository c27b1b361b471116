"""calculate_output's grammar against values worked out by hand, and every refusal naming its position."""

from __future__ import annotations

import pytest

from trainer.graders.arithmetic import ArithmeticError_, parse_formula

CASES = [
    ("1 + 2 * 3", {}, 7.0),
    ("(1 + 2) * 3", {}, 9.0),
    ("-2^2", {}, -4.0),  # ^ binds tighter than unary minus
    ("2^3^2", {}, 512.0),  # right-associative: 2^(3^2)
    ("2^-1", {}, 0.5),
    ("8 / 4 / 2", {}, 1.0),  # left-associative
    ("10 - 4 - 3", {}, 3.0),
    ("0.5 * a + 0.5 * b", {"a": 1.0, "b": 0.2}, 0.6),
    ("min(a, b, 0.3) + max(a, b)", {"a": 1.0, "b": 0.2}, 1.2),
    ("abs(-3) + floor(2.7) + ceil(2.1)", {}, 8.0),
    ("sqrt(16) + log(exp(2))", {}, 6.0),
    ("1e-1 * 10 + .5", {}, 1.5),
    ("+a", {"a": 3.0}, 3.0),
]


@pytest.mark.parametrize("text, values, expected", CASES)
def test_values_worked_out_by_hand(text: str, values: dict[str, float], expected: float) -> None:
    assert parse_formula(text).evaluate(values) == pytest.approx(expected)


def test_names_are_the_free_variables() -> None:
    assert parse_formula("0.5 * accuracy + min(style, 1) - log(x)").names == {"accuracy", "style", "x"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("1 +", "ends too early"),
        ("__import__(1)", "unknown function '__import__'"),
        ("__import__('os')", 'unexpected "\'" at position 11'),
        ("a.b", "unexpected '.' at position 1"),
        ("a; b", "unexpected ';' at position 1"),
        ("(1 + 2", "ends too early"),
        ("1 2", "unexpected '2' at position 2"),
        ("sqrt(1, 2)", "sqrt takes 1 argument"),
        ("a ** b", r"unexpected '\*' at position 3"),
        ("'x'", "unexpected"),
        ("+".join(["a"] * 600), "longer than"),
    ],
)
def test_anything_outside_the_grammar_is_refused(text: str, message: str) -> None:
    with pytest.raises(ArithmeticError_, match=message):
        parse_formula(text)


@pytest.mark.parametrize(
    "text, values",
    [
        ("a / b", {"a": 1.0, "b": 0.0}),
        ("log(a)", {"a": 0.0}),
        ("sqrt(-1)", {}),
        ("10 ^ 400", {}),
        ("2 ^ 5000", {}),
        ("(-8) ^ (1/3)", {}),  # complex in Python: not a real number
    ],
)
def test_evaluation_errors_raise_instead_of_returning_nonsense(text: str, values: dict[str, float]) -> None:
    with pytest.raises(ArithmeticError_):
        parse_formula(text).evaluate(values)


def test_a_missing_value_is_an_error() -> None:
    with pytest.raises(ArithmeticError_, match="no value for 'b'"):
        parse_formula("a + b").evaluate({"a": 1.0})
