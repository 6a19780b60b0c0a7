"""Storage tiers of a storaged node: memory (DRAM), nvme (local disk), cold (erasure fragments)."""

from tiers.base import (
    ByteRange,
    BytesLike,
    ChunkNotFound,
    ChunkStat,
    CorruptChunk,
    InvalidKey,
    InvalidRange,
    Tier,
    TierError,
    TierFull,
    TierUsage,
)

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
