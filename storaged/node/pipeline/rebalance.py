"""Rebalance: copies and fragments move to where placement says, then the misplaced go.

After a join, or a node's return, placement differs from where data sits: readers still
find it (they walk the order), but a joiner holds nothing of the old data and the holders
of re-encoded fragments hold duplicates. The repair leader of a chunk that lacks nothing
(``pipeline/repair.py``) offers it here; a worker moves it, at ``rebalance_rate`` bytes per
second per node (apart from the repair pass, which must stay quick for what lacks copies):

- a cold chunk's fragment ``i`` to ``fragment_targets[i]`` (read from a holder, checked on
  write), then the other holders of ``i`` drop theirs;
- a not yet cold chunk whose copies are all on nvme: a copy to each of ``hot_targets``
  lacking one, then, once those are on nvme, the copies outside them go.

Nothing moves while a member is *away* (down for less than ``gone_after``): placement over
the live nodes skips it, so fragments would move away and back for a node that returns.

Relies on: the per-chunk locks, ``collecting`` (see ``index.py``); ``chunk_info`` reporting
a copy and pinning it in one step.

Upholds, the removal: a drop never takes a chunk below ``replication`` nvme copies (not
yet cold) or below one holder per fragment index, whatever membership each node sees.
The leader only *asks*; the holder ``H`` decides, under the chunk's lock:

1. ``H`` refuses while its own copy is *pinned* (see 3), or is being collected, or its
   RAM copy is not yet on disk.
2. It asks the witnesses it was given (``replication`` nodes other than ``H`` for a copy,
   one for a fragment) whether they hold the slot (an nvme copy, or fragment ``i``); each
   answer *pins* the witness's chunk for ``PIN_SECONDS`` (in the same step as the answer:
   no await between), and a pinned chunk is not dropped there.
3. If every witness holds it, the answers came within ``PIN_SECONDS / 2`` of asking, and
   ``H`` is still not pinned, ``H`` marks the slot dropping (``chunk_info`` reports it held
   by no one from then on) in that same step, and deletes it.

Why no two drops can both count each other: say ``H1`` counts ``H2`` and ``H2`` counts
``H1``. ``H2`` answered ``H1`` at ``t1`` (before ``H2`` marked dropping at ``d2``, else it
would have said "not held"), so ``t1 < d2``; likewise ``t2 < d1``. ``H1``'s answer at
``t2`` pinned ``H1`` until at least ``d1`` (``d1`` came within ``PIN_SECONDS / 2`` of
asking, and the pin lasts ``PIN_SECONDS`` from ``t2``, itself after the asking), and
``t2 < d1`` — so at ``d1`` ``H1`` was pinned, and step 3 refused. Hence of all the drops
that happen, none counts a copy that another drop removes: every drop leaves its
``replication`` (or one) witnesses in place, until their pins lapse, by when the drop is
done. Two nodes that disagree on membership (each thinks it leads, or that the other's
copy is the misplaced one) can at worst both refuse; the pins lapse and one wins later.

A PUT or a GC pass cannot count the dropped copy either: ``already_held`` and GC's checks
count what ``chunk_info`` reports (a slot dropping is not reported), a store of a new copy
waits for the chunk's lock, and a drop leaves at least ``replication`` copies (what an
ack promised) or every fragment index (what GC's nvme trim counts). Pins count as a use
(``last_use``), so GC keeps a witness's copy for another grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from erasure import fragment_key
from storaged.node.index import COLD, Holding
from storaged.node.pipeline import Workers
from storaged.peer import PeerError
from tiers import TierFull

if TYPE_CHECKING:
    from storaged.node.core import Node

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


class Rebalance:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.throttle = Throttle(node.config.rebalance_rate)
        #: chunk id -> monotonic time until which no slot of it may be dropped here
        self._pins: dict[str, float] = {}
        #: (chunk id, slot) being dropped here: reported held by no one
        self.dropping: set[tuple[str, int]] = set()
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._pending: set[str] = set()
        self._workers = Workers("rebalance", _WORKERS, self._worker)

    def start(self) -> None:
        self._workers.start()

    async def close(self) -> None:
        await self._workers.close()

    def offer(self, chunk_id: str) -> None:
        """Move ``chunk_id`` where placement says, if this node still leads it then."""
        if chunk_id not in self._pending:
            self._pending.add(chunk_id)
            self._queue.put_nowait(chunk_id)

    async def _worker(self) -> None:
        node = self.node
        while True:
            cid = await self._queue.get()
            try:
                if node.repairer.away:
                    continue  # placement skips the away member: wait for it (or for gone)
                held = (
                    await node.holdings(node.membership.alive_ids(), [cid], timeout=_ASK_TIMEOUT)
                )[cid]
                if node.repairer.leader(cid, held) == node.id and self.complete(held):
                    await self.rebalance_one(cid, held)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("rebalance of %s failed; the next repair pass offers it again", cid)
            finally:
                self._pending.discard(cid)

    def complete(self, held: list[Holding]) -> bool:
        """Whether the chunk lacks nothing (what lacks is repair's, at once and unpaced)."""
        cfg = self.node.config
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

    async def drop_misplaced(self, chunk_id: str, slot: int, witnesses: list[str]) -> bool:
        """Drop this node's copy (``slot`` ``HOT``) or fragment ``slot`` of ``chunk_id`` if
        the witnesses hold it (see the module docstring); True if it was dropped."""
        node = self.node
        others = sorted(set(witnesses) - {node.id})
        need = node.config.replication if slot == HOT else 1
        if len(others) < need:
            return False
        async with node.locks.hold(chunk_id):
            if chunk_id in node.collecting or self.pinned(chunk_id):
                return False
            if slot == HOT:
                if not node.nvme_has(chunk_id) or node.memory.is_dirty(chunk_id):
                    return False
            elif slot not in node.fragments.get(chunk_id, ()):
                return False
            asked = time.monotonic()
            held = (
                await node.holdings(others, [chunk_id], pin=PIN_SECONDS, timeout=PIN_SECONDS / 4)
            )[chunk_id]
            holding = {h.node for h in held if _holds(h, slot)}
            if len(holding) < need or len(holding) < len(others):
                return False
            if time.monotonic() - asked > PIN_SECONDS / 2 or self.pinned(chunk_id):
                return False
            self.dropping.add((chunk_id, slot))  # the same step as the checks above
            try:
                await self._delete(chunk_id, slot)
            finally:
                self.dropping.discard((chunk_id, slot))
        node.metrics.rebalanced.labels("dropped").inc()
        return True

    async def _delete(self, chunk_id: str, slot: int) -> None:
        node = self.node
        if slot == HOT:
            await node.memory.delete(chunk_id)
            await node.nvme.delete(chunk_id)
        else:
            await node.cold.delete(fragment_key(chunk_id, slot))
            node.forget_fragment(fragment_key(chunk_id, slot))
        held_here = node.holds_hot(chunk_id) or node.fragments.get(chunk_id)
        if not held_here and node.index.pop(chunk_id, None) is not None:
            await node.state_log.append([(chunk_id, 0, 0, 0.0)], sync=False)

    # ---- the leader side -------------------------------------------------------------------
    def misplaced(self, chunk_id: str, held: list[Holding]) -> list[tuple[str, int]]:
        """(holder, slot) pairs of ``chunk_id`` outside the current placement."""
        node = self.node
        state = max((h.state for h in held), default=0)
        if state >= COLD:
            targets = node.fragment_targets(chunk_id)
            return [(h.node, i) for h in held for i in h.fragments if targets[i] != h.node]
        hot = [h for h in held if h.hot]
        if not all(h.nvme for h in hot):
            return []  # copies still on their way to disk: the drain comes first
        placed = set(node.hot_targets(chunk_id))
        return [(h.node, HOT) for h in hot if h.node not in placed]

    async def rebalance_one(self, chunk_id: str, held: list[Holding]) -> None:
        """As the chunk's repair leader, with nothing lacking: move what ``misplaced`` names
        to its place (paced), then ask the misplaced holders to drop theirs."""
        node = self.node
        misplaced = self.misplaced(chunk_id, held)
        if not misplaced:
            return
        if any(slot == HOT for _, slot in misplaced):
            targets = node.hot_targets(chunk_id)
            if await self._place_copies(chunk_id, held, targets):
                for holder, _ in misplaced:
                    await self._ask_drop(holder, chunk_id, HOT, targets)
            return
        frag_targets = node.fragment_targets(chunk_id)
        for index in sorted({slot for _, slot in misplaced}):
            target = frag_targets[index]
            placed = any(h.node == target and index in h.fragments for h in held)
            if not placed:
                source = next(h.node for h in held if index in h.fragments)
                placed = await self._move_fragment(chunk_id, index, source, target)
            if placed:
                for holder, slot in misplaced:
                    if slot == index:
                        await self._ask_drop(holder, chunk_id, index, [target])

    async def _place_copies(self, chunk_id: str, held: list[Holding], targets: list[str]) -> bool:
        """True once every target holds an nvme copy (copies sent now count next pass)."""
        node = self.node
        on_nvme = {h.node for h in held if h.nvme}
        lacking = [t for t in targets if t not in {h.node for h in held if h.hot}]
        if not lacking:
            return all(t in on_nvme for t in targets)
        async with node.reads.local_copy(chunk_id) as local:
            data = local if local is not None else await node.reads.whole_copy(chunk_id)
            if data is None:
                return False
            view = memoryview(data)
            for target in lacking:
                await self.throttle.take(len(view))
                try:
                    if target == node.id:
                        await node.writes.keep_copy(chunk_id, view)
                    else:
                        await node.writes.push_copy(target, chunk_id, view)
                except (PeerError, TierFull) as exc:
                    log.warning("rebalance copy of %s to %s failed: %s", chunk_id, target, exc)
                    continue
                node.metrics.rebalanced_bytes.inc(len(view))
                node.metrics.rebalanced.labels("copy").inc()
        return False  # on nvme at the new holders only once drained: drops wait a pass

    async def _move_fragment(self, chunk_id: str, index: int, source: str, target: str) -> bool:
        node = self.node
        key = fragment_key(chunk_id, index)
        try:
            _, blob = await node.call(source, "get_fragment", {"key": key})
            if blob is None:
                return False
            await self.throttle.take(len(blob))
            info = node.index.get(chunk_id)
            size = info.size if info is not None else -1
            await node.call(target, "put_fragment", {"key": key, "size": size}, blob)
        except PeerError as exc:
            log.warning("rebalance of fragment %s to %s failed: %s", key, target, exc)
            return False
        node.metrics.rebalanced_bytes.inc(len(blob))
        node.metrics.rebalanced.labels("fragment").inc()
        return True

    async def _ask_drop(self, holder: str, chunk_id: str, slot: int, witnesses: list[str]) -> None:
        with contextlib.suppress(PeerError):
            await self.node.call(
                holder,
                "drop_misplaced",
                {"id": chunk_id, "slot": slot, "witnesses": witnesses},
                timeout=PIN_SECONDS,
            )


def _holds(h: Holding, slot: int) -> bool:
    return h.nvme if slot == HOT else slot in h.fragments
