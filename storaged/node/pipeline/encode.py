"""Encode: the chunk's owner turns it into ``n`` fragments on ``n`` placements.

Relies on: the drain (every hot holder reports ``drained``), the codec's checks.

Upholds:

- A chunk is marked ``nvme`` only once every hot holder has it on disk, and ``cold`` only
  once all ``n`` fragments are stored durably; only then do the extra nvme copies go
  (the owner keeps its copy while retention wants it).
- **I6 progress**: an encode that fails leaves the chunk as it was; the repair pass offers
  it again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.coord.catalogue import CatalogueUnavailable
from storaged.node.index import COLD, NVME
from storaged.node.pipeline import ChunkWorkers
from storaged.peer import PeerError
from storaged.placement import Placement

if TYPE_CHECKING:
    from storaged.node.pipeline.drain import Drain
    from storaged.node.read import ReadPath
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.encode")


class Encoder(ChunkWorkers):
    def __init__(
        self, local: LocalStore, cluster: ClusterView, *, reads: ReadPath, drainer: Drain
    ) -> None:
        super().__init__("encode", local.config.encode_workers)
        self.local = local
        self.cluster = cluster
        self.reads = reads
        self.drainer = drainer

    @property
    def backlog(self) -> int:
        return self.pending

    def offered(self, chunk_id: str) -> None:
        self.local.metrics.encode_backlog.set(self.pending)

    def taken(self, chunk_id: str) -> None:
        self.local.metrics.encode_backlog.set(self.pending)

    async def handle(self, chunk_id: str) -> None:
        await self.advance(chunk_id)

    def failed(self, chunk_id: str, exc: Exception) -> None:
        if isinstance(exc, CatalogueUnavailable):
            log.warning("encode of %s: %s; repair will retry", chunk_id, exc)
        else:
            log.exception("encode of %s failed; repair will retry", chunk_id)

    async def advance(self, chunk_id: str) -> None:
        """As the owner: nvme once every hot holder drained, then encode, then trim copies."""
        placement = self.cluster.placement()  # one view for the whole encode
        if placement.owner(chunk_id) != self.local.id or self.local.is_cold(chunk_id):
            return
        rf = self.local.config.replication
        order = placement.order(chunk_id)
        ask = order[: rf + 2]
        held = (await self.cluster.holdings(ask, [chunk_id]))[chunk_id]
        if sum(1 for h in held if h.hot) < rf:
            # Placed while membership was changing: copies may sit further down the order.
            held += (await self.cluster.holdings(order[len(ask) :], [chunk_id]))[chunk_id]
        hot = [h for h in held if h.hot]
        if max((h.state for h in held), default=0) >= COLD:
            await self.local.record_state([chunk_id], COLD)
            return
        if len(hot) < rf or any(not h.nvme for h in hot):
            return  # not yet drained everywhere (the last holder's "drained" brings us back)
        await asyncio.gather(
            *(self.cluster.set_state(h.node, [chunk_id], NVME) for h in hot),
            return_exceptions=True,
        )
        # Durable now; the cold tier can wait for a pause in the PUTs (acks come first).
        await self.drainer.quiet(self.local.config.encode_defer)
        async with self.reads.local_copy(chunk_id) as local:
            data = local
            if data is None:
                # Placed while this node was thought down: the owner holds no copy itself.
                data = await self.reads.whole_copy(chunk_id, placement)
                if data is None:
                    log.warning("cannot encode %s: no holder serves it", chunk_id)
                    return
            if not await self.encode_and_spread(chunk_id, data, placement):
                return
        holders = [h.node for h in hot]
        await asyncio.gather(
            *(self.cluster.set_state(n, [chunk_id], COLD) for n in holders),
            return_exceptions=True,
        )
        self.local.metrics.encoded.inc()
        # Retention: the owner keeps its nvme copy (the GC pass drops it unless the chunk
        # belongs to a newest checkpoint); the other holders' nvme copies go now.
        others = [n for n in holders if n != self.local.id]
        await asyncio.gather(
            *(self.cluster.drop_nvme(n, [chunk_id]) for n in others),
            return_exceptions=True,
        )

    async def encode_and_spread(
        self,
        chunk_id: str,
        data: bytes | memoryview,
        placement: Placement,
        only: Iterable[int] | None = None,
    ) -> bool:
        """Encode and store fragments (all, or the indexes in ``only``) durably on their
        nodes in ``placement`` (the caller's view: draining nodes get none). False if any
        target did not take its fragment (down, full, or draining after all): the caller
        tries again with a later view."""
        targets = placement.fragment_targets(chunk_id)
        if not targets:
            return False
        per_node = math.ceil(self.local.config.n / len(set(targets)))
        if per_node > self.local.config.n - self.local.config.k:
            log.info(
                "not encoding %s: too few live nodes to spread %d fragments", chunk_id, len(targets)
            )
            return False  # repair offers it again once enough nodes are back
        fragments = await self.local.codec.encode_async(chunk_id, data)
        wanted = set(range(self.local.config.n)) if only is None else set(only)

        async def store(index: int) -> bool:
            key = fragment_key(chunk_id, index)
            blob = fragments[index].to_bytes()  # one joined copy: the peer call takes one body
            try:
                await self.cluster.put_fragment(targets[index], key, len(data), blob)
            except PeerError as exc:
                # A target that drains (our view predates its mark) refuses like a dead one:
                # the encode is offered again by repair, and that view places it elsewhere.
                level = logging.INFO if exc.code == "draining" else logging.WARNING
                log.log(level, "fragment %s to %s failed: %s", key, targets[index], exc)
                return False
            return True

        results = await asyncio.gather(*(store(i) for i in sorted(wanted)))
        return all(results)
