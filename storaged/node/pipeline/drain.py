"""Drain: every holder writes its RAM copy to nvme (temp file, fsync, rename, dir fsync).

Upholds:

- After ``drain`` returns, the chunk is on this node's disk and its RAM copy is clean
  (evictable); until then the RAM copy is dirty and never evicted.
- **I6 progress**: a failed drain (full disk, an I/O error, anything but the chunk having
  been collected) is retried with a growing delay; no chunk stays RAM-only forever while
  the node runs.
- **I5 stops**: ``drain_all`` writes every dirty chunk before a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from storaged.node.pipeline import ChunkWorkers
from storaged.peer import PeerError
from tiers import ChunkNotFound, CorruptChunk, TierFull

if TYPE_CHECKING:
    from storaged.node.services import ClusterView, LocalStore
    from storaged.node.write import WritePath

log = logging.getLogger("storaged.node.drain")

#: retry delays of a failing drain grow up to this
_MAX_BACKOFF = 5.0
#: a stop that cannot drain to a full disk says so this often
_FULL_SAY_EVERY = 10.0


class Drain(ChunkWorkers):
    def __init__(
        self,
        local: LocalStore,
        cluster: ClusterView,
        *,
        writes: WritePath,
        to_encode: Callable[[str], None],
    ) -> None:
        super().__init__("drain", local.config.drain_workers, dedup=False)
        self.local = local
        self.cluster = cluster
        self.writes = writes
        #: hands a chunk this node owns to the encoder
        self.to_encode = to_encode
        self._retries: dict[str, float] = {}  # chunk id -> its next delay

    @property
    def backlog(self) -> int:
        """Chunks waiting for their drain (queued or waiting to retry)."""
        return self.queued + len(self._retries)

    def offered(self, chunk_id: str) -> None:
        self.local.metrics.drain_backlog.inc()

    def taken(self, chunk_id: str) -> None:
        self.local.metrics.drain_backlog.dec()

    def _ram_pressed(self) -> bool:
        u = self.local.memory.usage()
        return u.used > u.capacity // 2

    async def quiet(self, longest: float, *, unless_ram_pressed: bool = False) -> None:
        """Wait (at most ``longest`` s) until no ack is under way here (a PUT in flight, a
        replica copy arriving): acks come first."""
        writes = self.writes
        deadline = time.monotonic() + longest
        while writes.busy() and time.monotonic() < deadline and not self.local.stopping:
            if unless_ram_pressed and self._ram_pressed():
                return
            await asyncio.sleep(0.02)

    async def handle(self, chunk_id: str) -> None:
        await self.quiet(self.local.config.drain_defer, unless_ram_pressed=True)
        await self.drain(chunk_id)
        self._retries.pop(chunk_id, None)

    def failed(self, chunk_id: str, exc: Exception) -> None:
        delay = self._retries.get(chunk_id, 0.5)
        self._retries[chunk_id] = min(delay * 2, _MAX_BACKOFF)
        log.warning(
            "drain of %s failed (%s: %s); retrying in %.1f s",
            chunk_id,
            type(exc).__name__,
            exc,
            delay,
        )
        self.local.spawn(self._retry_later(chunk_id, delay), f"drain-retry-{chunk_id[:8]}")

    async def _retry_later(self, chunk_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        self.offer(chunk_id)

    async def drain(self, chunk_id: str) -> None:
        """RAM copy -> nvme file (durable), then the RAM copy is clean (evictable)."""
        if not self.local.nvme_has(chunk_id) and not self.local.memory.holds(chunk_id):
            # Collected meanwhile, or all that is left here is a co-located client's local
            # copy (never drained: it is no copy of the chunk's, ``tiers/memory.py``).
            return
        if not self.local.nvme_has(chunk_id):
            try:
                await self._write(chunk_id)
            except ChunkNotFound:
                return  # collected meanwhile: nothing left to drain
            except CorruptChunk:
                self._quarantine(chunk_id)
                return
        self.local.memory.mark_clean(chunk_id)
        self.local.metrics.drained.inc()
        owner = self.cluster.placement().owner(chunk_id)
        if owner is None:
            return  # no placeable node now: repair offers the chunk to its owner later
        if owner == self.local.id:
            self.to_encode(chunk_id)
        else:
            with contextlib.suppress(PeerError):
                await self.cluster.drained(owner, chunk_id)

    async def _write(self, chunk_id: str) -> None:
        """The RAM copy to a durable file. A copy handed over in shared memory is hashed
        again on its way (I7): the kernel's seals keep its pages from changing, and this
        check is what proves it before the bytes become the durable copy."""
        async with self.local.memory.lease(chunk_id) as view:
            shared = self.local.memory.is_shared(chunk_id)
            try:
                await self.local.nvme.put(chunk_id, view, verified=not shared)
            except TierFull as exc:
                # The disk's own word (ENOSPC) or the capacity: PUTs that wait for RAM only
                # this drain could free are refused from now on (node/space.py).
                self.local.space.note_full("nvme", exc, view.nbytes)
                raise
        self.local.space.note_written("nvme")

    def _quarantine(self, chunk_id: str) -> None:
        """A RAM copy that fails its id is dropped (never drained, never served again);
        repair brings a good copy from another holder."""
        self.local.metrics.corrupt.labels("memory").inc()
        log.error("RAM copy of %s fails its id: dropped, repair will copy it anew", chunk_id)
        self.local.spawn(self.local.memory.delete(chunk_id), f"quarantine-{chunk_id[:8]}")

    def _dirty(self, chunk_id: str) -> bool:
        """Still RAM-only here (False once collected: gone is not dirty)."""
        try:
            return self.local.memory.is_dirty(chunk_id)
        except ChunkNotFound:
            return False

    async def drain_all(self, deadline: float) -> list[str]:
        """Drain every dirty RAM chunk (for a graceful stop), retrying failures until
        ``deadline`` (monotonic). Returns the chunks still RAM-only."""
        left = self.local.memory.dirty_keys()
        attempt = 0
        said = -_FULL_SAY_EVERY
        while left and time.monotonic() < deadline:
            if self.local.space.full("nvme") and time.monotonic() - said >= _FULL_SAY_EVERY:
                # Say what the stop waits for: it can last the whole stop_timeout.
                said = time.monotonic()
                log.error(
                    "stop: %d RAM-only chunk(s) cannot drain: nvme tier %s; waiting %.0f s "
                    "more for disk space, then exiting without them (lost unless another "
                    "holder has them on disk)",
                    len(left),
                    self.local.space.describe("nvme"),
                    deadline - said,
                )
            failed = []
            for cid in left:
                if time.monotonic() >= deadline:
                    failed.append(cid)
                    continue
                try:
                    if not self.local.nvme_has(cid):
                        await self._write(cid)
                    self.local.memory.mark_clean(cid)
                except ChunkNotFound:
                    continue
                except CorruptChunk:
                    self._quarantine(cid)
                    continue
                except Exception as exc:
                    log.warning("stop: drain of %s failed: %s", cid, exc)
                    failed.append(cid)
            left = [c for c in failed if self._dirty(c)]
            attempt += 1
            if left:
                await asyncio.sleep(min(0.2 * attempt, 2.0))
        return left
