"""The codec interface: whole bytes in, ``n`` self-describing fragments out, any ``k`` back.

Callers never split or pad: ``encode`` takes the chunk, ``decode`` returns exactly
the chunk's bytes, checked against the chunk id (BLAKE3-256), or raises.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

BytesLike = bytes | bytearray | memoryview


class ErasureError(Exception):
    """Base class of the codec errors."""


class InvalidParameters(ErasureError, ValueError):
    """k and n outside 1 <= k < n <= 256, or an unknown codec name."""


class CorruptFragment(ErasureError):
    """A fragment failed its header or payload check; the message says why.

    ``index`` is the fragment's index when the header was readable, else ``None``.
    """

    def __init__(self, reason: str, index: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.index = index


class NotEnoughFragments(ErasureError):
    """Fewer than ``k`` good fragments: the chunk cannot be rebuilt from what was given."""

    def __init__(self, available: int, needed: int, detail: str = "") -> None:
        msg = f"{available} good fragment(s) available, {needed} needed"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.available = available
        self.needed = needed


class DecodeMismatch(ErasureError):
    """The decoded bytes do not hash to the chunk id (never returned to a caller)."""


def check_parameters(k: int, n: int) -> None:
    if not (isinstance(k, int) and isinstance(n, int) and 1 <= k < n <= 256):
        raise InvalidParameters(
            f"erasure parameters must satisfy 1 <= k < n <= 256, got k={k!r} n={n!r}"
        )


class Codec(abc.ABC):
    """A Reed-Solomon code with fixed (k, n): ``erasure.zfec_codec``, ``erasure.isal``."""

    #: short stable name recorded in every fragment header ("zfec", "isal")
    name: str
    k: int
    n: int

    @abc.abstractmethod
    def encode(self, chunk_id: str, data: BytesLike) -> list[bytes]:
        """``n`` fragments (header + payload each), fragment ``i`` at position ``i``. CPU-bound."""

    @abc.abstractmethod
    def decode(
        self, chunk_id: str, fragments: Mapping[int, BytesLike] | Sequence[BytesLike]
    ) -> bytes:
        """Rebuild the chunk from fragments (by index, or a list of whole fragments whose headers
        say their index). Bad fragments are skipped; raises NotEnoughFragments when fewer than
        ``k`` good ones remain. The result always hashes to ``chunk_id``. CPU-bound."""

    async def encode_async(self, chunk_id: str, data: BytesLike) -> list[bytes]:
        """``encode`` in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.encode, chunk_id, data)

    async def decode_async(
        self, chunk_id: str, fragments: Mapping[int, BytesLike] | Sequence[BytesLike]
    ) -> bytes:
        """``decode`` in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.decode, chunk_id, fragments)
