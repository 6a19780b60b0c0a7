"""The read path: the fastest tier that has the bytes, here, on a peer, or from fragments.

Upholds **I7 bytes**: nothing is returned that was not checked against the chunk id on
the way (the tiers verify on every read; a peer's copy is hashed again here; a decode is
checked with BLAKE3 by the codec). A copy that fails its check is quarantined by its tier
and never served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from erasure import fragment_key
from erasure.base import ErasureError
from storaged.ids import chunk_id_of_async
from storaged.peer import PeerError
from storaged.placement import Placement
from tiers import ByteRange, ChunkNotFound, CorruptChunk

if TYPE_CHECKING:
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.read")


def _slice(data: bytes | memoryview, rng: ByteRange | None) -> bytes | memoryview:
    if rng is None:
        return data
    start, end = rng.resolve(len(data))
    return memoryview(data)[start:end]


class ReadPath:
    """``cached``: the archive's read-through cache (``node/archive.py``), asked after RAM
    and nvme; its chunks were checked against their ids when fetched."""

    def __init__(
        self,
        local: LocalStore,
        cluster: ClusterView,
        cached: Callable[[str], memoryview | None] | None = None,
    ) -> None:
        self.local = local
        self.cluster = cluster
        self.cached = cached

    async def read_hot(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview | None, str]:
        """The bytes from this node's RAM or nvme, verified, or from the archive's
        read-through cache (tier ``memory``); (None, "") when not held hot,
        or when the disk cannot be read now (an I/O error, a data dir replaced behind the
        node's back): readers then go to the next source."""
        if self.local.memory_has(chunk_id):
            try:
                data = await self.local.memory.get(chunk_id, rng)
                return data, "memory"
            except ChunkNotFound:
                pass  # evicted or collected since the check
        if self.local.nvme_has(chunk_id):
            try:
                data = await self.local.nvme.get(chunk_id, rng)
                return data, "nvme"
            except CorruptChunk:
                self.local.metrics.corrupt.labels("nvme").inc()
                log.error("corrupt nvme copy of %s quarantined", chunk_id)
            except ChunkNotFound:
                pass  # collected, dropped, or its file removed behind the tier's back
            except OSError as exc:
                # Not proof the copy is gone (the disk may come back): kept, not served.
                log.error("nvme copy of %s cannot be read: %s", chunk_id, exc)
        if self.cached is not None:
            view = self.cached(chunk_id)
            if view is not None:
                return _slice(view, rng), "memory"  # RAM, though not a holding
        return None, ""

    @contextlib.asynccontextmanager
    async def local_copy(self, chunk_id: str) -> AsyncIterator[bytes | memoryview | None]:
        """The chunk from this node's RAM (leased: valid inside the block only, and the pooled
        buffer stays in the pool) or nvme (verified); None when neither holds it."""
        async with contextlib.AsyncExitStack() as stack:
            view: memoryview | None
            try:
                view = await stack.enter_async_context(self.local.memory.lease(chunk_id))
            except ChunkNotFound:
                view = None
            if view is not None:
                yield view
            else:
                data, _ = await self.read_hot(chunk_id)
                yield data

    async def read_chunk(
        self, chunk_id: str, rng: ByteRange | None = None, placement: Placement | None = None
    ) -> tuple[bytes | memoryview, str]:
        """The chunk (or a range of it) from the fastest source: here, a peer, or fragments,
        found with one view (``placement``, the caller's; a new one without)."""
        data, tier = await self.read_hot(chunk_id, rng)
        if data is not None:
            return data, tier
        placement = placement or self.cluster.placement()
        for node_id in placement.order(chunk_id):
            if node_id == self.local.id:
                continue
            try:
                # Whole chunk from the peer, so that it can be checked against the id here.
                reply, body = await self.cluster.get_chunk(node_id, chunk_id)
            except PeerError:
                continue
            body = b"" if body is None else body  # an empty chunk travels without a body
            if await chunk_id_of_async(body) != chunk_id:
                log.error("peer %s served bytes that fail the id of %s", node_id, chunk_id)
                continue
            return _slice(body, rng), str(reply.get("tier", "memory"))
        whole = await self.rebuild(chunk_id, placement)
        if whole is None:
            raise ChunkNotFound(chunk_id)
        return _slice(whole, rng), "cold"

    async def local_fragment(self, chunk_id: str, index: int) -> memoryview:
        """Fragment ``index`` of ``chunk_id`` (header + payload) from this node's cold tier,
        checked by the tier (header and payload CRC-32C); ``ChunkNotFound`` when this node
        does not hold it. A copy that fails its check is quarantined, as for a peer's read,
        and reported not found: this node no longer holds it."""
        key = fragment_key(chunk_id, index)
        try:
            return await self.local.cold.get(key)
        except CorruptChunk:
            self.local.metrics.corrupt.labels("cold").inc()
            self.local.forget_fragment(key)
            log.error("corrupt fragment %s quarantined", key)
            raise ChunkNotFound(key) from None
        except ChunkNotFound:
            self.local.forget_fragment(key)
            raise
        except OSError as exc:
            # Unreadable now (not proof it is gone: kept); this node cannot serve it.
            log.error("fragment %s cannot be read: %s", key, exc)
            raise ChunkNotFound(key) from exc

    async def whole_copy(
        self, chunk_id: str, placement: Placement | None = None
    ) -> bytes | memoryview | None:
        """The whole chunk from wherever it can be had (for repair and encode), or None."""
        try:
            data, _ = await self.read_chunk(chunk_id, placement=placement)
        except ChunkNotFound:
            return None
        return data

    async def rebuild(self, chunk_id: str, placement: Placement | None = None) -> bytes | None:
        """Decode a chunk from any ``k`` good fragments found on the live nodes (of the
        caller's view, ``placement``; a new one without)."""
        alive = (placement or self.cluster.placement()).alive
        held = (await self.cluster.holdings(alive, [chunk_id]))[chunk_id]
        sources = [(h.node, i) for h in held for i in h.fragments]
        if not sources:
            return None
        fragments: dict[int, bytes | memoryview] = {}
        random.shuffle(sources)

        async def fetch(node_id: str, index: int) -> None:
            try:
                body = await self.cluster.get_fragment(node_id, fragment_key(chunk_id, index))
            except PeerError:
                return
            if body is not None:
                fragments[index] = body

        # Ask for k first, then the rest only if some were bad or missing.
        seen: set[int] = set()
        first = []
        for node_id, index in sources:
            if index not in seen:
                seen.add(index)
                first.append((node_id, index))
        k = self.local.config.k
        await asyncio.gather(*(fetch(n, i) for n, i in first[:k]))
        try:
            return await self.local.codec.decode_async(chunk_id, dict(fragments))
        except ErasureError:
            await asyncio.gather(*(fetch(n, i) for n, i in first[k:]))
            try:
                return await self.local.codec.decode_async(chunk_id, dict(fragments))
            except ErasureError as exc:
                log.error("cannot rebuild %s: %s", chunk_id, exc)
                return None
