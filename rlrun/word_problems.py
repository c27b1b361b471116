"""Arithmetic word problems in chat form: the real-model task of ``rlrun demo --real`` and
``bench/real_model.py``.

``Ann has 12 pens. Ann gets 7 more. How many pens does Ann have now? Answer with a number.`` (add or take
away, numbers 2..20) as one user turn, for the model's own chat template; the answer is the number, read
from the reply by rlrun's ``numeric`` verifier (its last number). SmolLM2-135M-Instruct gets 8-23% of them
right greedy (docs/benchmarks.md): room for RL, and a reply a person can read.
"""

from __future__ import annotations

import random
from typing import Any

SUFFIX = " Answer with a number."
NAMES = ("Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy")
ITEMS = ("pens", "eggs", "cards", "coins", "books", "cups")


def word_problem(
    rng: random.Random, low: int = 2, high: int = 20, ask: str = "How many {item} does {name} have now?"
) -> tuple[str, int]:
    """One problem (without ``SUFFIX``) and its answer: a person, an item, two numbers in ``low..high``,
    add or take away, then the question ``ask`` (``{name}`` and ``{item}`` filled in)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(low, high), rng.randint(low, high)
    question = ask.format(name=name, item=item)
    if rng.random() < 0.5:
        return f"{name} has {a} {item}. {name} gets {b} more. {question}", a + b
    a, b = max(a, b), min(a, b)
    return f"{name} has {a} {item}. {name} gives away {b}. {question}", a - b


def problems(seed: int, n_heldout: int, n_train: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) prompt rows ``{"prompt": [user turn], "answer": "19"}``, distinct questions: none
    is in both. The pool holds 8 x 6 x 19 x 19 x 2 questions, so ``n_heldout + n_train`` may not exceed it."""
    rng = random.Random(seed)
    found: dict[str, int] = {}
    while len(found) < n_heldout + n_train:
        question, answer = word_problem(rng)
        found[question] = answer
    rows = [{"prompt": [{"role": "user", "content": q + SUFFIX}], "answer": str(a)} for q, a in found.items()]
    return rows[n_heldout:], rows[:n_heldout]
