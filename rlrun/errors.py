"""The errors :class:`rlrun.Client` raises; all are :class:`RlrunError`."""

from __future__ import annotations

from rlrun.schemas import ErrorDetail


class RlrunError(Exception):
    """Base of every error this client raises."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ApiError(RlrunError):
    """The server answered with an error status; ``code``, ``message``, ``field`` and ``details`` come
    from its body ``{"error": {"code", "message", "field", "details"}}``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        details: list[ErrorDetail] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.field = field
        self.details = details or []

    def __str__(self) -> str:
        where = f" (field: {self.field})" if self.field else ""
        return f"{self.message}{where} [{self.status} {self.code}]"


class ConnectionFailed(RlrunError, ConnectionError):
    """The server could not be reached, or did not answer in time."""


class WaitTimeout(RlrunError, TimeoutError):
    """:meth:`Runs.wait` gave up before the run ended."""
