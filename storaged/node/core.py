"""One storaged node: its tiers, its chunk index, and the stages of a chunk's life.

The stages live one module each, and each says which invariants it relies on and which
it upholds (``docs/RELIABILITY.md`` has the whole list):

==========================  ==========================================================
``write.py``                the PUT path: RAM here and on the other holders, the ack
``read.py``                 the GET path: fastest local tier, a peer, or fragments
``checkpoints.py``          commits, the catalogue quorum, status and restore plans
``pipeline/drain.py``       RAM -> nvme on every holder
``pipeline/encode.py``      nvme -> cold fragments, by the chunk's owner
``pipeline/repair.py``      missing copies, fragments and catalogue records
``pipeline/rebalance.py``   copies and fragments to where placement says, paced
``pipeline/gc.py``          unreferenced chunks after the grace period, retention
``pipeline/scrub.py``       re-reads stored bytes
``referenced.py``           which chunks are referenced, from a fresh snapshot only
``evacuation.py``           draining a node that is to leave: the marks, and when it can go
``space.py``                whether the disk tiers have room: full and nearly-full marks
``rpc.py``                  the peer calls other nodes make on this one
==========================  ==========================================================

This module holds what they share: configuration, tiers, the index, placement, and the
peer-call plumbing. The HTTP layer (``storaged.server``) calls the ``Node`` methods below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import msgpack

from erasure import make_codec, parse_fragment_key
from erasure.base import Codec
from storaged.catalog import Catalog, CatalogRecord
from storaged.catalogue import Catalogue, CatalogueUnavailable, EmbeddedCatalogue
from storaged.config import Config, NodeSpec
from storaged.manifest import CheckedManifest
from storaged.membership import Membership, StaticMembership
from storaged.metrics import NodeMetrics
from storaged.node.checkpoints import Checkpoints
from storaged.node.evacuation import Evacuation
from storaged.node.index import (
    COLD,
    MEMORY,
    NVME,
    ChunkInfo,
    ChunkLocks,
    Holding,
    StateLog,
)
from storaged.node.pipeline.drain import Drain
from storaged.node.pipeline.encode import Encoder
from storaged.node.pipeline.gc import Collector
from storaged.node.pipeline.rebalance import Rebalance
from storaged.node.pipeline.repair import Repair
from storaged.node.pipeline.scrub import Scrubber
from storaged.node.read import ReadPath
from storaged.node.referenced import ReferencedSet
from storaged.node.rpc import DOC_METHODS, PeerRpc
from storaged.node.space import DiskSpace
from storaged.node.write import BodyPieces, WritePath
from storaged.peer import PeerClient, PeerError, PeerServer, PeerUnavailable
from storaged.placement import Placement
from tiers import ByteRange, ChunkNotFound, CorruptChunk
from tiers.cold import ColdTier
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier

log = logging.getLogger("storaged.node")
T = TypeVar("T")

#: chunk ids per chunk_info call
_INFO_BATCH = 4096
#: seconds between probes of the disk tiers' free space (node/space.py)
_SPACE_INTERVAL = 1.0


class Node:
    """A storaged node. Create with ``await Node.open(config)``, stop with ``await
    shutdown()`` (graceful: drains RAM-only data first) or ``await close()`` (at once)."""

    def __init__(
        self,
        config: Config,
        memory: MemoryTier,
        nvme: NvmeTier,
        cold: ColdTier,
        codec: Codec,
        catalog: Catalog,
        state_log: StateLog,
        index: dict[str, ChunkInfo],
        *,
        membership: Membership | None = None,
        catalogue: Catalogue | None = None,
    ) -> None:
        self.config = config
        self.id = config.node_id
        self.memory = memory
        self.nvme = nvme
        self.cold = cold
        self.codec = codec
        self.catalog = catalog
        self.state_log = state_log
        self.index = index
        self.fragments: dict[str, set[int]] = {}
        #: full and nearly-full marks of the disk tiers, from their writes and a probe
        self.space = DiskSpace({"nvme": nvme, "cold": cold})
        self.locks = ChunkLocks()
        #: chunks whose collection has been decided and is under way: held by no one
        self.collecting: set[str] = set()
        self.metrics = NodeMetrics()
        secret = config.cluster_secret.encode()
        self.rpc = PeerRpc(self)
        self.peers = PeerClient(self.id, secret)
        self.peer_server = PeerServer(self.id, secret, self.rpc.handler)
        self.membership: Membership = membership or StaticMembership(
            self.id,
            config.nodes,
            self._ping,
            interval=config.heartbeat_interval,
            down_after=config.down_after,
            marks_path=config.data_dir / "drain-marks.json",
        )
        self.catalogue: Catalogue = catalogue or EmbeddedCatalogue(self)
        self.writes = WritePath(self)
        self.reads = ReadPath(self)
        self.checkpoints = Checkpoints(self)
        self.drainer = Drain(self)
        self.encoder = Encoder(self)
        self.repairer = Repair(self)
        self.rebalance = Rebalance(self)
        #: "is this chunk unreferenced?", one answer for every stage (fresh snapshots only)
        self.referenced = ReferencedSet(config.gc_grace / 2, config.gc_grace)
        self.collector = Collector(self, self.referenced)
        self.scrubber = Scrubber(self)
        self.evacuation = Evacuation(self)
        self._tasks: set[asyncio.Task[None]] = set()
        #: every member's spec as the views this node took named it (``spec``)
        self._specs: dict[str, NodeSpec] = {}
        #: set by ``shutdown``: new PUTs (HTTP and peer) are refused from then on
        self.stopping = False
        #: set by ``shutdown`` once it no longer waits for PUTs in flight: a co-located
        #: client's lease taken before the stop is no longer sealed from then on
        self.writes_closed = False
        self.started = time.time()
        #: the shared-memory listener's address for local clients (set by the front end)
        self.shm_info: dict[str, Any] | None = None

    # ---- life cycle ----------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        config: Config,
        *,
        membership: Membership | None = None,
        catalogue: Callable[[Node], Catalogue] | None = None,
    ) -> Node:
        """Open the node's tiers and index. Membership and catalogue default to the embedded
        ones (cluster file + heartbeats; records on the nodes); pass others to inject them
        (``catalogue`` is a factory: it gets the node)."""
        data = config.data_dir
        await asyncio.to_thread(lambda: data.mkdir(parents=True, exist_ok=True))
        memory = MemoryTier(config.memory_capacity, put_timeout=config.put_wait)
        nvme = await NvmeTier.open(data / "nvme", config.nvme_capacity)
        cold = await ColdTier.open(data / "cold", config.cold_capacity)
        catalog = await Catalog.open(data / "catalog")
        state_log = StateLog(data / "chunks.state")
        index = await asyncio.to_thread(state_log.load)
        codec = make_codec(config.codec, config.k, config.n)
        node = cls(
            config, memory, nvme, cold, codec, catalog, state_log, index, membership=membership
        )
        if catalogue is not None:
            node.catalogue = catalogue(node)
        await node._rebuild_index()
        return node

    async def _rebuild_index(self) -> None:
        """Join the state log with what the disks hold; what no disk holds is forgotten."""
        now = time.time()
        on_nvme: dict[str, int] = {}
        async for key in self.nvme.keys():
            on_nvme[key] = (await self.nvme.stat(key)).size
        stored: list[str] = []
        async for key in self.cold.keys():
            stored.append(key)
        bad = await self._check_fragments(stored)
        async for key in self.cold.keys():
            cid, index = parse_fragment_key(key)
            self.fragments.setdefault(cid, set()).add(index)
        for cid, size in on_nvme.items():
            info = self.index.get(cid)
            if info is None:
                self.index[cid] = ChunkInfo(size, NVME, now)
            else:
                info.state = max(info.state, NVME)
        for cid in self.fragments:
            if cid not in self.index:
                # Fragments only: the state log was lost; a fragment is only written when the
                # chunk was fully on nvme, so "nvme" is a safe lower bound.
                self.index[cid] = ChunkInfo(-1, NVME, now)
        gone = [cid for cid in self.index if cid not in on_nvme and cid not in self.fragments]
        for cid in gone:
            del self.index[cid]
        # Uses before the restart were not recorded: count everything as used now (this
        # only delays collections by one grace period).
        for info in self.index.values():
            info.last_use = now
        log.info(
            "node %s: index rebuilt: %d chunks on nvme, %d with fragments (%d fragment(s) "
            "failed their check and were quarantined), %d forgotten",
            self.id,
            len(on_nvme),
            len(self.fragments),
            bad,
            len(gone),
        )

    async def _check_fragments(self, keys: list[str]) -> int:
        """Read and check every fragment on disk before any is advertised (a crash or a
        flip while the node was down must not count as a held fragment until the first
        scrub); what fails is quarantined by the tier. Returns how many failed.

        Costs one read of the cold tier per start, at disk speed, four at a time."""
        slots = asyncio.Semaphore(4)
        failed = 0

        async def check(key: str) -> None:
            nonlocal failed
            async with slots:
                try:
                    await self.cold.get(key)
                except CorruptChunk:
                    failed += 1
                    self.metrics.corrupt.labels("cold").inc()
                except ChunkNotFound:
                    pass

        await asyncio.gather(*(check(k) for k in keys))
        return failed

    async def start(self) -> None:
        host, port = self.config.node.peer_addr
        await self.peer_server.start(host, port)
        await self.membership.start()
        self.drainer.start()
        self.encoder.start()
        self.rebalance.start()
        self.spawn(self._periodic(self.config.gc_interval, self.gc_pass), "gc")
        self.spawn(self._periodic(self.config.repair_interval, self.repair_pass), "repair")
        self.spawn(self._periodic(self.config.scrub_interval, self.scrub_pass), "scrub")
        self.spawn(self._prefault(), "prefault")
        self.spawn(self._periodic(_SPACE_INTERVAL, self.space.refresh, jitter=False), "space")
        # Chunks that were on nvme but not yet cold when we stopped: offer them to the encoder.
        for cid, info in self.index.items():
            if info.state < COLD:
                self.encoder.offer(cid)

    async def _prefault(self) -> None:
        """Map part of the RAM tier ahead of the first PUTs (8 MiB, the client's chunk size)."""
        size = min(8 * 2**20, self.config.max_chunk_size)
        count = int(self.config.memory_capacity * self.config.prefault_fraction) // size
        if count > 0:
            added = await self.memory.prefault(size, count)
            log.info("pre-faulted %d RAM buffers of %d bytes", added, size)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as a background task of this node (cancelled by ``close``)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Graceful stop (I5): refuse new PUTs, let those in flight finish, drain every
        RAM-only chunk to nvme, then close. Bounded by ``timeout`` (default
        ``config.stop_timeout``); returns whether everything acknowledged got to disk."""
        limit = self.config.stop_timeout if timeout is None else timeout
        self.stopping = True
        deadline = time.monotonic() + limit
        await self.membership.leaving()  # out of everyone's placement while it drains
        log.info("node %s stopping: refusing new PUTs, draining RAM-only chunks", self.id)
        while self.writes.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.writes_closed = True  # no lease is sealed after this (storaged.shm)
        left = await self.drainer.drain_all(deadline)
        if left:
            log.error(
                "node %s: %d RAM-only chunk(s) not on disk after %.0f s: %s",
                self.id,
                len(left),
                limit,
                ", ".join(left[:8]),
            )
        else:
            log.info("node %s: every RAM-only chunk is on disk", self.id)
        await self.close()
        return not left

    async def close(self) -> None:
        """Stop at once (what a crash leaves behind, minus the torn files)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.drainer.close()
        await self.encoder.close()
        await self.rebalance.close()
        await self.membership.close()
        await self.peer_server.close()
        await self.peers.close()
        await self.memory.close()
        await self.nvme.close()
        await self.cold.close()
        self.state_log.close()

    async def _periodic(
        self, interval: float, job: Callable[[], Awaitable[Any]], *, jitter: bool = True
    ) -> None:
        # Jitter spreads the nodes' passes apart.
        await asyncio.sleep(interval * random.uniform(0.5, 1.0) if jitter else 0.0)
        while True:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except CatalogueUnavailable as exc:
                # etcd out of reach, a leader change: the next pass tries again. A line, not
                # a traceback: nothing is wrong with the node.
                log.warning("background pass %s: %s", getattr(job, "__name__", job), exc)
            except Exception:
                log.exception("background pass %s failed", getattr(job, "__name__", job))
            await asyncio.sleep(interval * (random.uniform(0.8, 1.2) if jitter else 1.0))

    # ---- placement -------------------------------------------------------------------------
    def placement(self) -> Placement:
        """Placement from the membership as it is now: take one per operation and ask only
        it (``storaged.placement.Placement``)."""
        view = self.membership.view()
        for member in view.members:
            self._specs[member.id] = member
        return Placement(view, self.config.replication, self.config.n)

    def spec(self, node_id: str) -> NodeSpec:
        """``node_id``'s addresses: from the membership, or, for a member removed since a
        view that named it was taken (a gone member on etcd), as that view had them; an
        operation's one view must not fail half-way because the member list moved on.
        ``KeyError`` for a node no view ever named."""
        try:
            spec = self.membership.node(node_id)
        except KeyError:
            return self._specs[node_id]
        self._specs[node_id] = spec
        return spec

    # ---- peer calls ------------------------------------------------------------------------
    async def call(
        self,
        node_id: str,
        method: str,
        args: dict[str, Any],
        body: bytes | bytearray | memoryview | None = None,
        timeout: float = 30.0,
        *,
        until_down: bool = False,
    ) -> tuple[dict[str, Any], bytes | memoryview | None]:
        """``method`` on ``node_id`` (locally without a socket when it is this node).

        ``until_down``: for a question whose asker goes on without a node that does not
        answer (a listing, a status, a plan): the call is abandoned (``PeerUnavailable``)
        as soon as the membership holds ``node_id`` down, so that a hung node, which
        accepts connections and never replies, costs a query about ``down_after``, not
        ``timeout``."""
        if until_down and node_id != self.id:
            return await self._until_down(node_id, self.call(node_id, method, args, body, timeout))
        if node_id == self.id:
            reply, out = await self.rpc.call_local(method, args, memoryview(body) if body else None)
            return reply, (bytes(out) if isinstance(out, bytearray) else out)
        try:
            spec = self.spec(node_id)
        except KeyError:
            # Removed from the membership (a gone member, on etcd) between the caller's
            # view and this call: as unreachable as a dead one.
            raise PeerUnavailable("unreachable", f"{node_id} is no longer a member") from None
        addr = self.config.dial_addr(spec)
        try:
            if method in DOC_METHODS:
                # Arguments and reply travel as msgpack bodies: a manifest or a batch of
                # thousands of chunk ids is far over the peer protocol's header limit.
                packed = msgpack.packb(args, use_bin_type=True)
                _, out = await self.peers.call(addr, method, {"doc": True}, packed, timeout=timeout)
                return msgpack.unpackb(out, raw=False) if out is not None else {}, None
            return await self.peers.call(addr, method, args, body, timeout=timeout)
        except PeerUnavailable:
            self.membership.report_failure(node_id)
            raise

    async def _until_down(self, node_id: str, call: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(call)
        try:
            # Checked as often as heartbeats come: no sooner can the verdict change.
            step = max(0.05, self.config.heartbeat_interval)
            while True:
                done, _ = await asyncio.wait({task}, timeout=step)
                if done:
                    return task.result()
                if not self.membership.is_alive(node_id):
                    raise PeerUnavailable("timeout", f"{node_id} went down while asked")
        finally:
            if not task.done():
                task.cancel()  # the peer client drops the connection
                with contextlib.suppress(asyncio.CancelledError, PeerError):
                    await task

    async def _ping(self, spec: NodeSpec) -> dict[str, Any]:
        reply, _ = await self.peers.call(self.config.dial_addr(spec), "ping", {}, timeout=2.0)
        return reply

    async def holdings(
        self,
        node_ids: Iterable[str],
        ids: list[str],
        *,
        touch: float | None = None,
        timeout: float = 30.0,
        answered: set[str] | None = None,
        draining: set[str] | None = None,
    ) -> dict[str, list[Holding]]:
        """Which of ``node_ids`` hold which of ``ids``, and how. Unreachable nodes are skipped.

        With ``touch``, every node that reports a chunk held also records that a request
        relies on its copy until that time (see ``ChunkInfo.last_use``): the answer and the
        touch are one step on that node, so GC cannot collect what was just reported held.
        ``answered``, if given, gets the ids of the nodes that answered; ``draining`` those
        that said they are draining (whatever the caller's view says: it may predate the
        mark), whose holdings a count of what stays must leave out.
        """
        out: dict[str, list[Holding]] = {cid: [] for cid in ids}
        args_extra = {} if touch is None else {"touch": touch}

        async def ask(node_id: str, batch: list[str]) -> None:
            try:
                reply, _ = await self.call(
                    node_id,
                    "chunk_info",
                    {"ids": batch, **args_extra},
                    timeout=timeout,
                    until_down=True,
                )
            except PeerError:
                return
            if answered is not None:
                answered.add(node_id)
            if draining is not None and reply.get("draining"):
                draining.add(node_id)
            for cid, (mem, nvme, frags, state, size) in reply["info"].items():
                if cid in out:
                    out[cid].append(Holding(node_id, mem, nvme, tuple(frags), state, size))

        # Batches keep each call's message small for checkpoints of many chunks.
        batches = [ids[i : i + _INFO_BATCH] for i in range(0, len(ids), _INFO_BATCH)]
        await asyncio.gather(*(ask(n, b) for n in node_ids for b in batches))
        return out

    async def chunk_states(
        self, ids: list[str], *, touch: float | None = None, placement: Placement | None = None
    ) -> dict[str, tuple[int, int]]:
        """Cluster-wide (state, size) of each held chunk; absent ids are not held anywhere.

        Held: a hot copy on some live node, or at least ``k`` distinct fragments. Asks the
        live nodes of ``placement`` (the caller's view; a new one without)."""
        alive = (placement or self.placement()).alive
        return self.states_of(await self.holdings(alive, ids, touch=touch))

    def states_of(self, held: dict[str, list[Holding]]) -> dict[str, tuple[int, int]]:
        """``chunk_states`` from holdings already asked for."""
        out: dict[str, tuple[int, int]] = {}
        for cid, answers in held.items():
            if not answers:
                continue
            state = max(h.state for h in answers)
            frags = {i for h in answers for i in h.fragments}
            if len(frags) >= self.config.n:
                state = COLD
            size = max(h.size for h in answers)
            hot = sum(1 for h in answers if h.hot)
            if hot == 0 and len(frags) < self.config.k:
                continue  # neither a copy nor enough fragments: not held
            out[cid] = (state, size)
        return out

    # ---- local holdings ------------------------------------------------------------------
    def memory_has(self, chunk_id: str) -> bool:
        """A RAM copy of this node's own (a co-located client's local copy is not one: it
        serves reads through shared memory and counts for nothing else)."""
        return self.memory.holds(chunk_id)

    def nvme_has(self, chunk_id: str) -> bool:
        return self.nvme.has(chunk_id)

    def holds_hot(self, chunk_id: str) -> bool:
        return self.memory_has(chunk_id) or self.nvme_has(chunk_id)

    def is_cold(self, chunk_id: str) -> bool:
        info = self.index.get(chunk_id)
        return info is not None and info.state >= COLD

    @property
    def url(self) -> str:
        """This node's advertised HTTP URL (what refusals name it by)."""
        return self.config.node.url

    def usage(self) -> dict[str, dict[str, Any]]:
        """Per tier: used, capacity, count; for the disk tiers also their room marks
        (``DiskSpace.mark``: state, free, full_since, cause)."""
        out: dict[str, dict[str, Any]] = {}
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            out[tier.name] = {"used": u.used, "capacity": u.capacity, "count": u.count}
        out["memory"]["dirty"] = self.memory.stats().dirty_bytes
        for name in ("nvme", "cold"):
            out[name].update(self.space.mark(name))
        return out

    def heartbeat(self) -> dict[str, Any]:
        """What this node tells its peers (and ``/v1/cluster``) about itself."""
        return {
            "id": self.id,
            "usage": self.usage(),
            "stopping": self.stopping,
            "up_since": self.started,
            "drain_backlog": self.drainer.backlog,
            "encode_backlog": self.encoder.backlog,
            "repair_backlog": self.repairer.backlog,
            "drain_marks": {n: [on, at] for n, (on, at) in self.membership.drains.known().items()},
            "misplaced_backlog": self.repairer.misplaced,
            "repair_pass_at": self.repairer.last_pass_started,
            "gc": self.referenced.status(),
            "shm": self.shm_info,
        }

    def note_stored(self, chunk_id: str, size: int) -> None:
        """A verified copy of ``chunk_id`` is now here (RAM): index it, counted as used now."""
        now = time.time()
        info = self.index.get(chunk_id)
        if info is None:
            self.index[chunk_id] = ChunkInfo(size, MEMORY, now, now)
        else:
            if info.size < 0:
                info.size = size
            info.touch(now)

    async def record_state(self, ids: Iterable[str], state: int) -> None:
        records = []
        for cid in ids:
            info = self.index.get(cid)
            if info is not None and info.state < state:
                info.state = state
                records.append((cid, state, info.size, info.stored_at))
        await self.state_log.append(records, sync=True)

    def forget_fragment(self, key: str) -> None:
        cid, index = parse_fragment_key(key)
        held = self.fragments.get(cid)
        if held is not None:
            held.discard(index)
            if not held:
                del self.fragments[cid]

    def update_gauges(self) -> None:
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            self.metrics.tier_bytes.labels(tier.name).set(u.used)
            self.metrics.tier_chunks.labels(tier.name).set(u.count)
            self.metrics.tier_capacity.labels(tier.name).set(u.capacity)

    # ---- what the HTTP layer calls -------------------------------------------------------
    async def put_chunk(
        self, chunk_id: str, size: int, body: BodyPieces
    ) -> tuple[int, dict[str, Any]]:
        return await self.writes.put_chunk(chunk_id, size, body)

    async def read_fragment(self, chunk_id: str, index: int) -> memoryview:
        return await self.reads.local_fragment(chunk_id, index)

    async def read_chunk(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview, str]:
        return await self.reads.read_chunk(chunk_id, rng)

    async def missing(self, ids: list[str]) -> list[str]:
        """Of ``ids``, those the cluster does not hold. The held ones count as used now."""
        states = await self.chunk_states(list(dict.fromkeys(ids)), touch=time.time())
        return [c for c in ids if c not in states]

    async def commit(self, name: str, checked: CheckedManifest) -> tuple[int, dict[str, Any]]:
        return await self.checkpoints.commit(name, checked)

    async def get_checkpoint(self, name: str) -> CatalogRecord:
        return await self.checkpoints.get(name)

    async def list_checkpoints(self, prefix: str) -> list[CatalogRecord]:
        return await self.checkpoints.list(prefix)

    async def delete_checkpoint(self, name: str) -> None:
        await self.checkpoints.delete(name)

    async def checkpoint_status(self, name: str) -> dict[str, Any]:
        return await self.checkpoints.status(name)

    async def restore_plan(self, name: str) -> dict[str, Any]:
        return await self.checkpoints.restore_plan(name)

    async def evict(self, name: str, *, nvme: bool) -> dict[str, int]:
        record = await self.checkpoints.get(name)
        results = await asyncio.gather(
            *(
                self.call(n, "evict", {"ids": record.chunks, "nvme": nvme})
                for n in self.placement().alive
            ),
            return_exceptions=True,
        )
        totals = {"memory": 0, "nvme": 0}
        for r in results:
            if not isinstance(r, BaseException):
                for k in totals:
                    totals[k] += int(r[0].get(k, 0))
        return totals

    async def drain(self, node_id: str, *, cancel: bool = False) -> dict[str, Any]:
        return await self.evacuation.mark(node_id, draining=not cancel)

    async def drain_progress(self, node_id: str) -> dict[str, Any]:
        return await self.evacuation.progress(node_id)

    # ---- background passes (also called directly by tests) ----------------------------------
    async def gc_pass(self) -> None:
        await self.collector.gc_pass()

    async def repair_pass(self) -> None:
        await self.repairer.repair_pass()

    async def scrub_pass(self) -> None:
        await self.scrubber.scrub_pass()

    @contextlib.asynccontextmanager
    async def local_copy(self, chunk_id: str) -> AsyncIterator[bytes | memoryview | None]:
        async with self.reads.local_copy(chunk_id) as data:
            yield data
