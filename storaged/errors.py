"""Service errors: one exception type, mapped to an HTTP response in one middleware.

Codes are the stable strings of API.md.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the client sees as ``{"error": code, "message": ..., **extra}`` with ``status``."""

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


def bad_request(message: str, code: str = "bad_request", **extra: Any) -> ApiError:
    return ApiError(400, code, message, **extra)


def unavailable(code: str, message: str, retry_after: float | None = None) -> ApiError:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return ApiError(503, code, message, headers=headers)
