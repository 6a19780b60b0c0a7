"""Errors: domain errors raised by node code, and the HTTP layer's own.

Domain code (the node, the manifest checks) raises a ``StoragedError`` subclass: a stable
code (the strings of API.md), a message, extra fields, and for transient refusals a
``retry_after``. The root is ``storaged.wire``'s, the one the client's exceptions share.
Which HTTP status each kind gets is decided in one place, the server's error middleware.
``ApiError`` is for what only the HTTP layer knows (auth, routes, ranges, request framing).
"""

from __future__ import annotations

from typing import Any

from storaged.wire import ErrorCode

# One root for server and client (``storaged.wire``): a refusal raised here carries its
# ``code``, ``message``, ``retry_after`` and ``extra`` fields; re-exported from here.
from storaged.wire import StoragedError as StoragedError


class BadInput(StoragedError):
    """The request itself is wrong (a checksum mismatch, a bad manifest, a short body)."""

    default_code = ErrorCode.BAD_REQUEST


class NotFound(StoragedError):
    """What the request names does not exist."""

    default_code = ErrorCode.NOT_FOUND


class Conflict(StoragedError):
    """The request contradicts the stored state (a taken name, chunks not held)."""

    default_code = ErrorCode.CONFLICT


class TooLarge(StoragedError):
    """The request is over a configured bound."""

    default_code = ErrorCode.TOO_LARGE


class Unavailable(StoragedError):
    """Not now: too few nodes, full memory, stopping; retry after ``retry_after``."""

    default_code = ErrorCode.UNAVAILABLE


class InsufficientStorage(StoragedError):
    """A disk tier is full (``nvme_full``, ``cold_full``): what the request needs cannot be
    kept until space is freed or nodes are added. Not backpressure: waiting does not
    clear it, an operator does (docs/API.md E16)."""

    default_code = ErrorCode.STORAGE_FULL


class ApiError(Exception):
    """An HTTP-layer error the client sees as ``{"error": code, "message": ..., **extra}``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.extra}


def bad_request(message: str, code: str = "bad_request", **extra: Any) -> BadInput:
    return BadInput(code, message, **extra)


def unavailable(code: str, message: str, retry_after: float | None = None) -> Unavailable:
    return Unavailable(code, message, retry_after=retry_after)
