"""The cluster as one node sees it: placement from its membership, its members'
addresses, who holds which chunks and how, and the peer calls (``services.ClusterView``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import msgpack

from storaged.config import Config, NodeSpec
from storaged.coord.manifest_store import CatalogRecord
from storaged.coord.membership import Membership
from storaged.node.index import COLD, Holding
from storaged.node.rpc import DOC_METHODS
from storaged.peer import PeerClient, PeerError, PeerUnavailable
from storaged.placement import Placement

T = TypeVar("T")

#: chunk ids per chunk_info call
_INFO_BATCH = 4096

#: how a call addressed to this node itself is served (``PeerRpc.call_local``)
LocalCall = Callable[
    [str, dict[str, Any], memoryview | None],
    Awaitable[tuple[dict[str, Any], bytes | bytearray | memoryview | None]],
]


async def ping(peers: PeerClient, config: Config, spec: NodeSpec) -> dict[str, Any]:
    """The heartbeat call of the static membership."""
    reply, _ = await peers.call(config.dial_addr(spec), "ping", {}, timeout=2.0)
    return reply


class Cluster:
    """This node's view of the others (``services.ClusterView``). ``serve_locally`` must
    be given before a call addressed to this node itself is made."""

    def __init__(self, config: Config, membership: Membership, peers: PeerClient) -> None:
        self.config = config
        self.id = config.node_id
        self.membership = membership
        self.peers = peers
        self._local: LocalCall | None = None
        #: every member's spec as the views this node took named it (``spec``)
        self._specs: dict[str, NodeSpec] = {}

    def serve_locally(self, call: LocalCall) -> None:
        self._local = call

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
            assert self._local is not None, "Cluster.serve_locally was not given"
            reply, out = await self._local(method, args, memoryview(body) if body else None)
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
                await asyncio.wait({task}, timeout=step)
                if task.done():  # its own answer first: a failing call marks the node down
                    return task.result()
                if not self.membership.is_alive(node_id):
                    raise PeerUnavailable("timeout", f"{node_id} went down while asked")
        finally:
            if not task.done():
                task.cancel()  # the peer client drops the connection
                with contextlib.suppress(asyncio.CancelledError, PeerError):
                    await task
            elif not task.cancelled():
                # Done while this asker was cancelled (a caller's timeout in the same step):
                # its outcome is nobody's now, but taken, or the loop logs it as a traceback
                # ("Task exception was never retrieved": the etcd soak, run 34).
                task.exception()

    # ---- the peer calls the stages make, one method each (``rpc.py`` serves them) ----------
    async def get_chunk(
        self, node_id: str, chunk_id: str
    ) -> tuple[dict[str, Any], bytes | memoryview | None]:
        """``node_id``'s hot copy of the chunk (unchecked: the caller checks it) and the tier
        it came from (``tier`` in the reply)."""
        return await self.call(node_id, "get_chunk", {"id": chunk_id})

    async def get_fragment(self, node_id: str, key: str) -> bytes | memoryview | None:
        """The stored fragment ``key`` (its header included), checked by the holder's tier."""
        _, body = await self.call(node_id, "get_fragment", {"key": key})
        return body

    async def put_fragment(
        self, node_id: str, key: str, size: int, blob: bytes | bytearray | memoryview
    ) -> None:
        """Store fragment ``key`` of a chunk of ``size`` bytes durably on ``node_id``."""
        await self.call(node_id, "put_fragment", {"key": key, "size": size}, blob)

    async def drained(self, node_id: str, chunk_id: str) -> None:
        """Tell the chunk's owner a copy of it is on disk here (it may encode now)."""
        await self.call(node_id, "drained", {"id": chunk_id})

    async def set_state(self, node_id: str, ids: list[str], state: int) -> None:
        """Raise the recorded state of ``ids`` on ``node_id`` to ``state``."""
        await self.call(node_id, "set_state", {"ids": ids, "state": state})

    async def drop_nvme(self, node_id: str, ids: list[str]) -> None:
        """Drop ``node_id``'s nvme copies of ``ids`` that are cold."""
        await self.call(node_id, "drop_nvme", {"ids": ids})

    async def evict(self, node_id: str, ids: list[str], *, nvme: bool) -> dict[str, Any]:
        """Evict ``node_id``'s RAM (and, with ``nvme``, nvme) copies of ``ids``; the counts."""
        reply, _ = await self.call(node_id, "evict", {"ids": ids, "nvme": nvme})
        return reply

    async def witness(
        self, node_id: str, chunk_id: str, slot: int, pin: float, *, timeout: float
    ) -> bool:
        """Whether ``node_id`` holds the slot and pinned its chunk (``pipeline/rebalance.py``)."""
        reply, _ = await self.call(
            node_id, "witness", {"id": chunk_id, "slot": slot, "pin": pin}, timeout=timeout
        )
        return bool(reply.get("held"))

    async def drop_misplaced(
        self, node_id: str, chunk_id: str, slot: int, witnesses: list[str], *, timeout: float
    ) -> bool:
        """Whether ``node_id`` dropped its misplaced slot (witnessed by ``witnesses``)."""
        reply, _ = await self.call(
            node_id,
            "drop_misplaced",
            {"id": chunk_id, "slot": slot, "witnesses": witnesses},
            timeout=timeout,
        )
        return bool(reply.get("dropped"))

    async def drain_marks(
        self, node_id: str, marks: dict[str, Any], *, timeout: float
    ) -> dict[str, Any]:
        """Merge drain ``marks`` into ``node_id``'s."""
        reply, _ = await self.call(node_id, "drain_marks", {"marks": marks}, timeout=timeout)
        return reply

    async def drain_progress(self, node_id: str, *, timeout: float) -> dict[str, Any]:
        """How far ``node_id``'s drain is (``Evacuation.local_progress`` there)."""
        reply, _ = await self.call(node_id, "drain_progress", {}, timeout=timeout)
        return reply

    async def catalog_put(self, node_id: str, record: CatalogRecord) -> dict[str, Any]:
        """Store ``record`` in ``node_id``'s catalog unless it holds a newer one (``stored``)."""
        reply, _ = await self.call(node_id, "catalog_put", {"record": record.to_wire()})
        return reply

    async def catalog_get(self, node_id: str, name: str) -> dict[str, Any]:
        """``node_id``'s record of ``name``, if any; abandoned once it is held down."""
        reply, _ = await self.call(node_id, "catalog_get", {"name": name}, until_down=True)
        return reply

    async def catalog_dump(self, node_id: str, prefix: str, *, chunks: bool) -> dict[str, Any]:
        """``node_id``'s records under ``prefix`` (with their chunk lists if ``chunks``);
        abandoned once it is held down."""
        reply, _ = await self.call(
            node_id, "catalog_dump", {"prefix": prefix, "chunks": chunks}, until_down=True
        )
        return reply

    async def catalog_versions(self, node_id: str, names: list[str]) -> dict[str, Any]:
        """What version of each of ``names`` ``node_id``'s catalog holds."""
        reply, _ = await self.call(node_id, "catalog_versions", {"names": names})
        return reply

    # ---- who holds what --------------------------------------------------------------------
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
        relies on its copy until that time (see ``IndexEntry.last_use``): the answer and the
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
