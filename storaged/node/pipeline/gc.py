"""GC: unreferenced chunks go after the grace period; retention trims cold chunks' nvme copies.

Relies on: the catalogue's ``references()`` naming every committed record's chunks at
one point in time when it says ``complete``; the referenced set (``node/referenced.py``),
which this module feeds and which answers every stage from a fresh snapshot only; every
use of a copy touching it
(``IndexEntry.last_use``: acks, ``/missing`` answers, commits — the commit's touch reaches
past its commit window); the per-chunk locks.

Upholds **I3 referenced means kept**: a chunk is collected here only if no checkpoint
named it in a catalogue snapshot taken at ``S``, its last use here is older than the grace
``G``, and the collection happens before ``S + G/2``. A commit that names the chunk
touched it at ``T`` (until ``T + W``, ``W`` its commit window) before writing its record,
which is everywhere by ``T + W``. Collecting needs ``now > T + W + G`` and ``now < S + G/2``,
so ``S > T + W``: the snapshot was taken after the record was written, and names the chunk.
The check and the mark (``LocalStore.collecting``) are one step under the chunk's lock, so a
touch or a store lands either before (and wins) or after (and sees the chunk gone).

Retention: a cold chunk's nvme copy goes only while all ``n`` of its fragments are held.

A pass that cannot take a complete snapshot (the catalogue out of reach, a damaged record,
an incomplete embedded snapshot, a pause asked by an operator) frees nothing and is
recorded as failed, with its cause, in the referenced set; past the grace that is a stall,
reported in ``/v1/cluster``, ``storaged nodes`` and the metrics, and logged at WARN each pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.coord.catalogue import CatalogueUnavailable
from storaged.coord.manifest_store import CatalogRecord
from storaged.node.index import COLD
from storaged.node.referenced import ReferencedSet
from storaged.placement import Placement

if TYPE_CHECKING:
    from storaged.coord.catalogue import Catalogue
    from storaged.node.pipeline.leadership import Leadership
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.gc")


def newest_per_prefix(records: list[CatalogRecord], keep: int) -> set[str]:
    """Chunk ids of the ``keep`` newest checkpoints under each prefix (the name's parent)."""
    groups: dict[str, list[CatalogRecord]] = {}
    for r in records:
        groups.setdefault(r.name.rpartition("/")[0], []).append(r)
    out: set[str] = set()
    for group in groups.values():
        group.sort(key=lambda r: (r.created, r.committed), reverse=True)
        for r in group[:keep]:
            out.update(r.chunks)
    return out


@dataclass(eq=False, repr=False)
class Collector:
    local: LocalStore
    cluster: ClusterView
    _: KW_ONLY
    #: what every stage asks "is this chunk unreferenced?" (fed by the passes here)
    referenced: ReferencedSet
    leadership: Leadership
    catalogue: Catalogue
    #: GC passes are skipped until then (``POST /v1/admin/gc``), counted as failed
    paused_until: float = field(default=0.0, init=False)

    def is_garbage(self, chunk_id: str) -> bool:
        """Unreferenced in a fresh complete snapshot and unused here for the grace period
        (what GC takes: repair and evacuation leave it alone rather than undo the
        collection). False whenever no snapshot is fresh: stale knowledge keeps data."""
        info = self.local.index.get(chunk_id)
        return info is not None and self.referenced.is_garbage(chunk_id, info.last_use)

    def pause(self, seconds: float) -> float:
        """Skip GC passes for ``seconds`` from now (0: resume); returns the end."""
        self.paused_until = time.time() + seconds if seconds > 0 else 0.0
        if seconds > 0:
            log.warning("GC paused for %.0f s by an operator", seconds)
        else:
            log.info("GC resumed by an operator")
        return self.paused_until

    def _failed(self, cause: str) -> None:
        self.referenced.failed(cause)
        self.local.metrics.gc_failed_passes.inc()
        stalled = self.referenced.stalled_since()
        self.local.metrics.gc_stalled.set(0 if stalled is None else time.time() - stalled)
        if stalled is not None:
            log.warning(
                "GC stalled for %.0f s (no complete pass since then): %s",
                time.time() - stalled,
                cause,
            )
        else:
            log.warning("GC pass skipped: %s", cause)

    async def gc_pass(self) -> None:
        cfg = self.local.config
        if time.time() < self.paused_until:
            self._failed(f"paused by an operator until {_clock(self.paused_until)}")
            return
        try:
            refs = await self.catalogue.references()
        except CatalogueUnavailable as exc:
            self._failed(f"the catalogue is unavailable: {exc}")
            return
        except Exception as exc:  # any other failure is a failed pass too, and reported
            self._failed(f"reading the catalogue failed: {type(exc).__name__}: {exc}")
            return
        if not refs.complete:
            # A manifest could be out of reach: freeing now could lose data.
            self._failed("the catalogue snapshot was incomplete (too few nodes answered)")
            return
        live = list(refs.live)
        snapshot = self.referenced.update(
            refs, frozenset(newest_per_prefix(live, cfg.retain_newest))
        )
        self.local.metrics.gc_stalled.set(0)
        self.local.metrics.gc_last_pass.set(snapshot.taken_at)
        referenced = snapshot.chunks
        protected = snapshot.protected
        deadline = snapshot.taken_at + self.referenced.fresh_for
        placement = self.cluster.placement()  # one view for the pass
        freed = 0
        trim: list[str] = []
        for cid in list(self.local.index):
            if time.time() > deadline:
                log.info("GC pass stopped: its catalogue snapshot is too old to act on")
                break
            info = self.local.index.get(cid)
            if info is None:
                continue
            if cid not in referenced:
                if await self.collect(cid, referenced, deadline):
                    freed += 1
                continue
            keep = placement.owner(cid) == self.local.id and cid in protected
            if info.state >= COLD and self.local.nvme_has(cid) and not keep:
                trim.append(cid)
        if trim:
            await self._trim_nvme(trim, placement)
        self.local.metrics.gc_freed.inc(freed)
        self.local.update_gauges()

    async def collect(self, chunk_id: str, referenced: frozenset[str], deadline: float) -> bool:
        """Remove every copy and fragment of ``chunk_id`` here if it is still garbage."""

        def garbage() -> bool:
            info = self.local.index.get(chunk_id)
            now = time.time()
            return (
                info is not None
                and chunk_id not in referenced
                and now - info.last_use > self.local.config.gc_grace
                and now <= deadline
            )

        if not garbage():
            return False
        async with self.local.locks.hold(chunk_id):
            if not garbage():
                return False
            self.local.collecting.add(chunk_id)  # same step as the check: held by no one from now
            try:
                await self._delete_local(chunk_id)
            finally:
                self.local.collecting.discard(chunk_id)
        return True

    async def _delete_local(self, chunk_id: str) -> None:
        await self.local.memory.delete(chunk_id)
        await self.local.nvme.delete(chunk_id)
        for index in list(self.local.fragments.get(chunk_id, ())):
            await self.local.cold.delete(fragment_key(chunk_id, index))
        self.local.fragments.pop(chunk_id, None)
        if self.local.index.pop(chunk_id, None) is not None:
            await self.local.state_log.append([(chunk_id, 0, 0, 0.0)], sync=False)

    async def _trim_nvme(self, ids: list[str], placement: Placement) -> None:
        """Drop the nvme copies of cold chunks whose ``n`` fragments are all held now by
        nodes that are not draining (a draining node's fragments are about to leave), and
        not concentrated on too few of them (``repairer.exposed``: repair spreads them)."""
        leaving: set[str] = set()
        held = await self.cluster.holdings(placement.placeable, ids, draining=leaving)
        for cid in ids:
            # A holder that says it drains counts for nothing, even where this view is older
            # than its mark: its fragments are about to leave with it.
            staying = [h for h in held[cid] if h.node not in leaving]
            frags = {i for h in staying for i in h.fragments}
            if (
                len(frags) >= self.local.config.n
                and not self.leadership.exposed(
                    {h.node: h.fragments for h in staying}, placement, without=leaving
                )
                and self.local.is_cold(cid)
                and cid not in self.local.collecting
            ):
                await self.local.nvme.delete(cid)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
