"""Room on the disk tiers: whether this node's nvme and cold tiers can take writes.

A tier is **full** from the moment a write to it fails for room (``TierFull``: the
configured capacity reached, or ENOSPC/EDQUOT from the filesystem), and stays full until
a write to it succeeds or a probe of the filesystem finds room for that write again. A
tier is **nearly full** when what it can still take is at most ``NEARLY_FULL`` of its
room in all (its bytes plus what it can still take, by capacity or by the filesystem's
free space, whichever is less).

Relies on: the drain, the encode's fragment stores and the fragment peer calls telling it
each write's outcome (``note_full``, ``note_written``), and ``refresh`` being run every
second or so (``os.statvfs`` in a thread: never on the event loop).

Upholds: the write path refuses a PUT that waits for RAM only a full nvme could free
(``storaged.node.write``) with ``nvme_full`` instead of making it sit out ``put_wait``;
every node's heartbeat carries each tier's mark (``marks``), so ``/v1/cluster``,
``?status`` and ``storaged nodes`` show it on every node.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tiers import TierFull, TierUsage

#: a tier that can take at most this share of its room in all is nearly full
NEARLY_FULL = 0.05

OK, NEARLY, FULL = "ok", "nearly_full", "full"
#: room beyond the failed write's size that clears a full mark
_MARGIN = 1 << 20


class DiskTier(Protocol):
    """What this needs of a disk tier: where it lives, and its usage."""

    root: Path

    def usage(self) -> TierUsage: ...


@dataclass(slots=True)
class _Full:
    since: float  # epoch seconds
    cause: str
    #: bytes of the write that failed: room for that much again clears the mark
    size: int


class DiskSpace:
    """The full / nearly-full marks of a node's disk tiers (``nvme``, ``cold``)."""

    def __init__(self, tiers: dict[str, DiskTier]) -> None:
        self._tiers = tiers
        self._full: dict[str, _Full] = {}
        #: bytes each tier can take now (by capacity and the filesystem), as last probed
        self._room: dict[str, int] = {}

    def note_full(self, tier: str, exc: TierFull, size: int) -> None:
        """A write of ``size`` bytes to ``tier`` failed for room."""
        mark = self._full.get(tier)
        if mark is None:
            self._full[tier] = _Full(time.time(), str(exc), size)
        else:
            mark.cause, mark.size = str(exc), min(mark.size, size)

    def note_written(self, tier: str) -> None:
        """A write to ``tier`` succeeded: it has room again."""
        self._full.pop(tier, None)

    def full(self, tier: str) -> bool:
        return tier in self._full

    def state(self, tier: str) -> str:
        if tier in self._full:
            return FULL
        room = self._room.get(tier)
        if room is None:
            return OK
        used = self._tiers[tier].usage().used
        return NEARLY if room <= NEARLY_FULL * (used + room) else OK

    def mark(self, tier: str) -> dict[str, Any]:
        """What the heartbeat says of ``tier``: ``state``, ``free`` (bytes it can still take,
        null before the first probe), ``full_since`` and ``cause`` (null unless full)."""
        full = self._full.get(tier)
        return {
            "state": self.state(tier),
            "free": self._room.get(tier),
            "full_since": full.since if full else None,
            "cause": full.cause if full else None,
        }

    def describe(self, tier: str) -> str:
        """``"full since HH:MM:SS (cause)"`` for a full tier's refusals."""
        full = self._full.get(tier)
        if full is None:
            return "not full"
        return f"full for {time.time() - full.since:.0f} s ({full.cause})"

    async def refresh(self) -> None:
        """Probe each tier's room (in a thread); a full tier with room for the write that
        failed is full no more (space was freed: the next drain retry will succeed)."""
        for name, tier in self._tiers.items():
            try:
                free = await asyncio.to_thread(_fs_free, str(tier.root))
            except OSError:
                continue  # the tier's own writes will say what is wrong
            u = tier.usage()
            room = max(0, min(u.capacity - u.used, free))
            self._room[name] = room
            full = self._full.get(name)
            # With a margin: a file costs a header and metadata blocks besides its bytes,
            # and a mark cleared too early only flaps back at the next failed write.
            if full is not None and room >= full.size + max(full.size, _MARGIN):
                del self._full[name]


def _fs_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
