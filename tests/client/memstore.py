"""An in-process ``CheckpointStore`` over dicts, for the save/restore tests that need no cluster.

It is not a server: it holds chunks and manifests the way the client's callers see
them, checks chunk ids, enforces immutable names, and can be told to fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from storaged.client.client import (
    BytesLike,
    CheckpointStatus,
    CommitResult,
    Holder,
    RestorePlanDoc,
    WritableBuffer,
    writable_view,
)
from storaged.client.errors import (
    BadRange,
    CheckpointNotFound,
    ChecksumMismatch,
    ChunkNotFound,
    Exists,
    MissingChunks,
)
from storaged.client.layout import Manifest
from storaged.ids import chunk_id_of
from tiers.base import ByteRange


class MemoryStore:
    def __init__(self, max_chunk_size: int = 16 << 20) -> None:
        self._max_chunk_size = max_chunk_size
        self.chunks: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}
        self.puts = 0
        self.put_bytes = 0
        self.gets: list[tuple[str, int, int]] = []
        #: Called with the chunk id before each upload; may raise to simulate a failure.
        self.on_put: Callable[[str], None] | None = None
        #: Called with the chunk id before each read; may raise.
        self.on_get: Callable[[str], None] | None = None

    @property
    def max_chunk_size(self) -> int:
        return self._max_chunk_size

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str:
        await asyncio.sleep(0)
        raw = bytes(data)  # a copy on purpose: the store must not alias the caller's buffer
        actual = chunk_id_of(raw)
        if chunk_id is not None and chunk_id != actual:
            raise ChecksumMismatch(message="digest differs from id", status=400)
        if self.on_put is not None:
            self.on_put(actual)
        self.puts += 1
        self.put_bytes += len(raw)
        self.chunks[actual] = raw
        return actual

    async def put_chunks(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None = None
    ) -> list[str]:
        ids = []
        for index, data in enumerate(chunks):
            cid = chunk_ids[index] if chunk_ids is not None else chunk_id_of(data)
            if cid not in self.chunks:
                await self.put_chunk(data, cid)
            ids.append(cid)
        return ids

    async def get_chunk(
        self,
        chunk_id: str,
        out: WritableBuffer | None = None,
        byte_range: ByteRange | None = None,
        *,
        holders: Sequence[Holder | str] | None = None,
    ) -> memoryview:
        await asyncio.sleep(0)
        if self.on_get is not None:
            self.on_get(chunk_id)
        try:
            data = self.chunks[chunk_id]
        except KeyError:
            raise ChunkNotFound(message=chunk_id, status=404) from None
        rng = byte_range or ByteRange()
        end = len(data) if rng.end is None else rng.end
        if rng.start < 0 or end > len(data) or end < rng.start:
            raise BadRange(message=str(rng), status=416)
        self.gets.append((chunk_id, rng.start, end))
        piece = memoryview(data)[rng.start : end]
        if out is None:
            return memoryview(bytearray(piece))
        view = writable_view(out)
        view[: len(piece)] = piece
        return view[: len(piece)]

    async def commit(self, name: str, manifest: Mapping[str, Any]) -> CommitResult:
        parsed = Manifest.from_wire(manifest)
        missing = [c for c in parsed.chunk_ids if c not in self.chunks]
        if missing:
            raise MissingChunks(message="missing", status=409, missing=missing)
        raw = msgpack.packb(manifest)
        if name in self.manifests and self.manifests[name] != raw:
            raise Exists(message=name, status=409)
        created = name not in self.manifests
        self.manifests[name] = raw
        sizes = {c: s for shard in parsed.shards for c, s in shard.chunks}
        return CommitResult(name, len(sizes), sum(sizes.values()), created)

    async def get_manifest(self, name: str) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = msgpack.unpackb(self.manifests[name])
        except KeyError:
            raise CheckpointNotFound(message=name, status=404) from None
        return doc

    async def plan(self, name: str) -> RestorePlanDoc:
        manifest = Manifest.from_wire(await self.get_manifest(name))
        return {c: [Holder("mem", "mem://", "memory")] for c in manifest.chunk_ids}

    async def wait(
        self,
        name: str,
        state: str = "memory",
        timeout: float = 60.0,  # noqa: ASYNC109
    ) -> CheckpointStatus:
        manifest = Manifest.from_wire(await self.get_manifest(name))
        n = len(manifest.chunk_ids)
        return CheckpointStatus("cold", n, n, n, n)
