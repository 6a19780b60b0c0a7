"""The tier protocol and its errors.

A tier maps string keys to immutable byte values. The memory and nvme tiers key
by chunk id (lowercase hex BLAKE3-256 of the bytes, verified on write and read);
the cold tier keys fragments by ``fragment_key(chunk_id, index)``.

Every method is async; implementations run file I/O, hashing and fsync in
threads so that the event loop never blocks.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from erasure.content import chunk_id_of, is_chunk_id

#: What the tiers accept as bytes: no copy is made of a bytearray or memoryview. The
#: storage leaves' one alias (``erasure``'s; ``storaged.wire`` states it for the server
#: and client, who may not need the codecs).
from erasure.errors import BytesLike as BytesLike

#: the package's names (``tiers`` re-exports exactly these)
__all__ = [
    "ByteRange",
    "BytesLike",
    "ChunkNotFound",
    "ChunkStat",
    "CorruptChunk",
    "InvalidKey",
    "InvalidRange",
    "Tier",
    "TierError",
    "TierFull",
    "TierUsage",
]


class TierError(Exception):
    """Base class of every tier error."""


class ChunkNotFound(TierError, KeyError):
    """The key is not held by this tier."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"not found: {self.key}"


class TierFull(TierError):
    """No room for the value: capacity reached, disk full, or timed out waiting for room."""


class CorruptChunk(TierError):
    """Stored bytes failed their check. The tier has quarantined them; they are gone from it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class InvalidRange(TierError, ValueError):
    """A byte range outside the value, or with end < start."""


class InvalidKey(TierError, ValueError):
    """A key this tier can never hold (not a chunk id, not a fragment key). Nothing changed."""

    def __init__(self, key: object) -> None:
        super().__init__(f"invalid key for this tier: {key!r}")
        self.key = key


def check_chunk_id(key: object) -> None:
    """``InvalidKey`` unless ``key`` is a chunk id: the key check of the tiers by chunk id."""
    if not is_chunk_id(key):
        raise InvalidKey(key)


#: Below this, hashing costs less than a hop to a worker thread.
INLINE_HASH_BYTES = 64 * 1024


async def chunk_id_of_async(view: memoryview) -> str:
    """``chunk_id_of(view)``, in a worker thread unless small (the event loop never hashes
    a chunk)."""
    if view.nbytes <= INLINE_HASH_BYTES:
        return chunk_id_of(view)
    return await asyncio.to_thread(chunk_id_of, view)


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of a value; ``end=None`` means to the end."""

    start: int = 0
    end: int | None = None

    def resolve(self, size: int) -> tuple[int, int]:
        """Return concrete ``(start, end)`` for a value of ``size`` bytes, or raise InvalidRange."""
        end = size if self.end is None else self.end
        if self.start < 0 or end < self.start or end > size:
            raise InvalidRange(f"range [{self.start}, {self.end}) outside value of {size} bytes")
        return self.start, end


@dataclass(frozen=True, slots=True)
class TierUsage:
    used: int
    capacity: int
    count: int


@dataclass(frozen=True, slots=True)
class ChunkStat:
    key: str
    size: int


class Tier(abc.ABC):
    """One store of immutable values by key. Conformance: ``tests/tiers/conformance.py``."""

    #: "memory", "nvme" or "cold"
    name: str

    @abc.abstractmethod
    async def put(self, key: str, data: BytesLike) -> None:
        """Store ``data`` under ``key``, durably for the disk tiers, once it passes its check.

        Raises ``CorruptChunk`` (nothing stored) when the data does not match its key,
        ``TierFull`` when there is no room (nothing stored, nothing half-written).
        Storing a key already held is a no-op.
        """

    @abc.abstractmethod
    async def get(self, key: str, byte_range: ByteRange | None = None) -> memoryview:
        """The value (or a slice of it), verified.

        Raises ChunkNotFound, CorruptChunk, InvalidRange.
        """

    @abc.abstractmethod
    async def stat(self, key: str) -> ChunkStat:
        """Size of the value held under ``key``; raises ChunkNotFound."""

    async def exists(self, key: str) -> bool:
        try:
            await self.stat(key)
        except ChunkNotFound:
            return False
        return True

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; idempotent (deleting a missing key is not an error)."""

    @abc.abstractmethod
    def keys(self) -> AsyncIterator[str]:
        """Iterate the keys held now (a snapshot; concurrent changes may or may not show)."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used, capacity in bytes, number of values."""

    async def close(self) -> None:  # noqa: B027
        """Release resources; the tier is unusable afterwards."""
