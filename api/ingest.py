"""Line-level parsing and normalisation of uploaded datasets (pure: no DB, no IO).

Every accepted input format of a kind is normalised to one stored form. For ``preference``:
``{"prompt": str | [messages], "chosen": str, "rejected": str}`` where chosen and rejected are the two
completions of the same prompt (a chat prompt stays a list of ``{"role", "content"}`` messages so the
trainer can apply the model's chat template).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HH_ASSISTANT = "\n\nAssistant:"
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class LineError(ValueError):
    """A line that cannot be accepted; ``field`` names the offending key where there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


def parse_json_line(raw: bytes) -> dict[str, Any]:
    """One JSONL line as an object; refuses non-UTF-8 bytes, bad JSON and non-objects."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(f"not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
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
    chosen, rejected = _text(obj, "chosen"), _text(obj, "rejected")
    cut = chosen.rfind(HH_ASSISTANT)
    if cut < 0:
        raise LineError("'chosen' has no '\\n\\nAssistant:' turn (Anthropic HH format)", "chosen")
    prompt = chosen[: cut + len(HH_ASSISTANT)]
    if not rejected.startswith(prompt):
        raise LineError(
            "'rejected' does not share the conversation up to the last Assistant turn", "rejected"
        )
    return {"prompt": prompt, "chosen": chosen[len(prompt) :], "rejected": rejected[len(prompt) :]}


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


NORMALIZERS: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], str]]] = {
    "preference": normalize_preference,
}


def content_hash(row: dict[str, Any]) -> str:
    """sha256 of the row's canonical JSON: equal rows, equal hashes."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _chars(prompt: str | list[dict[str, str]]) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


@dataclass
class _Length:
    total: int = 0
    max: int = 0

    def add(self, n: int) -> None:
        self.total += n
        self.max = max(self.max, n)


@dataclass
class PreferenceStats:
    """Running statistics of an upload; O(1) memory apart from the set of row hashes."""

    rows: int = 0
    exact_duplicates: int = 0
    empty_pairs: int = 0
    identical_pairs: int = 0
    source_formats: dict[str, int] = field(default_factory=dict)
    prompt: _Length = field(default_factory=_Length)
    chosen: _Length = field(default_factory=_Length)
    rejected: _Length = field(default_factory=_Length)
    _seen: set[bytes] = field(default_factory=set, repr=False)

    def add(self, row: dict[str, Any], fmt: str, digest: str) -> None:
        self.rows += 1
        key = bytes.fromhex(digest)[:16]
        if key in self._seen:
            self.exact_duplicates += 1
        self._seen.add(key)
        chosen, rejected = row["chosen"], row["rejected"]
        self.empty_pairs += int(not chosen.strip() or not rejected.strip())
        self.identical_pairs += int(chosen == rejected)
        self.source_formats[fmt] = self.source_formats.get(fmt, 0) + 1
        self.prompt.add(_chars(row["prompt"]))
        self.chosen.add(len(chosen))
        self.rejected.add(len(rejected))

    def as_dict(self) -> dict[str, Any]:
        def length(x: _Length) -> dict[str, Any]:
            return {"mean": x.total / self.rows if self.rows else 0.0, "max": x.max}

        return {
            "rows": self.rows,
            "exact_duplicates": self.exact_duplicates,
            "empty_pairs": self.empty_pairs,
            "identical_pairs": self.identical_pairs,
            "source_formats": dict(sorted(self.source_formats.items())),
            "prompt_chars": length(self.prompt),
            "chosen_chars": length(self.chosen),
            "rejected_chars": length(self.rejected),
        }
