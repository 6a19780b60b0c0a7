"""Draining a node that is to leave (a failing fan, a decommission): the marks, and when
it can go.

A draining node takes no new placements (``storaged.placement.Placement``: no hot copies,
fragments, encodes or catalogue records go to it) and refuses copies peers send it, but
goes on serving what it holds. Repair (``pipeline/repair.py``) does not count its copies
and fragments and copies them to where placement without it says. This module marks and
unmarks, and answers how far the evacuation is.

Upholds: ``can_leave`` is true only when every chunk the node holds (hot or as fragments,
garbage awaiting GC aside) has ``replication`` hot copies or all ``n`` fragments on live
nodes that are not draining, spread as the failure model needs (no ``budget`` of those
nodes hold so many that ``k`` would not be left: ``storaged.placement.exposed``), as
those nodes answer now, and no copy can still land on
the node (it knows it is draining, and no store or PUT is under way on it).

Where the mark lives: with a coordinator (etcd) in the coordinator, seen by every node by
watch. In the embedded mode each node keeps the marks in its data dir; the node that
marks tells every live peer at once, and the marks travel in every heartbeat (the last set
wins, by the clock of the node that set it), so a node that was down when a mark was set
learns it from the first peer it hears from after its restart. Until then it may send
the draining node a copy, which that node refuses (the sender places it elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from storaged.coord.catalogue import CoordinatorUnavailable
from storaged.coord.membership import ACTIVE, DRAINING
from storaged.errors import NotFound, unavailable
from storaged.peer import PeerError

if TYPE_CHECKING:
    from storaged.node.pipeline.leadership import Leadership
    from storaged.node.referenced import ReferencedSet
    from storaged.node.services import ClusterView, LocalStore
    from storaged.node.write import WritePath

log = logging.getLogger("storaged.node.evacuation")

#: how long the draining node may take to answer how far it is (it asks every other node
#: about every chunk it holds)
_PROGRESS_TIMEOUT = 120.0


@dataclass(eq=False, repr=False)
class Evacuation:
    local: LocalStore
    cluster: ClusterView
    _: KW_ONLY
    writes: WritePath
    leadership: Leadership
    referenced: ReferencedSet

    def _known(self, node_id: str) -> None:
        try:
            self.cluster.membership.node(node_id)
        except KeyError:
            raise NotFound("node_not_found", f"no member named {node_id!r}") from None

    async def mark(self, node_id: str, draining: bool) -> dict[str, Any]:
        """Mark ``node_id`` draining (or active again) cluster-wide. Returns the state and,
        in the embedded mode, the members the mark did not reach now (they learn it from
        their peers' heartbeats once back)."""
        membership = self.cluster.membership
        # What this node knew before (a forgotten member's leftover mark counts as draining)
        try:
            membership.node(node_id)
        except KeyError:
            was = DRAINING
        else:
            was = DRAINING if membership.drains.is_draining(node_id) else ACTIVE
        try:
            # A stranger is refused, except that a member forgotten while draining (etcd:
            # down past gone_after) left its mark, which a cancel lifts.
            await membership.drains.mark(node_id, draining)
        except KeyError:
            raise NotFound("node_not_found", f"no member named {node_id!r}") from None
        except CoordinatorUnavailable as exc:
            raise unavailable("coordinator_unavailable", str(exc), retry_after=1.0) from exc
        unreached: list[str] = []
        if not membership.drains.shared:
            marks = {n: [on, at] for n, (on, at) in membership.drains.known().items()}
            placement = self.cluster.placement()
            peers = [m.id for m in placement.view.members if m.id != self.local.id]
            live = [p for p in peers if placement.is_alive(p)]
            results = await asyncio.gather(
                *(self.cluster.drain_marks(p, marks, timeout=10.0) for p in live),
                return_exceptions=True,
            )
            told = {
                p for p, r in zip(live, results, strict=True) if not isinstance(r, BaseException)
            }
            unreached = [p for p in peers if p not in told]
        log.info(
            "node %s marked %s%s",
            node_id,
            DRAINING if draining else ACTIVE,
            f" (not reached now: {', '.join(unreached)})" if unreached else "",
        )
        return {
            "node": node_id,
            "state": DRAINING if draining else ACTIVE,
            "was": was,
            "unreached": unreached,
        }

    async def progress(self, node_id: str) -> dict[str, Any]:
        """How far ``node_id``'s evacuation is, as it answers (it alone knows what it holds);
        503 ``node_unavailable`` when it does not answer."""
        self._known(node_id)
        if node_id == self.local.id:
            return await self.local_progress()
        try:
            reply = await self.cluster.drain_progress(node_id, timeout=_PROGRESS_TIMEOUT)
        except PeerError as exc:
            raise unavailable(
                "node_unavailable", f"node {node_id} does not answer: {exc}", retry_after=1.0
            ) from exc
        return reply

    def _garbage(self, chunk_id: str) -> bool:
        info = self.local.index.get(chunk_id)
        return info is not None and self.referenced.is_garbage(chunk_id, info.last_use)

    async def local_progress(self) -> dict[str, Any]:
        """This node's side of ``progress``: what it holds, and how much of that is not yet
        safely elsewhere, asked of the nodes that stay."""
        placement = self.cluster.placement()
        draining = placement.is_draining(self.local.id)
        # Sampled before the index, with no await in between: with the node known draining
        # and nothing under way, no copy can land here after this snapshot.
        quiet = self.writes.inflight == 0 and self.writes.storing == 0
        hot = [
            c
            for c in self.local.index
            if self.local.holds_hot(c) and c not in self.local.collecting
        ]
        fragments = {
            c: len(held)
            for c, held in self.local.fragments.items()
            if c not in self.local.collecting
        }
        # Garbage awaiting GC is GC's to drop, not the evacuation's to keep; only a fresh
        # snapshot says what is garbage (node/referenced.py), else everything counts.
        ids = [c for c in dict.fromkeys([*hot, *fragments]) if not self._garbage(c)]
        others = [n for n in placement.placeable if n != self.local.id]
        leaving: set[str] = set()  # others that say they drain too: they do not stay
        held = await self.cluster.holdings(others, ids, draining=leaving) if ids else {}
        cfg = self.local.config
        pending: set[str] = set()
        for cid in ids:
            answers = [h for h in held[cid] if h.node not in leaving]
            copies = sum(1 for h in answers if h.hot)
            frags = {i for h in answers for i in h.fragments}
            spread = len(frags) >= cfg.n and not self.leadership.exposed(
                {h.node: h.fragments for h in answers}, placement, without={*leaving, self.local.id}
            )
            if copies < cfg.replication and not spread:
                pending.add(cid)
        return {
            "node": self.local.id,
            "state": DRAINING if draining else ACTIVE,
            "chunks": len(hot),
            "fragments": sum(fragments.values()),
            "chunks_pending": sum(1 for c in hot if c in pending),
            "fragments_pending": sum(n for c, n in fragments.items() if c in pending),
            "can_leave": draining and quiet and not pending,
        }
