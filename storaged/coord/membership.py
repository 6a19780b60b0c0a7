"""Who is in the cluster and who is alive: one small interface.

The embedded default is the static cluster file plus peer heartbeats. A later
coordination backend (etcd) implements the same interface.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storaged.config import NodeSpec
from tiers import TierFull
from tiers._durable import write_file_durably

log = logging.getLogger("storaged.coord.membership")

#: a member's states: ``draining`` is on its way out (decommission) but still serves
ACTIVE = "active"
DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class MembershipView:
    """One consistent snapshot: the members, who is alive and who is draining, and the
    coordinator's revision it reflects (0 where there is no such thing)."""

    members: tuple[NodeSpec, ...]
    alive: frozenset[str]
    draining: frozenset[str]
    revision: int


class DrainMarks(abc.ABC):
    """Which members are draining (on their way out: decommission) and since when.

    A mark is the operator's: it outlives the member's restarts. ``Membership.drains`` is
    the membership's; the embedded one keeps the marks on each node and passes them on,
    the etcd one keeps them in the member records.
    """

    #: whether ``mark`` reaches every node by itself (a coordinator does); when not, the
    #: node that marks tells its live peers, and the marks travel in heartbeats (``known``)
    shared = False

    @abc.abstractmethod
    def is_draining(self, node_id: str) -> bool: ...

    @abc.abstractmethod
    def draining_since(self, node_id: str) -> float | None:
        """When ``node_id`` was (last) marked draining, epoch seconds; None when it is not
        draining (or its mark predates the time being kept)."""

    @abc.abstractmethod
    def draining(self) -> frozenset[str]:
        """The members marked draining now."""

    @abc.abstractmethod
    async def mark(self, node_id: str, draining: bool = True) -> None:
        """Mark ``node_id`` draining (or active again); KeyError for a stranger. Cluster-wide
        when ``shared``; else in this node's view, for the caller to pass on."""

    def known(self) -> dict[str, tuple[bool, float]]:
        """The marks to pass on to peers (where not ``shared``): node id -> (draining, when
        it was set)."""
        return {}

    async def merge(self, marks: dict[str, tuple[bool, float]]) -> bool:
        """Take a peer's marks where newer than the ones known here; True if any changed."""
        return False


class LocalDrainMarks(DrainMarks):
    """The embedded drain marks: each node keeps them (in ``path`` across restarts) and they
    travel between nodes; the last set wins, by the clock of the node that set it."""

    def __init__(self, members: Callable[[], Iterable[str]], path: Path | None = None) -> None:
        self._members = members
        #: where the marks are kept across restarts (None: in memory only)
        self._path = path
        self._saving = asyncio.Lock()
        self._marks: dict[str, tuple[bool, float]] = {}

    def is_draining(self, node_id: str) -> bool:
        return self._marks.get(node_id, (False, 0.0))[0]

    def draining_since(self, node_id: str) -> float | None:
        on, at = self._marks.get(node_id, (False, 0.0))
        return at if on and at else None

    def draining(self) -> frozenset[str]:
        return frozenset(n for n, (on, _) in self._marks.items() if on)

    def known(self) -> dict[str, tuple[bool, float]]:
        return dict(self._marks)

    async def mark(self, node_id: str, draining: bool = True) -> None:
        if node_id not in set(self._members()):
            raise KeyError(node_id)
        await self.merge({node_id: (draining, time.time())})

    async def merge(self, marks: dict[str, tuple[bool, float]]) -> bool:
        """Marks of strangers are ignored."""
        known = self._marks
        members = set(self._members())
        changed = False
        for node_id, (draining, stamp) in marks.items():
            if node_id in members and stamp > known.get(node_id, (False, 0.0))[1]:
                known[node_id] = (bool(draining), float(stamp))
                changed = True
        if changed:
            await self._save()
        return changed

    async def load(self) -> None:
        """Take the marks kept in ``path`` (at start)."""
        if self._path is None:
            return
        try:
            blob = await asyncio.to_thread(self._path.read_bytes)
        except FileNotFoundError:
            return
        try:
            doc = json.loads(blob)
            marks = {str(n): (bool(on), float(at)) for n, (on, at) in doc["marks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Written durably, so only a hand edit gets here: say so, start without marks.
            log.error("ignoring unreadable drain marks in %s: %s", self._path, exc)
            return
        self._marks.update(marks)

    async def _save(self) -> None:
        if self._path is None:
            return
        # One save at a time, each of the marks as they are when it starts: two heartbeats'
        # saves finishing out of order would otherwise leave the older marks on disk.
        async with self._saving:
            doc = {"version": 1, "marks": {n: [on, at] for n, (on, at) in self._marks.items()}}
            blob = json.dumps(doc).encode()
            await asyncio.to_thread(write_file_durably, self._path, blob)


class Membership(abc.ABC):
    """The node list and liveness; ``alive_ids`` is what placement uses. Which members are
    draining is ``drains``'s."""

    self_id: str
    drains: DrainMarks

    @abc.abstractmethod
    def nodes(self) -> tuple[NodeSpec, ...]:
        """Every member, alive or not, in a stable order."""

    @abc.abstractmethod
    def is_alive(self, node_id: str) -> bool: ...

    def node(self, node_id: str) -> NodeSpec:
        for spec in self.nodes():
            if spec.id == node_id:
                return spec
        raise KeyError(node_id)

    def alive_ids(self) -> list[str]:
        return [n.id for n in self.nodes() if self.is_alive(n.id)]

    def all_ids(self) -> list[str]:
        return [n.id for n in self.nodes()]

    @abc.abstractmethod
    def report_failure(self, node_id: str) -> None:
        """A call to ``node_id`` failed to connect: treat it as down until it answers again."""

    def info(self, node_id: str) -> dict[str, Any]:
        """The last status a node reported in its heartbeat (usage figures), if any."""
        return {}

    def down_since(self, node_id: str) -> float | None:
        """Wall-clock time since which ``node_id`` counts as down (None: alive or unknown)."""
        return None

    async def forget(self, node_id: str) -> bool:
        """Remove ``node_id``, down past ``gone_after``, from the members for everyone; True
        if it is gone from them now. The embedded membership cannot: its cluster file decides
        who the members are (and fixes each name's catalogue primary over all of them), so a
        gone node stays listed as down until the file is edited."""
        return False

    def coordinator_reachable(self) -> bool:
        """Whether the coordination service this view comes from answers now (the embedded
        membership has none: always True). Writes are refused while it does not."""
        return True

    def view(self) -> MembershipView:
        """The members, alive and draining ones, as one snapshot."""
        nodes = self.nodes()
        return MembershipView(
            nodes,
            frozenset(n.id for n in nodes if self.is_alive(n.id)),
            self.drains.draining(),
            0,
        )

    @abc.abstractmethod
    async def leaving(self) -> None:
        """This node has begun a graceful stop (``Node.shutdown``): take it out of every
        node's placement promptly, while it still drains and serves reads until ``close``.
        Best effort: never raises; a node that stops without it goes down as a crashed one
        does."""

    async def start(self) -> None:  # noqa: B027
        pass

    async def close(self) -> None:  # noqa: B027
        pass


Pinger = Callable[[NodeSpec], Awaitable[dict[str, Any]]]


class StaticMembership(Membership):
    """Members from the cluster file; a peer is down after ``down_after`` s without a heartbeat."""

    def __init__(
        self,
        self_id: str,
        nodes: tuple[NodeSpec, ...],
        ping: Pinger,
        *,
        interval: float = 0.5,
        down_after: float = 3.0,
        marks_path: Path | None = None,
    ) -> None:
        self.self_id = self_id
        self._nodes = nodes
        self.drains: LocalDrainMarks = LocalDrainMarks(self.all_ids, marks_path)
        self._ping = ping
        self._interval = interval
        self._down_after = down_after
        # Peers start as alive for one grace period: a node that just started can take writes
        # before its first heartbeat round completes.
        now = time.monotonic()
        self._last_seen: dict[str, float] = {n.id: now for n in nodes}
        self._failed: set[str] = set()
        self._info: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None

    def nodes(self) -> tuple[NodeSpec, ...]:
        return self._nodes

    def is_alive(self, node_id: str) -> bool:
        if node_id == self.self_id:
            return True
        if node_id in self._failed:
            return False
        seen = self._last_seen.get(node_id)
        return seen is not None and time.monotonic() - seen < self._down_after

    def report_failure(self, node_id: str) -> None:
        if node_id != self.self_id and node_id not in self._failed:
            log.warning("peer %s unreachable: treating it as down", node_id)
            self._failed.add(node_id)

    def info(self, node_id: str) -> dict[str, Any]:
        return self._info.get(node_id, {})

    def down_since(self, node_id: str) -> float | None:
        if self.is_alive(node_id):
            return None
        seen = self._last_seen.get(node_id)
        if seen is None:
            return None
        # Down from its last heartbeat on (or from when a call to it failed, if later).
        return time.time() - (time.monotonic() - seen)

    async def start(self) -> None:
        await self.drains.load()
        self._task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")

    async def leaving(self) -> None:
        # Nothing to do here: from ``Node.shutdown`` on, this node answers pings with
        # ``stopping``, and each peer's next heartbeat takes it out (``_beat``).
        return

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _heartbeat_loop(self) -> None:
        while True:
            peers = [n for n in self._nodes if n.id != self.self_id]
            await asyncio.gather(*(self._beat(p) for p in peers))
            await asyncio.sleep(self._interval)

    async def _beat(self, peer: NodeSpec) -> None:
        try:
            info = await asyncio.wait_for(self._ping(peer), timeout=max(self._interval * 2, 1.0))
        except Exception:
            return
        if info.get("stopping"):
            # A node on its way out takes no new placements (its PUTs are refused anyway).
            self.report_failure(peer.id)
            return
        if peer.id in self._failed:
            log.info("peer %s is back", peer.id)
            self._failed.discard(peer.id)
        self._last_seen[peer.id] = time.monotonic()
        self._info[peer.id] = info
        # Drain marks travel in every heartbeat: a node that was down when one was set
        # (or cancelled) learns it from the first peer it hears from.
        marks = info.get("drain_marks")
        if isinstance(marks, dict):
            try:
                await self.drains.merge(
                    {str(n): (bool(m[0]), float(m[1])) for n, m in marks.items()}
                )
            except (TypeError, ValueError, IndexError, OSError, TierFull) as exc:
                log.warning("drain marks from %s not taken: %s", peer.id, exc)
