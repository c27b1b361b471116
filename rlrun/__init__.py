"""rlrun's Python client: ``Client`` talks to a running ``rlrun serve`` over its REST API."""

from rlrun.client import Client
from rlrun.errors import ApiError, ConnectionFailed, RlrunError, WaitTimeout
from rlrun.wire import StreamEvent

__all__ = ["ApiError", "Client", "ConnectionFailed", "RlrunError", "StreamEvent", "WaitTimeout"]
