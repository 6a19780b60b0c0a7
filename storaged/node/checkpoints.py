"""Checkpoints: commits, the catalogue quorum, listings, status and restore plans.

The records themselves are the catalogue's (``storaged.coord.catalogue``, injected into the
node); this module checks what a commit names and answers for checkpoints.

Upholds:

- **I4 commits**: a 201 or 200 commit is durable in the catalogue (for the embedded one:
  on ``replication`` holders). A retry of a commit whose writes reached only some holders
  completes them before it answers 200. Of two concurrent commits of different manifests
  under one name, the catalogue's create-if-absent picks the one that wins; the other
  writes nothing and gets 409.
- **I3, the commit's part**: the chunks a commit names are checked held *and touched*
  (``IndexEntry.last_use``) until the end of the commit window plus a margin; the
  catalogue writes must finish inside the window, so a GC pass whose catalogue snapshot
  predates the record cannot reach the touched copies before the record is in every
  later snapshot (see ``pipeline/gc.py``).
- A manifest's declared chunk sizes must match the stored chunks (400 ``bad_manifest``).
- Status reports ``lost`` chunks (held by no live node, neither as a copy nor as ``k``
  fragments) and then ``"state": "lost"``, and ``blocked``: the full disk tiers that keep
  its chunks from reaching nvme or cold (docs/API.md E16).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storaged.coord.catalogue import CatalogueUnavailable, CommitConflict, CoordinatorUnavailable
from storaged.coord.manifest_store import CatalogRecord, CheckpointNotFound
from storaged.errors import Conflict, NotFound, unavailable
from storaged.manifest import CheckedManifest, bad_manifest
from storaged.node.index import COLD, NVME, Holding
from storaged.placement import Placement, tolerance
from storaged.wire import STATES

if TYPE_CHECKING:
    from storaged.coord.catalogue import Catalogue
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.checkpoints")


@dataclass
class Listing:
    """A listing's answers per checkpoint name: the state reached, and (when asked) costs;
    ``complete`` is False when the catalogue snapshot the sharing was counted from could
    have missed a checkpoint (too few nodes answered)."""

    states: dict[str, str]
    costs: dict[str, dict[str, Any]] = field(default_factory=dict)
    complete: bool = True


class Checkpoints:
    def __init__(self, local: LocalStore, cluster: ClusterView, catalogue: Catalogue) -> None:
        self.local = local
        self.cluster = cluster
        self.catalogue = catalogue

    # ---- commit ----------------------------------------------------------------------------
    async def commit(self, name: str, checked: CheckedManifest) -> tuple[int, dict[str, Any]]:
        """201 (created), 200 (the identical manifest is committed under ``name``; any
        partial write of it completed), or raises: 409 ``exists`` (other contents), 409
        ``missing_chunks`` (nothing is or was committed under ``name`` by this manifest),
        503 (catalogue or coordinator out of reach: nothing decided).

        Identity comes before availability: a retry of a commit that succeeded answers
        200 even while some of its chunks have no live holder (repair's work, not the
        retry's), and ``missing_chunks`` is only said once a lookup that met the quorum
        found no identical live record."""
        existing = await self._find(name)
        live = existing is not None and existing.deleted is None
        if existing is not None and live and existing.digest != checked.digest:
            raise Conflict("exists", f"checkpoint {name!r} exists with other contents")
        checked_at = time.monotonic()
        try:
            await self._check_chunks(checked)
        except Conflict as exc:
            if exc.code != "missing_chunks" or not (live or await self._committed(name, checked)):
                raise
        record = record_of(name, checked)
        left = self.local.config.commit_window - (time.monotonic() - checked_at)
        try:
            async with asyncio.timeout(max(left, 0.0)):
                created = await self.catalogue.commit(record)
        except CommitConflict as exc:
            raise Conflict("exists", str(exc)) from exc
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "insufficient_replicas") from exc
        except TimeoutError:
            raise unavailable(
                "insufficient_replicas",
                "the manifest was not stored durably within the commit window; retry",
                retry_after=1.0,
            ) from None
        reply = {"name": name, "chunks": list(checked.chunks), "bytes": checked.total_bytes}
        return (201 if created else 200), reply

    async def _committed(self, name: str, checked: CheckedManifest) -> bool:
        """Whether ``checked`` is committed under ``name`` now (a commit of it may have
        landed since the first lookup); 409 ``exists`` for other contents, 503 when the
        lookup cannot say (never a false "not committed")."""
        record = await self._find(name)
        if record is None or record.deleted is not None:
            return False
        if record.digest != checked.digest:
            raise Conflict("exists", f"checkpoint {name!r} exists with other contents")
        return True

    async def _check_chunks(self, checked: CheckedManifest) -> None:
        """Every chunk held, with the declared size; the holders' copies touched until past
        the commit window (I3)."""
        ids = list(checked.chunks)
        until = (
            time.time() + self.local.config.commit_window + max(self.local.config.gc_interval, 1.0)
        )
        states = await self.cluster.chunk_states(ids, touch=until)
        missing = [cid for cid in ids if cid not in states]
        if missing:
            raise Conflict(
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

    # ---- reads -------------------------------------------------------------------------
    async def _find(self, name: str) -> CatalogRecord | None:
        try:
            return await self.catalogue.find(name)
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "catalogue_unavailable") from exc

    async def missing(self, ids: list[str]) -> list[str]:
        """Of ``ids``, those the cluster does not hold. The held ones count as used now."""
        states = await self.cluster.chunk_states(list(dict.fromkeys(ids)), touch=time.time())
        return [c for c in ids if c not in states]

    async def evict(self, name: str, *, nvme: bool) -> dict[str, int]:
        """Admin: push the checkpoint's chunks out of RAM (and, with ``nvme``, off nvme)
        where a colder copy exists, on every live node; how many went, per tier."""
        record = await self.get(name)
        alive = self.cluster.placement().alive
        results = await asyncio.gather(
            *(self.cluster.evict(n, record.chunks, nvme=nvme) for n in alive),
            return_exceptions=True,
        )
        totals = {"memory": 0, "nvme": 0}
        for r in results:
            if not isinstance(r, BaseException):
                for k in totals:
                    totals[k] += int(r.get(k, 0))
        return totals

    async def get(self, name: str) -> CatalogRecord:
        try:
            return await self.catalogue.get(name)
        except CheckpointNotFound:
            raise NotFound("checkpoint_not_found", f"no checkpoint named {name!r}") from None
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "catalogue_unavailable") from exc

    async def list(self, prefix: str) -> list[CatalogRecord]:
        try:
            return await self.catalogue.list(prefix)
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "catalogue_unavailable") from exc

    async def delete(self, name: str) -> None:
        try:
            await self.catalogue.delete(name)
        except CheckpointNotFound:
            raise NotFound("checkpoint_not_found", f"no checkpoint named {name!r}") from None
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "catalogue_unavailable") from exc

    async def status(self, name: str) -> dict[str, Any]:
        """How many distinct chunks reached at least each state; ``lost``: held by no live
        node; ``under_replicated``: held, but with fewer than ``replication`` hot copies and
        fewer than ``n`` fragments (repair's work); ``now``: how many have a copy in each
        tier at this moment (RAM copies go with a restart or an eviction, while the state
        they reached stays)."""
        return await self.status_of(await self.get(name))

    async def status_of(self, record: CatalogRecord) -> dict[str, Any]:
        """``status`` of a record found already (the catalogue's, or the archive's)."""
        placement = self.cluster.placement()  # one view for both questions
        held = await self.cluster.holdings(placement.alive, record.chunks)
        states = await self.cluster.chunk_states(record.chunks, placement=placement)
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
                if len({i for h in held[cid] for i in h.fragments}) >= self.local.config.k
            ),
        }
        rf, n = self.local.config.replication, self.local.config.n
        under = sum(
            1
            for cid in record.chunks
            if cid in states
            and sum(1 for h in held[cid] if h.hot) < rf
            and len({i for h in held[cid] for i in h.fragments}) < n
        )
        return {
            "state": _reached(record.chunks, states),
            "chunks": total,
            **counts,
            "lost": lost,
            "under_replicated": under,
            "now": now,
            "blocked": self._blocked(record.chunks, states, held, placement),
            # In a thread: a few microseconds a chunk, 0.7 s for a 97k-chunk checkpoint.
            "survives": await asyncio.to_thread(self._survives, record.chunks, held, placement),
        }

    def _survives(
        self,
        chunks: Sequence[str],
        held: dict[str, builtins.list[Holding]],
        placement: Placement,
    ) -> dict[str, Any]:
        """What the checkpoint survives as its chunks are held now (each chunk's
        ``storaged.placement.tolerance``, the worst of them): nodes lost at once, up to what
        placement promises, and one whole failure domain where placement promises that."""
        k = self.local.config.k
        nodes = placement.node_budget(k)
        domain_of = placement.domain_of if placement.survives_a_domain(k) else None
        domain = domain_of is not None
        for cid in dict.fromkeys(chunks):
            hot = {h.node for h in held[cid] if h.hot}
            fragments = {h.node: h.fragments for h in held[cid] if h.fragments}
            got, whole = tolerance(hot, fragments, k, nodes, domain_of if domain else None)
            nodes, domain = min(nodes, got), domain and whole
            if nodes == 0 and not domain:
                break
        return {"nodes": nodes, "domain": domain}

    def _blocked(
        self,
        chunks: Sequence[str],
        states: dict[str, tuple[int, int]],
        held: dict[str, builtins.list[Holding]],
        placement: Placement,
    ) -> builtins.list[dict[str, Any]]:
        """The live nodes' full disk tiers that keep some of ``chunks`` from their next
        state, each with how many: a holder's full nvme keeps a chunk it holds in RAM only
        from nvme (and so from cold), a fragment target's full cold tier keeps a chunk
        from cold. As of each node's last heartbeat (this node's: now)."""
        full: dict[tuple[str, str], dict[str, Any]] = {}
        for nid in placement.alive:
            usage = (
                self.local.usage()
                if nid == self.local.id
                else self.cluster.membership.info(nid).get("usage")
            )
            for tier in ("nvme", "cold"):
                mark = (usage or {}).get(tier) or {}
                if mark.get("state") == "full":
                    full[(nid, tier)] = mark
        if not full:
            return []
        stuck: dict[tuple[str, str], int] = dict.fromkeys(full, 0)
        for cid in chunks:
            if cid not in states:
                continue  # lost: no disk will help it
            state = states[cid][0]
            hit: set[tuple[str, str]] = set()
            if state < NVME:
                hit |= {(h.node, "nvme") for h in held[cid] if h.memory and not h.nvme}
            if state < COLD:
                has = {(h.node, i) for h in held[cid] for i in h.fragments}
                targets = placement.fragment_targets(cid)
                hit |= {(t, "cold") for i, t in enumerate(targets) if (t, i) not in has}
            for key in hit & full.keys():
                stuck[key] += 1
        return [
            {
                "node": nid,
                "url": self.cluster.spec(nid).url,
                "tier": tier,
                "chunks": stuck[(nid, tier)],
                "full_since": full[(nid, tier)].get("full_since"),
                "cause": full[(nid, tier)].get("cause"),
            }
            for nid, tier in sorted(full)
            if stuck[(nid, tier)]
        ]

    async def listing(self, records: Sequence[CatalogRecord], *, costs: bool) -> Listing:
        """The state each of ``records`` reached (``status``'s ``state``) and, with
        ``costs``, what each one costs (``costs_of``), from one snapshot of the catalogue
        (the chunk lists: a listing's records carry none) and one question to the live
        nodes about all the listed chunks. A listing asked each checkpoint's status in turn
        before (hundreds of round trips to etcd and to every node: the etcd soak's final
        listing timed out thrice); then states of the records as listed, without their
        chunks, and every checkpoint showed "cold" from its commit on."""
        try:
            refs = await self.catalogue.references()
        except CatalogueUnavailable as exc:
            raise _unavailable(exc, "catalogue_unavailable") from exc
        snapshot = {r.name: r for r in refs.live}
        chunks: dict[str, list[str]] = {}
        for record in records:
            found = snapshot.get(record.name)
            if found is None or found.digest != record.digest:
                # committed or replaced since the listing, or out of reach of the snapshot
                try:
                    found = await self.get(record.name)
                except NotFound:
                    continue  # deleted since the listing
            chunks[record.name] = found.chunks
        ids = list(dict.fromkeys(cid for listed in chunks.values() for cid in listed))
        held = await self.cluster.holdings(self.cluster.placement().alive, ids) if ids else {}
        states = self.cluster.states_of(held)
        listing = Listing({name: _reached(listed, states) for name, listed in chunks.items()})
        if costs:
            named = Counter(cid for r in snapshot.values() for cid in set(r.chunks))
            for name, listed in chunks.items():
                if snapshot.get(name) is None:
                    named.update(set(listed))  # counted once, as the snapshot would have
            sizes = {cid: size for cid, (_, size) in states.items() if size >= 0}
            for name, listed in chunks.items():
                listing.costs[name] = self.costs_of(listed, held, sizes, named)
            listing.complete = refs.complete
        return listing

    def costs_of(
        self,
        chunks: Sequence[str],
        held: Mapping[str, Sequence[Holding]],
        sizes: Mapping[str, int],
        named: Counter[str],
    ) -> dict[str, Any]:
        """What a checkpoint of ``chunks`` costs (extension E17): its distinct chunks, the
        bytes of those that another live checkpoint names too (``shared``), and per tier
        how many of them have a copy there now (RAM and nvme: on a live node; cold: ``k``
        or more fragments), their bytes, and the bytes the tier stores for them (every
        copy; every fragment at ``ceil(size / k)``: n/k of the chunk once all are there).
        ``stored`` sums the tiers. Sizes are the chunks' bytes, file and fragment headers
        aside; a chunk no live node holds (``lost``) counts in no tier and has no size."""
        k = self.local.config.k
        tiers = {t: {"chunks": 0, "bytes": 0, "stored": 0} for t in ("memory", "nvme", "cold")}
        shared = shared_chunks = lost = 0
        for cid in chunks:
            size = sizes.get(cid)
            answers = held.get(cid, [])
            if size is None:
                lost += 1
                continue
            if named[cid] > 1:
                shared += size
                shared_chunks += 1
            copies = {
                "memory": sum(1 for h in answers if h.memory),
                "nvme": sum(1 for h in answers if h.nvme),
            }
            for tier, count in copies.items():
                if count:
                    tiers[tier]["chunks"] += 1
                    tiers[tier]["bytes"] += size
                    tiers[tier]["stored"] += count * size
            fragments = sum(len(h.fragments) for h in answers)
            if fragments:
                if len({i for h in answers for i in h.fragments}) >= k:
                    tiers["cold"]["chunks"] += 1
                    tiers["cold"]["bytes"] += size
                tiers["cold"]["stored"] += fragments * -(-size // k)
        return {
            "chunks": len(chunks),
            "shared": shared,
            "shared_chunks": shared_chunks,
            **tiers,
            "stored": sum(t["stored"] for t in tiers.values()),
            "lost": lost,
        }

    async def restore_plan(self, name: str) -> dict[str, Any]:
        return await self.plan_of(await self.get(name))

    async def plan_of(self, record: CatalogRecord) -> dict[str, Any]:
        """``restore_plan`` of a record found already (the catalogue's, or the archive's)."""
        held = await self.cluster.holdings(self.cluster.placement().alive, record.chunks)
        tier_rank = {"memory": 0, "nvme": 1, "cold": 2}
        plan: dict[str, list[dict[str, Any]]] = {}
        for cid in record.chunks:
            sources = []
            frag_nodes = []
            for h in held[cid]:
                url = self.cluster.spec(h.node).url
                if h.memory:
                    sources.append({"node": h.node, "url": url, "tier": "memory"})
                elif h.nvme:
                    sources.append({"node": h.node, "url": url, "tier": "nvme"})
                elif h.fragments:
                    frag_nodes.append(
                        {"node": h.node, "url": url, "tier": "cold", "fragments": list(h.fragments)}
                    )
            sources.sort(key=lambda s: tier_rank[s["tier"]])
            # Any node rebuilds from fragments; list those that hold some.
            plan[cid] = sources + frag_nodes
        return {"chunks": plan}


def _unavailable(exc: CatalogueUnavailable, code: str) -> Exception:
    """503 ``coordinator_unavailable`` when the coordination service is out of reach,
    else ``code``."""
    if isinstance(exc, CoordinatorUnavailable):
        return unavailable("coordinator_unavailable", str(exc), retry_after=1.0)
    return unavailable(code, str(exc), retry_after=1.0)


def record_of(name: str, checked: CheckedManifest) -> CatalogRecord:
    """The catalogue record a commit of ``checked`` under ``name`` writes (committed now)."""
    return CatalogRecord(
        name=name,
        digest=checked.digest,
        created=float(checked.manifest["created"]),
        committed=time.time(),
        total_bytes=checked.total_bytes,
        chunks=list(checked.chunks),
        manifest=checked.encoded,
    )


def _reached(chunks: Sequence[str], states: dict[str, tuple[int, int]]) -> str:
    """The last of ``STATES`` every one of ``chunks`` reached; ``lost`` if one is held by no
    live node (absent from ``states``)."""
    if any(cid not in states for cid in chunks):
        return "lost"
    low = min((states[cid][0] for cid in chunks), default=len(STATES))
    return STATES[max(low, 1) - 1]
