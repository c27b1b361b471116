"""Rows and requests shared by the OpenAI-surface tests."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient


def dpo_line(prompt: str, chosen: str, rejected: str) -> dict[str, Any]:
    """One line of OpenAI's DPO fine-tuning format."""
    return {
        "input": {"messages": [{"role": "user", "content": prompt}]},
        "preferred_output": [{"role": "assistant", "content": chosen}],
        "non_preferred_output": [{"role": "assistant", "content": rejected}],
    }


def chat_line(prompt: str, answer: str) -> dict[str, Any]:
    """One line of OpenAI's supervised (chat) fine-tuning format."""
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def dpo_lines(n: int) -> list[dict[str, Any]]:
    return [dpo_line(f"{i}+{i}=", str(2 * i), str(2 * i + 1)) for i in range(n)]


def chat_lines(n: int) -> list[dict[str, Any]]:
    return [chat_line(f"{i}+{i}=", str(2 * i)) for i in range(n)]


def upload_file(
    client: TestClient, data: bytes, purpose: str = "fine-tune", headers: dict[str, str] | None = None
) -> Any:
    return client.post(
        "/v1/files", files={"file": ("train.jsonl", data)}, data={"purpose": purpose}, headers=headers
    )


def openai_error(resp: Any) -> dict[str, Any]:
    """The body's error after checking it has exactly OpenAI's four keys."""
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    error: dict[str, Any] = body["error"]
    return error
