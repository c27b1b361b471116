"""The ``calculate_output`` of a multi grader: arithmetic over grader names, parsed by a grammar of its own
and never handed to ``eval``.

Grammar (``^`` binds tighter than unary minus, and to the right, as in maths: ``-2^2 = -4``)::

    expr    := term (("+" | "-") term)*
    term    := unary (("*" | "/") unary)*
    unary   := ("+" | "-") unary | power
    power   := primary ("^" unary)?
    primary := number | name | name "(" expr ("," expr)* ")" | "(" expr ")"

Functions: ``min``/``max`` (one or more arguments), ``abs floor ceil exp sqrt log`` (one). Anything else is
refused when the grader is submitted, naming the position. Evaluation errors (division by zero, ``log`` of a
non-positive number, overflow) raise ``ArithmeticError_``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

FUNCTIONS: dict[str, tuple[Callable[..., float], int | None]] = {
    "min": (min, None),
    "max": (max, None),
    "abs": (abs, 1),
    "floor": (lambda x: float(math.floor(x)), 1),
    "ceil": (lambda x: float(math.ceil(x)), 1),
    "exp": (math.exp, 1),
    "sqrt": (math.sqrt, 1),
    "log": (math.log, 1),
}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*/^(),]))"
)
MAX_NODES = 512


class ArithmeticError_(ValueError):
    """A formula that does not parse, or cannot be evaluated with the given values."""


@dataclass(frozen=True)
class Node:
    kind: str  # "num", "name", "neg", "bin", "call"
    value: float = 0.0
    text: str = ""
    args: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Formula:
    root: Node
    names: frozenset[str]

    def evaluate(self, values: Mapping[str, float]) -> float:
        try:
            result = _eval(self.root, values)
        except (ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ArithmeticError_(f"cannot evaluate: {exc}") from None
        if not math.isfinite(result):
            raise ArithmeticError_(f"the result is not a finite number: {result}")
        return result


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, at = [], 0
    while at < len(text):
        if text[at:].strip() == "":
            break
        m = _TOKEN.match(text, at)
        if m is None or m.end() == at:
            raise ArithmeticError_(f"unexpected {text[at:].strip()[:1]!r} at position {at}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind), m.start(kind)))
        at = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.i = 0
        self.nodes = 0
        self.names: set[str] = set()

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, op: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            raise ArithmeticError_("the formula ends too early")
        if op is not None and tok[1] != op:
            raise ArithmeticError_(f"expected {op!r} at position {tok[2]}, found {tok[1]!r}")
        self.i += 1
        return tok

    def node(self, **kw: object) -> Node:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ArithmeticError_(f"the formula is longer than {MAX_NODES} terms")
        return Node(**kw)  # type: ignore[arg-type]

    def expr(self) -> Node:
        left = self.term()
        while (tok := self.peek()) is not None and tok[1] in "+-" and tok[0] == "op":
            self.take()
            left = self.node(kind="bin", text=tok[1], args=(left, self.term()))
        return left

    def term(self) -> Node:
        left = self.unary()
        while (tok := self.peek()) is not None and tok[1] in "*/" and tok[0] == "op":
            self.take()
            left = self.node(kind="bin", text=tok[1], args=(left, self.unary()))
        return left

    def unary(self) -> Node:
        tok = self.peek()
        if tok is not None and tok[0] == "op" and tok[1] in "+-":
            self.take()
            inner = self.unary()
            return self.node(kind="neg", args=(inner,)) if tok[1] == "-" else inner
        return self.power()

    def power(self) -> Node:
        base = self.primary()
        tok = self.peek()
        if tok is not None and tok[1] == "^":
            self.take()
            return self.node(kind="bin", text="^", args=(base, self.unary()))
        return base

    def primary(self) -> Node:
        kind, text, at = self.take()
        if kind == "num":
            return self.node(kind="num", value=float(text))
        if kind == "name":
            nxt = self.peek()
            if nxt is not None and nxt[1] == "(":
                if text not in FUNCTIONS:
                    raise ArithmeticError_(f"unknown function {text!r} at position {at}")
                self.take("(")
                args = [self.expr()]
                while (tok := self.peek()) is not None and tok[1] == ",":
                    self.take()
                    args.append(self.expr())
                self.take(")")
                arity = FUNCTIONS[text][1]
                if arity is not None and len(args) != arity:
                    raise ArithmeticError_(f"{text} takes {arity} argument, got {len(args)}")
                return self.node(kind="call", text=text, args=tuple(args))
            self.names.add(text)
            return self.node(kind="name", text=text)
        if text == "(":
            inner = self.expr()
            self.take(")")
            return inner
        raise ArithmeticError_(f"unexpected {text!r} at position {at}")


def parse_formula(text: str) -> Formula:
    """Parse ``text`` (ArithmeticError_ naming the position of the first thing that does not fit)."""
    parser = _Parser(text)
    if not parser.tokens:
        raise ArithmeticError_("the formula is empty")
    root = parser.expr()
    if (tok := parser.peek()) is not None:
        raise ArithmeticError_(f"unexpected {tok[1]!r} at position {tok[2]}")
    return Formula(root, frozenset(parser.names))


def _eval(node: Node, values: Mapping[str, float]) -> float:
    if node.kind == "num":
        return node.value
    if node.kind == "name":
        if node.text not in values:
            raise ValueError(f"no value for {node.text!r}")
        return float(values[node.text])
    if node.kind == "neg":
        return -_eval(node.args[0], values)
    if node.kind == "call":
        fn, _ = FUNCTIONS[node.text]
        return float(fn(*(_eval(a, values) for a in node.args)))
    a, b = (_eval(x, values) for x in node.args)
    if node.text == "+":
        return a + b
    if node.text == "-":
        return a - b
    if node.text == "*":
        return a * b
    if node.text == "/":
        return a / b
    if abs(b) > 1024:
        raise OverflowError(f"exponent {b} is too large")
    result = a**b
    if isinstance(result, complex):
        raise ValueError(f"{a} ^ {b} is not a real number")
    return float(result)
