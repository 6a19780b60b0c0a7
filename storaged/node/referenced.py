"""The referenced set: which chunks committed checkpoints name, as of a snapshot of known age.

Every stage that asks "is this chunk unreferenced?" asks this one service: GC before it
collects, repair before it leaves a chunk alone, evacuation before it lets a chunk go
uncounted, rebalance for the retained copies. It is fed by GC's passes (``update`` after a
complete catalogue snapshot, ``failed`` after a pass that could not get one).

Upholds **one freshness rule** (I3 for every consumer, not only for GC): a chunk counts as
unreferenced only from a complete snapshot taken less than ``fresh_for`` seconds ago
(``gc_grace / 2``, the bound within which GC itself may act on a snapshot: see
``pipeline/gc.py``). Past that bound, and before the first complete snapshot, *every*
chunk counts as referenced: a consumer that cannot know fails safe. Without this rule a
GC that stopped completing passes (etcd out of reach, a damaged record, an incomplete
embedded snapshot) left the last snapshot in force, and every chunk committed after it
counted as garbage for repair and for ``can_leave`` for as long as the stall lasted.

It also keeps the *stall* on record: GC that has not completed a pass for longer than the
grace is stalled (``status()``: since when and why), which the node reports in its
heartbeat, ``/v1/cluster``, ``storaged nodes`` and its metrics, and logs at WARN on each
failed pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from storaged.coord.catalogue import References


@dataclass(frozen=True)
class Snapshot:
    """One complete catalogue snapshot: the chunks it names and when it was taken."""

    chunks: frozenset[str]
    #: chunks of the ``retain_newest`` newest checkpoints per prefix, as of the snapshot
    protected: frozenset[str]
    taken_at: float


class ReferencedSet:
    def __init__(
        self, fresh_for: float, grace: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        #: a snapshot is acted on only while younger than this (GC's own bound)
        self.fresh_for = fresh_for
        #: GC not completing a pass for longer than this is a stall
        self.grace = grace
        self._clock = clock
        self._last: Snapshot | None = None
        #: when the first pass failed since the last complete one (None: none failed)
        self._failing_since: float | None = None
        self._cause: str | None = None
        self._failed = 0
        self.started = clock()

    # ---- fed by GC -------------------------------------------------------------------------
    def update(self, refs: References, protected: frozenset[str]) -> Snapshot:
        """A complete snapshot arrived: it is the one in force from now."""
        snapshot = Snapshot(refs.chunks, protected, refs.taken_at)
        self._last = snapshot
        self._failing_since = None
        self._cause = None
        return snapshot

    def failed(self, cause: str) -> None:
        """A pass could not take a complete snapshot (``cause`` says why)."""
        if self._failing_since is None:
            self._failing_since = self._clock()
        self._cause = cause
        self._failed += 1

    # ---- asked by every stage --------------------------------------------------------------
    def fresh(self) -> Snapshot | None:
        """The snapshot in force if it is young enough to act on, else None."""
        s = self._last
        if s is None or self._clock() - s.taken_at >= self.fresh_for:
            return None
        return s

    def is_unreferenced(self, chunk_id: str) -> bool:
        """True only if a fresh complete snapshot does not name ``chunk_id``. False when
        it names it, and False (fail safe) when no snapshot is fresh."""
        s = self.fresh()
        return s is not None and chunk_id not in s.chunks

    def is_garbage(self, chunk_id: str, last_use: float) -> bool:
        """What GC may take: unreferenced in a fresh snapshot, and unused on this node
        (``last_use``, the index's) for longer than the grace."""
        return self.is_unreferenced(chunk_id) and self._clock() - last_use > self.grace

    def is_protected(self, chunk_id: str) -> bool:
        """Whether the chunk belongs to a retained newest checkpoint, as of the last
        snapshot however old (a stale answer moves a retained copy late or not at all,
        never loses one: GC trims only from a fresh snapshot)."""
        s = self._last
        return s is not None and chunk_id in s.protected

    # ---- the alarm -------------------------------------------------------------------------
    @property
    def last_pass(self) -> float | None:
        """When the last complete snapshot was taken."""
        return None if self._last is None else self._last.taken_at

    @property
    def failed_passes(self) -> int:
        return self._failed

    def stalled_since(self) -> float | None:
        """Since when GC has been stalled: no complete pass for longer than the grace.
        None while it is not (a failing pass younger than the grace is not yet a stall)."""
        if self._failing_since is None:
            return None
        now = self._clock()
        since = self._last.taken_at if self._last is not None else self.started
        if now - since <= self.grace:
            return None
        return since if self._last is not None else self._failing_since

    def status(self) -> dict[str, Any]:
        """What the node reports: ``last_pass`` (the last complete snapshot's time),
        ``stalled_since`` and ``cause`` (None unless stalled), ``failed_passes``."""
        stalled = self.stalled_since()
        return {
            "last_pass": self.last_pass,
            "stalled_since": stalled,
            "cause": self._cause if stalled is not None else None,
            "failed_passes": self._failed,
        }
