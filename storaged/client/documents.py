"""The documents the client's API returns and takes (``docs/API.md``, ``docs/CLIENT.md``):
the cluster's membership, a PUT's and a commit's answers, a checkpoint's status, costs and
restore plan, and the client's counters. Plain frozen dataclasses parsed from the wire;
``storaged.client.client`` re-exports them where callers import them from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from storaged.client.errors import ColdFull, NvmeFull, ProtocolError, StorageFull
from storaged.domains import describe
from storaged.wire import STATES, state_at_least, state_rank

#: the level a checkpoint reaches once its manifest is in the archive (E19), and the state
#: of one only the archive holds
ARCHIVED = "archived"
#: the levels ``Client.wait`` and ``--wait`` take
WAIT_LEVELS = (*STATES, ARCHIVED)


@dataclass(frozen=True, slots=True)
class TierSpace:
    used: int
    capacity: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    id: str
    url: str
    alive: bool
    #: Space per tier ("memory", "nvme", "cold") as the node reported it.
    tiers: Mapping[str, TierSpace] = field(default_factory=dict)
    #: Being drained (docs/API.md E13): it serves what it holds but takes no new copies.
    draining: bool = False


@dataclass(frozen=True, slots=True)
class ErasureInfo:
    codec: str
    k: int
    n: int


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """The membership and settings from ``GET /v1/cluster``."""

    nodes: tuple[NodeInfo, ...]
    replication: int
    erasure: ErasureInfo | None
    max_chunk_size: int

    @property
    def live(self) -> tuple[NodeInfo, ...]:
        return tuple(node for node in self.nodes if node.alive)

    def node(self, node_id: str) -> NodeInfo:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @classmethod
    def from_wire(cls, doc: Any) -> ClusterInfo:
        """Parse a ``/v1/cluster`` document; ``ProtocolError`` when it lacks what API.md lists."""
        try:
            nodes = []
            for raw in doc["nodes"]:
                tiers = {
                    tier: TierSpace(int(raw[tier]["used"]), int(raw[tier]["capacity"]))
                    for tier in STATES
                    if isinstance(raw.get(tier), dict)
                }
                nodes.append(
                    NodeInfo(
                        str(raw["id"]),
                        str(raw["url"]).rstrip("/"),
                        bool(raw["alive"]),
                        tiers,
                        raw.get("state") == "draining",
                    )
                )
            erasure_doc = doc.get("erasure")
            erasure = (
                ErasureInfo(str(erasure_doc["codec"]), int(erasure_doc["k"]), int(erasure_doc["n"]))
                if isinstance(erasure_doc, dict)
                else None
            )
            return cls(tuple(nodes), int(doc["replication"]), erasure, int(doc["max_chunk_size"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(message=f"malformed cluster document: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class PutResult:
    chunk: str
    size: int
    replicas: tuple[str, ...]
    state: str
    #: False when the cluster already held the chunk (HTTP 200 rather than 201).
    created: bool


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    chunk: str
    size: int
    tier: str | None
    state: str | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    name: str
    #: Number of distinct chunks the checkpoint names.
    chunks: int
    #: Their total size.
    bytes: int
    #: False when the identical manifest was already committed (HTTP 200 rather than 201).
    created: bool


@dataclass(frozen=True, slots=True)
class FullTier:
    """A node's full disk tier that keeps ``chunks`` of a checkpoint from a level (E16)."""

    node: str
    url: str
    #: "nvme" (keeps them from nvme, and so from cold) or "cold" (from cold)
    tier: str
    chunks: int
    full_since: float | None = None
    cause: str | None = None

    def describe(self) -> str:
        since = "" if self.full_since is None else f" for {time.time() - self.full_since:.0f} s"
        cause = f" ({self.cause})" if self.cause else ""
        return f"{self.tier} tier full on node {self.node} ({self.url}){since}{cause}"


@dataclass(frozen=True, slots=True)
class CheckpointStatus:
    """``?status``: how many distinct chunks reached at least each level, and the overall one."""

    state: str
    chunks: int
    memory: int
    nvme: int
    cold: int
    #: Chunks no node holds any more, when the node reports it (None: not reported).
    lost: int | None = None
    #: Full disk tiers that keep some of its chunks from nvme or cold (E16).
    blocked: tuple[FullTier, ...] = ()
    #: What it survives as held now: nodes lost at once, and whether one whole failure
    #: domain (None: the node did not say)
    survives: Survives | None = None
    #: Whether its manifest is in the archive (E19); None: the archive did not answer, or
    #: the node did not say
    archived: bool | None = None

    def reached(self, level: str) -> bool:
        """Whether it reached ``level``: ``memory``, ``nvme``, ``cold`` (the cluster's), or
        ``archived``. A checkpoint only the archive holds (``state`` ``archived``) reached
        none of the cluster's."""
        if level == ARCHIVED:
            return bool(self.archived)
        if self.state == ARCHIVED:
            state_rank(level)
            return False
        return state_at_least(self.state, level)

    def blocked_from(self, level: str) -> list[FullTier]:
        """The full tiers that keep it from ``level`` (a full nvme keeps it from cold too);
        empty once it reached ``level``."""
        if self.reached(level) or level in ("memory", ARCHIVED):
            return []
        tiers = ("nvme",) if level == "nvme" else ("nvme", "cold")
        return [b for b in self.blocked if b.tier in tiers]


@dataclass(frozen=True, slots=True)
class Survives:
    """What data survives lost at once: ``nodes`` nodes, or (``domain``) one whole failure
    domain (``storaged.domains``)."""

    nodes: int
    domain: bool

    @classmethod
    def of(cls, doc: Any) -> Survives | None:
        if not isinstance(doc, Mapping) or "nodes" not in doc:
            return None
        return cls(int(doc["nodes"]), bool(doc.get("domain")))

    def __str__(self) -> str:
        return describe(self.nodes, self.domain)


def blocked_error(name: str, status: CheckpointStatus, level: str) -> StorageFull | None:
    """``NvmeFull`` (or ``ColdFull``) saying why checkpoint ``name`` cannot reach
    ``level`` now, when full disk tiers keep it from it; None otherwise."""
    blocked = status.blocked_from(level)
    if not blocked:
        return None
    cls: type[StorageFull] = NvmeFull if any(b.tier == "nvme" for b in blocked) else ColdFull
    why = "; ".join(f"{b.describe()}, {b.chunks} of its chunks wait for it" for b in blocked)
    full = [{"node": b.node, "url": b.url, "tier": b.tier} for b in blocked]
    return cls(
        message=f"checkpoint {name} cannot reach {level} until disk space is freed: {why}",
        body={"error": cls.default_code, "full": full},
    )


@dataclass(frozen=True, slots=True)
class TierCost:
    """A checkpoint in one tier now: its chunks with a copy there (cold: ``k`` or more
    fragments), their bytes, and the bytes the tier stores for them (every copy, every
    fragment)."""

    chunks: int
    bytes: int
    stored: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> TierCost:
        return cls(int(doc["chunks"]), int(doc["bytes"]), int(doc["stored"]))


@dataclass(frozen=True, slots=True)
class CheckpointCosts:
    """What a checkpoint costs (extension E17, ``list(costs=True)``): its distinct chunks,
    the bytes of those another checkpoint names too (``shared``), where its chunks are now,
    and ``stored``, the bytes all tiers hold for it; ``lost``: chunks no live node holds."""

    chunks: int
    shared: int
    shared_chunks: int
    memory: TierCost
    nvme: TierCost
    cold: TierCost
    stored: int
    lost: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> CheckpointCosts:
        return cls(
            int(doc["chunks"]),
            int(doc["shared"]),
            int(doc["shared_chunks"]),
            TierCost.from_wire(doc["memory"]),
            TierCost.from_wire(doc["nvme"]),
            TierCost.from_wire(doc["cold"]),
            int(doc["stored"]),
            int(doc["lost"]),
        )


@dataclass(frozen=True, slots=True)
class RetentionInfo:
    """What the retention policy says of a checkpoint (extension E20,
    ``list(retention=True)``): the prefix of the rule it falls under (None: no rule), the
    clauses that keep it (``"newest, last 3"``, ``"every 10th until 2026-12-13"``, ``"being
    read"``, ``"awaiting archive"``, ``"no policy"``) or ``"to delete"``, and whether the
    archive holds a copy (None: not known)."""

    rule: str | None
    kept_by: str
    archived: bool | None = None

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> RetentionInfo:
        rule, archived = doc.get("rule"), doc.get("archived")
        return cls(
            None if rule is None else str(rule),
            str(doc["kept_by"]),
            None if archived is None else bool(archived),
        )


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    name: str
    created: float
    bytes: int
    state: str
    #: With ``Client.list(costs=True)`` (extension E17); else None.
    costs: CheckpointCosts | None = None
    #: With ``Client.list(retention=True)`` (extension E20); else None.
    retention: RetentionInfo | None = None


@dataclass(frozen=True, slots=True)
class Holder:
    """A node that can serve a chunk, and from which tier."""

    node: str
    url: str
    tier: str
    #: The fragment indexes a ``cold`` holder has (extension E8; empty when not reported).
    fragments: tuple[int, ...] = ()


#: ``?plan``: chunk id -> holders, fastest tier first.
RestorePlanDoc = dict[str, list[Holder]]


@dataclass(slots=True)
class ClientStats:
    """Counters since the client was opened (or ``reset``). Not thread-safe; one loop."""

    #: HTTP attempts made for the caller's requests (background refreshes not included).
    requests: int = 0
    #: ``GET /v1/cluster`` attempts made in the background after a node failed to answer.
    background_requests: int = 0
    retries: int = 0
    failovers: int = 0
    chunks_uploaded: int = 0
    bytes_uploaded: int = 0
    #: Chunks ``put_chunks`` did not send because the cluster already held them.
    chunks_skipped: int = 0
    bytes_skipped: int = 0
    chunks_downloaded: int = 0
    bytes_downloaded: int = 0
    #: Cold chunks this client decoded itself from fragments (``storaged.client.degraded``).
    chunks_decoded: int = 0
    fragments_downloaded: int = 0
    #: Fragments not used: refused, unreachable, or failing their checks.
    fragments_skipped: int = 0
    #: Of the uploads and downloads above, those through shared memory (``storaged.client.shm``).
    shm_chunks_uploaded: int = 0
    shm_bytes_uploaded: int = 0
    shm_chunks_downloaded: int = 0
    shm_bytes_downloaded: int = 0
    #: Requests sent to another node too because one missed its deadline (hedges).
    hedges: int = 0
    #: Of the logical requests that were hedged, those a later attempt answered first.
    hedge_wins: int = 0
    #: Times a body refused as too slow (408) halved the upload window
    #: (``storaged.client.pacing``).
    upload_window_halvings: int = 0

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


class WaitTimeout(TimeoutError):
    """``Client.wait`` ran out of time; ``status`` is the last one seen (None if none)."""

    def __init__(self, message: str, status: CheckpointStatus | None) -> None:
        super().__init__(message)
        self.status = status


class BlockedWatch:
    """Follows the statuses of a wait for ``level``: ``check`` raises ``blocked_error``
    once full disk tiers have kept the checkpoint from it for ``BLOCKED_FOR`` seconds of
    polls in a row (a mark cleared at once, space freed meanwhile, does not fail a wait)."""

    BLOCKED_FOR = 1.0

    def __init__(self, name: str, level: str) -> None:
        self.name, self.level = name, level
        self._since: float | None = None

    def check(self, status: CheckpointStatus) -> None:
        error = blocked_error(self.name, status, self.level)
        if error is None:
            self._since = None
            return
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since >= self.BLOCKED_FOR:
            raise error
