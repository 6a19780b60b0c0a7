"""One storaged node: its tiers, its chunk index, and the life of a chunk.

The write path (``put_chunk``) streams a body into this node's RAM and to the
other replica holders at once and acks when ``replication`` nodes hold it. In
the background every holder drains RAM to nvme; the chunk's owner (first live
node of its placement) encodes it into ``n`` fragments over the nodes; once
cold, extra nvme copies go. Reads come from the fastest tier that has the
bytes, here or on a peer, else from any ``k`` fragments.

Peer calls go over the peer protocol (``storaged.peer``); the HTTP layer
(``storaged.server``) only translates requests into calls on ``Node``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from erasure import fragment_key, make_codec, parse_fragment_key
from erasure.base import Codec, ErasureError
from storaged.catalog import Catalog, CatalogRecord
from storaged.config import Config, NodeSpec
from storaged.errors import ApiError, unavailable
from storaged.ids import chunk_id_of_async
from storaged.manifest import CheckedManifest
from storaged.membership import Membership, StaticMembership
from storaged.metrics import NodeMetrics
from storaged.peer import (
    PeerClient,
    PeerError,
    PeerHandler,
    PeerServer,
    PeerUnavailable,
    PutStream,
)
from storaged.placement import rendezvous_order
from tiers import ByteRange, ChunkNotFound, CorruptChunk, TierFull
from tiers.cold import ColdTier
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier

log = logging.getLogger("storaged.node")

STATES = ("memory", "nvme", "cold")
MEMORY, NVME, COLD = 1, 2, 3
_STATE_RANK = {name: i + 1 for i, name in enumerate(STATES)}

#: chunk ids per chunk_info call
_INFO_BATCH = 4096
#: peer calls whose arguments and replies can be large: sent as msgpack bodies
_DOC_METHODS = frozenset(
    {"chunk_info", "catalog_put", "catalog_get", "catalog_dump", "set_state", "drop_nvme",
     "forget", "evict"}
)  # fmt: skip

BodyPieces = AsyncIterator[bytes | bytearray | memoryview]


def state_name(rank: int) -> str:
    return STATES[rank - 1]


def state_rank(name: str) -> int:
    return _STATE_RANK[name]


@dataclass(slots=True)
class ChunkInfo:
    """What this node knows of a chunk it holds (or held): size, furthest state, first seen."""

    size: int
    state: int
    stored_at: float


@dataclass(frozen=True, slots=True)
class Holding:
    """One node's answer about a chunk."""

    node: str
    memory: bool
    nvme: bool
    fragments: tuple[int, ...]
    state: int
    size: int

    @property
    def hot(self) -> bool:
        return self.memory or self.nvme


class StateLog:
    """Append-only record of chunk states (and forgotten chunks) so states never move back.

    Each record is ``[chunk_id, state, size, stored_at]`` (state 0: forgotten), msgpack,
    length-prefixed; a torn tail from a crash is ignored. Rewritten compactly at start-up.
    """

    _LEN = struct.Struct(">I")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = asyncio.Lock()

    def load(self) -> dict[str, ChunkInfo]:
        entries: dict[str, ChunkInfo] = {}
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            blob = b""
        pos = 0
        while pos + 4 <= len(blob):
            (length,) = self._LEN.unpack_from(blob, pos)
            if pos + 4 + length > len(blob):
                break
            try:
                cid, state, size, stored_at = msgpack.unpackb(blob[pos + 4 : pos + 4 + length])
            except (ValueError, TypeError, msgpack.UnpackException):
                break
            pos += 4 + length
            if state == 0:
                entries.pop(cid, None)
            else:
                prev = entries.get(cid)
                entries[cid] = ChunkInfo(size, max(state, prev.state if prev else 0), stored_at)
        # Compact: rewrite the live entries, then append from there.
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(self._encode((cid, i.state, i.size, i.stored_at) for cid, i in entries.items()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return entries

    def _encode(self, records: Iterable[tuple[str, int, int, float]]) -> bytes:
        out = bytearray()
        for record in records:
            body = msgpack.packb(list(record))
            out += self._LEN.pack(len(body)) + body
        return bytes(out)

    async def append(self, records: list[tuple[str, int, int, float]], *, sync: bool) -> None:
        if not records or self._fd is None:
            return
        blob = self._encode(records)
        fd = self._fd

        def write() -> None:
            os.write(fd, blob)
            if sync:
                os.fsync(fd)

        async with self._lock:
            await asyncio.to_thread(write)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Node:
    """A storaged node. Create with ``await Node.open(config)``, stop with ``await close()``."""

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
        self.metrics = NodeMetrics()
        secret = config.cluster_secret.encode()
        self.peers = PeerClient(self.id, secret)
        self.peer_server = PeerServer(self.id, secret, _PeerHandler(self))
        self.membership: Membership = StaticMembership(
            self.id,
            config.nodes,
            self._ping,
            interval=config.heartbeat_interval,
            down_after=config.down_after,
        )
        self.fragments: dict[str, set[int]] = {}
        self._drain_queue: asyncio.Queue[str] = asyncio.Queue()
        self._encode_queue: asyncio.Queue[str] = asyncio.Queue()
        self._encode_pending: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_catalog_replies = 0
        self._puts_inflight = 0
        #: chunks named by a live checkpoint, as of the last complete GC pass
        self._referenced: set[str] | None = None
        self.started = time.time()

    # ---- life cycle ----------------------------------------------------------------------
    @classmethod
    async def open(cls, config: Config) -> Node:
        data = config.data_dir
        await asyncio.to_thread(lambda: data.mkdir(parents=True, exist_ok=True))
        memory = MemoryTier(config.memory_capacity, put_timeout=config.put_wait)
        nvme = await NvmeTier.open(data / "nvme", config.nvme_capacity)
        cold = await ColdTier.open(data / "cold", config.cold_capacity)
        catalog = await Catalog.open(data / "catalog")
        state_log = StateLog(data / "chunks.state")
        index = await asyncio.to_thread(state_log.load)
        codec = make_codec(config.codec, config.k, config.n)
        node = cls(config, memory, nvme, cold, codec, catalog, state_log, index)
        await node._rebuild_index()
        return node

    async def _rebuild_index(self) -> None:
        """Join the state log with what the disks hold; what no disk holds is forgotten."""
        now = time.time()
        on_nvme: dict[str, int] = {}
        async for key in self.nvme.keys():
            on_nvme[key] = (await self.nvme.stat(key)).size
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
        log.info(
            "node %s: index rebuilt: %d chunks on nvme, %d with fragments, %d forgotten",
            self.id,
            len(on_nvme),
            len(self.fragments),
            len(gone),
        )

    async def start(self) -> None:
        host, port = self.config.node.peer_addr
        await self.peer_server.start(host, port)
        await self.membership.start()
        for i in range(self.config.drain_workers):
            self._spawn(self._drain_worker(), f"drain-{i}")
        for i in range(self.config.encode_workers):
            self._spawn(self._encode_worker(), f"encode-{i}")
        self._spawn(self._periodic(self.config.gc_interval, self.gc_pass), "gc")
        self._spawn(self._periodic(self.config.repair_interval, self.repair_pass), "repair")
        self._spawn(self._periodic(self.config.scrub_interval, self.scrub_pass), "scrub")
        self._spawn(self._prefault(), "prefault")
        # Chunks that were on nvme but not yet cold when we stopped: offer them to the encoder.
        for cid, info in self.index.items():
            if info.state < COLD:
                self._offer_encode(cid)

    async def _prefault(self) -> None:
        """Map part of the RAM tier ahead of the first PUTs (8 MiB, the client's chunk size)."""
        size = min(8 * 2**20, self.config.max_chunk_size)
        count = int(self.config.memory_capacity * self.config.prefault_fraction) // size
        if count > 0:
            added = await self.memory.prefault(size, count)
            log.info("pre-faulted %d RAM buffers of %d bytes", added, size)

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))  # type: ignore[arg-type]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.membership.close()
        await self.peer_server.close()
        await self.peers.close()
        await self.memory.close()
        await self.nvme.close()
        await self.cold.close()
        self.state_log.close()

    async def _periodic(self, interval: float, job: Callable[[], Awaitable[Any]]) -> None:
        # Jitter spreads the nodes' passes apart.
        await asyncio.sleep(interval * random.uniform(0.5, 1.0))
        while True:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background pass %s failed", getattr(job, "__name__", job))
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))

    # ---- placement -------------------------------------------------------------------------
    def live_order(self, key: str) -> list[str]:
        """Live node ids in the rendezvous order of ``key`` (a chunk id)."""
        return rendezvous_order(key, self.membership.alive_ids())

    def hot_targets(self, chunk_id: str) -> list[str]:
        return self.live_order(chunk_id)[: self.config.replication]

    def owner(self, chunk_id: str) -> str:
        return self.live_order(chunk_id)[0]

    def fragment_targets(self, chunk_id: str) -> list[str]:
        """Node of fragment ``i`` at position ``i``: a second ordering, wrapped over live nodes."""
        order = rendezvous_order("fragments/" + chunk_id, self.membership.alive_ids())
        return [order[i % len(order)] for i in range(self.config.n)]

    def name_targets(self, name: str) -> list[str]:
        return rendezvous_order("checkpoint/" + name, self.membership.alive_ids())[
            : self.config.replication
        ]

    def spec(self, node_id: str) -> NodeSpec:
        return self.membership.node(node_id)

    # ---- peer calls ------------------------------------------------------------------------
    async def call(
        self,
        node_id: str,
        method: str,
        args: dict[str, Any],
        body: bytes | bytearray | memoryview | None = None,
        timeout: float = 30.0,
    ) -> tuple[dict[str, Any], bytes | memoryview | None]:
        """``method`` on ``node_id`` (locally without a socket when it is this node)."""
        if node_id == self.id:
            reply, out = await self.call_local(method, args, memoryview(body) if body else None)
            return reply, (bytes(out) if isinstance(out, bytearray) else out)
        addr = self.config.dial_addr(self.spec(node_id))
        try:
            if method in _DOC_METHODS:
                # Arguments and reply travel as msgpack bodies: a manifest or a batch of
                # thousands of chunk ids is far over the peer protocol's header limit.
                packed = msgpack.packb(args, use_bin_type=True)
                _, out = await self.peers.call(addr, method, {"doc": True}, packed, timeout=timeout)
                return msgpack.unpackb(out, raw=False) if out is not None else {}, None
            return await self.peers.call(addr, method, args, body, timeout=timeout)
        except PeerUnavailable:
            self.membership.report_failure(node_id)
            raise

    async def _ping(self, spec: NodeSpec) -> dict[str, Any]:
        reply, _ = await self.peers.call(self.config.dial_addr(spec), "ping", {}, timeout=2.0)
        return reply

    async def holdings(self, node_ids: Iterable[str], ids: list[str]) -> dict[str, list[Holding]]:
        """Which of ``node_ids`` hold which of ``ids``, and how. Unreachable nodes are skipped."""
        out: dict[str, list[Holding]] = {cid: [] for cid in ids}

        async def ask(node_id: str, batch: list[str]) -> None:
            try:
                reply, _ = await self.call(node_id, "chunk_info", {"ids": batch}, timeout=30.0)
            except PeerError:
                return
            for cid, (mem, nvme, frags, state, size) in reply["info"].items():
                if cid in out:
                    out[cid].append(Holding(node_id, mem, nvme, tuple(frags), state, size))

        # Batches keep each call's message small for checkpoints of many chunks.
        batches = [ids[i : i + _INFO_BATCH] for i in range(0, len(ids), _INFO_BATCH)]
        await asyncio.gather(*(ask(n, b) for n in node_ids for b in batches))
        return out

    # ---- the PeerHandler interface ---------------------------------------------------------
    async def receive_chunk(self, chunk_id: str, size: int) -> memoryview:
        if size > self.config.max_chunk_size:
            raise PeerError("too_large", f"{size} bytes is over the max chunk size")
        try:
            return await self.memory.allocate(size, timeout=self.config.put_wait)
        except TierFull as exc:
            raise PeerError("memory_full", str(exc)) from exc

    async def chunk_received(self, chunk_id: str, buf: memoryview) -> dict[str, Any]:
        new = await self._store_received(chunk_id, buf)
        return {"new": new}

    def chunk_aborted(self, chunk_id: str, buf: memoryview) -> None:
        self.memory.release(buf)

    async def _store_received(self, chunk_id: str, buf: memoryview) -> bool:
        """Verify and keep a received body (a buffer from ``memory.allocate``). True if new."""
        if await chunk_id_of_async(buf) != chunk_id:
            self.memory.release(buf)
            raise PeerError("checksum_mismatch", "the body does not hash to the chunk id")
        if self.holds_hot(chunk_id):
            self.memory.release(buf)
            return False
        await self.memory.put(chunk_id, buf, verified=True)
        self._note_stored(chunk_id, len(buf))
        self._drain_queue.put_nowait(chunk_id)
        self.metrics.drain_backlog.inc()
        return True

    def _note_stored(self, chunk_id: str, size: int) -> None:
        info = self.index.get(chunk_id)
        if info is None:
            self.index[chunk_id] = ChunkInfo(size, MEMORY, time.time())
        elif info.size < 0:
            info.size = size

    async def call_local(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], bytes | bytearray | memoryview | None]:
        handler = getattr(self, f"rpc_{method}", None)
        if handler is None:
            raise PeerError("bad_request", f"unknown method {method!r}")
        result: tuple[dict[str, Any], bytes | bytearray | memoryview | None] = await handler(
            args, body
        )
        return result

    # ---- RPC methods (peer side) ----------------------------------------------------------
    async def rpc_ping(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        return {"id": self.id, "usage": self.usage()}, None

    async def rpc_chunk_info(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        info: dict[str, list[Any]] = {}
        for cid in args["ids"]:
            mem = self.memory_has(cid)
            nvme = self.nvme_has(cid)
            frags = sorted(self.fragments.get(cid, ()))
            known = self.index.get(cid)
            if mem or nvme or frags:
                state = known.state if known else MEMORY
                size = known.size if known else -1
                info[cid] = [mem, nvme, frags, state, size]
        return {"info": info}, None

    async def rpc_get_chunk(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], bytes | memoryview]:
        cid = args["id"]
        rng = ByteRange(args.get("start", 0), args.get("end"))
        data, tier = await self.read_hot(cid, rng)
        if data is None:
            raise PeerError("chunk_not_found", f"{cid} is not held hot here")
        return {"tier": tier}, data

    async def rpc_put_fragment(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        if body is None:
            raise PeerError("bad_request", "put_fragment needs a body")
        key = args["key"]
        try:
            await self.cold.put(key, body)
        except CorruptChunk as exc:
            raise PeerError("checksum_mismatch", str(exc)) from exc
        except TierFull as exc:
            raise PeerError("cold_full", str(exc)) from exc
        cid, index = parse_fragment_key(key)
        self.fragments.setdefault(cid, set()).add(index)
        if cid not in self.index:
            self.index[cid] = ChunkInfo(int(args.get("size", -1)), NVME, time.time())
        return {}, None

    async def rpc_get_fragment(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], memoryview]:
        key = args["key"]
        try:
            data = await self.cold.get(key)
        except CorruptChunk as exc:
            self.metrics.corrupt.labels("cold").inc()
            self._forget_fragment(key)
            raise PeerError("corrupt", str(exc)) from exc
        except ChunkNotFound as exc:
            self._forget_fragment(key)
            raise PeerError("chunk_not_found", str(exc)) from exc
        return {}, data

    async def rpc_set_state(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        await self.record_state(args["ids"], int(args["state"]))
        return {}, None

    async def rpc_drained(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        self._offer_encode(args["id"])
        return {}, None

    async def rpc_drop_nvme(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        for cid in args["ids"]:
            info = self.index.get(cid)
            # Only a cold chunk's nvme copy may go: it is what makes a chunk durable before.
            if info is not None and info.state >= COLD:
                await self.nvme.delete(cid)
        return {}, None

    async def rpc_forget(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        """Drop copies that a failed PUT left behind (only ones it created)."""
        for cid in args["ids"]:
            await self.delete_local(cid)
        return {}, None

    async def rpc_evict(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        """Admin: push chunks out of RAM (and, with ``nvme``, off nvme) where a colder copy
        exists."""
        counts = await self.evict_local(args["ids"], nvme=bool(args.get("nvme")))
        return counts, None

    async def rpc_catalog_put(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        record = CatalogRecord.from_wire(args["record"])
        ok = await self.catalog.store(record)
        return {"stored": ok}, None

    async def rpc_catalog_get(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        record = self.catalog.raw(args["name"])
        return {"record": record.to_wire() if record else None}, None

    async def rpc_catalog_dump(
        self, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], None]:
        prefix = args.get("prefix", "")
        with_chunks = bool(args.get("chunks"))
        records = []
        for r in self.catalog.records(prefix, tombstones=True):
            wire = r.to_wire()
            wire["manifest"] = None
            if not with_chunks:
                wire["chunks"] = []
            records.append(wire)
        return {"records": records}, None

    # ---- local holdings ------------------------------------------------------------------
    def memory_has(self, chunk_id: str) -> bool:
        return self.memory.has(chunk_id)

    def nvme_has(self, chunk_id: str) -> bool:
        return self.nvme.has(chunk_id)

    def holds_hot(self, chunk_id: str) -> bool:
        return self.memory_has(chunk_id) or self.nvme_has(chunk_id)

    def usage(self) -> dict[str, dict[str, int]]:
        out = {}
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            out[tier.name] = {"used": u.used, "capacity": u.capacity, "count": u.count}
        return out

    async def record_state(self, ids: Iterable[str], state: int) -> None:
        records = []
        for cid in ids:
            info = self.index.get(cid)
            if info is not None and info.state < state:
                info.state = state
                records.append((cid, state, info.size, info.stored_at))
        await self.state_log.append(records, sync=True)

    def _forget_fragment(self, key: str) -> None:
        cid, index = parse_fragment_key(key)
        held = self.fragments.get(cid)
        if held is not None:
            held.discard(index)
            if not held:
                del self.fragments[cid]

    async def delete_local(self, chunk_id: str) -> None:
        """Remove every copy and fragment of ``chunk_id`` held here."""
        await self.memory.delete(chunk_id)
        await self.nvme.delete(chunk_id)
        for index in list(self.fragments.get(chunk_id, ())):
            await self.cold.delete(fragment_key(chunk_id, index))
        self.fragments.pop(chunk_id, None)
        if self.index.pop(chunk_id, None) is not None:
            await self.state_log.append([(chunk_id, 0, 0, 0.0)], sync=False)

    async def evict_local(self, ids: Iterable[str], *, nvme: bool) -> dict[str, int]:
        evicted = {"memory": 0, "nvme": 0}
        for cid in ids:
            info = self.index.get(cid)
            if info is None:
                continue
            colder = self.nvme_has(cid) or info.state >= COLD
            if self.memory_has(cid) and colder and not self.memory.is_dirty(cid):
                await self.memory.delete(cid)
                evicted["memory"] += 1
            if nvme and info.state >= COLD and self.nvme_has(cid) and not self.memory_has(cid):
                await self.nvme.delete(cid)
                evicted["nvme"] += 1
        return evicted

    # ---- write path --------------------------------------------------------------------
    async def put_chunk(
        self, chunk_id: str, size: int, body: BodyPieces
    ) -> tuple[int, dict[str, Any]]:
        """Stream a chunk into RAM here and on the other replica holders; (status, reply)."""
        started = time.perf_counter()
        targets = self.hot_targets(chunk_id)
        if len(targets) < self.config.replication:
            raise unavailable(
                "insufficient_replicas",
                f"{len(targets)} live node(s), replication needs {self.config.replication}",
                retry_after=self.config.down_after,
            )
        if (chunk_id in self.index and self.holds_hot(chunk_id)) or self._is_cold(chunk_id):
            reply = self._put_reply(chunk_id, size, targets)
            return 200, reply
        self._puts_inflight += 1
        try:
            return await self._put_new(chunk_id, size, body, targets, started)
        finally:
            self._puts_inflight -= 1

    async def _put_new(
        self, chunk_id: str, size: int, body: BodyPieces, targets: list[str], started: float
    ) -> tuple[int, dict[str, Any]]:
        try:
            buf = await self.memory.allocate(size, timeout=self.config.put_wait)
        except TierFull as exc:
            raise unavailable("memory_full", str(exc), retry_after=1.0) from exc
        try:
            remote = [t for t in targets if t != self.id]
            streams = await self._open_streams(chunk_id, size, remote)
            refused: list[PeerError] = []
            received = await self._receive(body, buf, streams, refused)
            if received < size:
                raise ApiError(400, "truncated", f"body ended after {received} of {size} bytes")
            if await chunk_id_of_async(buf) != chunk_id:
                raise ApiError(400, "checksum_mismatch", "the body's BLAKE3-256 is not the id")
            holders, created = await self._finish_streams(chunk_id, buf, streams, targets, refused)
        except BaseException:
            for stream in list(locals().get("streams", {}).values()):
                stream.abort()
            self.memory.release(buf)
            raise
        if self.id in holders and not self.holds_hot(chunk_id):
            await self.memory.put(chunk_id, buf, verified=True)
            self._note_stored(chunk_id, size)
            self._drain_queue.put_nowait(chunk_id)
            self.metrics.drain_backlog.inc()
            created.append(self.id)
        else:
            self.memory.release(buf)
        self.metrics.ack_latency.observe(time.perf_counter() - started)
        if not created:
            return 200, self._put_reply(chunk_id, size, holders)
        self.metrics.put_bytes.inc(size)
        return 201, {"chunk": chunk_id, "size": size, "replicas": holders, "state": "memory"}

    def _is_cold(self, chunk_id: str) -> bool:
        info = self.index.get(chunk_id)
        return info is not None and info.state >= COLD

    def _put_reply(self, chunk_id: str, size: int, targets: list[str]) -> dict[str, Any]:
        info = self.index.get(chunk_id)
        state = state_name(info.state) if info else "memory"
        return {"chunk": chunk_id, "size": size, "replicas": targets, "state": state}

    async def _open_streams(
        self, chunk_id: str, size: int, remote: list[str]
    ) -> dict[str, PutStream]:
        streams: dict[str, PutStream] = {}

        async def open_one(node_id: str) -> None:
            try:
                streams[node_id] = await self.peers.open_put(
                    self.config.dial_addr(self.spec(node_id)), chunk_id, size
                )
            except PeerUnavailable:
                self.membership.report_failure(node_id)

        await asyncio.gather(*(open_one(n) for n in remote))
        return streams

    async def _receive(
        self,
        body: BodyPieces,
        buf: memoryview,
        streams: dict[str, PutStream],
        refused: list[PeerError],
    ) -> int:
        """Copy pieces into ``buf`` and forward them to every open stream as they arrive.

        A peer that fails or refuses (e.g. memory_full) mid-body leaves ``streams``; its
        refusal goes into ``refused``.
        """
        pos = 0
        size = len(buf)
        async for piece in body:
            n = len(piece)
            if pos + n > size:
                raise ApiError(400, "bad_request", "body longer than its Content-Length")
            buf[pos : pos + n] = piece  # the one copy into this node's RAM copy
            if streams:
                view = buf[pos : pos + n]
                dropped = []
                for node_id, stream in streams.items():
                    try:
                        await stream.write(view)
                    except PeerUnavailable:
                        self.membership.report_failure(node_id)
                        dropped.append(node_id)
                    except PeerError as exc:
                        refused.append(exc)
                        dropped.append(node_id)
                for node_id in dropped:
                    streams.pop(node_id).abort()
            pos += n
        return pos

    async def _finish_streams(
        self,
        chunk_id: str,
        buf: memoryview,
        streams: dict[str, PutStream],
        targets: list[str],
        refused: list[PeerError],
    ) -> tuple[list[str], list[str]]:
        """Collect the peers' verdicts; replace failed holders from our own copy.

        Returns (the holders in placement order, the remote ones that did not have it before).
        """
        holders: list[str] = [self.id] if self.id in targets else []
        created: list[str] = []

        async def finish(node_id: str, stream: PutStream) -> None:
            try:
                reply = await stream.finish()
            except PeerUnavailable as exc:
                log.warning("replica %s of %s unavailable: %s", node_id, chunk_id, exc)
                self.membership.report_failure(node_id)
                return
            except PeerError as exc:
                log.warning("replica %s refused %s: %s", node_id, chunk_id, exc)
                refused.append(exc)
                return
            holders.append(node_id)
            if reply.get("new"):
                created.append(node_id)

        await asyncio.gather(*(finish(n, s) for n, s in streams.items()))
        if any(e.code == "checksum_mismatch" for e in refused):
            # The peers saw other bytes than we did: nothing may stay anywhere.
            await self._forget_on(created, chunk_id)
            raise ApiError(400, "checksum_mismatch", "a replica saw bytes that fail the id")
        # Fill the gaps (a dead or full peer) with the next live nodes of the order.
        tried = set(targets)
        for candidate in self.live_order(chunk_id):
            if len(holders) >= self.config.replication:
                break
            if candidate in tried or candidate in holders:
                continue
            tried.add(candidate)
            if candidate == self.id:
                holders.append(self.id)
                continue
            try:
                reply = await self.push_copy(candidate, chunk_id, buf)
            except PeerUnavailable:
                continue
            except PeerError as exc:
                refused.append(exc)
                continue
            holders.append(candidate)
            if reply.get("new"):
                created.append(candidate)
        if len(holders) < self.config.replication:
            await self._forget_on(created, chunk_id)
            if any(e.code == "memory_full" for e in refused):
                raise unavailable("memory_full", "a replica holder is out of RAM", retry_after=1.0)
            raise unavailable(
                "insufficient_replicas",
                f"only {len(holders)} node(s) could take the chunk; need {self.config.replication}",
                retry_after=self.config.down_after,
            )
        rank = {n: i for i, n in enumerate(self.live_order(chunk_id))}
        return sorted(holders, key=lambda n: rank.get(n, len(rank))), created

    async def push_copy(self, node_id: str, chunk_id: str, data: memoryview) -> dict[str, Any]:
        """Send a whole copy of a chunk to ``node_id``'s RAM."""
        stream = await self.peers.open_put(
            self.config.dial_addr(self.spec(node_id)), chunk_id, len(data)
        )
        try:
            await stream.write(data)
            return await stream.finish()
        except BaseException:
            stream.abort()
            raise

    async def _forget_on(self, node_ids: list[str], chunk_id: str) -> None:
        await asyncio.gather(
            *(self.call(n, "forget", {"ids": [chunk_id]}) for n in node_ids),
            return_exceptions=True,
        )

    # ---- drain and encode ---------------------------------------------------------------
    async def _quiet(self, longest: float, *, unless: Callable[[], bool] | None = None) -> None:
        """Wait (at most ``longest`` s) until no PUT is in flight: acks come first."""
        deadline = time.monotonic() + longest
        while self._puts_inflight and time.monotonic() < deadline:
            if unless is not None and unless():
                return
            await asyncio.sleep(0.02)

    def _ram_pressed(self) -> bool:
        u = self.memory.usage()
        return u.used > u.capacity // 2

    async def _drain_worker(self) -> None:
        while True:
            cid = await self._drain_queue.get()
            self.metrics.drain_backlog.dec()
            try:
                await self._quiet(self.config.drain_defer, unless=self._ram_pressed)
                await self.drain(cid)
            except asyncio.CancelledError:
                raise
            except TierFull:
                log.warning("nvme full: %s stays in RAM; retrying later", cid)
                await asyncio.sleep(1.0)
                self._drain_queue.put_nowait(cid)
                self.metrics.drain_backlog.inc()
            except Exception:
                log.exception("drain of %s failed", cid)

    async def drain(self, chunk_id: str) -> None:
        """RAM copy -> nvme file (durable), then the RAM copy is clean (evictable)."""
        if not self.nvme_has(chunk_id):
            try:
                async with self.memory.lease(chunk_id) as view:
                    await self.nvme.put(chunk_id, view, verified=True)
            except ChunkNotFound:
                return
        self.memory.mark_clean(chunk_id)
        self.metrics.drained.inc()
        owner = self.owner(chunk_id)
        if owner == self.id:
            self._offer_encode(chunk_id)
        else:
            with contextlib.suppress(PeerError):
                await self.call(owner, "drained", {"id": chunk_id})

    def _offer_encode(self, chunk_id: str) -> None:
        if chunk_id not in self._encode_pending:
            self._encode_pending.add(chunk_id)
            self._encode_queue.put_nowait(chunk_id)
            self.metrics.encode_backlog.set(len(self._encode_pending))

    async def _encode_worker(self) -> None:
        while True:
            cid = await self._encode_queue.get()
            self._encode_pending.discard(cid)
            self.metrics.encode_backlog.set(len(self._encode_pending))
            try:
                await self.advance(cid)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("encode of %s failed; repair will retry", cid)

    async def advance(self, chunk_id: str) -> None:
        """As the owner: nvme once every hot holder drained, then encode, then trim copies."""
        if self.owner(chunk_id) != self.id or self._is_cold(chunk_id):
            return
        order = self.live_order(chunk_id)
        ask = order[: self.config.replication + 2]
        held = (await self.holdings(ask, [chunk_id]))[chunk_id]
        if sum(1 for h in held if h.hot) < self.config.replication:
            # Placed while membership was changing: copies may sit further down the order.
            held += (await self.holdings(order[len(ask) :], [chunk_id]))[chunk_id]
        hot = [h for h in held if h.hot]
        if max((h.state for h in held), default=0) >= COLD:
            await self.record_state([chunk_id], COLD)
            return
        if len(hot) < self.config.replication or any(not h.nvme for h in hot):
            return  # not yet drained everywhere (the last holder's "drained" brings us back)
        await asyncio.gather(
            *(self.call(h.node, "set_state", {"ids": [chunk_id], "state": NVME}) for h in hot),
            return_exceptions=True,
        )
        # Durable now; the cold tier can wait for a pause in the PUTs (acks come first).
        await self._quiet(self.config.encode_defer)
        async with self.local_copy(chunk_id) as local:
            data = local
            if data is None:
                # Placed while this node was thought down: the owner holds no copy itself.
                try:
                    data, _ = await self.read_chunk(chunk_id)
                except ChunkNotFound:
                    log.warning("cannot encode %s: no holder serves it", chunk_id)
                    return
            if not await self.encode_and_spread(chunk_id, data):
                return
        holders = [h.node for h in hot]
        await asyncio.gather(
            *(self.call(n, "set_state", {"ids": [chunk_id], "state": COLD}) for n in holders),
            return_exceptions=True,
        )
        self.metrics.encoded.inc()
        # Retention: the owner keeps its nvme copy (the GC pass drops it unless the chunk
        # belongs to a newest checkpoint); the other holders' nvme copies go now.
        others = [n for n in holders if n != self.id]
        await asyncio.gather(
            *(self.call(n, "drop_nvme", {"ids": [chunk_id]}) for n in others),
            return_exceptions=True,
        )

    async def encode_and_spread(
        self, chunk_id: str, data: bytes | memoryview, only: Iterable[int] | None = None
    ) -> bool:
        """Encode and store fragments (all, or the indexes in ``only``) durably on their nodes."""
        targets = self.fragment_targets(chunk_id)
        per_node = math.ceil(self.config.n / len(set(targets)))
        if per_node > self.config.n - self.config.k:
            log.info(
                "not encoding %s: too few live nodes to spread %d fragments", chunk_id, len(targets)
            )
            return False  # repair offers it again once enough nodes are back
        fragments = await self.codec.encode_async(chunk_id, data)
        wanted = set(range(self.config.n)) if only is None else set(only)

        async def store(index: int) -> bool:
            key = fragment_key(chunk_id, index)
            blob = fragments[index].to_bytes()  # one joined copy: the peer call takes one body
            try:
                await self.call(
                    targets[index], "put_fragment", {"key": key, "size": len(data)}, blob
                )
            except PeerError as exc:
                log.warning("fragment %s to %s failed: %s", key, targets[index], exc)
                return False
            return True

        results = await asyncio.gather(*(store(i) for i in sorted(wanted)))
        return all(results)

    # ---- read path ---------------------------------------------------------------------
    async def read_hot(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview | None, str]:
        """The bytes from this node's RAM or nvme, verified; (None, "") when not held hot."""
        if self.memory_has(chunk_id):
            try:
                data = await self.memory.get(chunk_id, rng)
                return data, "memory"
            except ChunkNotFound:
                pass
        if self.nvme_has(chunk_id):
            try:
                data = await self.nvme.get(chunk_id, rng)
                return data, "nvme"
            except CorruptChunk:
                self.metrics.corrupt.labels("nvme").inc()
                log.error("corrupt nvme copy of %s quarantined", chunk_id)
            except ChunkNotFound:
                pass
        return None, ""

    @contextlib.asynccontextmanager
    async def local_copy(self, chunk_id: str) -> AsyncIterator[bytes | memoryview | None]:
        """The chunk from this node's RAM (leased: valid inside the block only, and the pooled
        buffer stays in the pool) or nvme (verified); None when neither holds it."""
        async with contextlib.AsyncExitStack() as stack:
            view: memoryview | None
            try:
                view = await stack.enter_async_context(self.memory.lease(chunk_id))
            except ChunkNotFound:
                view = None
            if view is not None:
                yield view
            else:
                data, _ = await self.read_hot(chunk_id)
                yield data

    async def read_chunk(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview, str]:
        """The chunk (or a range of it) from the fastest source: here, a peer, or fragments."""
        data, tier = await self.read_hot(chunk_id, rng)
        if data is not None:
            return data, tier
        for node_id in self.live_order(chunk_id):
            if node_id == self.id:
                continue
            try:
                # Whole chunk from the peer, so that it can be checked against the id here.
                reply, body = await self.call(node_id, "get_chunk", {"id": chunk_id})
            except PeerError:
                continue
            body = b"" if body is None else body  # an empty chunk travels without a body
            if await chunk_id_of_async(body) != chunk_id:
                log.error("peer %s served bytes that fail the id of %s", node_id, chunk_id)
                continue
            return _slice(body, rng), str(reply.get("tier", "memory"))
        whole = await self.rebuild(chunk_id)
        if whole is None:
            raise ChunkNotFound(chunk_id)
        return _slice(whole, rng), "cold"

    async def rebuild(self, chunk_id: str) -> bytes | None:
        """Decode a chunk from any ``k`` good fragments found on the live nodes."""
        alive = self.membership.alive_ids()
        held = (await self.holdings(alive, [chunk_id]))[chunk_id]
        sources = [(h.node, i) for h in held for i in h.fragments]
        if not sources:
            return None
        fragments: dict[int, bytes | memoryview] = {}
        random.shuffle(sources)

        async def fetch(node_id: str, index: int) -> None:
            try:
                _, body = await self.call(
                    node_id, "get_fragment", {"key": fragment_key(chunk_id, index)}
                )
            except PeerError:
                return
            if body is not None:
                fragments[index] = body

        # Ask for k first, then the rest only if some were bad or missing.
        seen: set[int] = set()
        first = []
        for node_id, index in sources:
            if index not in seen:
                seen.add(index)
                first.append((node_id, index))
        await asyncio.gather(*(fetch(n, i) for n, i in first[: self.config.k]))
        try:
            return await self.codec.decode_async(chunk_id, dict(fragments))
        except ErasureError:
            await asyncio.gather(*(fetch(n, i) for n, i in first[self.config.k :]))
            try:
                return await self.codec.decode_async(chunk_id, dict(fragments))
            except ErasureError as exc:
                log.error("cannot rebuild %s: %s", chunk_id, exc)
                return None

    async def chunk_states(self, ids: list[str]) -> dict[str, tuple[int, int]]:
        """Cluster-wide (state, size) of each held chunk; absent ids are not held anywhere."""
        alive = self.membership.alive_ids()
        held = await self.holdings(alive, ids)
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

    # ---- checkpoints -------------------------------------------------------------------
    async def commit(self, name: str, checked: CheckedManifest) -> tuple[int, dict[str, Any]]:
        existing = await self.find_record(name)
        if existing is not None and existing.deleted is None:
            if existing.digest == checked.digest:
                return 200, self._commit_reply(name, checked)
            raise ApiError(409, "exists", f"checkpoint {name!r} exists with other contents")
        ids = list(checked.chunks)
        states = await self.chunk_states(ids)
        missing = [cid for cid in ids if cid not in states]
        if missing:
            raise ApiError(
                409,
                "missing_chunks",
                f"{len(missing)} chunk(s) named by the manifest are not held by the cluster",
                missing=missing,
            )
        now = time.time()
        record = CatalogRecord(
            name=name,
            digest=checked.digest,
            created=float(checked.manifest["created"]),
            committed=now,
            total_bytes=checked.total_bytes,
            chunks=ids,
            manifest=checked.encoded,
        )
        targets = self.name_targets(name)
        if len(targets) < self.config.replication:
            raise unavailable(
                "insufficient_replicas",
                f"{len(targets)} live node(s), replication needs {self.config.replication}",
                retry_after=self.config.down_after,
            )
        results = await asyncio.gather(
            *(self.call(n, "catalog_put", {"record": record.to_wire()}) for n in targets),
            return_exceptions=True,
        )
        stored = sum(1 for r in results if not isinstance(r, BaseException) and r[0]["stored"])
        if stored < len(targets):
            conflict = any(not isinstance(r, BaseException) and not r[0]["stored"] for r in results)
            if conflict:
                raise ApiError(409, "exists", f"checkpoint {name!r} was committed concurrently")
            raise unavailable(
                "insufficient_replicas",
                f"the manifest reached {stored} of {len(targets)} nodes",
                retry_after=1.0,
            )
        return 201, self._commit_reply(name, checked)

    @staticmethod
    def _commit_reply(name: str, checked: CheckedManifest) -> dict[str, Any]:
        return {"name": name, "chunks": list(checked.chunks), "bytes": checked.total_bytes}

    async def find_record(self, name: str) -> CatalogRecord | None:
        """The newest record or tombstone of ``name`` among the nodes that should hold it."""
        alive = self.membership.alive_ids()
        order = rendezvous_order("checkpoint/" + name, alive)
        best: CatalogRecord | None = None

        async def ask(node_id: str) -> CatalogRecord | None:
            try:
                reply, _ = await self.call(node_id, "catalog_get", {"name": name})
            except PeerError:
                return None
            wire = reply.get("record")
            return CatalogRecord.from_wire(wire) if wire else None

        # Its placement first; the rest only if none of those has it (membership changed).
        for group in (order[: self.config.replication + 1], order[self.config.replication + 1 :]):
            for record in await asyncio.gather(*(ask(n) for n in group)):
                if record is not None and (best is None or _newer(record, best)):
                    best = record
            if best is not None:
                break
        return best

    async def get_checkpoint(self, name: str) -> CatalogRecord:
        record = await self.find_record(name)
        if record is None or record.deleted is not None or record.manifest is None:
            raise ApiError(404, "checkpoint_not_found", f"no checkpoint named {name!r}")
        return record

    async def list_checkpoints(self, prefix: str) -> list[CatalogRecord]:
        merged = await self.gather_catalog(prefix, with_chunks=False)
        return sorted((r for r in merged.values() if r.deleted is None), key=lambda r: r.name)

    async def gather_catalog(
        self, prefix: str = "", *, with_chunks: bool
    ) -> dict[str, CatalogRecord]:
        alive = self.membership.alive_ids()
        merged: dict[str, CatalogRecord] = {}
        replies = await asyncio.gather(
            *(
                self.call(n, "catalog_dump", {"prefix": prefix, "chunks": with_chunks})
                for n in alive
            ),
            return_exceptions=True,
        )
        self._last_catalog_replies = sum(1 for r in replies if not isinstance(r, BaseException))
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            for wire in reply[0]["records"]:
                record = CatalogRecord.from_wire(wire)
                current = merged.get(record.name)
                if current is None or _newer(record, current):
                    merged[record.name] = record
        return merged

    async def delete_checkpoint(self, name: str) -> None:
        record = await self.find_record(name)
        if record is None or record.deleted is not None:
            raise ApiError(404, "checkpoint_not_found", f"no checkpoint named {name!r}")
        record.deleted = time.time()
        record.manifest = None
        holders = set(self.name_targets(name)) | set(self.membership.alive_ids())
        await asyncio.gather(
            *(self.call(n, "catalog_put", {"record": record.to_wire()}) for n in holders),
            return_exceptions=True,
        )

    async def checkpoint_status(self, name: str) -> dict[str, Any]:
        record = await self.get_checkpoint(name)
        states = await self.chunk_states(record.chunks)
        counts = {s: 0 for s in STATES}
        for cid in record.chunks:
            rank = states.get(cid, (0, 0))[0]
            for i, s in enumerate(STATES):
                if rank >= i + 1:
                    counts[s] += 1
        total = len(record.chunks)
        reached = "memory"
        for s in STATES:
            if counts[s] == total:
                reached = s
        return {"state": reached, "chunks": total, **counts}

    async def restore_plan(self, name: str) -> dict[str, Any]:
        record = await self.get_checkpoint(name)
        alive = self.membership.alive_ids()
        held = await self.holdings(alive, record.chunks)
        tier_rank = {"memory": 0, "nvme": 1, "cold": 2}
        plan: dict[str, list[dict[str, str]]] = {}
        for cid in record.chunks:
            sources = []
            frag_nodes = []
            for h in held[cid]:
                url = self.spec(h.node).url
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

    # ---- background passes -------------------------------------------------------------
    async def gc_pass(self) -> None:
        """Free unreferenced chunks after the grace period; apply retention to cold chunks."""
        catalog = await self.gather_catalog(with_chunks=True)
        nodes = len(self.membership.all_ids())
        if self._last_catalog_replies < nodes - (self.config.replication - 1):
            return  # a manifest could be out of reach: freeing now could lose data
        # Tombstones seen anywhere are applied everywhere.
        for record in catalog.values():
            local = self.catalog.raw(record.name)
            if record.deleted is not None and local is not None and local.deleted is None:
                await self.catalog.store(record)
        live = [r for r in catalog.values() if r.deleted is None]
        referenced: set[str] = set()
        for r in live:
            referenced.update(r.chunks)
        self._referenced = referenced
        protected = _newest_per_prefix(live, self.config.retain_newest)
        now = time.time()
        freed = 0
        for cid in list(self.index):
            info = self.index.get(cid)
            if info is None:
                continue
            if cid not in referenced:
                if now - info.stored_at > self.config.gc_grace:
                    await self.delete_local(cid)
                    freed += 1
                continue
            keep = self.owner(cid) == self.id and cid in protected
            if info.state >= COLD and self.nvme_has(cid) and not keep:
                await self.nvme.delete(cid)
        self.metrics.gc_freed.inc(freed)
        self._update_gauges()

    def _update_gauges(self) -> None:
        for tier in (self.memory, self.nvme, self.cold):
            u = tier.usage()
            self.metrics.tier_bytes.labels(tier.name).set(u.used)
            self.metrics.tier_chunks.labels(tier.name).set(u.count)
            self.metrics.tier_capacity.labels(tier.name).set(u.capacity)

    async def repair_pass(self) -> None:
        """Re-replicate hot chunks short of copies; rebuild missing fragments of cold ones."""
        ids = list(self.index)
        for start in range(0, len(ids), 256):
            batch = ids[start : start + 256]
            held = await self.holdings(self.membership.alive_ids(), batch)
            for cid in batch:
                try:
                    await self._repair_one(cid, held[cid])
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("repair of %s failed", cid)

    async def _repair_one(self, chunk_id: str, held: list[Holding]) -> None:
        info = self.index.get(chunk_id)
        if (
            info is not None
            and self._referenced is not None
            and chunk_id not in self._referenced
            and time.time() - info.stored_at > self.config.gc_grace
        ):
            return  # garbage waiting for GC: copying it back would undo the collection
        order = self.live_order(chunk_id)
        holders = {h.node for h in held if h.hot or h.fragments}
        # The first node in placement order that has anything of the chunk does the repair.
        leader = next((n for n in order if n in holders), None)
        if leader != self.id:
            return
        state = max((h.state for h in held), default=0)
        frags = {i for h in held for i in h.fragments}
        if state >= COLD or len(frags) >= self.config.n:
            missing = set(range(self.config.n)) - frags
            if missing:
                async with self.local_copy(chunk_id) as local:
                    data = local if local is not None else await self.rebuild(chunk_id)
                    if data is not None and await self.encode_and_spread(chunk_id, data, missing):
                        self.metrics.repaired.labels("fragment").inc(len(missing))
            return
        hot = {h.node for h in held if h.hot}
        targets = order[: self.config.replication]
        lacking = [n for n in targets if n not in hot]
        if len(hot) >= self.config.replication or not lacking:
            if all(h.nvme for h in held if h.hot):
                self._offer_encode(chunk_id)  # owner side: encode when ready
                if self.owner(chunk_id) != self.id:
                    with contextlib.suppress(PeerError):
                        await self.call(self.owner(chunk_id), "drained", {"id": chunk_id})
            return
        async with self.local_copy(chunk_id) as data:
            if data is None:
                return
            view = memoryview(data)
            for node_id in lacking[: self.config.replication - len(hot)]:
                try:
                    await self.push_copy(node_id, chunk_id, view)
                    self.metrics.repaired.labels("copy").inc()
                except PeerError as exc:
                    log.warning("repair copy of %s to %s failed: %s", chunk_id, node_id, exc)

    async def scrub_pass(self) -> None:
        """Re-read every stored copy and fragment; what fails its check is quarantined."""
        async for key in self.nvme.keys():
            try:
                await self.nvme.get(key)
            except CorruptChunk:
                self.metrics.corrupt.labels("nvme").inc()
            except ChunkNotFound:
                pass
        async for key in self.cold.keys():
            try:
                await self.cold.get(key)
            except CorruptChunk:
                self.metrics.corrupt.labels("cold").inc()
                self._forget_fragment(key)
            except ChunkNotFound:
                pass


class _PeerHandler(PeerHandler):
    """What the peer server calls: chunk receives go to the node's RAM, calls to ``rpc_*``.

    The peer server may hand back a new view of the buffer it was given; the memory tier
    knows its allocations by the view it returned, so map back by the underlying object.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self._given: dict[int, memoryview] = {}

    def _original(self, buf: memoryview) -> memoryview:
        return self._given.pop(id(buf.obj), buf)

    async def receive_chunk(self, chunk_id: str, size: int) -> memoryview:
        view = await self.node.receive_chunk(chunk_id, size)
        self._given[id(view.obj)] = view
        return view

    async def chunk_received(self, chunk_id: str, buf: memoryview) -> dict[str, Any]:
        return await self.node.chunk_received(chunk_id, self._original(buf))

    def chunk_aborted(self, chunk_id: str, buf: memoryview) -> None:
        self.node.chunk_aborted(chunk_id, self._original(buf))

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], bytes | bytearray | memoryview | None]:
        if args.get("doc") and method in _DOC_METHODS:
            if body is None:
                raise PeerError("bad_request", f"{method} needs its arguments as a body")
            try:
                doc = msgpack.unpackb(body, raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                raise PeerError("bad_request", f"{method}: arguments are not msgpack") from exc
            reply, _ = await self.node.call_local(method, doc, None)
            return {"doc": True}, msgpack.packb(reply, use_bin_type=True)
        return await self.node.call_local(method, args, body)


def _slice(data: bytes | memoryview, rng: ByteRange | None) -> bytes | memoryview:
    if rng is None:
        return data
    start, end = rng.resolve(len(data))
    return memoryview(data)[start:end]


def _newer(a: CatalogRecord, b: CatalogRecord) -> bool:
    """Whether record ``a`` supersedes ``b`` (a later event: commit or delete)."""
    return (a.deleted or a.committed) > (b.deleted or b.committed)


def _newest_per_prefix(records: list[CatalogRecord], keep: int) -> set[str]:
    """Chunk ids of the ``keep`` newest checkpoints under each prefix (the name's parent)."""
    groups: dict[str, list[CatalogRecord]] = {}
    for r in records:
        groups.setdefault(r.name.rpartition("/")[0], []).append(r)
    out: set[str] = set()
    for group in groups.values():
        group.sort(key=lambda r: (r.created, r.committed), reverse=True)
        for r in group[:keep]:
            out.update(r.chunks)
    return out
