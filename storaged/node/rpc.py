"""The peer calls other nodes make on this one (``rpc_*``), and the peer server's handler.

Chunk receives go to the write path; ``chunk_info`` answers for the index and, with
``touch``, records the use in the same step (see ``index.IndexEntry.last_use``). No call
deletes a chunk on a request's behalf: collections are this node's own GC's decision, and
``drop_misplaced`` (rebalance) drops a copy only once this node has itself checked that
enough others hold it (``pipeline/rebalance.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from storaged.coord.catalogue import CatalogueUnavailable
from storaged.coord.manifest_store import CatalogRecord
from storaged.node.index import COLD, MEMORY
from storaged.node.pipeline.rebalance import HOT
from storaged.peer import PeerError, PeerHandler
from tiers import ByteRange, ChunkNotFound, CorruptChunk
from tiers.memory import Allocation

if TYPE_CHECKING:
    from storaged.node.evacuation import Evacuation
    from storaged.node.pipeline.encode import Encoder
    from storaged.node.pipeline.rebalance import Rebalance
    from storaged.node.read import ReadPath
    from storaged.node.services import ClusterView, LocalStore
    from storaged.node.write import WritePath

#: peer calls whose arguments and replies can be large: sent as msgpack bodies
DOC_METHODS = frozenset(
    {"chunk_info", "catalog_put", "catalog_get", "catalog_dump", "catalog_versions",
     "set_state", "drop_nvme", "evict", "drain_marks", "read_holds"}
)  # fmt: skip

Reply = tuple[dict[str, Any], bytes | bytearray | memoryview | None]
Method = Callable[[dict[str, Any], memoryview | None], Awaitable[Reply]]


@dataclass(eq=False, repr=False)
class PeerRpc:
    local: LocalStore
    cluster: ClusterView
    _: KW_ONLY
    writes: WritePath
    reads: ReadPath
    encoder: Encoder
    rebalance: Rebalance
    evacuation: Evacuation
    #: what this node tells its peers about itself (``Node.heartbeat``)
    heartbeat: Callable[[], dict[str, Any]]
    #: the checkpoints it served a manifest or plan of recently (``pipeline/retention.py``)
    read_holds: Callable[[], list[str]]

    def __post_init__(self) -> None:
        self.handler = _PeerHandler(self)

    async def call_local(self, method: str, args: dict[str, Any], body: memoryview | None) -> Reply:
        handler: Method | None = getattr(self, f"rpc_{method}", None)
        if handler is None:
            raise PeerError("bad_request", f"unknown method {method!r}")
        try:
            return await handler(args, body)
        except CatalogueUnavailable as exc:
            # etcd out of reach (or too few record holders): the caller's to retry, as a
            # peer out of reach is, not a handler's defect.
            raise PeerError("coordinator_unavailable", str(exc)) from exc

    async def rpc_ping(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        return self.heartbeat(), None

    async def rpc_chunk_info(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        touch = args.get("touch")
        until = float(touch) if touch is not None else None
        dropping = self.rebalance.dropping
        info: dict[str, list[Any]] = {}
        for cid in args["ids"]:
            if cid in self.local.collecting:
                continue  # being collected: held by no one from the moment it was decided
            # A slot being dropped is held by no one from the moment the drop was decided.
            hot = (cid, HOT) not in dropping
            mem = hot and self.local.memory_has(cid)
            nvme = hot and self.local.nvme_has(cid)
            frags = sorted(i for i in self.local.fragments.get(cid, ()) if (cid, i) not in dropping)
            known = self.local.index.get(cid)
            if mem or nvme or frags:
                if known is not None and until is not None:
                    known.touch(until)
                state = known.state if known else MEMORY
                size = known.size if known else -1
                info[cid] = [mem, nvme, frags, state, size]
        # Whether this node knows itself draining: a caller whose view is older than the
        # mark (a node just back) must not count what it holds as staying (Node.holdings).
        return {
            "info": info,
            "draining": self.cluster.membership.drains.is_draining(self.local.id),
        }, None

    async def rpc_get_chunk(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        cid = args["id"]
        rng = ByteRange(args.get("start", 0), args.get("end"))
        data, tier = await self.reads.read_hot(cid, rng)
        if data is None:
            raise PeerError("chunk_not_found", f"{cid} is not held hot here")
        return {"tier": tier}, data

    async def rpc_put_fragment(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        if body is None:
            raise PeerError("bad_request", "put_fragment needs a body")
        await self.writes.store_fragment(args["key"], body, int(args.get("size", -1)))
        return {}, None

    async def rpc_get_fragment(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        key = args["key"]
        try:
            data = await self.local.cold.get(key)
        except CorruptChunk as exc:
            self.local.metrics.corrupt.labels("cold").inc()
            self.local.forget_fragment(key)
            raise PeerError("corrupt", str(exc)) from exc
        except ChunkNotFound as exc:
            self.local.forget_fragment(key)
            raise PeerError("chunk_not_found", str(exc)) from exc
        except OSError as exc:
            # An unreadable disk (not proof the file is gone: kept): the reader goes on.
            raise PeerError("io_error", f"{key} cannot be read here: {exc}") from exc
        return {}, data

    async def rpc_set_state(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        await self.local.record_state(args["ids"], int(args["state"]))
        return {}, None

    async def rpc_drained(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        self.encoder.offer(args["id"])
        return {}, None

    async def rpc_drop_misplaced(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        """Rebalance: drop this node's copy (``slot`` -1) or fragment ``slot`` of ``id`` if
        every one of ``witnesses`` holds it; this node checks, the caller only asks."""
        witnesses = [str(w) for w in args["witnesses"]]
        dropped = await self.rebalance.drop_misplaced(str(args["id"]), int(args["slot"]), witnesses)
        return {"dropped": dropped}, None

    async def rpc_witness(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        """Rebalance: whether a checked copy (``slot`` -1) or fragment ``slot`` of ``id`` is
        here; if so it is kept from a drop here for ``pin`` seconds (``pipeline/rebalance.py``)."""
        if self.cluster.membership.drains.is_draining(self.local.id):
            # A node that is leaving vouches for nothing: a drop it witnessed could leave
            # the only other copy on a node that goes (its can_leave may have counted the
            # dropped one, taken before the drop).
            return {"held": False}, None
        held = await self.rebalance.witness(str(args["id"]), int(args["slot"]), float(args["pin"]))
        return {"held": held}, None

    async def rpc_drop_nvme(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        for cid in args["ids"]:
            # Only a cold chunk's nvme copy may go: it is what makes a chunk durable before.
            if self.local.is_cold(cid):
                await self.local.nvme.delete(cid)
        return {}, None

    async def rpc_evict(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        """Admin: push chunks out of RAM (and, with ``nvme``, off nvme) where a colder copy
        exists."""
        evicted = {"memory": 0, "nvme": 0}
        for cid in args["ids"]:
            info = self.local.index.get(cid)
            if info is None:
                continue
            colder = self.local.nvme_has(cid) or info.state >= COLD
            if self.local.memory_has(cid) and colder and not self.local.memory.is_dirty(cid):
                await self.local.memory.delete(cid)
                evicted["memory"] += 1
            nvme_goes = args.get("nvme") and info.state >= COLD and self.local.nvme_has(cid)
            if nvme_goes and not self.local.memory_has(cid):
                await self.local.nvme.delete(cid)
                evicted["nvme"] += 1
        return evicted, None

    async def rpc_drain_marks(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        """Embedded mode: the drain marks another node set, to take where newer."""
        marks = {str(n): (bool(m[0]), float(m[1])) for n, m in args["marks"].items()}
        await self.cluster.membership.drains.merge(marks)
        return {}, None

    async def rpc_drain_progress(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        return await self.evacuation.local_progress(), None

    async def rpc_read_holds(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        return {"names": self.read_holds()}, None

    async def rpc_catalog_put(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        record = CatalogRecord.from_wire(args["record"])
        ok = await self.local.catalog.store(record)
        return {"stored": ok}, None

    async def rpc_catalog_get(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        record = self.local.catalog.raw(args["name"])
        return {"record": record.to_wire() if record else None}, None

    async def rpc_catalog_versions(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        """For each name: ``[digest, committed, deleted]`` of the record held here, or None."""
        versions: dict[str, list[Any] | None] = {}
        for name in args["names"]:
            r = self.local.catalog.raw(name)
            versions[name] = None if r is None else [r.digest, r.committed, r.deleted]
        return {"versions": versions}, None

    async def rpc_catalog_dump(self, args: dict[str, Any], body: memoryview | None) -> Reply:
        prefix = args.get("prefix", "")
        with_chunks = bool(args.get("chunks"))
        records = []
        for r in self.local.catalog.records(prefix, tombstones=True):
            wire = r.to_wire()
            wire["manifest"] = None
            if not with_chunks:
                wire["chunks"] = []
            records.append(wire)
        return {"records": records}, None


class _PeerHandler(PeerHandler[Allocation]):
    """What the peer server calls: chunk receives go to the write path, calls to ``rpc_*``.

    A copy's body is received into an ``Allocation`` of the memory tier, which the peer
    server hands back as it was lent.
    """

    def __init__(self, rpc: PeerRpc) -> None:
        self.rpc = rpc

    async def receive_chunk(self, chunk_id: str, size: int) -> Allocation:
        return await self.rpc.writes.receive_chunk(chunk_id, size)

    async def chunk_received(self, chunk_id: str, buf: Allocation) -> dict[str, Any]:
        return await self.rpc.writes.chunk_received(chunk_id, buf)

    def ack_copy(self, chunk_id: str) -> None:
        self.rpc.writes.ack_copy_arriving()

    async def chunk_received_crc(
        self, chunk_id: str, buf: Allocation, crc32c: int
    ) -> dict[str, Any]:
        return await self.rpc.writes.chunk_received(chunk_id, buf, crc32c=crc32c)

    def chunk_aborted(self, chunk_id: str, buf: Allocation) -> None:
        self.rpc.writes.chunk_aborted(chunk_id, buf)

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], bytes | bytearray | memoryview | None]:
        if args.get("doc") and method in DOC_METHODS:
            if body is None:
                raise PeerError("bad_request", f"{method} needs its arguments as a body")
            try:
                doc = msgpack.unpackb(body, raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                raise PeerError("bad_request", f"{method}: arguments are not msgpack") from exc
            reply, _ = await self.rpc.call_local(method, doc, None)
            return {"doc": True}, msgpack.packb(reply, use_bin_type=True)
        return await self.rpc.call_local(method, args, body)
