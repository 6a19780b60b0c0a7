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
from storaged.membership import Membership
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
