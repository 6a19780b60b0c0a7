"""The read router: which chunk source is asked first, which node first, and what one
source's failure changes for the next (``Client.get_chunk``).

The order: the node on this host through shared memory (``ShmSource``), then a decode
here from fragments when the plan names only cold holders (``ColdDecodeSource``), then
the nodes over HTTP (``DirectSource``: direct reads where they reach, aiohttp elsewhere).
The fallback rules:

- a shared-memory copy that fails its id sends the read to the other holders, its node
  left out (it serves its RAM copy as it holds it) and every answer checked;
- too few fragments to decode here leave the read to the nodes, and when none of them
  has the chunk either, the decode's ``NotEnoughFragments`` is raised (it says more than
  their 404);
- nodes are asked holders first (the least loaded of the hot ones, which are
  interchangeable), then the rest in placement order, and the read goes to the next one
  too when the first has not answered within the deadline its size and the bandwidth
  seen so far allow (``storaged.client.deadlines``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from storaged.client.deadlines import Bandwidth
from storaged.client.documents import ClientStats, Holder
from storaged.client.errors import NotFound
from storaged.client.request import Requests, check_chunk_id
from storaged.client.sources import (
    ChunkRead,
    ColdDecodeSource,
    DirectSource,
    HttpSource,
    Links,
    ShmSource,
    WritableBuffer,
)
from storaged.wire import ByteRange


class ReadRouter:
    """Reads chunks through the sources in order (see the module's docstring)."""

    def __init__(
        self,
        requests: Requests,
        links: Links,
        *,
        bandwidth: Bandwidth,
        decode_slots: asyncio.Semaphore,
        decode_cache_bytes: int,
        verify_reads: bool,
    ) -> None:
        self.requests = requests
        self.stats: ClientStats = requests.stats
        self.bandwidth = bandwidth
        self.verify_reads = verify_reads
        self.shm = ShmSource(links, self.stats)
        self.cold = ColdDecodeSource(requests, bandwidth, links, decode_slots, decode_cache_bytes)
        self.nodes: HttpSource = DirectSource(requests, bandwidth, links)

    def asked(
        self,
        chunk_id: str,
        out: WritableBuffer | None,
        byte_range: ByteRange | None,
        holders: Sequence[Holder | str] | None,
    ) -> ChunkRead:
        """The read of ``chunk_id`` as the sources take it; ``ValueError`` for a bad id,
        ``BadRange``, ``ValueError`` for a buffer smaller than the range, before any request."""
        check_chunk_id(chunk_id)
        read = ChunkRead.asked(chunk_id, out, byte_range, holders)
        read.verify = self.verify_reads
        return read

    async def get(
        self,
        chunk_id: str,
        out: WritableBuffer | None,
        byte_range: ByteRange | None,
        holders: Sequence[Holder | str] | None,
    ) -> memoryview:
        """``Client.get_chunk``: the bytes from the first source that has them."""
        read = self.asked(chunk_id, out, byte_range, holders)
        if read.want == 0:  # HTTP cannot ask for nothing
            return (read.target if read.target is not None else memoryview(bytearray()))[:0]
        view = await self.shm.read(read)
        if view is None:
            view = await self.cold.read(read)
        if view is None:
            view = await self.from_nodes(read, self.nodes)
        self.stats.chunks_downloaded += 1
        self.stats.bytes_downloaded += len(view)
        return view

    async def from_nodes(self, read: ChunkRead, source: HttpSource) -> memoryview:
        """``read`` from the nodes through ``source``, in the order ``aim`` sets."""
        self.aim(read)
        try:
            return await source.read(read)
        except NotFound:
            if read.degraded is not None:
                raise read.degraded from None
            raise

    def aim(self, read: ChunkRead) -> None:
        """Set the nodes to ask for ``read`` (the shared-memory node whose copy failed left
        out) and how long the first may take before the next is asked too."""
        candidates, balance = self.candidates(read.chunk_id, read.holders)
        if read.bad_copy in candidates:
            if candidates.index(read.bad_copy) < balance:
                balance -= 1
            candidates.remove(read.bad_copy)
        read.candidates, read.balance = candidates, balance
        target = read.target
        size_hint = (
            read.want if read.want is not None else len(target) if target is not None else None
        )
        if size_hint is None:
            size_hint = self.requests.known_cluster().max_chunk_size
        read.hedge_after = self.bandwidth.deadline(size_hint)

    def candidates(
        self, chunk_id: str, holders: Sequence[Holder | str] | None
    ) -> tuple[list[str], int]:
        """Holders (least loaded among the hot ones first), then the rest in placement order;
        and how many leading candidates are interchangeable hot holders."""
        requests = self.requests
        ordered: list[str] = []
        balance = 0
        if holders:
            hot: list[str] = []
            cold: list[str] = []
            for holder in holders:
                if isinstance(holder, Holder):
                    requests.learn_url(holder.node, holder.url)
                    (cold if holder.tier == "cold" else hot).append(holder.node)
                else:
                    hot.append(holder)
            ordered = [*requests.by_load(list(dict.fromkeys(hot))), *requests.by_load(cold)]
            # Any node rebuilds a cold-only chunk: then the cold holders are interchangeable.
            balance = len(dict.fromkeys(hot)) or len(cold)
        cluster = requests.known_cluster()
        placement = requests.placement(chunk_id)
        first = requests.by_load(placement[: cluster.replication]) if not holders else []
        if not holders:
            balance = len(first)
        rest = [n.id for n in cluster.nodes]
        return list(dict.fromkeys([*ordered, *first, *placement, *rest])), balance

    def close(self) -> None:
        self.cold.clear()
