"""The cluster-wide checkpoint catalogue: one small interface, injected into the node.

What a node needs from it: a create-if-absent commit of name -> record, reads, listings,
deletes (tombstones), and, for GC, the chunks referenced at one consistent point. The
embedded implementation keeps records on the nodes (``EmbeddedCatalogue``, over the
peer protocol and each node's durable ``storaged.coord.manifest_store.Catalog``); a coordination
service (etcd) implements the same interface. One conformance suite
(``tests/coordination/catalogue_conformance.py``) runs against every implementation.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storaged.coord.manifest_store import CatalogRecord, CheckpointNotFound
from storaged.peer import PeerError
from storaged.placement import Placement

if TYPE_CHECKING:
    from storaged.coord.policy_store import PolicyStore
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.coord.catalogue")

#: names per catalog_versions call of a repair pass
_REPAIR_BATCH = 2048


class CatalogueError(Exception):
    """Base of the catalogue's errors."""


class CommitConflict(CatalogueError):
    """Another manifest holds the name (or a delete came in between): nothing was written."""


class CatalogueUnavailable(CatalogueError):
    """The record could not be made durable on enough holders; a retry completes it."""


class CoordinatorUnavailable(CatalogueUnavailable):
    """The coordination service (etcd) could not be reached in time; nothing was decided.

    The HTTP layer answers 503 ``coordinator_unavailable`` with ``Retry-After``."""


@dataclass(frozen=True, slots=True)
class References:
    """The chunks named by live checkpoints, read at one point (``taken_at``, wall clock).

    ``complete`` is False when some record could have been out of reach: a GC pass must
    then free nothing."""

    chunks: frozenset[str]
    live: tuple[CatalogRecord, ...]
    taken_at: float
    complete: bool


def newer(a: CatalogRecord, b: CatalogRecord) -> bool:
    """Whether record ``a`` supersedes ``b`` (a later event: commit or delete)."""
    return (a.deleted or a.committed) > (b.deleted or b.committed)


class Catalogue(abc.ABC):
    """name -> checkpoint record, cluster-wide."""

    @abc.abstractmethod
    async def commit(self, record: CatalogRecord) -> bool:
        """Create ``name`` -> ``record`` if the name is free. Returns True if this call
        created it, False if the identical record (same digest) was already there — then
        the call has completed any partial write of it before returning. Raises
        ``CommitConflict`` (another digest holds the name; nothing written) or
        ``CatalogueUnavailable`` (not durable yet; retrying completes it)."""

    @abc.abstractmethod
    async def find(self, name: str) -> CatalogRecord | None:
        """The newest record or tombstone of ``name``, or None."""

    async def get(self, name: str) -> CatalogRecord:
        """The live record of ``name``; raises ``CheckpointNotFound`` (also when deleted)."""
        record = await self.find(name)
        if record is None or record.deleted is not None or record.manifest is None:
            raise CheckpointNotFound(name)
        return record

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[CatalogRecord]:
        """Live records under ``prefix``, sorted by name, without manifests or chunk lists."""

    @abc.abstractmethod
    async def delete(self, name: str) -> None:
        """Tombstone ``name``; raises ``CheckpointNotFound`` when there is no live record."""

    @abc.abstractmethod
    async def references(self) -> References:
        """The chunks live checkpoints name, at one point in time (for GC)."""

    async def repair(self) -> int:
        """Bring records back to their full number of holders; returns copies written."""
        return 0

    def policy_store(self) -> PolicyStore | None:
        """Where the coordinator keeps the cluster's retention policy (``storaged retention
        set``); None: it keeps none, the cluster file's ``[[retention]]`` is the policy."""
        return None


class EmbeddedCatalogue(Catalogue):
    """Records on ``replication`` nodes: the name's *primary* (the first node of the name's
    rendezvous order over every member, alive or not) and the next live nodes of that
    order. The primary's create-if-absent store decides between concurrent commits; since
    every node computes the same primary from the cluster file alone, two views of who is
    alive cannot make two primaries. The price: while a name's primary is down, commits
    of that name (about 1 in N) answer 503 until it is back; reads go on.

    Lookups and GC snapshots need answers from ``R = N - (replication - 1)`` of the ``N``
    members (all a cluster has left after the ``replication - 1`` losses it must survive):
    a lookup asks every live node and answers only once ``R`` did (else
    ``CatalogueUnavailable``), so it meets at least one holder of any committed record
    (``R + replication > N``). A delete's tombstone must reach ``replication`` nodes, so
    every later lookup meets it too (``R + replication > N``) and a node that missed the
    delete cannot bring the checkpoint back. A GC snapshot is complete on the same
    condition as a lookup."""

    def __init__(self, local: LocalStore, cluster: ClusterView) -> None:
        self.local = local
        self.cluster = cluster

    def holders(self, name: str, placement: Placement) -> tuple[str, list[str]]:
        """(the primary, the live secondaries that are not draining) of ``name``'s record,
        in the caller's view."""
        targets = placement.name_targets(name)
        return targets[0], targets[1:]

    def quorum(self, placement: Placement) -> int:
        """How many nodes must answer a lookup or a GC snapshot."""
        return len(placement.view.members) - (self.local.config.replication - 1)

    def _enough(self, answered: int, placement: Placement) -> bool:
        return answered >= self.quorum(placement)

    async def commit(self, record: CatalogRecord) -> bool:
        placement = self.cluster.placement()  # one view for the whole commit
        primary, others = self.holders(record.name, placement)
        if not placement.is_alive(primary):
            raise CatalogueUnavailable(
                f"{primary}, the catalogue primary of {record.name!r}, is down; retry later"
            )
        rf = self.local.config.replication
        if len(others) < rf - 1:
            raise CatalogueUnavailable(f"{len(others) + 1} live holder(s), replication needs {rf}")
        existing = await self._find(record.name, placement)
        if existing is not None and existing.deleted is None:
            if existing.digest != record.digest:
                raise CommitConflict(f"checkpoint {record.name!r} exists with other contents")
            record, created = existing, False
        else:
            created = True
        try:
            reply = await self.cluster.catalog_put(primary, record)
        except PeerError as exc:
            raise CatalogueUnavailable(
                f"the primary catalogue holder {primary} is unreachable: {exc}"
            ) from exc
        if not reply["stored"]:
            raise CommitConflict(
                f"checkpoint {record.name!r} was committed or deleted concurrently"
            )
        results = await asyncio.gather(
            *(self.cluster.catalog_put(n, record) for n in others),
            return_exceptions=True,
        )
        stored = 1 + sum(1 for r in results if not isinstance(r, BaseException) and r["stored"])
        if stored < 1 + len(others):
            raise CatalogueUnavailable(
                f"the manifest reached {stored} of {1 + len(others)} nodes; retry completes it"
            )
        return created

    async def find(self, name: str) -> CatalogRecord | None:
        return await self._find(name, self.cluster.placement())

    async def _find(self, name: str, placement: Placement) -> CatalogRecord | None:
        best: CatalogRecord | None = None
        answered = 0

        async def ask(node_id: str) -> None:
            nonlocal answered, best
            try:
                reply = await self.cluster.catalog_get(node_id, name)
            except PeerError:
                return
            answered += 1
            wire = reply.get("record")
            record = CatalogRecord.from_wire(wire) if wire else None
            if record is not None and (best is None or newer(record, best)):
                best = record

        await asyncio.gather(*(ask(n) for n in placement.alive))
        if not self._enough(answered, placement):
            raise CatalogueUnavailable(
                f"only {answered} node(s) answered about {name!r}, {self.quorum(placement)} needed"
            )
        return best

    async def _gather(
        self, prefix: str, placement: Placement, *, with_chunks: bool
    ) -> tuple[dict[str, CatalogRecord], int]:
        alive = placement.alive
        merged: dict[str, CatalogRecord] = {}
        replies = await asyncio.gather(
            *(self.cluster.catalog_dump(n, prefix, chunks=with_chunks) for n in alive),
            return_exceptions=True,
        )
        answered = 0
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            answered += 1
            for wire in reply["records"]:
                record = CatalogRecord.from_wire(wire)
                current = merged.get(record.name)
                if current is None or newer(record, current):
                    merged[record.name] = record
        return merged, answered

    async def list(self, prefix: str = "") -> list[CatalogRecord]:
        merged, _ = await self._gather(prefix, self.cluster.placement(), with_chunks=False)
        return sorted((r for r in merged.values() if r.deleted is None), key=lambda r: r.name)

    async def delete(self, name: str) -> None:
        placement = self.cluster.placement()  # one view for the whole delete
        record = await self._find(name, placement)
        if record is None or record.deleted is not None:
            raise CheckpointNotFound(name)
        record.deleted = time.time()
        record.manifest = None
        primary, others = self.holders(name, placement)
        holders = {primary, *others} | set(placement.alive)
        results = await asyncio.gather(
            *(self.cluster.catalog_put(n, record) for n in holders),
            return_exceptions=True,
        )
        # A holder that refuses has something newer (a later commit or delete): it still
        # counts as having seen the delete.
        reached = sum(1 for r in results if not isinstance(r, BaseException))
        if reached < self.local.config.replication:
            raise CatalogueUnavailable(
                f"the delete of {name!r} reached {reached} node(s), "
                f"{self.local.config.replication} needed; retry completes it"
            )

    async def references(self) -> References:
        taken_at = time.time()
        placement = self.cluster.placement()
        merged, answered = await self._gather("", placement, with_chunks=True)
        # Every committed record is on `replication` holders: hearing from all nodes but
        # replication - 1 guarantees one of them answered.
        complete = self._enough(answered, placement)
        if complete:
            # Tombstones seen anywhere are applied here, so this node cannot bring back a
            # deleted checkpoint.
            for record in merged.values():
                local = self.local.catalog.raw(record.name)
                if record.deleted is not None and local is not None and local.deleted is None:
                    await self.local.catalog.store(record)
        live = tuple(r for r in merged.values() if r.deleted is None)
        chunks: set[str] = set()
        for r in live:
            chunks.update(r.chunks)
        return References(frozenset(chunks), live, taken_at, complete)

    async def repair(self) -> int:
        """Every record and tombstone held here goes to the name's targets that lack it or
        hold an older version: a commit that reached only some, a holder that lost its
        disk, a membership change. Asks each target in batches what it holds first."""
        by_target: dict[str, list[CatalogRecord]] = {}
        placement = self.cluster.placement()  # one view for the pass
        for record in self.local.catalog.records(tombstones=True):
            primary, others = self.holders(record.name, placement)
            for target in (primary, *others):
                if target != self.local.id and placement.is_alive(target):
                    by_target.setdefault(target, []).append(record)
        written = 0
        for target, records in by_target.items():
            for start in range(0, len(records), _REPAIR_BATCH):
                batch = records[start : start + _REPAIR_BATCH]
                try:
                    reply = await self.cluster.catalog_versions(target, [r.name for r in batch])
                except PeerError:
                    break  # unreachable now: the next pass tries again
                held = reply["versions"]
                for record in batch:
                    theirs = held.get(record.name)
                    if theirs is not None and not _older(theirs, record):
                        continue
                    try:
                        put = await self.cluster.catalog_put(target, record)
                    except PeerError:
                        continue
                    written += int(bool(put["stored"]))
        return written


def _older(theirs: list[Any], record: CatalogRecord) -> bool:
    """Whether a holder's ``[digest, committed, deleted]`` is superseded by ``record``."""
    _, committed, deleted = theirs
    return bool((record.deleted or record.committed) > (deleted or committed))
