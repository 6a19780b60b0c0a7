"""The write path: a PUT streams into RAM here and on the other holders; the ack.

Relies on: the memory tier's buffer ownership (every ``Allocation`` from ``allocate``
goes back through exactly one of ``put`` or ``release``; the peer server hands back the
very handle ``receive_chunk`` lent), and the per-chunk locks of ``index``.

Upholds:

- **I1 ack**: a 201 or 200 means that at that moment ``replication`` distinct live nodes
  hold a copy checked against the id, or the cluster holds all ``n`` fragments. The
  "already stored" 200 asks the holders (and counts only what they report) first.
- **I2 no collateral damage**: a failed or cancelled PUT deletes nothing anywhere. The
  copies it left on other nodes are orphans like any unreferenced chunk: GC collects them
  once their last use is older than the grace period. A copy another PUT counted is
  touched (``last_use``) by that PUT, so it outlives the grace.
- A replica that sees bytes that fail the id (damage between nodes: this node checked
  its own copy) gets the chunk again from the checked local copy; only a client body
  that fails the id is the client's 400.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from erasure import parse_fragment_key
from storaged.errors import BadInput, InsufficientStorage, StoragedError, unavailable
from storaged.ids import chunk_id_of_async, crc32c_of_async
from storaged.node.index import NVME, IndexEntry
from storaged.peer import PeerError, PeerUnavailable, PutStream
from storaged.placement import Placement
from storaged.wire import state_name
from tiers import CorruptChunk, TierFull
from tiers.memory import Allocation, size_class

if TYPE_CHECKING:
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.write")

BodyPieces = AsyncIterator[bytes | bytearray | memoryview]
T = TypeVar("T")
#: a replica's refusal, and who refused
Refusal = tuple[str, PeerError]

#: sends of one copy to one replica that saw damaged bytes, before it counts as failed
_RESENDS = 2
#: a sealed chunk goes to each replica in slices this big
_SEND_SLICE = 1 << 20
#: background work counts a replica copy as an ack under way for this long after it
#: began or ended arriving (a replica cannot tell when the entry node's PUT is done)
_COPY_QUIET = 0.25
#: once this node's nvme is full, a new copy waits this long at most for RAM (which then
#: frees only when the disk does) before it is refused with ``nvme_full``
_FULL_WAIT = 1.0
#: a wait for RAM looks again at the nvme's mark this often
_FULL_STEP = 0.25


@dataclass(eq=False)
class Replicas:
    """One PUT's streams to its other holders, by node id, and the refusals met so far: a
    stream that fails is dropped (aborted), and a refusal kept to say why the PUT failed."""

    streams: dict[str, PutStream] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)

    def drop(self, node_ids: Iterable[str]) -> None:
        for node_id in node_ids:
            self.streams.pop(node_id).abort()

    def abort(self) -> None:
        for stream in self.streams.values():
            stream.abort()


class WritePath:
    def __init__(
        self, local: LocalStore, cluster: ClusterView, *, to_drain: Callable[[str], None]
    ) -> None:
        self.local = local
        self.cluster = cluster
        #: hands a chunk stored here to the drain
        self.to_drain = to_drain
        #: PUTs in flight on this node (drain and encode give way to them)
        self.inflight = 0
        #: local stores of data under way (a PUT's copy, a peer's copy or fragment, a
        #: repair's or rebalance's copy): a drain's ``can_leave`` waits for them, since
        #: data may still land here
        self.storing = 0
        #: when a replica copy of another node's PUT last began or ended arriving here
        #: (monotonic): a node that takes other nodes' acks as a replica (every PUT
        #: entering through one node, as co-located clients make them) gives way to them
        #: as to its own PUTs
        self.copy_seen = -1.0

    def ack_copy_arriving(self) -> None:
        self.copy_seen = time.monotonic()

    def busy(self) -> bool:
        """Whether acks are under way here: a PUT in flight, or a replica copy of one that
        began or ended arriving within the last ``_COPY_QUIET`` seconds."""
        return bool(self.inflight) or time.monotonic() - self.copy_seen < _COPY_QUIET

    # ---- entry node ----------------------------------------------------------------------
    async def put_chunk(
        self, chunk_id: str, size: int, body: BodyPieces
    ) -> tuple[int, dict[str, Any]]:
        """Stream a chunk into RAM here and on the other replica holders; (status, reply)."""
        started = time.perf_counter()
        placement, order = self._admit(chunk_id)
        # In flight from the admission on (no await in between): the view it was admitted
        # with may have this node as a holder, so a drain's ``can_leave`` sampled while it
        # asks who holds the chunk must not miss the copy it may still store here.
        self.inflight += 1
        try:
            if chunk_id in self.local.index:
                held = await self.already_held(chunk_id, placement)
                if held is not None:
                    return 200, held
            return await self._put_new(chunk_id, size, body, order, started)
        finally:
            self.inflight -= 1

    async def put_sealed(
        self, chunk_id: str, buf: Allocation, crc32c: int | None = None, *, admitted: bool = False
    ) -> tuple[int, dict[str, Any]]:
        """A chunk handed over in a sealed shared segment (``storaged.front.shm``): ``buf`` is an
        allocation of the memory tier that already hashed to ``chunk_id``, and is taken over
        whatever happens (adopted as this node's RAM copy when this node is a holder,
        released otherwise). Replicates and answers as ``put_chunk`` does (I1, I2).
        ``crc32c`` (of ``buf``) goes with the copies, so replicas need not hash them.
        ``admitted``: its lease was handed out before the node began stopping, so a stop
        does not refuse it (it waits for it, I5)."""
        started = time.perf_counter()
        try:
            placement, order = self._admit(chunk_id, admitted=admitted)
        except BaseException:
            self.local.memory.release(buf)
            raise
        self.inflight += 1  # from the admission on, as in ``put_chunk``
        try:
            if chunk_id in self.local.index:
                try:
                    held = await self.already_held(chunk_id, placement)
                except BaseException:
                    self.local.memory.release(buf)
                    raise
                if held is not None:
                    self.local.memory.release(buf)
                    return 200, held
            return await self._put_new(
                chunk_id, len(buf.view), None, order, started, sealed=buf, crc32c=crc32c
            )
        finally:
            self.inflight -= 1

    def _admit(self, chunk_id: str, *, admitted: bool = False) -> tuple[Placement, list[str]]:
        """Refusals that come before any byte (but the stop's, for a PUT ``admitted``
        before it); the PUT's one view of the membership (its targets, replacements and
        the reply's order)."""
        if self.local.stopping and not admitted:
            raise unavailable("shutting_down", f"node {self.local.id} is stopping", retry_after=1.0)
        if not self.cluster.membership.coordinator_reachable():
            raise unavailable(
                "coordinator_unavailable",
                "the coordination service is unreachable: writes wait until it is back",
                retry_after=1.0,
            )
        # One membership view for the whole PUT: targets, replacements and the reply's order.
        # Draining nodes take no new copies (``Placement.write_order``).
        placement = self.cluster.placement()
        order = placement.write_order(chunk_id)
        if len(order) < self.local.config.replication:
            raise unavailable(
                "insufficient_replicas",
                f"{len(order)} live node(s) that are not draining, replication needs "
                f"{self.local.config.replication}",
                retry_after=self.local.config.down_after,
            )
        return placement, order

    async def already_held(self, chunk_id: str, placement: Placement) -> dict[str, Any] | None:
        """The 200 reply if the cluster holds ``chunk_id`` as an ack promises (``replication``
        hot copies or all ``n`` fragments), as the live nodes of ``placement`` (the PUT's
        view) report it now; else None. Every copy counted is touched, so GC keeps it for
        another grace period."""
        answers = (await self.cluster.holdings(placement.alive, [chunk_id], touch=time.time()))[
            chunk_id
        ]
        hot = [h.node for h in answers if h.hot]
        frags = {i for h in answers for i in h.fragments}
        size = max((h.size for h in answers), default=-1)
        state = max((h.state for h in answers), default=0)
        if len(hot) >= self.local.config.replication:
            rank = {n: i for i, n in enumerate(placement.order(chunk_id))}
            replicas = sorted(hot, key=lambda n: rank.get(n, len(rank)))
        elif len(frags) >= self.local.config.n:
            replicas = sorted({h.node for h in answers if h.fragments})
            state = max(state, 3)
        else:
            return None
        return {
            "chunk": chunk_id,
            "size": size,
            "replicas": replicas,
            "state": state_name(max(state, 1)),
        }

    async def _put_new(
        self,
        chunk_id: str,
        size: int,
        body: BodyPieces | None,
        order: list[str],
        started: float,
        sealed: Allocation | None = None,
        crc32c: int | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The PUT of a new chunk: ``body`` streamed into a fresh allocation, or ``sealed``
        (an allocation already filled and checked, of CRC-32C ``crc32c`` when given) sent
        on as it is."""
        targets = order[: self.local.config.replication]
        if sealed is not None:
            buf = sealed
        else:
            buf = await self.room(size, lambda wait: self.local.memory.allocate(size, timeout=wait))
        replicas = Replicas()
        try:
            remote = [t for t in targets if t != self.local.id]
            replicas.streams = await self._open_streams(chunk_id, size, remote, crc32c)
            if body is not None:
                received = await self._receive(body, buf.view, replicas)
                if received < size:
                    raise BadInput("truncated", f"body ended after {received} of {size} bytes")
                if await chunk_id_of_async(buf.view) != chunk_id:
                    raise BadInput("checksum_mismatch", "the body's BLAKE3-256 is not the id")
            else:
                await self._send_all(buf.view, replicas)
            holders, created = await self._finish_streams(
                chunk_id, buf.view, replicas, order, crc32c
            )
        except BaseException:
            # Nothing is deleted anywhere (I2): what reached other nodes is GC's to collect.
            replicas.abort()
            self.local.memory.release(buf)
            raise
        if self.local.id in holders:
            if await self.store_local(chunk_id, buf):
                created.append(self.local.id)
        elif sealed is not None:
            # Handed over by a client on this host, which will read it back from here (a
            # job restarted in place): the sealed pages stay as a local copy, evictable and
            # counted as no copy of the chunk (the holders above are its copies).
            async with self.local.locks.hold(chunk_id):
                await self.local.memory.put_local_copy(chunk_id, buf)
        else:
            self.local.memory.release(buf)
        self.local.metrics.ack_latency.observe(time.perf_counter() - started)
        if not created:
            return 200, self._reply(chunk_id, size, holders)
        self.local.metrics.put_bytes.inc(size)
        return 201, {"chunk": chunk_id, "size": size, "replicas": holders, "state": "memory"}

    async def room(self, size: int, take: Callable[[float], Awaitable[T]]) -> T:
        """RAM for a new copy of ``size`` bytes, by ``take(timeout)`` (an allocation of the
        memory tier, or a shared segment): it waits up to ``put_wait`` for room, but once
        this node's nvme is full only about ``_FULL_WAIT`` more (its RAM is then held by
        chunks that cannot drain: waiting would only make a client sit out ``put_wait`` for
        the same answer).

        Raises ``InsufficientStorage`` ``nvme_full`` naming this node (the nvme is full),
        else ``Unavailable`` ``memory_full`` (``put_wait`` passed, or at once for a size that
        can never fit)."""
        if size_class(size) > self.local.memory.usage().capacity:
            raise unavailable(
                "memory_full", f"{size} bytes can never fit in this node's RAM", retry_after=1.0
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.local.config.put_wait
        full_from: float | None = None
        while True:
            now = loop.time()
            give_up = deadline
            if self.local.space.full("nvme"):
                full_from = now if full_from is None else full_from
                give_up = min(deadline, full_from + _FULL_WAIT)
            else:
                full_from = None
            try:
                return await take(max(0.0, min(give_up - now, _FULL_STEP)))
            except TierFull as exc:
                if full_from is not None and loop.time() >= give_up:
                    raise self.nvme_full() from exc
                if loop.time() >= deadline:
                    raise unavailable("memory_full", str(exc), retry_after=1.0) from exc

    def nvme_full(self) -> InsufficientStorage:
        """The refusal of a copy by a node whose nvme is full (docs/API.md E16)."""
        local = self.local
        dirty = local.memory.stats().dirty_bytes
        return InsufficientStorage(
            "nvme_full",
            f"nvme tier full on node {local.id} ({local.url}), {local.space.describe('nvme')}: "
            f"its RAM holds {dirty / 2**20:.1f} MiB of chunks that cannot drain to disk, so "
            "it takes no new ones until space is freed there",
            full=[{"node": local.id, "url": local.url, "tier": "nvme"}],
        )

    def _reply(self, chunk_id: str, size: int, holders: list[str]) -> dict[str, Any]:
        info = self.local.index.get(chunk_id)
        state = state_name(info.state) if info else "memory"
        return {"chunk": chunk_id, "size": size, "replicas": holders, "state": state}

    async def _open_streams(
        self, chunk_id: str, size: int, remote: list[str], crc32c: int | None = None
    ) -> dict[str, PutStream]:
        streams: dict[str, PutStream] = {}

        async def open_one(node_id: str) -> None:
            try:
                streams[node_id] = await self.cluster.peers.open_put(
                    self.local.config.dial_addr(self.cluster.spec(node_id)),
                    chunk_id,
                    size,
                    crc32c,
                    ack=True,
                )
            except PeerUnavailable:
                self.cluster.membership.report_failure(node_id)

        await asyncio.gather(*(open_one(n) for n in remote))
        return streams

    async def _receive(self, body: BodyPieces, buf: memoryview, replicas: Replicas) -> int:
        """Copy pieces into ``buf`` and forward them to every open stream as they arrive.

        A peer that fails or refuses (e.g. memory_full) mid-body is dropped from
        ``replicas``; its refusal goes into ``replicas.refused``.
        """
        pos = 0
        size = len(buf)
        async for piece in body:
            n = len(piece)
            if pos + n > size:
                raise BadInput("bad_request", "body longer than its Content-Length")
            buf[pos : pos + n] = piece  # the one copy into this node's RAM copy
            if replicas.streams:
                view = buf[pos : pos + n]
                dropped = [
                    node_id
                    for node_id, stream in replicas.streams.items()
                    if not await self._forward(node_id, stream, (view,), replicas.refused)
                ]
                replicas.drop(dropped)
            pos += n
        return pos

    async def _send_all(self, buf: memoryview, replicas: Replicas) -> None:
        """Send the whole of ``buf`` to every open stream at once, in slices (the transport
        keeps what the socket does not take); failures leave ``replicas`` as in ``_receive``."""
        slices = [buf[pos : pos + _SEND_SLICE] for pos in range(0, len(buf), _SEND_SLICE)]
        streams = replicas.streams
        sent = await asyncio.gather(
            *(self._forward(n, s, slices, replicas.refused) for n, s in streams.items())
        )
        replicas.drop([node_id for node_id, ok in zip(streams, sent, strict=True) if not ok])

    async def _forward(
        self,
        node_id: str,
        stream: PutStream,
        views: Sequence[memoryview],
        refused: list[Refusal],
    ) -> bool:
        """Write ``views`` to one replica's stream; False when it failed (an unreachable
        peer is reported to the membership, a refusal goes into ``refused``): the caller
        drops that stream."""
        try:
            for view in views:
                await stream.write(view)
        except PeerUnavailable:
            self.cluster.membership.report_failure(node_id)
            return False
        except PeerError as exc:
            refused.append((node_id, exc))
            return False
        return True

    async def _finish_streams(
        self,
        chunk_id: str,
        buf: memoryview,
        replicas: Replicas,
        order: list[str],
        crc32c: int | None = None,
    ) -> tuple[list[str], list[str]]:
        """Collect the peers' verdicts; replace failed holders from our own (checked) copy,
        with the next nodes of ``order`` (the PUT's one view of the membership).

        Returns (the holders in placement order, the remote ones that did not have it before).
        """
        rf = self.local.config.replication
        targets = order[:rf]
        holders: list[str] = [self.local.id] if self.local.id in targets else []
        created: list[str] = []
        refused = replicas.refused
        damaged = await self._verdicts(chunk_id, replicas, holders, created)
        # Our copy hashed to the id: a replica that saw other bytes got them damaged on the
        # way. Send it our copy again rather than failing the client's good upload.
        for node_id in damaged:
            log.warning("replica %s saw damaged bytes of %s: sending it again", node_id, chunk_id)
            reply = await self._push_with_resends(node_id, chunk_id, buf, refused, crc32c)
            if reply is not None:
                holders.append(node_id)
                if reply.get("new"):
                    created.append(node_id)
        # Fill the gaps (a dead or full peer) with the next live nodes of the order.
        tried = set(targets)
        for candidate in order:
            if len(holders) >= rf:
                break
            if candidate in tried or candidate in holders:
                continue
            tried.add(candidate)
            if candidate == self.local.id:
                holders.append(self.local.id)
                continue
            reply = await self._push_with_resends(candidate, chunk_id, buf, refused, crc32c)
            if reply is None:
                continue
            holders.append(candidate)
            if reply.get("new"):
                created.append(candidate)
        if len(holders) < rf:
            raise self._too_few_holders(len(holders), refused)
        rank = {n: i for i, n in enumerate(order)}
        return sorted(holders, key=lambda n: rank.get(n, len(rank))), created

    async def _verdicts(
        self, chunk_id: str, replicas: Replicas, holders: list[str], created: list[str]
    ) -> list[str]:
        """Each replica stream's verdict: a holder goes to ``holders`` (and ``created`` if
        it did not have the chunk before), a refusal to ``replicas.refused``; an unreachable
        replica is reported to the membership. Returns the replicas that saw damaged bytes."""
        damaged: list[str] = []

        async def finish(node_id: str, stream: PutStream) -> None:
            try:
                reply = await stream.finish()
            except PeerUnavailable as exc:
                log.warning("replica %s of %s unavailable: %s", node_id, chunk_id, exc)
                self.cluster.membership.report_failure(node_id)
                return
            except PeerError as exc:
                if exc.code == "checksum_mismatch":
                    damaged.append(node_id)
                else:
                    log.warning("replica %s refused %s: %s", node_id, chunk_id, exc)
                    replicas.refused.append((node_id, exc))
                return
            holders.append(node_id)
            if reply.get("new"):
                created.append(node_id)

        await asyncio.gather(*(finish(n, s) for n, s in replicas.streams.items()))
        return damaged

    def _too_few_holders(self, count: int, refused: list[Refusal]) -> StoragedError:
        """Why a PUT found only ``count`` holders: this node stops, replicas' nvme full
        (E16), out of RAM, or too few live nodes."""
        if self.local.stopping:
            return unavailable(
                "shutting_down", f"node {self.local.id} is stopping", retry_after=1.0
            )
        rf = self.local.config.replication
        short = f"only {count} node(s) could take the chunk, need {rf}"
        full = {n: e for n, e in refused if e.code == "nvme_full"}
        if full:
            # Not backpressure: those nodes' RAM frees only when their disk does (E16).
            return InsufficientStorage(
                "nvme_full",
                f"{short}: " + "; ".join(e.message for e in full.values()),
                full=[{"node": n, "url": self.cluster.spec(n).url, "tier": "nvme"} for n in full],
            )
        out_of_ram = [f"{n}: {e.message}" for n, e in refused if e.code == "memory_full"]
        if out_of_ram:
            return unavailable(
                "memory_full", f"{short}: out of RAM on " + "; ".join(out_of_ram), retry_after=1.0
            )
        return unavailable(
            "insufficient_replicas",
            f"only {count} node(s) could take the chunk; need {rf}",
            retry_after=self.local.config.down_after,
        )

    async def _push_with_resends(
        self,
        node_id: str,
        chunk_id: str,
        data: memoryview,
        refused: list[Refusal],
        crc32c: int | None = None,
    ) -> dict[str, Any] | None:
        for _ in range(_RESENDS):
            try:
                return await self.push_copy(node_id, chunk_id, data, crc32c)
            except PeerUnavailable:
                return None
            except PeerError as exc:
                if exc.code != "checksum_mismatch":
                    refused.append((node_id, exc))
                    return None
                log.warning("replica %s saw damaged bytes of %s again", node_id, chunk_id)
        return None

    async def push_copy(
        self, node_id: str, chunk_id: str, data: memoryview, crc32c: int | None = None
    ) -> dict[str, Any]:
        """Send a whole copy of a chunk to ``node_id``'s RAM (with its CRC-32C when known,
        which the receiver then checks instead of BLAKE3)."""
        stream = await self.cluster.peers.open_put(
            self.local.config.dial_addr(self.cluster.spec(node_id)), chunk_id, len(data), crc32c
        )
        try:
            await stream.write(data)
            return await stream.finish()
        except BaseException:
            stream.abort()
            raise

    # ---- any holder ------------------------------------------------------------------------
    async def store_local(self, chunk_id: str, buf: Allocation) -> bool:
        """Keep ``buf`` (a checked copy from ``memory.allocate``) as this node's RAM copy, or
        release it when a copy is already here; either way this node now holds the chunk and
        it counts as used now. True if the copy is new. Under the chunk's lock, so a
        collection of an older copy is either finished (we store anew) or not begun (it will
        see the fresh use and keep the copy)."""
        self.storing += 1
        try:
            return await self._store_local(chunk_id, buf)
        finally:
            self.storing -= 1

    async def _store_local(self, chunk_id: str, buf: Allocation) -> bool:
        async with self.local.locks.hold(chunk_id):
            if self.local.holds_hot(chunk_id):
                self.local.memory.release(buf)
                self.local.note_stored(chunk_id, len(buf.view))
                return False
            await self.local.memory.put(chunk_id, buf, verified=True)
            self.local.note_stored(chunk_id, len(buf.view))
        self.to_drain(chunk_id)
        return True

    async def keep_copy(self, chunk_id: str, data: memoryview) -> bool:
        """Store a copy of checked bytes read from elsewhere (repair, rebalance) as this
        node's own. Refused (``PeerError`` ``draining``) on a draining node, as a peer's
        copy is: the caller places it on the next node."""
        self._refuse_if_draining()
        self.storing += 1  # with the check, one step: ``can_leave`` sees it from here on
        try:
            buf = await self.local.memory.allocate(len(data), timeout=self.local.config.put_wait)
            try:
                buf.view[:] = data  # deliberate copy: ``data`` belongs to a lease or a peer reply
                self._refuse_if_draining()  # again: marked while RAM was found
            except BaseException:
                self.local.memory.release(buf)
                raise
            return await self.store_local(chunk_id, buf)
        finally:
            self.storing -= 1

    async def store_fragment(self, key: str, body: memoryview, size: int) -> None:
        """Peer side: keep fragment ``key`` (checked against its header's checksum by the
        cold tier, durable when this returns) and index it. ``size`` is the chunk's length
        when the sender knows it (-1 else).

        Refused with ``PeerError``: ``draining`` on a draining node (checked when the call
        arrives, its body with it, and again under the chunk's lock, right before the
        store), ``checksum_mismatch``, ``cold_full``. A sender treats ``draining`` like a
        dead target: its next view places the fragment elsewhere."""
        cid, index = parse_fragment_key(key)
        self._refuse_if_draining()
        self.storing += 1  # with the check, one step: ``can_leave`` sees it from here on
        try:
            async with self.local.locks.hold(cid):
                self._refuse_if_draining()
                try:
                    await self.local.cold.put(key, body)
                except CorruptChunk as exc:
                    raise PeerError("checksum_mismatch", str(exc)) from exc
                except TierFull as exc:
                    self.local.space.note_full("cold", exc, len(body))
                    raise PeerError(
                        "cold_full", f"cold tier full on {self.local.id} ({self.local.url}): {exc}"
                    ) from exc
                self.local.space.note_written("cold")
                self.local.fragments.setdefault(cid, set()).add(index)
                now = time.time()
                info = self.local.index.get(cid)
                if info is None:
                    self.local.index[cid] = IndexEntry(size, NVME, now, now)
                else:
                    info.touch(now)
        finally:
            self.storing -= 1

    async def receive_chunk(self, chunk_id: str, size: int) -> Allocation:
        """Peer side: a buffer for a copy another node sends."""
        if self.local.stopping:
            raise PeerError("shutting_down", f"node {self.local.id} is stopping")
        self._refuse_if_draining()
        if size > self.local.config.max_chunk_size:
            raise PeerError("too_large", f"{size} bytes is over the max chunk size")
        try:
            return await self.room(
                size, lambda wait: self.local.memory.allocate(size, timeout=wait)
            )
        except StoragedError as exc:  # memory_full, or nvme_full naming this node
            raise PeerError(exc.code, exc.message) from exc

    async def chunk_received(
        self, chunk_id: str, buf: Allocation, crc32c: int | None = None
    ) -> dict[str, Any]:
        """Peer side: verify a received copy and keep it. Against the id, or, when the
        sender (which checked the id on its own copy) sent ``crc32c``, against that: the
        peer link is authenticated, and the CRC catches damage on the way for a fraction
        of a BLAKE3 pass. Reads and the drain's file header check the bytes again."""
        if crc32c is not None:
            ok = await crc32c_of_async(buf.view) == crc32c
        else:
            ok = await chunk_id_of_async(buf.view) == chunk_id
        if not ok:
            self.local.memory.release(buf)
            raise PeerError("checksum_mismatch", "the body does not match its check")
        try:
            # Again at the end: the node may have been marked draining while the body came.
            self._refuse_if_draining()
        except PeerError:
            self.local.memory.release(buf)
            raise
        return {"new": await self.store_local(chunk_id, buf)}

    def _refuse_if_draining(self) -> None:
        """A draining node takes no new data of any kind (copies, fragments, repair and
        rebalance moves): a sender whose view predates the mark then places it on the next
        node of its order. Every store checks this when it begins and again once its bytes
        are here, right before the store, and counts in ``storing`` (or ``inflight``) from
        the first check on, with no await in between; so the drain's ``can_leave`` (which
        needs the node to know it drains, and nothing counted) cannot be outrun by data
        landing after it was computed."""
        if self.cluster.membership.drains.is_draining(self.local.id):
            raise PeerError("draining", f"node {self.local.id} is draining: it takes no new data")

    def chunk_aborted(self, chunk_id: str, buf: Allocation) -> None:
        self.local.memory.release(buf)
