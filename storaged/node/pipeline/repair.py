"""Repair: missing hot copies, missing fragments, and catalogue records short of holders.

Relies on: the referenced set's view of garbage (``node/referenced.py``: from a fresh
snapshot only; repair leaves garbage alone), the read path to find a whole
copy anywhere (a peer, or a decode from fragments).

Upholds **I6 progress**: every pass looks at every chunk this node knows of; the node that
leads a chunk's repair (the first in placement order holding a hot copy, or, without any,
the first holding fragments) brings it back to ``replication`` hot copies (not yet cold)
or ``n`` fragments (cold), getting the bytes from wherever they are. An under-replicated
chunk thus never waits on a node that cannot act (one holding only fragments).

A member down for less than ``gone_after`` is *away* (Ceph's down but in; HDFS's stale, not
yet dead): what it held on disk is expected back, so a chunk it may hold waits for it while
it can still lose one more holder: a cold chunk with at least ``k + 1`` live fragments, a
chunk durable on nvme (state ``nvme``) with at least two live copies. A RAM-only chunk is
copied at once (durability first), and so is any chunk with fewer. A member down for
longer is *gone* (Ceph's out; HDFS's dead): nothing waits for it, and on a coordinator
that can, its member record is removed (``Membership.forget``). A chunk that lacks nothing
but sits outside its placement is moved by ``pipeline/rebalance.py``; the backlog counts
the two apart (``lacking``, ``misplaced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.coord.catalogue import CatalogueUnavailable, CoordinatorUnavailable
from storaged.node.index import COLD, NVME, Holding
from storaged.node.pipeline.leadership import Leadership
from storaged.peer import PeerError
from storaged.placement import Placement
from tiers import TierFull

if TYPE_CHECKING:
    from storaged.coord.catalogue import Catalogue
    from storaged.node.pipeline.encode import Encoder
    from storaged.node.read import ReadPath
    from storaged.node.referenced import ReferencedSet
    from storaged.node.services import ClusterView, LocalStore, Rebalancing
    from storaged.node.write import WritePath

log = logging.getLogger("storaged.node.repair")


#: chunks repaired at once by one node (each may fetch k fragments and store some)
_PARALLEL = 8
#: a holder that does not answer a repair pass's question within this is skipped this pass
_ASK_TIMEOUT = 5.0

#: what ``repair_one`` found of a chunk it leads
LACKING = "lacking"
MISPLACED = "misplaced"


@dataclass(eq=False, repr=False)
class Repair:
    local: LocalStore
    cluster: ClusterView
    _: KW_ONLY
    leadership: Leadership
    reads: ReadPath
    writes: WritePath
    encoder: Encoder
    rebalance: Rebalancing
    referenced: ReferencedSet
    catalogue: Catalogue
    #: chunks this node leads the repair of that lacked something at the last pass
    backlog: int = field(default=0, init=False)
    #: chunks it leads that lacked nothing but sat (partly) outside their placement
    misplaced: int = field(default=0, init=False)
    #: when the last complete pass started (wall clock; None before the first): its
    #: backlogs describe the cluster as of then, not before
    last_pass_started: float | None = field(default=None, init=False)

    async def repair_pass(self) -> None:
        started = time.time()
        try:
            await self.catalogue.repair()
        except asyncio.CancelledError:
            raise
        except CatalogueUnavailable as exc:
            log.warning("catalogue repair: %s; the next pass tries again", exc)
        except Exception:
            log.exception("catalogue repair failed")
        away = await self._away_members()
        ids = list(self.local.index)
        lacking = misplaced = 0
        slots = asyncio.Semaphore(_PARALLEL)

        async def one(cid: str, held: list[Holding], placement: Placement) -> None:
            nonlocal lacking, misplaced
            async with slots:
                try:
                    found = await self.repair_one(cid, held, placement)
                except asyncio.CancelledError:
                    raise
                except CatalogueUnavailable as exc:
                    found = LACKING
                    log.warning("repair of %s: %s; the next pass tries again", cid, exc)
                except Exception:
                    found = LACKING
                    log.exception("repair of %s failed", cid)
                lacking += found == LACKING
                misplaced += found == MISPLACED

        for start in range(0, len(ids), 256):
            batch = ids[start : start + 256]
            placement = self.cluster.placement()  # one view per batch: its questions and repairs
            asked = placement.alive
            answered: set[str] = set()
            # A stalled holder must not hold up every other chunk's repair for long.
            held = await self.cluster.holdings(
                asked, batch, timeout=_ASK_TIMEOUT, answered=answered
            )
            # One that did not answer (just died, or stalled) is away too: what it holds is
            # missing from the answers, as an away member's is.
            self.leadership.away = away | frozenset(asked).difference(answered)
            await asyncio.gather(*(one(cid, held[cid], placement) for cid in batch))
        self.backlog = lacking
        self.misplaced = misplaced
        self.last_pass_started = started
        self.local.metrics.repair_backlog.set(lacking)
        self.local.metrics.misplaced_backlog.set(misplaced)

    async def _away_members(self) -> frozenset[str]:
        """Members down for less than ``gone_after``; those down for longer are forgotten
        where the membership can (etcd), and are not waited for either way."""
        membership = self.cluster.membership
        now = time.time()
        away = set()
        for node_id in membership.all_ids():
            since = membership.down_since(node_id)
            if since is None and not membership.is_alive(node_id):
                since = now  # down, since when unknown: as if from now
            if since is None:
                continue
            if now - since < self.local.config.gone_after:
                away.add(node_id)
                continue
            try:
                await membership.forget(node_id)
            except CoordinatorUnavailable as exc:
                log.warning("cannot remove gone member %s now: %s", node_id, exc)
        return frozenset(away)

    async def repair_one(
        self, chunk_id: str, held: list[Holding], placement: Placement
    ) -> str | None:
        """Repair ``chunk_id`` if this node leads it; ``LACKING`` if it lacked copies or
        fragments (repaired, or waiting for an away member), ``MISPLACED`` if it lacked
        nothing but some of it sat outside its placement (moved, paced), else None.

        ``held`` is what the live nodes of ``placement`` (the caller's one view) reported.
        Evacuation: copies and fragments on draining nodes do not count toward
        ``replication`` or ``n``; they are copied to where placement without those nodes
        says, and a draining holder may lead (it has the bytes)."""
        cfg = self.local.config
        info = self.local.index.get(chunk_id)
        if info is not None and self.referenced.is_garbage(chunk_id, info.last_use):
            return None  # garbage waiting for GC: copying it back would undo the collection
        staying = [h for h in held if not placement.is_draining(h.node)]
        state = max((h.state for h in held), default=0)
        frags = {i for h in held for i in h.fragments}
        if state >= COLD and len(frags) >= cfg.n and info is not None and info.state < COLD:
            # A copy that arrived while the chunk was being encoded (a rebalance or repair
            # copy) missed the encoder's "cold": without it GC would keep it on nvme forever.
            await self.local.record_state([chunk_id], COLD)
        if self.leadership.leader(chunk_id, held, placement) != self.local.id:
            return None
        cold = state >= COLD or len(frags) >= cfg.n
        missing = set(range(cfg.n)) - {i for h in staying for i in h.fragments} if cold else set()
        if missing and not self._can_spread(placement):
            # Too few placeable nodes to hold the missing fragments (a cluster of about
            # ``n`` nodes with one draining or gone): keep the chunk as a hot one instead,
            # at ``replication`` copies on the nodes that stay, until nodes are back.
            cold = False
        if cold:
            return await self._repair_cold(chunk_id, held, placement, missing)
        return await self._repair_hot(chunk_id, held, placement, missing)

    async def _repair_cold(
        self, chunk_id: str, held: list[Holding], placement: Placement, missing: set[int]
    ) -> str | None:
        """A cold chunk: the ``missing`` fragment indexes (none on a node that stays) are
        stored anew, fragments concentrated beyond one loss move at once, and what lies
        outside the placement goes to the rebalance."""
        cfg = self.local.config
        frags = {i for h in held for i in h.fragments}
        if missing and self.leadership.away and len(frags) >= cfg.k + 1:
            # The away member likely holds them: wait (see the docstring), except for
            # what a draining node holds: that must leave now, away member or not.
            on_draining = {i for h in held if placement.is_draining(h.node) for i in h.fragments}
            if not missing & on_draining:
                return LACKING
            missing &= on_draining
        if missing:
            await self._restore_fragments(chunk_id, held, placement, missing)
            return LACKING
        spread = {h.node: h.fragments for h in held if not placement.is_draining(h.node)}
        if self.leadership.exposed(spread, placement, at_most=1):
            # Every index present, but one node's loss would leave fewer than k: not the
            # paced rebalance's to fix in its own time. Each index goes to its target
            # now (the bytes as they are); the rebalance drops the extras later. (Below
            # the failure model only for two losses, as after a fifth node's return to
            # six, it is misplaced: the rebalance moves it, paced, as for a join.)
            await self._move_fragments(chunk_id, held, placement, set(range(cfg.n)))
            return LACKING
        return self._rebalance(chunk_id, held, placement)

    async def _restore_fragments(
        self, chunk_id: str, held: list[Holding], placement: Placement, missing: set[int]
    ) -> None:
        """Store the ``missing`` fragment indexes on their targets: encoded from a whole
        copy (here, or rebuilt from ``k`` fragments), or, without a copy here, a draining
        node's fragments moved as they are."""
        async with self.reads.local_copy(chunk_id) as local:
            if local is None:
                # No whole copy here: a draining node's fragments move as they are
                # (one read each, not k reads and an encode).
                missing -= await self._move_fragments(chunk_id, held, placement, missing)
            data = local
            if data is None and missing:
                data = await self.reads.rebuild(chunk_id, placement)
            if data is not None and await self.encoder.encode_and_spread(
                chunk_id, data, placement, missing
            ):
                self.local.metrics.repaired.labels("fragment").inc(len(missing))

    async def _repair_hot(
        self, chunk_id: str, held: list[Holding], placement: Placement, missing: set[int]
    ) -> str | None:
        """A chunk kept hot: copies up to ``replication`` on its hot targets; once it has
        them, on to the encoder (owner side) and the rebalance. ``missing``: the fragment
        indexes of a cold chunk whose fragments cannot be placed now."""
        cfg = self.local.config
        kept = {h.node for h in held if h.hot and not placement.is_draining(h.node)}
        lacking = [n for n in placement.hot_targets(chunk_id) if n not in kept]
        if missing and len(kept) >= cfg.replication:
            return None  # cold, fragments unplaceable now, and safe as a hot chunk
        if len(kept) >= cfg.replication or not lacking:
            owner = placement.owner(chunk_id)
            if all(h.nvme for h in held if h.hot) and owner is not None:
                self.encoder.offer(chunk_id)  # owner side: encode when ready
                if owner != self.local.id:
                    with contextlib.suppress(PeerError):
                        await self.cluster.drained(owner, chunk_id)
            return self._rebalance(chunk_id, held, placement)
        state = max((h.state for h in held), default=0)
        if self.leadership.away and state >= NVME and len(kept) >= 2:
            return LACKING  # durable on the away member's disk too: wait for it
        await self._copy_to(chunk_id, placement, lacking[: cfg.replication - len(kept)])
        return LACKING

    async def _copy_to(self, chunk_id: str, placement: Placement, targets: list[str]) -> None:
        """A whole copy of the chunk (from here, a peer, or decoded) to each of ``targets``;
        a target that fails is logged and left for the next pass."""
        async with self.reads.local_copy(chunk_id) as local:
            data = local if local is not None else await self.reads.whole_copy(chunk_id, placement)
            if data is None:
                log.warning("repair of %s: no copy and too few fragments to read", chunk_id)
                return
            view = memoryview(data)
            for target in targets:
                try:
                    if target == self.local.id:
                        await self.writes.keep_copy(chunk_id, view)
                    else:
                        await self.writes.push_copy(target, chunk_id, view)
                    self.local.metrics.repaired.labels("copy").inc()
                except (PeerError, TierFull) as exc:
                    log.warning("repair copy of %s to %s failed: %s", chunk_id, target, exc)

    def _can_spread(self, placement: Placement) -> bool:
        """Whether the placeable nodes can hold ``n`` fragments with at most ``n - k`` on
        any one (the encoder's own rule: ``pipeline/encode.py``)."""
        cfg = self.local.config
        nodes = len(placement.placeable)
        return nodes > 0 and math.ceil(cfg.n / nodes) <= cfg.n - cfg.k

    async def _move_fragments(
        self, chunk_id: str, held: list[Holding], placement: Placement, missing: set[int]
    ) -> set[int]:
        """Copy the fragments of ``missing`` that are not on their targets in ``placement``
        there, bytes as they are, from a holder (a draining one first: its copy is about
        to leave); the indexes moved. The target checks each fragment against its
        header's checksum (``put_fragment``), as for an encode."""
        targets = placement.fragment_targets(chunk_id)
        if not targets:
            return set()
        size = max((h.size for h in held), default=-1)
        placed = {(h.node, i) for h in held for i in h.fragments}
        sources: dict[int, str] = {}
        for h in sorted(held, key=lambda h: not placement.is_draining(h.node)):
            for i in h.fragments:
                if (targets[i], i) not in placed:
                    sources.setdefault(i, h.node)

        async def move(index: int) -> bool:
            key = fragment_key(chunk_id, index)
            try:
                blob = await self.cluster.get_fragment(sources[index], key)
                if blob is None:
                    return False
                await self.cluster.put_fragment(targets[index], key, size, blob)
            except PeerError as exc:
                log.warning("moving fragment %s to %s failed: %s", key, targets[index], exc)
                return False
            return True

        wanted = sorted(i for i in missing if i in sources)
        moved = await asyncio.gather(*(move(i) for i in wanted))
        done = {i for i, ok in zip(wanted, moved, strict=True) if ok}
        if done:
            self.local.metrics.repaired.labels("fragment_moved").inc(len(done))
        return done

    def _rebalance(self, chunk_id: str, held: list[Holding], placement: Placement) -> str | None:
        """Move what lies outside the placement; not while a member is away (placement over
        the live nodes skips it: what moved would move back on its return)."""
        rebalance = self.rebalance
        if not rebalance.misplaced(chunk_id, held, placement):
            # Nothing to move now, but a copy outside the placement may still wait for the
            # new holders' copies to reach disk (its drop comes a pass later): misplaced
            # still, or the backlog would say 0 while the cluster holds a copy too many.
            return MISPLACED if _hot_copy_outside(held, placement, chunk_id) else None
        if not self.leadership.away:
            rebalance.offer(chunk_id)
        return MISPLACED


def _hot_copy_outside(held: list[Holding], placement: Placement, chunk_id: str) -> bool:
    """Whether a chunk not yet cold has a copy on a node outside its hot targets (a
    draining node's is evacuation's, not counted)."""
    if max((h.state for h in held), default=0) >= COLD:
        return False
    targets = set(placement.hot_targets(chunk_id))
    return any(h.hot and h.node not in targets and not placement.is_draining(h.node) for h in held)
