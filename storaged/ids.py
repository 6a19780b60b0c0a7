"""Chunk ids and checkpoint names: the strict forms of API.md, and hashing."""

from __future__ import annotations

import asyncio
import re

import blake3

from storaged.wire import BytesLike

CHUNK_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
CHECKPOINT_NAME_RE = re.compile(rf"^{_SEGMENT}(/{_SEGMENT}){{0,3}}$")

# Below this size a thread hop costs more than hashing on the loop.
_INLINE_HASH_BYTES = 64 * 1024


def is_chunk_id(value: object) -> bool:
    return isinstance(value, str) and CHUNK_ID_RE.fullmatch(value) is not None


def is_checkpoint_name(value: object) -> bool:
    return isinstance(value, str) and CHECKPOINT_NAME_RE.fullmatch(value) is not None


def chunk_id_of(data: BytesLike) -> str:
    """Lowercase hex BLAKE3-256 of ``data``. Releases the GIL for large inputs."""
    hasher = blake3.blake3(max_threads=1)
    hasher.update(data)
    return hasher.hexdigest()


async def chunk_id_of_async(data: BytesLike) -> str:
    """``chunk_id_of`` off the event loop for anything but tiny inputs."""
    if len(data) <= _INLINE_HASH_BYTES:
        return chunk_id_of(data)
    return await asyncio.to_thread(chunk_id_of, data)


def crc32c_of(data: BytesLike) -> int:
    """CRC-32C of ``data`` (the check replicas may use instead of BLAKE3, see peer.handler)."""
    import crc32c  # here: a client command that hashes nothing starts without it

    return int(crc32c.crc32c(data))


def chunk_id_and_crc32c(data: BytesLike) -> tuple[str, int]:
    """``chunk_id_of`` and ``crc32c_of`` of ``data`` in one call (for a thread)."""
    return chunk_id_of(data), crc32c_of(data)


async def crc32c_of_async(data: BytesLike) -> int:
    """``crc32c_of`` off the event loop for anything but tiny inputs."""
    if len(data) <= _INLINE_HASH_BYTES:
        return crc32c_of(data)
    return await asyncio.to_thread(crc32c_of, data)
