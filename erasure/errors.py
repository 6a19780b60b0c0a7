"""The codec errors and parameter check, shared by ``erasure.base`` and ``erasure.fragment``."""

from __future__ import annotations

__all__ = [
    "BytesLike",
    "CorruptFragment",
    "DecodeMismatch",
    "ErasureError",
    "InvalidParameters",
    "NotEnoughFragments",
    "check_parameters",
]

BytesLike = bytes | bytearray | memoryview


class ErasureError(Exception):
    """Base class of the codec errors."""


class InvalidParameters(ErasureError, ValueError):
    """k and n outside 1 <= k < n <= 256, an unknown or unavailable codec, or a bad argument."""


class CorruptFragment(ErasureError):
    """A fragment failed its header or payload check; the message says why.

    ``index`` is the fragment's index when the header was readable, else ``None``.
    """

    def __init__(self, reason: str, index: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.index = index


class NotEnoughFragments(ErasureError):
    """Fewer than ``k`` good fragments: the chunk cannot be rebuilt from what was given.

    ``available`` counts distinct good fragments, ``needed`` is ``k``; the message also says
    why the others were rejected.
    """

    def __init__(self, available: int, needed: int, detail: str = "") -> None:
        msg = f"{available} good fragment(s) available, {needed} needed"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.available = available
        self.needed = needed


class DecodeMismatch(ErasureError):
    """Every subset of good fragments tried decoded to bytes that do not hash to the chunk id.

    The wrong bytes are never returned.
    """


def check_parameters(k: int, n: int) -> None:
    """Raise ``InvalidParameters`` unless ``1 <= k < n <= 256`` (both plain ints)."""
    if not (
        type(k) is int and type(n) is int and 1 <= k < n <= 256  # bool is not a count
    ):
        raise InvalidParameters(
            f"erasure parameters must satisfy 1 <= k < n <= 256, got k={k!r} n={n!r}"
        )
