"""What one node holds locally: its tiers, the chunk index joined with them, the fragments
it stores, the per-chunk locks, the state log, its counters and its background tasks.

Every stage reads and changes these through a ``Local`` (``services.LocalStore``); none of
it asks another node anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from erasure import parse_fragment_key
from erasure.base import Codec
from storaged.config import Config
from storaged.coord.manifest_store import Catalog
from storaged.metrics import NodeMetrics
from storaged.node.index import COLD, MEMORY, NVME, ChunkLocks, IndexEntry, StateLog
from storaged.node.space import DiskSpace
from tiers import ChunkNotFound, CorruptChunk
from tiers.cold import ColdTier, forget_fragment
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier

log = logging.getLogger("storaged.node")


@dataclass(eq=False, repr=False)
class Local:
    """This node's own holdings (``services.LocalStore``)."""

    config: Config
    memory: MemoryTier
    nvme: NvmeTier
    cold: ColdTier
    codec: Codec
    catalog: Catalog
    state_log: StateLog
    index: dict[str, IndexEntry]
    id: str = field(init=False)
    fragments: dict[str, set[int]] = field(default_factory=dict, init=False)
    #: full and nearly-full marks of the disk tiers, from their writes and a probe
    space: DiskSpace = field(init=False)
    locks: ChunkLocks = field(default_factory=ChunkLocks, init=False)
    #: chunks whose collection has been decided and is under way: held by no one
    collecting: set[str] = field(default_factory=set, init=False)
    metrics: NodeMetrics = field(default_factory=NodeMetrics, init=False)
    #: set by ``Node.shutdown``: new PUTs (HTTP and peer) are refused from then on
    stopping: bool = field(default=False, init=False)
    #: set by ``Node.shutdown`` once it no longer waits for PUTs in flight: a co-located
    #: client's lease taken before the stop is no longer sealed from then on
    writes_closed: bool = field(default=False, init=False)
    #: the node's background tasks (cancelled by ``cancel_tasks``)
    tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.id = self.config.node_id
        self.space = DiskSpace({"nvme": self.nvme, "cold": self.cold})

    @property
    def url(self) -> str:
        """This node's advertised HTTP URL (what refusals name it by)."""
        return self.config.node.url

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as a background task of this node (cancelled by ``Node.close``)."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- the index, from the disks -----------------------------------------------------
    async def rebuild_index(self) -> None:
        """Join the state log with what the disks hold; what no disk holds is forgotten."""
        now = time.time()
        on_nvme: dict[str, int] = {}
        async for key in self.nvme.keys():
            on_nvme[key] = (await self.nvme.stat(key)).size
        stored: list[str] = []
        async for key in self.cold.keys():
            stored.append(key)
        bad = await self._check_fragments(stored)
        async for key in self.cold.keys():
            cid, index = parse_fragment_key(key)
            self.fragments.setdefault(cid, set()).add(index)
        for cid, size in on_nvme.items():
            info = self.index.get(cid)
            if info is None:
                self.index[cid] = IndexEntry(size, NVME, now)
            else:
                info.state = max(info.state, NVME)
        for cid in self.fragments:
            if cid not in self.index:
                # Fragments only: the state log was lost; a fragment is only written when the
                # chunk was fully on nvme, so "nvme" is a safe lower bound.
                self.index[cid] = IndexEntry(-1, NVME, now)
        gone = [cid for cid in self.index if cid not in on_nvme and cid not in self.fragments]
        for cid in gone:
            del self.index[cid]
        # Uses before the restart were not recorded: count everything as used now (this
        # only delays collections by one grace period).
        for info in self.index.values():
            info.last_use = now
        log.info(
            "node %s: index rebuilt: %d chunks on nvme, %d with fragments (%d fragment(s) "
            "failed their check and were quarantined), %d forgotten",
            self.id,
            len(on_nvme),
            len(self.fragments),
            bad,
            len(gone),
        )

    async def _check_fragments(self, keys: list[str]) -> int:
        """Read and check every fragment on disk before any is advertised (a crash or a
        flip while the node was down must not count as a held fragment until the first
        scrub); what fails is quarantined by the tier. Returns how many failed.

        Costs one read of the cold tier per start, at disk speed, four at a time."""
        slots = asyncio.Semaphore(4)
        failed = 0

        async def check(key: str) -> None:
            nonlocal failed
            async with slots:
                try:
                    await self.cold.get(key)
                except CorruptChunk:
                    failed += 1
                    self.metrics.corrupt.labels("cold").inc()
                except ChunkNotFound:
                    pass

        await asyncio.gather(*(check(k) for k in keys))
        return failed

    async def prefault(self) -> None:
        """Map part of the RAM tier ahead of the first PUTs (8 MiB, the client's chunk size)."""
        size = min(8 * 2**20, self.config.max_chunk_size)
        count = int(self.config.memory_capacity * self.config.prefault_fraction) // size
        if count > 0:
            added = await self.memory.prefault(size, count)
            log.info("pre-faulted %d RAM buffers of %d bytes", added, size)

    # ---- local holdings ------------------------------------------------------------------
    def memory_has(self, chunk_id: str) -> bool:
        """A RAM copy of this node's own (a co-located client's local copy is not one: it
        serves reads through shared memory and counts for nothing else)."""
        return self.memory.holds(chunk_id)

    def nvme_has(self, chunk_id: str) -> bool:
        return self.nvme.has(chunk_id)

    def holds_hot(self, chunk_id: str) -> bool:
        return self.memory_has(chunk_id) or self.nvme_has(chunk_id)

    def is_cold(self, chunk_id: str) -> bool:
        info = self.index.get(chunk_id)
        return info is not None and info.state >= COLD

    def usage(self) -> dict[str, dict[str, Any]]:
        """Per tier: used, capacity, count; for the disk tiers also their room marks
        (``DiskSpace.mark``: state, free, full_since, cause)."""
        out: dict[str, dict[str, Any]] = {}
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            out[tier.name] = {"used": u.used, "capacity": u.capacity, "count": u.count}
        out["memory"]["dirty"] = self.memory.stats().dirty_bytes
        for name in ("nvme", "cold"):
            out[name].update(self.space.mark(name))
        return out

    def note_stored(self, chunk_id: str, size: int) -> None:
        """A verified copy of ``chunk_id`` is now here (RAM): index it, counted as used now."""
        now = time.time()
        info = self.index.get(chunk_id)
        if info is None:
            self.index[chunk_id] = IndexEntry(size, MEMORY, now, now)
        else:
            if info.size < 0:
                info.size = size
            info.touch(now)

    async def record_state(self, ids: Iterable[str], state: int) -> None:
        records = []
        for cid in ids:
            info = self.index.get(cid)
            if info is not None and info.state < state:
                info.state = state
                records.append((cid, state, info.size, info.stored_at))
        await self.state_log.append(records, sync=True)

    def forget_fragment(self, key: str) -> None:
        forget_fragment(self.fragments, key)

    def update_gauges(self) -> None:
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            self.metrics.tier_bytes.labels(tier.name).set(u.used)
            self.metrics.tier_chunks.labels(tier.name).set(u.count)
            self.metrics.tier_capacity.labels(tier.name).set(u.capacity)
