"""Checkpoints: commits, the catalogue quorum, listings, status and restore plans.

A checkpoint's record lives on the ``replication`` nodes its name's placement picks
(``Node.name_targets``); the first of them is its *primary*.

Upholds:

- **I4 commits**: a 201 or 200 commit is durable on ``replication`` catalogue holders.
  A retry of a commit whose writes reached only some holders writes the rest before it
  answers 200. Of two concurrent commits of different manifests under one name, the
  primary's create-if-absent picks the one that wins; the other writes nothing and gets
  409. (With a split membership view two primaries can exist: the embedded catalogue
  does not solve consensus; the etcd coordinator does.)
- **I3, the commit's part**: the chunks a commit names are checked held *and touched*
  (``ChunkInfo.last_use``) until the end of the commit window plus a margin; the
  catalogue writes must finish inside the window, so a GC pass whose catalogue snapshot
  predates the record cannot reach the touched copies before the record is in every
  later snapshot (see ``pipeline/gc.py``).
- A manifest's declared chunk sizes must match the stored chunks (400 ``bad_manifest``).
- Status reports ``lost`` chunks (held by no live node, neither as a copy nor as ``k``
  fragments) and then ``"state": "lost"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from storaged.catalog import CatalogRecord
from storaged.errors import ApiError, unavailable
from storaged.manifest import CheckedManifest, bad_manifest
from storaged.node.index import STATES
from storaged.peer import PeerError
from storaged.placement import rendezvous_order

if TYPE_CHECKING:
    from storaged.node.core import Node

log = logging.getLogger("storaged.node.checkpoints")


def newer(a: CatalogRecord, b: CatalogRecord) -> bool:
    """Whether record ``a`` supersedes ``b`` (a later event: commit or delete)."""
    return (a.deleted or a.committed) > (b.deleted or b.committed)


def _version(record: CatalogRecord) -> tuple[str, float | None]:
    return record.digest, record.deleted


class Checkpoints:
    def __init__(self, node: Node) -> None:
        self.node = node
        #: how many nodes answered the last full catalogue gather
        self.last_replies = 0
        #: (name -> (version, nodes known to hold that version)) for catalogue repair
        self._confirmed: dict[str, tuple[tuple[str, float | None], set[str]]] = {}

    # ---- commit ----------------------------------------------------------------------------
    async def commit(self, name: str, checked: CheckedManifest) -> tuple[int, dict[str, Any]]:
        node = self.node
        targets = node.name_targets(name)
        if len(targets) < node.config.replication:
            raise unavailable(
                "insufficient_replicas",
                f"{len(targets)} live node(s), replication needs {node.config.replication}",
                retry_after=node.config.down_after,
            )
        existing = await self.find_record(name)
        live = existing is not None and existing.deleted is None
        if existing is not None and live and existing.digest != checked.digest:
            raise ApiError(409, "exists", f"checkpoint {name!r} exists with other contents")
        checked_at = time.monotonic()
        await self._check_chunks(checked)
        if existing is not None and live:
            record, status = existing, 200  # a retry: complete the writes before answering
        else:
            record = CatalogRecord(
                name=name,
                digest=checked.digest,
                created=float(checked.manifest["created"]),
                committed=time.time(),
                total_bytes=checked.total_bytes,
                chunks=list(checked.chunks),
                manifest=checked.encoded,
            )
            status = 201
        left = node.config.commit_window - (time.monotonic() - checked_at)
        try:
            async with asyncio.timeout(max(left, 0.0)):
                await self._store(record, targets)
        except TimeoutError:
            raise unavailable(
                "insufficient_replicas",
                f"the manifest was not stored on {len(targets)} nodes in time",
                retry_after=1.0,
            ) from None
        return status, {"name": name, "chunks": list(checked.chunks), "bytes": checked.total_bytes}

    async def _check_chunks(self, checked: CheckedManifest) -> None:
        """Every chunk held, with the declared size; the holders' copies touched until past
        the commit window (I3)."""
        node = self.node
        ids = list(checked.chunks)
        until = time.time() + node.config.commit_window + max(node.config.gc_interval, 1.0)
        states = await node.chunk_states(ids, touch=until)
        missing = [cid for cid in ids if cid not in states]
        if missing:
            raise ApiError(
                409,
                "missing_chunks",
                f"{len(missing)} chunk(s) named by the manifest are not held by the cluster",
                missing=missing,
            )
        wrong = [
            cid for cid in ids if states[cid][1] >= 0 and states[cid][1] != checked.chunks[cid]
        ]
        if wrong:
            err = bad_manifest(
                f"{len(wrong)} chunk(s) are declared with another size than they have "
                f"(first: {wrong[0]} is {states[wrong[0]][1]} bytes, declared "
                f"{checked.chunks[wrong[0]]})"
            )
            err.extra["mismatched"] = wrong
            raise err

    async def _store(self, record: CatalogRecord, targets: list[str]) -> None:
        """The record on every target: the primary first (its create-if-absent decides
        between concurrent commits), then the others."""
        node = self.node
        primary, others = targets[0], targets[1:]
        try:
            reply, _ = await node.call(primary, "catalog_put", {"record": record.to_wire()})
        except PeerError as exc:
            raise unavailable(
                "insufficient_replicas",
                f"the checkpoint's primary catalogue holder {primary} is unreachable: {exc}",
                retry_after=1.0,
            ) from exc
        if not reply["stored"]:
            raise ApiError(
                409, "exists", f"checkpoint {record.name!r} was committed or deleted concurrently"
            )
        results = await asyncio.gather(
            *(node.call(n, "catalog_put", {"record": record.to_wire()}) for n in others),
            return_exceptions=True,
        )
        stored = 1 + sum(1 for r in results if not isinstance(r, BaseException) and r[0]["stored"])
        if stored < len(targets):
            raise unavailable(
                "insufficient_replicas",
                f"the manifest reached {stored} of {len(targets)} nodes; retry completes it",
                retry_after=1.0,
            )
        self._confirmed[record.name] = (_version(record), set(targets))

    # ---- reads -------------------------------------------------------------------------
    async def find_record(self, name: str) -> CatalogRecord | None:
        """The newest record or tombstone of ``name`` among the nodes that should hold it."""
        node = self.node
        alive = node.membership.alive_ids()
        order = rendezvous_order("checkpoint/" + name, alive)
        best: CatalogRecord | None = None

        async def ask(node_id: str) -> CatalogRecord | None:
            try:
                reply, _ = await node.call(node_id, "catalog_get", {"name": name})
            except PeerError:
                return None
            wire = reply.get("record")
            return CatalogRecord.from_wire(wire) if wire else None

        # Its placement first; the rest only if none of those has it (membership changed).
        rf = node.config.replication
        for group in (order[: rf + 1], order[rf + 1 :]):
            for record in await asyncio.gather(*(ask(n) for n in group)):
                if record is not None and (best is None or newer(record, best)):
                    best = record
            if best is not None:
                break
        return best

    async def get(self, name: str) -> CatalogRecord:
        record = await self.find_record(name)
        if record is None or record.deleted is not None or record.manifest is None:
            raise ApiError(404, "checkpoint_not_found", f"no checkpoint named {name!r}")
        return record

    async def list(self, prefix: str) -> list[CatalogRecord]:
        merged = await self.gather_catalog(prefix, with_chunks=False)
        return sorted((r for r in merged.values() if r.deleted is None), key=lambda r: r.name)

    async def gather_catalog(
        self, prefix: str = "", *, with_chunks: bool
    ) -> dict[str, CatalogRecord]:
        """Every record and tombstone under ``prefix`` that a live node has, the newest of
        each name. ``last_replies`` says how many nodes answered."""
        node = self.node
        alive = node.membership.alive_ids()
        merged: dict[str, CatalogRecord] = {}
        replies = await asyncio.gather(
            *(
                node.call(n, "catalog_dump", {"prefix": prefix, "chunks": with_chunks})
                for n in alive
            ),
            return_exceptions=True,
        )
        self.last_replies = sum(1 for r in replies if not isinstance(r, BaseException))
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            for wire in reply[0]["records"]:
                record = CatalogRecord.from_wire(wire)
                current = merged.get(record.name)
                if current is None or newer(record, current):
                    merged[record.name] = record
        return merged

    async def delete(self, name: str) -> None:
        node = self.node
        record = await self.find_record(name)
        if record is None or record.deleted is not None:
            raise ApiError(404, "checkpoint_not_found", f"no checkpoint named {name!r}")
        record.deleted = time.time()
        record.manifest = None
        holders = set(node.name_targets(name)) | set(node.membership.alive_ids())
        await asyncio.gather(
            *(node.call(n, "catalog_put", {"record": record.to_wire()}) for n in holders),
            return_exceptions=True,
        )

    async def status(self, name: str) -> dict[str, Any]:
        """How many distinct chunks reached at least each state; ``lost``: held by no live
        node; ``now``: how many have a copy in each tier at this moment (RAM copies go with
        a restart or an eviction, while the state they reached stays)."""
        node = self.node
        record = await self.get(name)
        held = await node.holdings(node.membership.alive_ids(), record.chunks)
        states = await node.chunk_states(record.chunks)
        counts = {s: 0 for s in STATES}
        for cid in record.chunks:
            rank = states.get(cid, (0, 0))[0]
            for i, s in enumerate(STATES):
                if rank >= i + 1:
                    counts[s] += 1
        total = len(record.chunks)
        lost = sum(1 for cid in record.chunks if cid not in states)
        now = {
            "memory": sum(1 for cid in record.chunks if any(h.memory for h in held[cid])),
            "nvme": sum(1 for cid in record.chunks if any(h.nvme for h in held[cid])),
            "cold": sum(
                1
                for cid in record.chunks
                if len({i for h in held[cid] for i in h.fragments}) >= node.config.k
            ),
        }
        reached = "memory"
        for s in STATES:
            if counts[s] == total:
                reached = s
        if lost:
            reached = "lost"
        return {"state": reached, "chunks": total, **counts, "lost": lost, "now": now}

    async def restore_plan(self, name: str) -> dict[str, Any]:
        node = self.node
        record = await self.get(name)
        alive = node.membership.alive_ids()
        held = await node.holdings(alive, record.chunks)
        tier_rank = {"memory": 0, "nvme": 1, "cold": 2}
        plan: dict[str, list[dict[str, str]]] = {}
        for cid in record.chunks:
            sources = []
            frag_nodes = []
            for h in held[cid]:
                url = node.spec(h.node).url
                if h.memory:
                    sources.append({"node": h.node, "url": url, "tier": "memory"})
                elif h.nvme:
                    sources.append({"node": h.node, "url": url, "tier": "nvme"})
                elif h.fragments:
                    frag_nodes.append({"node": h.node, "url": url, "tier": "cold"})
            sources.sort(key=lambda s: tier_rank[s["tier"]])
            # Any node rebuilds from fragments; list those that hold some.
            plan[cid] = sources + frag_nodes
        return {"chunks": plan}

    # ---- repair of the catalogue (I4, I6) ------------------------------------------------
    async def replicate_records(self) -> int:
        """Push every record and tombstone held here to the name's targets that are not
        known to hold it (a commit that reached only some, a membership change). Returns
        how many copies were written."""
        node = self.node
        written = 0
        for record in node.catalog.records(tombstones=True):
            version = _version(record)
            known = self._confirmed.get(record.name)
            confirmed = known[1] if known is not None and known[0] == version else {node.id}
            for target in node.name_targets(record.name):
                if target in confirmed:
                    continue
                try:
                    reply, _ = await node.call(target, "catalog_put", {"record": record.to_wire()})
                except PeerError:
                    continue
                # Not stored: the target has something newer; it will reach us by GC's
                # tombstone sharing or a later pass. Either way, nothing to push.
                confirmed.add(target)
                written += int(bool(reply["stored"]))
            self._confirmed[record.name] = (version, confirmed)
        return written
