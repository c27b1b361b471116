"""The addition rows the run-kind tests train on (16 of each kind: a+b for a, b < 4)."""

from __future__ import annotations

PAIRS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(4)
    for b in range(4)
]
SFT = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
