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
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import crc32c
import msgpack

from storaged.wire import ChunkState
from tiers._durable import write_file_durably
from tiers.keylocks import KeyLocks

log = logging.getLogger("storaged.node.index")

#: one state log record: chunk id, state (0: forgotten), size, when it was stored
Record = tuple[str, int, int, float]

# The ranks the state log persists (plain ints: what msgpack has always written).
MEMORY, NVME, COLD = (int(state) for state in ChunkState)


@dataclass(slots=True)
class IndexEntry:
    """What this node knows of a chunk it holds (or held): size, furthest state, first seen,
    and the latest moment a request relied on this node's copy (``last_use``). The node's own
    record, not the answer a client gets about a chunk (``storaged.client.ChunkInfo``: what a
    HEAD says of it)."""

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


#: one asyncio lock per chunk id, created on demand and dropped when unused
ChunkLocks = KeyLocks


class StateLog:
    """Append-only record of chunk states (and forgotten chunks) so states never move back.

    The file describes itself, as every persisted format here does: a header (magic
    ``SDSL``, a version, CRC-32C of both), then records, each a length, the CRC-32C of its
    body and the body, msgpack ``[chunk_id, state, size, stored_at]`` (state 0: forgotten).
    Reading stops at the first record that is short (a torn tail from a crash: expected)
    or fails its CRC (damage: a WARN, and the file kept aside as ``*.damaged``); what came
    before it counts. A log of the first format (no header, no record CRCs) is read and
    rewritten in this one. At start-up the live entries are rewritten compactly through
    the durable write (temp file, fsync, rename, directory fsync), and appends go on from
    there.
    """

    _HEAD = struct.Struct(">4sHH")  # magic, version, reserved
    _CRC = struct.Struct(">I")
    _RECORD = struct.Struct(">II")  # body length, CRC-32C of the body
    MAGIC = b"SDSL"
    VERSION = 1
    HEADER_SIZE = _HEAD.size + _CRC.size

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def header(cls) -> bytes:
        head = cls._HEAD.pack(cls.MAGIC, cls.VERSION, 0)
        return head + cls._CRC.pack(crc32c.crc32c(head))

    def load(self) -> dict[str, IndexEntry]:
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            blob = b""
        records, damage = self._records(memoryview(blob))
        entries: dict[str, IndexEntry] = {}
        for cid, state, size, stored_at in records:
            if state == 0:
                entries.pop(cid, None)
            else:
                prev = entries.get(cid)
                entries[cid] = IndexEntry(size, max(state, prev.state if prev else 0), stored_at)
        if damage is not None:
            log.warning("%s: %s; the file is kept as %s.damaged", self.path, damage, self.path.name)
            os.replace(self.path, self.path.with_name(self.path.name + ".damaged"))
        live = ((cid, i.state, i.size, i.stored_at) for cid, i in entries.items())
        write_file_durably(self.path, [self.header(), self._encode(live)])
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return entries

    def _records(self, blob: memoryview) -> tuple[list[Record], str | None]:
        """The records of ``blob`` up to its end, a torn tail or damage; and what the damage
        was (None for none, or only a torn tail)."""
        if not blob:
            return [], None
        if blob[:4] != self.MAGIC:
            return self._legacy_records(blob), None
        if len(blob) < self.HEADER_SIZE:
            return [], None  # torn while the header was written
        (crc,) = self._CRC.unpack_from(blob, self._HEAD.size)
        _, version, reserved = self._HEAD.unpack_from(blob)
        if crc != crc32c.crc32c(blob[: self._HEAD.size]) or version != self.VERSION or reserved:
            return [], f"unreadable header (version {version})"
        out: list[Record] = []
        pos = self.HEADER_SIZE
        while pos + self._RECORD.size <= len(blob):
            length, crc = self._RECORD.unpack_from(blob, pos)
            body = blob[pos + self._RECORD.size : pos + self._RECORD.size + length]
            if len(body) < length:
                break  # a torn tail
            record = self._decode(body) if crc32c.crc32c(body) == crc else None
            if record is None:
                return (
                    out,
                    f"record at byte {pos} fails its check ({len(blob) - pos} bytes dropped)",
                )
            out.append(record)
            pos += self._RECORD.size + length
        return out, None

    def _legacy_records(self, blob: memoryview) -> list[Record]:
        """The first format: length-prefixed msgpack records, no header, no CRCs."""
        out: list[Record] = []
        pos = 0
        while pos + 4 <= len(blob):
            (length,) = self._CRC.unpack_from(blob, pos)
            if pos + 4 + length > len(blob):
                break
            record = self._decode(blob[pos + 4 : pos + 4 + length])
            if record is None:
                break
            out.append(record)
            pos += 4 + length
        return out

    @staticmethod
    def _decode(body: memoryview) -> Record | None:
        try:
            cid, state, size, stored_at = msgpack.unpackb(body)
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
        return str(cid), int(state), int(size), float(stored_at)

    def _encode(self, records: Iterable[Record]) -> bytes:
        out = bytearray()
        for record in records:
            body = msgpack.packb(list(record))
            out += self._RECORD.pack(len(body), crc32c.crc32c(body)) + body
        return bytes(out)

    async def append(self, records: list[Record], *, sync: bool) -> None:
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
