"""Repair: missing hot copies, missing fragments, and catalogue records short of holders.

Relies on: GC's view of garbage (repair leaves it alone), the read path to find a whole
copy anywhere (a peer, or a decode from fragments).

Upholds **I6 progress**: every pass looks at every chunk this node knows of; the node that
leads a chunk's repair (the first in placement order holding a hot copy, or, without any,
the first holding fragments) brings it back to ``replication`` hot copies (not yet cold)
or ``n`` fragments (cold), getting the bytes from wherever they are. An under-replicated
chunk thus never waits on a node that cannot act (one holding only fragments).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.node.index import COLD, Holding
from storaged.peer import PeerError
from storaged.placement import Placement
from tiers import TierFull

if TYPE_CHECKING:
    from storaged.node.core import Node

log = logging.getLogger("storaged.node.repair")


#: chunks repaired at once by one node (each may fetch k fragments and store some)
_PARALLEL = 8
#: a holder that does not answer a repair pass's question within this is skipped this pass
_ASK_TIMEOUT = 5.0


class Repair:
    def __init__(self, node: Node) -> None:
        self.node = node
        #: chunks this node leads the repair of that lacked something at the last pass
        self.backlog = 0

    async def repair_pass(self) -> None:
        node = self.node
        try:
            await node.catalogue.repair()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("catalogue repair failed")
        ids = list(node.index)
        lacking = 0
        slots = asyncio.Semaphore(_PARALLEL)

        async def one(cid: str, held: list[Holding], placement: Placement) -> None:
            nonlocal lacking
            async with slots:
                try:
                    if await self.repair_one(cid, held, placement):
                        lacking += 1
                except asyncio.CancelledError:
                    raise
                except Exception:
                    lacking += 1
                    log.exception("repair of %s failed", cid)

        for start in range(0, len(ids), 256):
            batch = ids[start : start + 256]
            placement = node.placement()  # one view per batch: its questions and repairs
            # A stalled holder must not hold up every other chunk's repair for long.
            held = await node.holdings(placement.alive, batch, timeout=_ASK_TIMEOUT)
            await asyncio.gather(*(one(cid, held[cid], placement) for cid in batch))
        self.backlog = lacking
        node.metrics.repair_backlog.set(lacking)

    async def repair_one(self, chunk_id: str, held: list[Holding], placement: Placement) -> bool:
        """Repair ``chunk_id`` if this node leads it; True if it lacked copies or fragments.

        ``held`` is what the live nodes of ``placement`` (the caller's one view) reported.
        Evacuation: copies and fragments on draining nodes do not count toward
        ``replication`` or ``n``; they are copied to where placement without those nodes
        says, and a draining holder may lead (it has the bytes)."""
        node = self.node
        cfg = node.config
        if node.collector.is_garbage(chunk_id):
            return False  # garbage waiting for GC: copying it back would undo the collection
        order = placement.order(chunk_id)
        hot = {h.node for h in held if h.hot}
        with_fragments = {h.node for h in held if h.fragments}
        leader = next((n for n in order if n in (hot or with_fragments)), None)
        if leader != node.id:
            return False
        staying = [h for h in held if not placement.is_draining(h.node)]
        state = max((h.state for h in held), default=0)
        frags = {i for h in held for i in h.fragments}
        if state >= COLD or len(frags) >= cfg.n:
            missing = set(range(cfg.n)) - {i for h in staying for i in h.fragments}
            if missing:
                async with node.reads.local_copy(chunk_id) as local:
                    if local is None:
                        # No whole copy here: a draining node's fragments move as they are
                        # (one read each, not k reads and an encode).
                        missing -= await self._move_fragments(chunk_id, held, placement, missing)
                    data = local
                    if data is None and missing:
                        data = await node.reads.rebuild(chunk_id, placement)
                    if data is not None and await node.encoder.encode_and_spread(
                        chunk_id, data, placement, missing
                    ):
                        node.metrics.repaired.labels("fragment").inc(len(missing))
            return bool(missing)
        kept = {h.node for h in staying if h.hot}
        targets = placement.hot_targets(chunk_id)
        lacking = [n for n in targets if n not in kept]
        if len(kept) >= cfg.replication or not lacking:
            owner = placement.owner(chunk_id)
            if all(h.nvme for h in held if h.hot) and owner is not None:
                node.encoder.offer(chunk_id)  # owner side: encode when ready
                if owner != node.id:
                    with contextlib.suppress(PeerError):
                        await node.call(owner, "drained", {"id": chunk_id})
            return False
        async with node.reads.local_copy(chunk_id) as local:
            data = local if local is not None else await node.reads.whole_copy(chunk_id, placement)
            if data is None:
                log.warning("repair of %s: no copy and too few fragments to read", chunk_id)
                return True
            view = memoryview(data)
            for target in lacking[: cfg.replication - len(kept)]:
                try:
                    if target == node.id:
                        await node.writes.keep_copy(chunk_id, view)
                    else:
                        await node.writes.push_copy(target, chunk_id, view)
                    node.metrics.repaired.labels("copy").inc()
                except (PeerError, TierFull) as exc:
                    log.warning("repair copy of %s to %s failed: %s", chunk_id, target, exc)
        return True

    async def _move_fragments(
        self, chunk_id: str, held: list[Holding], placement: Placement, missing: set[int]
    ) -> set[int]:
        """Copy the fragments of ``missing`` that draining nodes hold, bytes as they are, to
        their targets in ``placement``; the indexes moved. The target checks each fragment
        against its header's checksum (``put_fragment``), as for an encode."""
        node = self.node
        targets = placement.fragment_targets(chunk_id)
        if not targets:
            return set()
        size = max((h.size for h in held), default=-1)
        sources = {i: h.node for h in held if placement.is_draining(h.node) for i in h.fragments}

        async def move(index: int) -> bool:
            key = fragment_key(chunk_id, index)
            try:
                _, blob = await node.call(sources[index], "get_fragment", {"key": key})
                if blob is None:
                    return False
                await node.call(targets[index], "put_fragment", {"key": key, "size": size}, blob)
            except PeerError as exc:
                log.warning("moving fragment %s to %s failed: %s", key, targets[index], exc)
                return False
            return True

        wanted = sorted(i for i in missing if i in sources)
        moved = await asyncio.gather(*(move(i) for i in wanted))
        done = {i for i, ok in zip(wanted, moved, strict=True) if ok}
        if done:
            node.metrics.repaired.labels("fragment_moved").inc(len(done))
        return done
