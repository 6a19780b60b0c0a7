"""What a node knows of the chunks it holds: states, sizes, last use, and per-chunk locks.

Invariants this module upholds:

- A chunk's recorded state only moves forward (``memory -> nvme -> cold``), also across
  restarts: states are appended to a log that is replayed at start-up.
- ``last_use`` is the latest moment anyone relied on this node's copy (an ack that counted
  it, a ``/missing`` answer, a commit naming it). GC compares it with the grace period. It
  is not persisted: after a restart every chunk counts as used at start-up, which can only
  delay a collection, never hasten it.
- Mutations of one chunk's local copies (storing a new copy, collecting it) run under that
  chunk's lock, so a collection never interleaves with a store or a touch that counted the
  copy. A chunk being collected is in ``collecting`` and is reported held by no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from storaged.wire import ChunkState

# The ranks the state log persists (plain ints: what msgpack has always written).
MEMORY, NVME, COLD = (int(state) for state in ChunkState)


@dataclass(slots=True)
class ChunkInfo:
    """What this node knows of a chunk it holds (or held): size, furthest state, first seen,
    and the latest moment a request relied on this node's copy (``last_use``)."""

    size: int
    state: int
    stored_at: float
    last_use: float = 0.0

    def touch(self, until: float) -> None:
        if until > self.last_use:
            self.last_use = until


@dataclass(frozen=True, slots=True)
class Holding:
    """One node's answer about a chunk."""

    node: str
    memory: bool
    nvme: bool
    fragments: tuple[int, ...]
    state: int
    size: int

    @property
    def hot(self) -> bool:
        return self.memory or self.nvme


class ChunkLocks:
    """One asyncio lock per chunk id, created on demand and dropped when unused."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, chunk_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(chunk_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[chunk_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[chunk_id]
            if users <= 1:
                del self._locks[chunk_id]
            else:
                self._locks[chunk_id] = (lock, users - 1)

    def busy(self, chunk_id: str) -> bool:
        return chunk_id in self._locks


class StateLog:
    """Append-only record of chunk states (and forgotten chunks) so states never move back.

    Each record is ``[chunk_id, state, size, stored_at]`` (state 0: forgotten), msgpack,
    length-prefixed; a torn tail from a crash is ignored. Rewritten compactly at start-up.
    """

    _LEN = struct.Struct(">I")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = asyncio.Lock()

    def load(self) -> dict[str, ChunkInfo]:
        entries: dict[str, ChunkInfo] = {}
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            blob = b""
        pos = 0
        while pos + 4 <= len(blob):
            (length,) = self._LEN.unpack_from(blob, pos)
            if pos + 4 + length > len(blob):
                break
            try:
                cid, state, size, stored_at = msgpack.unpackb(blob[pos + 4 : pos + 4 + length])
            except (ValueError, TypeError, msgpack.UnpackException):
                break
            pos += 4 + length
            if state == 0:
                entries.pop(cid, None)
            else:
                prev = entries.get(cid)
                entries[cid] = ChunkInfo(size, max(state, prev.state if prev else 0), stored_at)
        # Compact: rewrite the live entries, then append from there.
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(self._encode((cid, i.state, i.size, i.stored_at) for cid, i in entries.items()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return entries

    def _encode(self, records: Iterable[tuple[str, int, int, float]]) -> bytes:
        out = bytearray()
        for record in records:
            body = msgpack.packb(list(record))
            out += self._LEN.pack(len(body)) + body
        return bytes(out)

    async def append(self, records: list[tuple[str, int, int, float]], *, sync: bool) -> None:
        if not records or self._fd is None:
            return
        blob = self._encode(records)
        fd = self._fd

        def write() -> None:
            os.write(fd, blob)
            if sync:
                os.fsync(fd)

        async with self._lock:
            await asyncio.to_thread(write)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
