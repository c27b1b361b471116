"""Rule-based verifiers: pure functions ``fn(sample, **params) -> float`` over one decoded completion.

Every verifier has the call shape ``fn(sample: Sample, **params) -> float`` and lives in ``VERIFIERS``; the
spec's ``params`` are its keyword arguments. Correctness verifiers return 1.0 or 0.0; the penalties return a
value in [-scale, 0] or [-1, 0]. A verifier raises ValueError when it cannot judge a sample at all (no
reference answer, a bad parameter); ``CompositeReward`` scores that 0 and counts it as a failure, so a
verifier never has to guess.

Numbers (``numeric``) are read with one pattern: an optional sign (only where it cannot be a binary minus,
i.e. not right after a letter, digit or dot), digits with optional thousands separators (``1,234``) and
decimals (``-0.5``, ``.5``), and an optional ``/ denominator`` (``3/4`` -> 0.75). Exponents (``1e5``) are not
read as one number.

Pure Python: no torch, nothing from the rest of rlrun except the shared registry lookup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import regex as regex_engine  # user patterns: a match can time out (see `regex`)

from trainer.algorithms._registry import lookup


@dataclass(frozen=True)
class Sample:
    """One completion to score, with what a verifier may need to judge it.

    Attributes:
        prompt: the rendered prompt text.
        completion: the decoded completion text (special tokens stripped).
        row: the dataset row, ``{"prompt", "answer": str | None, "meta": {...}}``.
        n_tokens: completion length in tokens.
        max_new_tokens: the generation budget.
        truncated: True if generation stopped at ``max_new_tokens`` without EOS.
        env_return: a multi-turn episode's sum of environment rewards (None: no environment).
    """

    prompt: str
    completion: str
    row: Mapping[str, Any]
    n_tokens: int
    max_new_tokens: int
    truncated: bool
    env_return: float | None = None


VerifierFn = Callable[..., float]  # called as fn(sample, **params) -> float

GSM8K_MARKER = "####"
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"  # 1,234.5 | 1234.5 | .5
_NUMBER = re.compile(rf"(?<![\w.])(?P<sign>[-+\u2212]?)(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_SPACING = re.compile(r"\{,\}|\\[,!;: ]")  # 1{,}234 and thin spaces inside a boxed number
_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}
EXTRACT_MODES = ("auto", "boxed", "hash", "last")


# ---------------------------------------------------------------------------------------------- helpers


def reference_answer(sample: Sample, answer_field: str = "answer") -> str:
    """``row[answer_field]``, else ``row["meta"][answer_field]``, as text; ValueError if neither is set.

    A top-level ``None`` (prompt datasets without answers) falls through to ``meta``.
    """
    value = sample.row.get(answer_field)
    if value is None:
        meta = sample.row.get("meta")
        value = meta.get(answer_field) if isinstance(meta, Mapping) else None
    if value is None:
        raise ValueError(f"the row has no reference {answer_field!r} (neither top level nor in meta)")
    return str(value)


def parse_numbers(text: str) -> list[float]:
    """Every number in ``text``, left to right (see the module docstring for what counts as one).

    ``"-1,234.5 and 3/4"`` -> ``[-1234.5, 0.75]``; a fraction with a zero denominator is skipped.
    """
    out = []
    for m in _NUMBER.finditer(text):
        value = float(m["num"].replace(",", ""))
        if m["den"] is not None:
            den = float(m["den"].replace(",", ""))
            if den == 0:
                continue
            value /= den
        out.append(-value if m["sign"] in ("-", "\u2212") else value)
    return out


def boxed_content(text: str) -> str | None:
    """The content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; None if absent.

    An unclosed box (a truncated completion) counts as absent.
    """
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    begin = starts[-1].end()
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def extract_number(text: str, mode: str = "auto") -> float | None:
    """The answer number of ``text``, or None.

    Modes:
        ``boxed``: the last number inside the last ``\\boxed{}`` (``\\frac{a}{b}`` read as a/b;
        ``x = 5`` -> 5).
        ``hash``: the first number after the last ``####`` (GSM8K's final-answer marker).
        ``last``: the last number anywhere in the text.
        ``auto``: ``boxed`` if a box is present, else ``hash`` if the marker is present, else ``last``.
        A present box or marker without a number gives None: it is the committed answer, so auto does not
        fall back to a number elsewhere in the text.
    """
    if mode not in EXTRACT_MODES:
        raise ValueError(f"unknown extract mode {mode!r}; valid: {', '.join(EXTRACT_MODES)}")
    if mode in ("auto", "boxed"):
        box = boxed_content(text)
        if box is not None:
            numbers = parse_numbers(_LATEX_SPACING.sub("", _FRAC.sub(r"\1/\2", box)))
            return numbers[-1] if numbers else None
        if mode == "boxed":
            return None
    if mode in ("auto", "hash"):
        if GSM8K_MARKER in text:
            numbers = parse_numbers(text.rsplit(GSM8K_MARKER, 1)[1])
            return numbers[0] if numbers else None
        if mode == "hash":
            return None
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


# -------------------------------------------------------------------------------------------- verifiers


def exact_match(
    sample: Sample, *, strip: bool = True, case_sensitive: bool = True, answer_field: str = "answer"
) -> float:
    """1.0 if the completion equals the reference answer, else 0.0.

    Args:
        sample: the completion and its row.
        strip: compare with surrounding whitespace removed (both sides).
        case_sensitive: False compares ``str.casefold()`` of both sides.
        answer_field: the row key of the reference (top level, else ``row["meta"]``).

    Formula: ``1[c == a]`` with ``c`` the completion and ``a`` the reference; a reference containing
    GSM8K's ``#### N`` marker is reduced to the text after its LAST ``####`` (always stripped), so
    ``"...#### 18"`` matches the completion ``"18"``. The completion itself is not reduced.
    Source: exact-match accuracy as in GSM8K (Cobbe et al. 2021) / MATH (Hendrycks et al. 2021) evals.
    Degenerate: no reference -> ValueError; empty completion vs empty reference -> 1.0.
    """
    reference = reference_answer(sample, answer_field)
    if GSM8K_MARKER in reference:
        reference = reference.rsplit(GSM8K_MARKER, 1)[1].strip()
    completion = sample.completion
    if strip:
        completion, reference = completion.strip(), reference.strip()
    if not case_sensitive:
        completion, reference = completion.casefold(), reference.casefold()
    return 1.0 if completion == reference else 0.0


def numeric(
    sample: Sample,
    *,
    tolerance: float = 1e-6,
    relative: bool = False,
    answer_field: str = "answer",
    extract: str = "auto",
) -> float:
    """1.0 if the completion's answer number equals the reference's within tolerance, else 0.0.

    Args:
        sample: the completion and its row.
        tolerance: absolute tolerance, or relative to ``|reference|`` when ``relative``.
        relative: compare ``|p - r| <= tolerance * |r|`` instead of ``|p - r| <= tolerance``.
        answer_field: the row key of the reference (top level, else ``row["meta"]``).
        extract: how to read the completion's number: ``auto`` (``\\boxed{}``, else ``####``, else the last
            number), ``boxed``, ``hash`` or ``last`` (see ``extract_number``). The reference is always
            read with ``auto``, so GSM8K's ``"... #### 42"`` and a plain ``"1,234"`` both work.

    Formula: ``1[|p - r| <= tol]`` (absolute) or ``1[|p - r| <= tol * |r|]`` (relative), with ``p`` and
    ``r`` the extracted predicted and reference numbers.
    Source: the GSM8K answer format (Cobbe et al. 2021); ``\\boxed{}`` as in MATH (Hendrycks et al. 2021).
    Degenerate: no number in the completion (or an empty box / marker) -> 0.0; no reference, or a reference
    without a number -> ValueError (a data problem, counted as a failure); relative with r == 0 needs
    p == 0 exactly.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    reference_text = reference_answer(sample, answer_field)
    reference = extract_number(reference_text, "auto")
    if reference is None:
        raise ValueError(f"the reference {reference_text[-80:]!r} contains no number")
    predicted = extract_number(sample.completion, extract)
    if predicted is None:
        return 0.0
    bound = tolerance * abs(reference) if relative else tolerance
    return 1.0 if abs(predicted - reference) <= bound else 0.0


def regex(sample: Sample, *, pattern: str, full_match: bool = False, flags: str = "") -> float:
    """1.0 if ``pattern`` matches the completion, else 0.0.

    Args:
        sample: the completion.
        pattern: a Python ``re`` pattern.
        full_match: require the whole completion to match (``re.fullmatch``) instead of a match anywhere
            (``re.search``).
        flags: letters of ``re`` flags: ``i`` IGNORECASE, ``m`` MULTILINE, ``s`` DOTALL, ``x`` VERBOSE,
            ``a`` ASCII.

    Formula: ``1[re.search(pattern, c)]`` or ``1[re.fullmatch(pattern, c)]``.
    Source: rule-based rewards as in DeepSeek-R1 (Guo et al. 2025) and TRL/Open-R1 reward functions.
    Degenerate: an invalid pattern or an unknown flag letter -> ValueError / ``regex.error``. Patterns run
    on model output, and ``re`` holds the GIL (the composite's thread timeout could not interrupt a
    catastrophically backtracking match), so user patterns run on the ``regex`` engine with its own
    ``timeout``: a match running past ``USER_PATTERN_TIMEOUT_S`` raises TimeoutError (scored 0, counted).
    """
    compiled = regex_engine.compile(pattern, _parse_flags(flags))
    if full_match:
        match = compiled.fullmatch(sample.completion, timeout=USER_PATTERN_TIMEOUT_S)
    else:
        match = compiled.search(sample.completion, timeout=USER_PATTERN_TIMEOUT_S)
    return 1.0 if match is not None else 0.0


USER_PATTERN_TIMEOUT_S = 1.0
R1_FORMAT = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def format(sample: Sample, *, pattern: str = R1_FORMAT) -> float:  # shadows the builtin: the registry name
    """1.0 if the completion has the think/answer format, else 0.0.

    Args:
        sample: the completion.
        pattern: searched with ``re.DOTALL`` (so ``.`` crosses lines); the pattern carries its own anchors.
            The default is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else around
            them (whitespace allowed between the two blocks).

    Formula: ``1[re.search(pattern, c, DOTALL)]``.
    Source: the format reward of DeepSeek-R1 (Guo et al. 2025), as in Open-R1's ``format_reward``.
    Degenerate: leading or trailing text (even whitespace before ``<think>``) fails the default pattern;
    ``$`` also matches before one final newline. Runs on the ``regex`` engine with a timeout, as ``regex``.
    """
    found = regex_engine.search(
        pattern, sample.completion, regex_engine.DOTALL, timeout=USER_PATTERN_TIMEOUT_S
    )
    return 1.0 if found is not None else 0.0


def length_penalty(sample: Sample, *, target_tokens: int, scale: float = 1.0) -> float:
    """A linear penalty for every token beyond ``target_tokens``, as a fraction of the budget.

    Args:
        sample: uses ``n_tokens`` and ``max_new_tokens``.
        target_tokens: length allowed without penalty.
        scale: the penalty at ``target_tokens + max_new_tokens`` tokens (i.e. per budget's worth of
            excess).

    Formula: ``-scale * max(0, n - target_tokens) / max_new_tokens``.
    Source: a plain linear length penalty (cf. the length-penalty rewards of Kimi k1.5, Team et al. 2025,
    which are group-relative instead).
    Degenerate: ``n <= target_tokens`` -> 0.0; ``max_new_tokens <= 0`` or ``target_tokens < 0`` ->
    ValueError.
    """
    if sample.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {sample.max_new_tokens}")
    if target_tokens < 0:
        raise ValueError(f"target_tokens must be >= 0, got {target_tokens}")
    excess = max(0, sample.n_tokens - target_tokens)
    return -scale * excess / sample.max_new_tokens if excess else 0.0


def overlong_penalty(sample: Sample, *, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment: 0 up to a soft limit, then linear down to -1 at the budget.

    Args:
        sample: uses ``n_tokens`` (``|y|``) and ``max_new_tokens`` (``L_max``).
        cache_tokens: ``L_cache``, the width of the linear region just below ``L_max``.

    Formula (Yu et al. 2025, "DAPO", eq. 13):
        ``0``                                 if ``|y| <= L_max - L_cache``
        ``((L_max - L_cache) - |y|) / L_cache``  if ``L_max - L_cache < |y| <= L_max``
        ``-1``                                if ``|y| > L_max``
    Source: DAPO section 3.4 (Overlong Reward Shaping).
    Degenerate: ``|y| = L_max`` already gives -1 (a truncated completion is fully punished);
    ``cache_tokens = 0`` leaves no linear region (0 up to ``L_max``, -1 beyond); ``cache_tokens < 0`` or
    ``> L_max`` -> ValueError.
    """
    l_max = sample.max_new_tokens
    if not 0 <= cache_tokens <= l_max:
        raise ValueError(f"cache_tokens must be in [0, max_new_tokens={l_max}], got {cache_tokens}")
    n, soft_limit = sample.n_tokens, l_max - cache_tokens
    if n <= soft_limit:
        return 0.0
    if n <= l_max:
        return (soft_limit - n) / cache_tokens
    return -1.0


def _parse_flags(flags: str) -> re.RegexFlag:
    out = re.RegexFlag(0)
    for letter in flags:
        if letter not in _FLAGS:
            raise ValueError(f"unknown regex flag {letter!r}; valid: {', '.join(_FLAGS)}")
        out |= _FLAGS[letter]
    return out


def get_verifier(name: str) -> VerifierFn:
    """Look up a verifier by registry name.

    Args:
        name: one of the keys of ``VERIFIERS``.

    Returns:
        ``fn(sample: Sample, **params) -> float``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(VERIFIERS, name, "verifier")


VERIFIERS: Mapping[str, VerifierFn] = MappingProxyType(
    {
        "exact_match": exact_match,
        "numeric": numeric,
        "regex": regex,
        "format": format,
        "length_penalty": length_penalty,
        "overlong_penalty": overlong_penalty,
    }
)
