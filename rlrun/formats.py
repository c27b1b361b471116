"""The accepted line formats of each dataset kind: parsing, normalising and detecting a line (pure: no
DB, no IO). The server ingests uploads with it; the client checks a file's kind with it before sending.

Every accepted input format of a kind is normalised to one stored form, e.g. for ``preference``
``{"prompt": str | [messages], "chosen": str, "rejected": str, "margin"?: float}`` where chosen and
rejected are two completions of the same prompt (a chat prompt stays a list of ``{"role", "content"}``
messages so the trainer can apply the model's chat template). See each ``normalize_*`` for its kind.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

HH_ASSISTANT = "\n\nAssistant:"
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Deepest nesting of objects and lists in one line, the line's own object counting 1. Real rows need about
# 4 (a chat preference row: row -> prompt list -> message); pydantic refuses to serialise past ~250 (GET
# /rows would fail) and the JSON parser's recursion is bounded by the stack, so deeper lines are refused.
MAX_ROW_DEPTH = 32
_SURROGATE = re.compile("[\\ud800-\\udfff]")
_MAX_FIELD_CHARS = 200  # a field path echoed back in an error is cut to this


class LineError(ValueError):
    """A line that cannot be accepted; ``field`` names the offending key where there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored on every backend, or None: PostgreSQL refuses NUL in text and in JSONB
    (so both backends refuse it, rather than SQLite storing what PostgreSQL cannot), and a lone surrogate
    (``"\\ud800"`` is valid JSON, not valid Unicode) cannot be encoded as UTF-8 at all."""
    if "\x00" in text:
        return "contains a NUL character (U+0000), which cannot be stored"
    if not text.isascii() and (found := _SURROGATE.search(text)) is not None:
        return f"contains a lone surrogate (U+{ord(found.group()):04X}), which is not valid Unicode"
    return None


def _field(path: str) -> str:
    return path if len(path) <= _MAX_FIELD_CHARS else path[: _MAX_FIELD_CHARS - 1] + "…"


def check_tree(obj: dict[str, Any]) -> None:
    """Raise ``LineError`` naming the field if a parsed line nests deeper than ``MAX_ROW_DEPTH``, holds a
    string (value or key) that ``text_problem`` refuses, or a number that is not finite (Python's parser
    accepts ``NaN`` and ``Infinity``; JSON and PostgreSQL do not). Iterative: no input exhausts the stack."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if (problem := text_problem(value)) is not None:
                raise LineError(f"'{_field(path)}' {problem}", _field(path))
            continue
        if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity, 1e400: PostgreSQL refuses
            raise LineError(f"'{_field(path)}' must be a finite number, got {value}", _field(path))
        if isinstance(value, dict):
            items: Iterator[tuple[Any, Any]] = iter(value.items())
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        if depth > MAX_ROW_DEPTH:
            top = re.split(r"[.\[]", path, maxsplit=1)[0]  # name the top-level field, not a 30-part path
            raise LineError(f"'{_field(top)}' is nested more than {MAX_ROW_DEPTH} levels deep", _field(top))
        children = []
        for key, item in items:
            if isinstance(key, str):
                if (problem := text_problem(key)) is not None:
                    where = f"a key in '{_field(path)}'" if path else "a key"
                    raise LineError(f"{where} {problem}", _field(path) or None)
                child = f"{path}.{key}" if path else key
            else:
                child = f"{path}[{key}]"
            children.append((item, depth + 1, child))
        stack.extend(reversed(children))  # so the first bad field in the line is the one reported


def parse_json_line(raw: bytes) -> dict[str, Any]:
    """One JSONL line as an object; refuses non-UTF-8 bytes, bad JSON, non-objects, and what ``check_tree``
    refuses (NUL, lone surrogates, NaN, nesting deeper than ``MAX_ROW_DEPTH``), naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(f"not valid UTF-8 (byte {exc.start})") from None
    if "\x00" in text:  # a raw NUL byte is never valid JSON: say what it is, in no particular field
        raise LineError("NUL characters are not allowed")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise LineError(f"invalid JSON: nested too deeply (more than {MAX_ROW_DEPTH} levels)") from None
    except ValueError:  # the one other failure: an integer longer than Python converts (4300 digits)
        raise LineError("invalid JSON: a number has too many digits") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    check_tree(obj)
    return obj


def _text(obj: dict[str, Any], key: str, path: str | None = None) -> str:
    if key not in obj:
        raise LineError(f"missing field '{path or key}'", path or key)
    value = obj[key]
    if not isinstance(value, str):
        raise LineError(f"'{path or key}' must be a string, got {type(value).__name__}", path or key)
    return value


def _messages(value: Any, path: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise LineError(f"'{path}' must be a non-empty list of messages", path)
    out = []
    for i, msg in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(msg, dict):
            raise LineError(f"'{where}' must be an object with role and content", where)
        role = _text(msg, "role", f"{where}.role")
        if role not in ROLES:
            raise LineError(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
        out.append({"role": role, "content": _text(msg, "content", f"{where}.content")})
    return out


def _single_assistant(messages: list[dict[str, str]], path: str) -> str:
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise LineError(f"'{path}' must hold exactly one assistant message after the shared prompt", path)
    return messages[0]["content"]


def _from_openai(obj: dict[str, Any]) -> dict[str, Any]:
    inp = obj["input"]
    if not isinstance(inp, dict):
        raise LineError("'input' must be an object with 'messages'", "input")
    prompt = _messages(inp.get("messages"), "input.messages")
    chosen = _single_assistant(_messages(obj.get("preferred_output"), "preferred_output"), "preferred_output")
    rejected = _single_assistant(
        _messages(obj.get("non_preferred_output"), "non_preferred_output"), "non_preferred_output"
    )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _from_chat(obj: dict[str, Any]) -> dict[str, Any]:
    chosen = _messages(obj["chosen"], "chosen")
    rejected = _messages(obj.get("rejected"), "rejected")
    if "prompt" in obj:  # explicit prompt messages, completions hold only the answer
        prompt = _messages(obj["prompt"], "prompt")
    else:  # the prompt is the longest shared prefix of the two conversations
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise LineError("'chosen' and 'rejected' share no prompt messages", "chosen")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    return {
        "prompt": prompt,
        "chosen": _single_assistant(chosen, "chosen"),
        "rejected": _single_assistant(rejected, "rejected"),
    }


def _from_hh(obj: dict[str, Any]) -> dict[str, Any]:
    r"""Split an Anthropic HH pair (two whole ``\n\nHuman: … \n\nAssistant: …`` conversations) into a
    shared prompt and two completions.

    Rule: the prompt is the longest common prefix of ``chosen`` and ``rejected``, cut back to just after
    the last ``"\n\nAssistant:"`` inside it; each completion is the rest of its conversation, so
    ``prompt + chosen`` and ``prompt + rejected`` are the original strings, unedited.

    Why: real HH files have quirks. A turn marker without its blank line (``"…drag kings.  Human: Then
    how…"``) hides a turn, so the two conversations can diverge before chosen's last Assistant turn; the
    old rule (the prompt is chosen up to its last ``"\n\nAssistant:"``, which rejected must start with)
    refused those lines. The reference is TRL's ``extract_prompt`` (``trl/data_utils.py``), which reads
    every such line: its prompt is the common prefix up to the first differing character (less a trailing
    space). Cutting back to the last Assistant marker does better when both answers
    start alike (``" I"``, or a stray ``" Human: "``): each answer keeps its shared start, and the prompt
    always ends where the model's turn begins. A marker without its blank line inside the shared
    conversation is not a marker here; it stays in the prompt.

    Refused (``LineError`` naming the field): a chosen without ``"\n\nAssistant:"``, and a pair whose
    common prefix holds no ``"\n\nAssistant:"`` (they share no conversation up to an Assistant turn).
    """
    chosen, rejected = _text(obj, "chosen"), _text(obj, "rejected")
    if HH_ASSISTANT not in chosen:
        raise LineError("'chosen' has no '\\n\\nAssistant:' turn (Anthropic HH format)", "chosen")
    shared = os.path.commonprefix([chosen, rejected])
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        raise LineError(
            "'rejected' does not share the conversation with 'chosen' up to an Assistant turn "
            "('\\n\\nAssistant:')",
            "rejected",
        )
    end = cut + len(HH_ASSISTANT)
    return {"prompt": chosen[:end], "chosen": chosen[end:], "rejected": rejected[end:]}


def _from_plain(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": _text(obj, "prompt"),
        "chosen": _text(obj, "chosen"),
        "rejected": _text(obj, "rejected"),
    }


def normalize_preference(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The stored form of one preference line and the name of the format it came in.

    Formats: ``plain`` {prompt, chosen, rejected} strings; ``openai`` {input.messages, preferred_output,
    non_preferred_output}; ``chat`` chosen/rejected message lists (with a ``prompt`` list, or sharing a
    prefix); ``hh`` Anthropic HH {chosen, rejected} whole conversations.
    """
    if "preferred_output" in obj or "input" in obj:
        return _from_openai(_require(obj, "input", "preferred_output", "non_preferred_output")), "openai"
    if "chosen" not in obj:
        raise LineError("missing field 'chosen'", "chosen")
    if isinstance(obj["chosen"], list):
        return _from_chat(obj), "chat"
    if "prompt" not in obj and isinstance(obj["chosen"], str) and HH_ASSISTANT in obj["chosen"]:
        return _from_hh(obj), "hh"
    return _from_plain(obj), "plain"


def _require(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        if key not in obj:
            raise LineError(f"missing field '{key}'", key)
    return obj


def _margin(obj: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    if "margin" in obj:
        m = obj["margin"]
        if isinstance(m, bool) or not isinstance(m, int | float) or m != m:
            raise LineError("'margin' must be a number", "margin")
        row["margin"] = float(m)
    return row


def normalize_preference_with_margin(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    row, fmt = normalize_preference(obj)
    return _margin(obj, row), fmt


def _prompt(obj: dict[str, Any], key: str = "prompt") -> str | list[dict[str, str]]:
    if key not in obj:
        raise LineError(f"missing field '{key}'", key)
    value = obj[key]
    if isinstance(value, list):
        return _messages(value, key)
    if not isinstance(value, str):
        raise LineError(f"'{key}' must be a string or a list of messages, got {type(value).__name__}", key)
    return value


def normalize_sft(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """SFT lines -> ``{"prompt": str | [messages], "completion": str}``.

    Formats: ``plain`` {prompt, completion} strings; ``chat`` {messages: [..., assistant]} (OpenAI fine-tuning
    lines: the last message, an assistant turn, is the completion); ``conversational`` {prompt: [messages],
    completion: [one assistant message]}.
    """
    if "messages" in obj:
        messages = _messages(obj["messages"], "messages")
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise LineError(
                "'messages' must end with an assistant message after at least one other", "messages"
            )
        return {"prompt": messages[:-1], "completion": messages[-1]["content"]}, "chat"
    prompt = _prompt(obj)
    if "completion" not in obj:
        raise LineError("missing field 'completion'", "completion")
    if isinstance(obj["completion"], list):
        completion = _single_assistant(_messages(obj["completion"], "completion"), "completion")
        return {"prompt": prompt, "completion": completion}, "conversational"
    return {"prompt": prompt, "completion": _text(obj, "completion")}, "plain"


def normalize_ranking(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """K-way rankings -> ``{"prompt", "responses": [best, ..., worst]}`` with K >= 2."""
    prompt = _prompt(obj)
    responses = obj.get("responses")
    if not isinstance(responses, list) or len(responses) < 2:
        raise LineError("'responses' must be a list of at least 2 strings, best first", "responses")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise LineError(f"'responses[{i}]' must be a string, got {type(r).__name__}", f"responses[{i}]")
    return {"prompt": prompt, "responses": list(responses)}, "plain"


def normalize_unpaired(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Unpaired feedback (KTO) -> ``{"prompt": str | [messages], "completion": str, "label": bool}``:
    one answer marked desirable (``true``) or undesirable (``false``), no pair needed.

    Formats: ``plain`` {prompt, completion, label} strings (TRL's unpaired preference lines);
    ``conversational`` {prompt: [messages], completion: [one assistant message], label}.
    """
    prompt = _prompt(obj)
    if "completion" not in obj:
        raise LineError("missing field 'completion'", "completion")
    label = obj.get("label")
    if not isinstance(label, bool):
        raise LineError("'label' must be true (a desirable answer) or false (an undesirable one)", "label")
    if isinstance(obj["completion"], list):
        completion = _single_assistant(_messages(obj["completion"], "completion"), "completion")
        return {"prompt": prompt, "completion": completion, "label": label}, "conversational"
    return {"prompt": prompt, "completion": _text(obj, "completion"), "label": label}, "plain"


def is_rft_line(obj: dict[str, Any]) -> bool:
    """An OpenAI reinforcement fine-tuning line: chat ``messages`` whose last turn is not the assistant's
    (the model writes that one), with no ``prompt``/``question`` of its own."""
    messages = obj.get("messages")
    if "prompt" in obj or "question" in obj or not isinstance(messages, list) or not messages:
        return False
    last = messages[-1]
    return isinstance(last, dict) and last.get("role") != "assistant"


def normalize_prompts(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Prompts for online RL -> ``{"prompt", "answer": str | None, "meta": {other fields}}``.

    Formats: ``plain`` {prompt, answer?, ...}; ``question`` {question, answer?, ...} (GSM8K-style lines);
    ``rft`` {messages: [..., user turn], ...} (OpenAI's reinforcement fine-tuning lines: the messages are
    the prompt, every other field is the item graders read). A numeric answer is kept as its decimal text;
    in ``rft`` lines an answer of another JSON type stays in ``meta`` (graders read it as ``item.answer``).
    """
    if is_rft_line(obj):
        messages = _messages(obj["messages"], "messages")
        if messages[-1]["role"] == "assistant":
            raise LineError("'messages' must end with the turn the model answers, not an assistant one")
        answer = obj.get("answer")
        scalar = isinstance(answer, str | int | float) and not isinstance(answer, bool)
        meta = {k: v for k, v in obj.items() if k != "messages" and (k != "answer" or not scalar)}
        return {"prompt": messages, "answer": str(answer) if scalar else None, "meta": meta}, "rft"
    key, fmt = ("prompt", "plain") if "prompt" in obj or "question" not in obj else ("question", "question")
    prompt = _prompt(obj, key)
    answer = obj.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise LineError("'answer' must be a string or a number", "answer")
        answer = str(answer)
    meta = {k: v for k, v in obj.items() if k not in (key, "answer")}
    return {"prompt": prompt, "answer": answer, "meta": meta}, fmt


NORMALIZERS: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], str]]] = {
    "preference": normalize_preference_with_margin,
    "sft": normalize_sft,
    "ranking": normalize_ranking,
    "prompts": normalize_prompts,
    "unpaired": normalize_unpaired,
}


# Keys only a preference line has (rlrun's pairs, OpenAI's DPO lines): the upload's and the Files API's
# detectors both read a line holding one as preference data.
PREFERENCE_KEYS = ("chosen", "rejected", "preferred_output", "non_preferred_output")
# Keys that say which kind a line is, tried in this order: a preference or sft line may hold `prompt`
# too, so the keys only one kind has come first.
KIND_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("preference", PREFERENCE_KEYS),
    ("ranking", ("responses",)),
    ("sft", ("messages", "completion")),
    ("prompts", ("prompt", "question")),
)
DETECT_LINES = 20  # non-blank lines read to detect a kind (or to check one) before giving up


def detect_kind(obj: dict[str, Any]) -> str | None:
    """The dataset kind a parsed line's keys say (see ``KIND_KEYS``; chat ``messages`` that end before the
    assistant's turn are an RFT prompts line, ``label`` with ``completion`` an unpaired line), or None when
    they say none."""
    if is_rft_line(obj):
        return "prompts"
    if "label" in obj and "completion" in obj:  # an unpaired (KTO) line; `label` alone is too common a key
        return "unpaired"
    return next((kind for kind, keys in KIND_KEYS if any(k in obj for k in keys)), None)


def _head(lines: Iterable[bytes], max_lines: int) -> Iterator[tuple[int, dict[str, Any] | LineError]]:
    """(line number, parsed object or why not) of the first ``max_lines`` non-blank lines."""
    seen = 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            yield line_no, parse_json_line(raw.strip())
        except LineError as exc:
            yield line_no, exc
        seen += 1
        if seen >= max_lines:
            return


def detect_upload_kind(lines: Iterable[bytes], max_lines: int = DETECT_LINES) -> str:
    """The kind of an upload whose kind was not given, from its first ``max_lines`` non-blank lines: the
    most specific kind any of them says (``KIND_KEYS`` order: a line with only ``prompt`` says
    ``prompts``, but a ``chosen`` two lines later makes it a preference file whose first line lacks
    ``chosen``). Lines that are no JSON object do not decide (with ``skip_invalid`` they are skipped);
    ingest then validates every line against the kind found. Raises ``LineError`` (field ``kind``) saying
    what the first line held when no line decides."""
    order = ["preference", "ranking", "unpaired", "sft", "prompts"]  # most specific first (KIND_KEYS's)
    best: str | None = None
    first: str | None = None
    for line_no, obj in _head(lines, max_lines):
        kind = detect_kind(obj) if isinstance(obj, dict) else None
        if kind is not None and (best is None or order.index(kind) < order.index(best)):
            best = kind
        if first is None:
            what = obj.message if isinstance(obj, LineError) else f"keys {sorted(obj)[:10]}"
            first = f"line {line_no}: {_field(what)}"
    if best is None:
        raise LineError(
            "cannot detect the kind from the first lines "
            f"({first or 'the upload holds no rows'}); pass kind: one of {sorted(NORMALIZERS)}",
            "kind",
        )
    return best


@dataclass(frozen=True)
class KindMismatch:
    """A file whose first lines are not ``kind`` data but read as ``fits`` data (``kind_mismatch``)."""

    kind: str
    line: int
    reason: str
    fits: str


def kind_mismatch(lines: Iterable[bytes], kind: str, max_lines: int = DETECT_LINES) -> KindMismatch | None:
    """Whether a file is plainly of another kind than ``kind``, judged on its first ``max_lines``
    non-blank lines (the CLI asks before uploading): yes when none of them reads as ``kind`` and one
    reads as another kind (its keys say that kind and its normaliser accepts it). Lines that are no JSON
    object, or fit no kind, say nothing: the upload's own validation reports (or skips) them."""
    normalize = NORMALIZERS[kind]
    found: KindMismatch | None = None
    for line_no, obj in _head(lines, max_lines):
        if isinstance(obj, LineError):
            continue
        try:
            normalize(obj)
            return None
        except LineError as exc:
            other = detect_kind(obj)
            if found is None and other is not None and other != kind and _reads_as(obj, other):
                found = KindMismatch(kind=kind, line=line_no, reason=exc.message, fits=other)
    return found


def _reads_as(obj: dict[str, Any], kind: str) -> bool:
    try:
        NORMALIZERS[kind](obj)
    except LineError:
        return False
    return True


def upload_lines(fileobj: IO[bytes], max_line_bytes: int) -> Iterator[bytes]:
    """Lines of the spooled upload, never more than ``max_line_bytes + 1`` bytes of one line in memory:
    the rest of an over-long line is read and dropped (the ingest reports it by its length)."""
    fileobj.seek(0)
    while line := fileobj.readline(max_line_bytes + 1):
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            while (rest := fileobj.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line
