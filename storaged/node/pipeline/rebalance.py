"""Rebalance: copies and fragments move to where placement says, then the misplaced go.

After a join, or a node's return, placement differs from where data sits: readers still
find it (they walk the order), but a joiner holds nothing of the old data and the holders
of re-encoded fragments hold duplicates. The repair leader of a chunk that lacks nothing
(``pipeline/repair.py``) offers it here; a worker moves it, at ``rebalance_rate`` bytes per
second per node (apart from the repair pass, which must stay quick for what lacks copies):

- a cold chunk's fragment ``i`` to ``fragment_targets[i]`` (read from a holder, checked on
  write), then the other holders of ``i`` drop theirs;
- a not yet cold chunk whose copies are all on nvme: a copy to each of ``hot_targets``
  lacking one, then, once those are on nvme, the copies outside them go;
- the nvme copy retention keeps of a cold chunk of a newest checkpoint: to its owner, when
  the owner changed (the old owner's GC then trims its own, as for any non-owner). Only a
  copy that exists moves: one that GC trimmed first is not rebuilt, nor one an admin evicted.

Nothing moves while a member is *away* (down for less than ``gone_after``): placement over
the live nodes skips it, so fragments would move away and back for a node that returns.

Relies on: the per-chunk locks and ``collecting`` (``index.py``); the disk tiers' check of
every read (a corrupt file is quarantined and reads as absent).

Upholds, for the removal: a drop never takes a chunk below ``replication`` verified nvme
copies (not yet cold) or below one verified holder of each fragment index (cold), whatever
membership each node sees. The leader only *asks* (``drop_misplaced``); the holder ``H``
decides, under the chunk's lock:

1. ``H`` refuses while its chunk is *pinned* (3), being collected, or its RAM copy is not
   on disk yet.
2. It asks each witness it was given (the ``replication`` placement targets of a copy, or
   the new holder of fragment ``i``) to *witness* the slot: the witness reads it from disk
   (checked on read), and then, in one step with no await (so nothing can remove it in
   between), checks the slot is still held and not being dropped or collected, *pins* its
   chunk for ``PIN_SECONDS`` (no slot of it is dropped there meanwhile) and answers held.
3. If every witness (at least ``replication``, or one, other than ``H``) answered held
   within ``PIN_SECONDS / 2`` of asking, and ``H`` is still not pinned, ``H`` marks the slot
   dropping (``chunk_info`` reports it held by no one from then on) in that same step,
   and deletes it.

Why no drop can count a copy that another drop removes (the case of two nodes that each
think the other's copy is the misplaced one, because they see different memberships, or
both believe they lead): take two drops, by ``H1`` counting ``H2`` and by ``H2``, decided at
``d2 < d1``. ``H2`` witnessed for ``H1`` at some ``t`` with ``t < d2`` (at ``t`` it did not yet
drop) and ``t`` after ``H1`` asked; ``d1`` is within ``PIN_SECONDS / 2`` of that asking. So
``t < d2 < d1 < t + PIN_SECONDS / 2``: ``H2`` was pinned at ``d2`` and refused — a
contradiction. Hence each drop leaves its witnesses' slots in place (GC keeps them too: a
witness answer counts as a use), and a drop leaves ``replication`` copies or one holder of
the index. At worst two disagreeing nodes both refuse; the pins lapse and one goes later.
(Pins are durations on each node's own monotonic clock: no clock needs to agree.)

A PUT or GC cannot count the dropped copy either: ``already_held`` and GC's nvme trim count
what ``chunk_info`` reports (a slot being dropped is not reported); a new copy's store waits
for the chunk's lock; and what is left is what an ack promises (``replication`` copies) or
what the trim needs (every fragment index).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.coord.catalogue import CatalogueUnavailable
from storaged.node.index import COLD, Holding
from storaged.node.pipeline import ChunkWorkers
from storaged.node.pipeline.leadership import Leadership
from storaged.peer import PeerError
from storaged.placement import Placement
from tiers import ChunkNotFound, CorruptChunk, TierFull

if TYPE_CHECKING:
    from storaged.node.read import ReadPath
    from storaged.node.referenced import ReferencedSet
    from storaged.node.services import ClusterView, LocalStore
    from storaged.node.write import WritePath

log = logging.getLogger("storaged.node.rebalance")

#: how long a witness's answer keeps its copy from being dropped (see the module docstring)
PIN_SECONDS = 20.0
#: the slot of a whole (hot) copy; fragments are slots 0 .. n-1
HOT = -1
#: chunks moved at once: the throttle paces them; two keep one slow peer from idling it
_WORKERS = 2
#: a holder that does not answer within this is skipped (the chunk comes back next pass)
_ASK_TIMEOUT = 5.0


class Throttle:
    """Paces transfers to ``rate`` bytes per second: a transfer of ``size`` bytes waits
    until the ones before it would have taken their time at that rate. By any time ``T``
    after the first, at most ``rate * T`` bytes plus one transfer have started."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._free_at = 0.0

    async def take(self, size: int) -> None:
        now = time.monotonic()
        start = max(self._free_at, now)
        self._free_at = start + size / self.rate
        if start > now:
            await asyncio.sleep(start - now)


class Rebalance(ChunkWorkers):
    def __init__(
        self,
        local: LocalStore,
        cluster: ClusterView,
        *,
        leadership: Leadership,
        reads: ReadPath,
        writes: WritePath,
        referenced: ReferencedSet,
    ) -> None:
        super().__init__("rebalance", _WORKERS, pending_while_handled=True)
        self.local = local
        self.cluster = cluster
        self.leadership = leadership
        self.reads = reads
        self.writes = writes
        self.referenced = referenced
        self.throttle = Throttle(local.config.rebalance_rate)
        #: chunk id -> monotonic time until which no slot of it may be dropped here
        self._pins: dict[str, float] = {}
        #: (chunk id, slot) being dropped here: reported held by no one
        self.dropping: set[tuple[str, int]] = set()

    def offer(self, chunk_id: str) -> None:
        """Move ``chunk_id`` where placement says, if this node still leads it then."""
        super().offer(chunk_id)

    async def handle(self, chunk_id: str) -> None:
        if self.leadership.away:
            return  # placement skips the away member: wait for it (or for gone)
        placement = self.cluster.placement()  # one view for this chunk's move
        held = (await self.cluster.holdings(placement.alive, [chunk_id], timeout=_ASK_TIMEOUT))[
            chunk_id
        ]
        leads = self.leadership.leader(chunk_id, held, placement) == self.local.id
        if leads and self.complete(held):
            await self.rebalance_one(chunk_id, held, placement)

    def failed(self, chunk_id: str, exc: Exception) -> None:
        if isinstance(exc, CatalogueUnavailable):
            log.warning("rebalance of %s: %s; the next repair pass offers it again", chunk_id, exc)
        else:
            log.exception("rebalance of %s failed; the next repair pass offers it again", chunk_id)

    def complete(self, held: list[Holding]) -> bool:
        """Whether the chunk lacks nothing (what lacks is repair's, at once and unpaced)."""
        cfg = self.local.config
        if max((h.state for h in held), default=0) >= COLD:
            return len({i for h in held for i in h.fragments}) >= cfg.n
        return sum(1 for h in held if h.hot) >= cfg.replication

    # ---- pins (the holder and witness side) ------------------------------------------------
    def pin(self, chunk_id: str, seconds: float) -> None:
        until = time.monotonic() + min(seconds, PIN_SECONDS)
        if until > self._pins.get(chunk_id, 0.0):
            self._pins[chunk_id] = until
        if len(self._pins) > 4096:
            now = time.monotonic()
            self._pins = {c: t for c, t in self._pins.items() if t > now}

    def pinned(self, chunk_id: str) -> bool:
        return self._pins.get(chunk_id, 0.0) > time.monotonic()

    async def witness(self, chunk_id: str, slot: int, seconds: float) -> bool:
        """Whether this node holds ``slot`` of ``chunk_id`` (read back and checked); if so,
        no slot of the chunk is dropped here for ``seconds`` (at most ``PIN_SECONDS``)."""
        try:
            if slot == HOT:
                await self.local.nvme.get(chunk_id)
            else:
                await self.local.cold.get(fragment_key(chunk_id, slot))
        except CorruptChunk:
            self.local.metrics.corrupt.labels("cold" if slot != HOT else "nvme").inc()
            if slot != HOT:
                self.local.forget_fragment(fragment_key(chunk_id, slot))
            return False
        except ChunkNotFound:
            return False
        except OSError as exc:
            # An unreadable disk (EIO, a data dir gone): no sound copy to witness.
            log.warning("witness of %s slot %d: cannot read it: %s", chunk_id, slot, exc)
            return False
        # From here to the answer, one step: the pin is in force before anyone hears "held".
        held = (
            self.local.nvme_has(chunk_id)
            if slot == HOT
            else slot in self.local.fragments.get(chunk_id, ())
        )
        if not held or chunk_id in self.local.collecting or (chunk_id, slot) in self.dropping:
            return False
        self.pin(chunk_id, seconds)
        info = self.local.index.get(chunk_id)
        if info is not None:
            info.touch(time.time())  # a use: GC keeps the witnessed copy another grace period
        return True

    async def drop_misplaced(self, chunk_id: str, slot: int, witnesses: list[str]) -> bool:
        """Drop this node's copy (``slot`` ``HOT``) or fragment ``slot`` of ``chunk_id`` if
        every witness holds it (see the module docstring); True if it was dropped."""
        others = sorted(set(witnesses) - {self.local.id})
        if len(others) < (self.local.config.replication if slot == HOT else 1):
            return False
        async with self.local.locks.hold(chunk_id):
            if chunk_id in self.local.collecting or self.pinned(chunk_id):
                return False
            if slot == HOT:
                # Any tier state: on nvme only (evicted from RAM), or with a clean RAM copy
                # too; a RAM copy not yet on disk refuses.
                if not self.local.nvme_has(chunk_id) or self._dirty_in_ram(chunk_id):
                    return False
            elif slot not in self.local.fragments.get(chunk_id, ()):
                return False
            asked = time.monotonic()

            async def held_by(witness: str) -> bool:
                try:
                    return await self.cluster.witness(
                        witness, chunk_id, slot, PIN_SECONDS, timeout=PIN_SECONDS / 4
                    )
                except PeerError:
                    return False

            answers = await asyncio.gather(*(held_by(w) for w in others))
            if not all(answers) or time.monotonic() - asked > PIN_SECONDS / 2:
                return False
            if self.pinned(chunk_id):
                return False
            self.dropping.add((chunk_id, slot))  # the same step as the check just above
            try:
                await self._delete(chunk_id, slot)
            finally:
                self.dropping.discard((chunk_id, slot))
        self.local.metrics.rebalanced.labels("dropped").inc()
        log.info(
            "dropped misplaced %s of %s", "copy" if slot == HOT else f"fragment {slot}", chunk_id
        )
        return True

    def _dirty_in_ram(self, chunk_id: str) -> bool:
        """Whether this node's RAM holds a copy of ``chunk_id`` not yet on disk (False when
        RAM holds none: ``is_dirty`` raises for a key it does not have)."""
        memory = self.local.memory
        return memory.has(chunk_id) and memory.is_dirty(chunk_id)

    async def _delete(self, chunk_id: str, slot: int) -> None:
        if slot == HOT:
            await self.local.memory.delete(chunk_id)
            await self.local.nvme.delete(chunk_id)
        else:
            await self.local.cold.delete(fragment_key(chunk_id, slot))
            self.local.forget_fragment(fragment_key(chunk_id, slot))
        held_here = self.local.holds_hot(chunk_id) or self.local.fragments.get(chunk_id)
        if not held_here and self.local.index.pop(chunk_id, None) is not None:
            await self.local.state_log.append([(chunk_id, 0, 0, 0.0)], sync=False)

    # ---- the leader side -------------------------------------------------------------------
    def misplaced(
        self, chunk_id: str, held: list[Holding], placement: Placement
    ) -> list[tuple[str, int]]:
        """(holder, slot) pairs of ``chunk_id`` outside ``placement``. A draining holder's
        are not named: evacuation copies them (``repair.py``), and they leave with it."""
        state = max((h.state for h in held), default=0)
        staying = [h for h in held if not placement.is_draining(h.node)]
        owner = placement.owner(chunk_id)
        if state >= COLD:
            targets = placement.fragment_targets(chunk_id)
            if not targets:
                return []  # no placeable node: nowhere to move to
            out = [(h.node, i) for h in staying for i in h.fragments if targets[i] != h.node]
            keepers = [h.node for h in staying if h.hot]
            protected = self.referenced.is_protected(chunk_id)
            if protected and keepers and owner is not None and owner not in keepers:
                out += [(n, HOT) for n in keepers]  # the retained copy, away from its owner
            return out
        hot = [h for h in held if h.hot]
        if not all(h.nvme for h in hot):
            return []  # copies still on their way to disk: the drain comes first
        placed = set(placement.hot_targets(chunk_id))
        return [(h.node, HOT) for h in staying if h.hot and h.node not in placed]

    async def rebalance_one(self, chunk_id: str, held: list[Holding], placement: Placement) -> None:
        """As the chunk's repair leader, with nothing lacking: move what ``misplaced`` names
        to its place (paced), then ask the misplaced holders to drop theirs."""
        misplaced = self.misplaced(chunk_id, held, placement)
        if not misplaced:
            return
        cold = max((h.state for h in held), default=0) >= COLD
        owner = placement.owner(chunk_id)
        if cold and owner is not None and any(slot == HOT for _, slot in misplaced):
            # No drop: once the owner has it, the other holders' GC trims theirs.
            await self._place_copies(chunk_id, held, [owner])
        if not cold and any(slot == HOT for _, slot in misplaced):
            targets = placement.hot_targets(chunk_id)
            if await self._place_copies(chunk_id, held, targets):
                for holder, _ in misplaced:
                    await self._ask_drop(holder, chunk_id, HOT, targets)
            return
        frag_targets = placement.fragment_targets(chunk_id)
        # What the drops leave, as this pass counts it: no drop may leave the fragments
        # more concentrated than the failure model allows (a holder of misplaced indexes
        # that became the only holder of one more), or repair would move it straight back.
        left = {h.node: set(h.fragments) for h in held if not placement.is_draining(h.node)}
        for index in sorted({slot for _, slot in misplaced if slot != HOT}):
            target = frag_targets[index]
            placed = any(h.node == target and index in h.fragments for h in held)
            if not placed:
                source = next(h.node for h in held if index in h.fragments)
                placed = await self._move_fragment(chunk_id, index, source, target)
                if placed:
                    left.setdefault(target, set()).add(index)
            if placed:
                for holder, slot in misplaced:
                    if slot != index:
                        continue
                    after = {n: f - {index} if n == holder else f for n, f in left.items()}
                    if self.leadership.exposed(after, placement):
                        continue
                    if await self._ask_drop(holder, chunk_id, index, [target]):
                        left = after

    async def _place_copies(self, chunk_id: str, held: list[Holding], targets: list[str]) -> bool:
        """True once every target holds an nvme copy (copies sent now count next pass)."""
        on_nvme = {h.node for h in held if h.nvme}
        lacking = [t for t in targets if t not in {h.node for h in held if h.hot}]
        if not lacking:
            return all(t in on_nvme for t in targets)
        async with self.reads.local_copy(chunk_id) as local:
            data = local if local is not None else await self.reads.whole_copy(chunk_id)
            if data is None:
                return False
            view = memoryview(data)
            for target in lacking:
                await self.throttle.take(len(view))
                try:
                    if target == self.local.id:
                        await self.writes.keep_copy(chunk_id, view)
                    else:
                        await self.writes.push_copy(target, chunk_id, view)
                except (PeerError, TierFull) as exc:
                    log.warning("rebalance copy of %s to %s failed: %s", chunk_id, target, exc)
                    continue
                self.local.metrics.rebalanced_bytes.inc(len(view))
                self.local.metrics.rebalanced.labels("copy").inc()
        return False  # on nvme at the new holders only once drained: drops wait a pass

    async def _move_fragment(self, chunk_id: str, index: int, source: str, target: str) -> bool:
        key = fragment_key(chunk_id, index)
        try:
            blob = await self.cluster.get_fragment(source, key)
            if blob is None:
                return False
            await self.throttle.take(len(blob))
            info = self.local.index.get(chunk_id)
            size = info.size if info is not None else -1
            await self.cluster.put_fragment(target, key, size, blob)
        except PeerError as exc:
            log.warning("rebalance of fragment %s to %s failed: %s", key, target, exc)
            return False
        self.local.metrics.rebalanced_bytes.inc(len(blob))
        self.local.metrics.rebalanced.labels("fragment").inc()
        return True

    async def _ask_drop(self, holder: str, chunk_id: str, slot: int, witnesses: list[str]) -> bool:
        """Whether ``holder`` says it dropped the slot (False also when it did not answer)."""
        try:
            return await self.cluster.drop_misplaced(
                holder, chunk_id, slot, witnesses, timeout=PIN_SECONDS
            )
        except PeerError:
            return False
