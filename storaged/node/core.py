"""One storaged node: its tiers, its chunk index, and the stages of a chunk's life.

The stages live one module each, and each says which invariants it relies on and which
it upholds (``docs/RELIABILITY.md`` has the whole list):

==========================  ==========================================================
``write.py``                the PUT path: RAM here and on the other holders, the ack
``read.py``                 the GET path: fastest local tier, a peer, or fragments
``checkpoints.py``          commits, the catalogue quorum, status and restore plans
``archive.py``              checkpoints to the archive tier; reads through it
``pipeline/drain.py``       RAM -> nvme on every holder
``pipeline/encode.py``      nvme -> cold fragments, by the chunk's owner
``pipeline/repair.py``      missing copies, fragments and catalogue records
``pipeline/rebalance.py``   copies and fragments to where placement says, paced
``pipeline/gc.py``          unreferenced chunks after the grace period, retention
``pipeline/scrub.py``       re-reads stored bytes
``pipeline/leadership.py``  who leads a chunk's repair, which members are away
``pipeline/retention.py``   the retention policy, applied by the leader through ``rm``
``referenced.py``           which chunks are referenced, from a fresh snapshot only
``evacuation.py``           draining a node that is to leave: the marks, and when it can go
``space.py``                whether the disk tiers have room: full and nearly-full marks
``rpc.py``                  the peer calls other nodes make on this one
``local.py``                what this node holds: tiers, index, fragments, locks
``cluster.py``              placement, who holds what, the peer calls this node makes
==========================  ==========================================================

Each stage is built from small services alone (``services.py``): what this node holds
(``local.py``), the cluster as it sees it and the peer calls (``cluster.py``), and the
sibling stages it hands work to. This module is the wiring and the life cycle; the HTTP
layer (``storaged.front.http``) calls the ``Node`` methods below.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from erasure import make_codec
from erasure.base import Codec
from storaged.config import Config, ConfigError
from storaged.coord.catalogue import Catalogue, CatalogueUnavailable, EmbeddedCatalogue
from storaged.coord.manifest_store import Catalog, CatalogRecord
from storaged.coord.membership import Membership, StaticMembership
from storaged.errors import NotFound
from storaged.manifest import CheckedManifest
from storaged.node.archive import Archive, ReadThroughCache, is_archived_record, open_archive
from storaged.node.checkpoints import Checkpoints
from storaged.node.cluster import Cluster, ping
from storaged.node.evacuation import Evacuation
from storaged.node.index import COLD, IndexEntry, StateLog
from storaged.node.local import Local
from storaged.node.pipeline.drain import Drain
from storaged.node.pipeline.encode import Encoder
from storaged.node.pipeline.gc import Collector
from storaged.node.pipeline.leadership import Leadership
from storaged.node.pipeline.rebalance import Rebalance
from storaged.node.pipeline.repair import Repair
from storaged.node.pipeline.retention import ReadHolds, Retention
from storaged.node.pipeline.scrub import Scrubber
from storaged.node.read import ReadPath
from storaged.node.referenced import ReferencedSet
from storaged.node.rpc import PeerRpc
from storaged.node.services import DataPlane
from storaged.node.write import BodyPieces, WritePath
from storaged.peer import PeerClient, PeerServer
from storaged.retention import PolicyError
from tiers import ByteRange, ChunkNotFound
from tiers.archive import ArchiveTier
from tiers.cold import ColdTier
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier

log = logging.getLogger("storaged.node")

#: seconds between probes of the disk tiers' free space (node/space.py)
_SPACE_INTERVAL = 1.0


class Node:
    """A storaged node. Create with ``await Node.open(config)``, stop with ``await
    shutdown()`` (graceful: drains RAM-only data first) or ``await close()`` (at once).

    ``catalogue``: the catalogue, or a factory that gets the node's chunks (``DataPlane``:
    the node itself) once its write and read paths exist; the embedded one without."""

    def __init__(
        self,
        config: Config,
        memory: MemoryTier,
        nvme: NvmeTier,
        cold: ColdTier,
        codec: Codec,
        catalog: Catalog,
        state_log: StateLog,
        index: dict[str, IndexEntry],
        *,
        membership: Membership | None = None,
        catalogue: Catalogue | Callable[[DataPlane], Catalogue] | None = None,
        archive: ArchiveTier | None = None,
    ) -> None:
        self.config = config
        #: the archive tier (``[archive] url``), None when there is none
        self.archive_tier = archive
        self.id = config.node_id
        self.url = config.node.url
        self.local = local = Local(config, memory, nvme, cold, codec, catalog, state_log, index)
        # The services' objects and calls, named on the node as the HTTP layer and the
        # tests reach them (the same objects: nothing is copied or kept twice).
        self.memory, self.nvme, self.cold, self.codec = memory, nvme, cold, codec
        self.catalog, self.state_log, self.index = catalog, state_log, index
        self.fragments, self.space, self.locks = local.fragments, local.space, local.locks
        self.collecting, self.metrics = local.collecting, local.metrics
        self.memory_has = local.memory_has
        self.nvme_has = local.nvme_has
        self.holds_hot = local.holds_hot
        self.is_cold = local.is_cold
        self.usage = local.usage
        self.forget_fragment = local.forget_fragment
        self.update_gauges = local.update_gauges
        self.spawn = local.spawn
        secret = config.cluster_secret.encode()
        self.peers = PeerClient(self.id, secret)
        self.membership: Membership = membership or StaticMembership(
            self.id,
            config.nodes,
            functools.partial(ping, self.peers, config),
            interval=config.heartbeat_interval,
            down_after=config.down_after,
            marks_path=config.data_dir / "drain-marks.json",
        )
        self.cluster = cluster = Cluster(config, self.membership, self.peers)
        self.placement, self.spec, self.call = cluster.placement, cluster.spec, cluster.call
        self.holdings, self.chunk_states = cluster.holdings, cluster.chunk_states
        self._wire_stages(catalogue)
        self.peer_server = PeerServer(self.id, secret, self.rpc.handler)
        self.started = time.time()
        #: the shared-memory listener's address for local clients (set by the front end)
        self.shm_info: dict[str, Any] | None = None

    def _wire_stages(self, catalogue: Catalogue | Callable[[DataPlane], Catalogue] | None) -> None:
        """Each stage from the services and the sibling stages it uses. Where a stage hands
        work to one built after it (write -> drain -> encode), the hand-over is bound late."""
        local, cluster, config = self.local, self.cluster, self.config
        #: "is this chunk unreferenced?", one answer for every stage (fresh snapshots only)
        self.referenced = ReferencedSet(config.gc_grace / 2, config.gc_grace)
        #: who leads each chunk's repair, and which members are away (repair keeps it)
        self.leadership = leads = Leadership(config)
        self.writes = WritePath(local, cluster, to_drain=lambda cid: self.drainer.offer(cid))
        cache = ReadThroughCache(config.archive_cache_size)
        self.reads = ReadPath(local, cluster, cached=cache.get)
        if isinstance(catalogue, Catalogue):
            self.catalogue: Catalogue = catalogue
        elif catalogue is not None:
            self.catalogue = catalogue(self)
        else:
            self.catalogue = EmbeddedCatalogue(local, cluster)
        self.checkpoints = Checkpoints(local, cluster, self.catalogue)
        self.archive = Archive(
            local,
            self.archive_tier,
            cache,
            read_chunk=self.reads.read_chunk,
            get_record=self.checkpoints.get,
        )
        self.drainer = Drain(
            local, cluster, writes=self.writes, to_encode=lambda cid: self.encoder.offer(cid)
        )
        self.encoder = Encoder(local, cluster, reads=self.reads, drainer=self.drainer)
        self.rebalance = Rebalance(
            local,
            cluster,
            leadership=leads,
            reads=self.reads,
            writes=self.writes,
            referenced=self.referenced,
        )
        self.repairer = Repair(
            local,
            cluster,
            leadership=leads,
            reads=self.reads,
            writes=self.writes,
            encoder=self.encoder,
            rebalance=self.rebalance,
            referenced=self.referenced,
            catalogue=self.catalogue,
        )
        self.collector = Collector(
            local, cluster, referenced=self.referenced, leadership=leads, catalogue=self.catalogue
        )
        self.scrubber = Scrubber(local)
        #: the checkpoints whose manifest or plan this node served within the grace
        self.read_holds = ReadHolds(config.gc_grace)
        # A node without an archive refuses a policy with archive clauses.
        archives = self.archive.configured
        self.retention = Retention(
            local,
            cluster,
            catalogue=self.catalogue,
            delete=self.checkpoints.delete,
            holds=self.read_holds,
            archive=self.archive.archive if archives else None,
            is_archived=self.archive.archived if archives else None,
        )
        self.evacuation = Evacuation(
            local, cluster, writes=self.writes, leadership=leads, referenced=self.referenced
        )
        self.rpc = PeerRpc(
            local,
            cluster,
            writes=self.writes,
            reads=self.reads,
            encoder=self.encoder,
            rebalance=self.rebalance,
            evacuation=self.evacuation,
            heartbeat=self.heartbeat,
            read_holds=self.read_holds.names,
        )
        cluster.serve_locally(self.rpc.call_local)

    @property
    def stopping(self) -> bool:
        """Set by ``shutdown``: new PUTs (HTTP and peer) are refused from then on."""
        return self.local.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.local.stopping = value

    @property
    def writes_closed(self) -> bool:
        """Set by ``shutdown`` once it no longer waits for PUTs in flight: a co-located
        client's lease taken before the stop is no longer sealed from then on."""
        return self.local.writes_closed

    # ---- life cycle ----------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        config: Config,
        *,
        membership: Membership | None = None,
        catalogue: Callable[[DataPlane], Catalogue] | None = None,
    ) -> Node:
        """Open the node's tiers and index. Membership and catalogue default to the embedded
        ones (cluster file + heartbeats; records on the nodes); pass others to inject them
        (``catalogue`` is a factory: it gets the node's chunks, ``DataPlane``)."""
        data = config.data_dir
        await asyncio.to_thread(lambda: data.mkdir(parents=True, exist_ok=True))
        # First: a node that cannot reach its archive refuses to start (CannotOpenArchive)
        archive = await open_archive(config) if config.archive else None
        memory = MemoryTier(config.memory_capacity, put_timeout=config.put_wait)
        nvme = await NvmeTier.open(data / "nvme", config.nvme_capacity)
        cold = await ColdTier.open(data / "cold", config.cold_capacity)
        catalog = await Catalog.open(data / "catalog")
        state_log = StateLog(data / "chunks.state")
        index = await asyncio.to_thread(state_log.load)
        codec = make_codec(config.codec, config.k, config.n)
        node = cls(
            config,
            memory,
            nvme,
            cold,
            codec,
            catalog,
            state_log,
            index,
            membership=membership,
            catalogue=catalogue,
            archive=archive,
        )
        await node.local.rebuild_index()
        return node

    async def start(self) -> None:
        try:
            self.retention.check(self.config.retention)
        except PolicyError as exc:
            raise ConfigError(f"[[retention]]: {exc}") from None
        host, port = self.config.node.peer_addr
        await self.peer_server.start(host, port)
        await self.membership.start()
        self.drainer.start()
        self.encoder.start()
        self.rebalance.start()
        self.spawn(self._periodic(self.config.gc_interval, self.gc_pass), "gc")
        self.spawn(self._periodic(self.config.repair_interval, self.repair_pass), "repair")
        self.spawn(self._periodic(self.config.scrub_interval, self.scrub_pass), "scrub")
        self.spawn(self._periodic(self.config.retention_interval, self.retention_pass), "retention")
        self.spawn(self.local.prefault(), "prefault")
        self.spawn(self._periodic(_SPACE_INTERVAL, self.space.refresh, jitter=False), "space")
        # Chunks that were on nvme but not yet cold when we stopped: offer them to the encoder.
        for cid, info in self.index.items():
            if info.state < COLD:
                self.encoder.offer(cid)

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Graceful stop (I5): refuse new PUTs, let those in flight finish, drain every
        RAM-only chunk to nvme, then close. Bounded by ``timeout`` (default
        ``config.stop_timeout``); returns whether everything acknowledged got to disk."""
        limit = self.config.stop_timeout if timeout is None else timeout
        self.local.stopping = True
        deadline = time.monotonic() + limit
        await self.membership.leaving()  # out of everyone's placement while it drains
        log.info("node %s stopping: refusing new PUTs, draining RAM-only chunks", self.id)
        while self.writes.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.local.writes_closed = True  # no lease is sealed after this (storaged.front.shm)
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
        tasks = list(self.local.tasks)
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
        if self.archive_tier is not None:
            await self.archive_tier.close()
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
        """The chunk from the cluster, else read through from the archive (if any)."""
        try:
            return await self.reads.read_chunk(chunk_id, rng)
        except ChunkNotFound:
            if not self.archive.configured:
                raise
        return await self.archive.read_through(chunk_id, rng)

    async def missing(self, ids: list[str]) -> list[str]:
        """Of ``ids``, those the cluster does not hold. The held ones count as used now."""
        return await self.checkpoints.missing(ids)

    async def commit(self, name: str, checked: CheckedManifest) -> tuple[int, dict[str, Any]]:
        return await self.checkpoints.commit(name, checked)

    async def get_checkpoint(self, name: str) -> CatalogRecord:
        """The manifest, for a client: held for reads from now (``pipeline/retention.py``)."""
        record = await self._record(name)
        self.read_holds.hold(name)
        return record

    async def _record(self, name: str) -> CatalogRecord:
        """The catalogue's record of ``name``, else the archive's (``is_archived_record``)."""
        try:
            return await self.checkpoints.get(name)
        except NotFound:
            if not self.archive.configured:
                raise
        return await self.archive.record(name)

    async def list_checkpoints(self, prefix: str) -> list[CatalogRecord]:
        return await self.checkpoints.list(prefix)

    async def delete_checkpoint(self, name: str) -> None:
        await self.checkpoints.delete(name)

    async def checkpoint_status(self, name: str) -> dict[str, Any]:
        """``Checkpoints.status``, with ``archived`` (E19); a checkpoint only the archive
        knows is ``"state": "archived"``, ``"source": "archive"``."""
        record = await self._record(name)  # a status poll is no read: no hold
        status = await self.checkpoints.status_of(record)
        if is_archived_record(record):
            # Its chunks are in the archive: none is lost for want of a live holder.
            status.update(state="archived", lost=0, archived=True, source="archive")
        else:
            status["archived"] = await self.archive.archived_or_none(name)
        return status

    async def restore_plan(self, name: str) -> dict[str, Any]:
        """``Checkpoints.restore_plan``, of the archive's record when the catalogue has none
        (its chunks then have the holders the cluster has: often none; a GET reads them
        through the archive). Held for reads from now, as a manifest is."""
        record = await self.get_checkpoint(name)
        plan = await self.checkpoints.plan_of(record)
        if is_archived_record(record):
            plan["source"] = "archive"
        return plan

    async def evict(self, name: str, *, nvme: bool) -> dict[str, int]:
        return await self.checkpoints.evict(name, nvme=nvme)

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

    async def retention_pass(self) -> None:
        await self.retention.retention_pass()

    @contextlib.asynccontextmanager
    async def local_copy(self, chunk_id: str) -> AsyncIterator[bytes | memoryview | None]:
        async with self.reads.local_copy(chunk_id) as data:
            yield data
