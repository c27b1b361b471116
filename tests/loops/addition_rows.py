"""The addition rows the run-kind tests train on: a+b for a, b < n (16 of each kind by default)."""

from __future__ import annotations

from typing import Any


def pairs(n: int = 4) -> list[dict[str, Any]]:
    return [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(n)
        for b in range(n)
    ]


def sft(n: int = 4) -> list[dict[str, Any]]:
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(n) for b in range(n)]


def prompts(n: int = 4) -> list[dict[str, Any]]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(n) for b in range(n)]


PAIRS, SFT, PROMPTS = pairs(), sft(), prompts()


# A reward the random tiny preset earns about half the time (a vowel anywhere in the completion), so its
# groups have reward variance and the RL updates are not zero; "numeric" on addition is almost always 0.
VOWEL_REWARD = [{"name": "regex", "params": {"pattern": "[aeiou]"}}]
