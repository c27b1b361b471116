"""The error an engine process's answer raises in the inference process (torch- and httpx-free, so the
server imports it without loading the engine backend)."""

from __future__ import annotations


class EngineRequestError(RuntimeError):
    """The engine refused a request or broke off; ``status`` is its HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
