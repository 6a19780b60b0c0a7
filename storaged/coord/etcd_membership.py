"""Membership and liveness in etcd: a lease per node, a watch for every change.

A node registers ``membership/nodes/<id>`` (id, url, peer address, state) and
``membership/alive/<id>`` under a lease of ``ttl`` seconds that it keeps alive; a lease
that expires (a crash, a partition from etcd) deletes the alive key, and every node's
watch sees the node go down. A graceful stop revokes the lease as it begins (``leaving``),
so placement everywhere stops choosing the node while it drains. No etcd locks and
no leader election: the data path never waits on etcd.

When this node cannot reach etcd it keeps its last view (it goes on serving reads with
it) and keeps trying; on return it registers again if its lease expired meanwhile.
``report_failure`` (a peer call failed to connect) counts a peer down at once, until the
peer answers a ping or registers anew.

Peers' figures (usage, backlogs: ``info``) come from pinging them over the peer
protocol, as the embedded membership's heartbeats do, not through etcd: a few peers per
round in turn, so that a node's cost stays the same however large the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
from etcd3aio._protobuf import Compare
from etcd3aio.kv import KVService

from storaged.config import Config, NodeSpec
from storaged.coord.catalogue import CoordinatorUnavailable
from storaged.coord.etcd import EtcdSession, compare_mod_revision, kv_response
from storaged.coord.etcd_catalogue import EtcdCatalogue
from storaged.coord.membership import ACTIVE, DRAINING, DrainMarks, Membership, MembershipView
from storaged.peer import PeerClient

if TYPE_CHECKING:
    from storaged.node.services import DataPlane

log = logging.getLogger("storaged.coord.membership")

#: live peers asked for their figures per probe round (one round per ttl/3 s), in turn: a
#: peer's figures are at most about members/FIGURES_PER_ROUND rounds old, and each node
#: sends and answers that many pings per round whatever the cluster's size (a ping to
#: every peer every round would be N^2 pings cluster-wide)
FIGURES_PER_ROUND = 16


class EtcdMembership(Membership):
    """This node's registration and everyone's, as etcd says; ``nodes()`` in id order."""

    def __init__(
        self,
        config: Config,
        session: EtcdSession,
        *,
        ttl: int = 3,
        start_timeout: float = 30.0,
    ) -> None:
        self.self_id = config.node_id
        self.config = config
        self.s = session
        self.ttl = ttl
        self.start_timeout = start_timeout
        spec = config.node
        self._spec = spec
        self._members: dict[str, tuple[NodeSpec, str]] = {spec.id: (spec, ACTIVE)}
        self._alive: set[str] = {spec.id}
        self._failed: set[str] = set()
        #: wall-clock time this node saw each peer go down (lease gone or call failed)
        self._down_at: dict[str, float] = {}
        #: when each member's state was last set (its record's ``since``): a drain's start
        self._draining_since: dict[str, float] = {}
        self._revision = 0
        self._state = ACTIVE
        self._lease = 0
        self._tasks: list[asyncio.Task[None]] = []
        #: the task that renews the lease (one of ``_tasks``; None once ``leaving``)
        self._keepalive: asyncio.Task[None] | None = None
        self._probe = PeerClient(self.self_id, config.cluster_secret.encode(), connect_timeout=2)
        #: each peer's last ping reply (its ``Node.heartbeat()``)
        self._info: dict[str, dict[str, Any]] = {}
        #: where the next round of figure pings starts in the sorted peer ids
        self._figures_from = 0
        #: when the lease was last granted or renewed (monotonic)
        self._renewed = 0.0
        self.drains: EtcdDrainMarks = EtcdDrainMarks(self)

    # ---- keys ----------------------------------------------------------------------------
    def _node_key(self, node_id: str = "") -> str:
        return self.s.key("membership", "nodes", node_id)

    def _alive_key(self, node_id: str = "") -> str:
        return self.s.key("membership", "alive", node_id)

    def _drained_key(self, node_id: str = "") -> str:
        # The drain mark of a member forgotten while draining: it outlives the member record
        # so that the node, back, drains again instead of taking placements as a joiner.
        return self.s.key("membership", "drained", node_id)

    # ---- the interface -------------------------------------------------------------------
    def nodes(self) -> tuple[NodeSpec, ...]:
        return tuple(spec for _, (spec, _) in sorted(self._members.items()))

    def is_alive(self, node_id: str) -> bool:
        if node_id == self.self_id:
            return True
        return node_id in self._alive and node_id not in self._failed

    def report_failure(self, node_id: str) -> None:
        if node_id != self.self_id and node_id not in self._failed:
            log.warning("peer %s unreachable: treating it as down", node_id)
            self._failed.add(node_id)
            self._down_at.setdefault(node_id, time.time())

    def info(self, node_id: str) -> dict[str, Any]:
        return self._info.get(node_id, {})

    def down_since(self, node_id: str) -> float | None:
        if self.is_alive(node_id) or node_id not in self._members:
            return None
        return self._down_at.get(node_id)

    def view(self) -> MembershipView:
        return MembershipView(
            members=self.nodes(),
            alive=frozenset(n for n in self._members if self.is_alive(n)),
            draining=self.drains.draining(),
            revision=self._revision,
        )

    async def leave(self) -> None:
        """Deregister this node for good (decommission): it leaves ``nodes()`` everywhere."""
        kv = await self.s.kv()
        await self.s.call(
            "deregistration",
            kv.txn(
                [],
                [
                    KVService.txn_op_delete(self._node_key(self.self_id)),
                    KVService.txn_op_delete(self._alive_key(self.self_id)),
                    KVService.txn_op_delete(self._drained_key(self.self_id)),
                ],
            ),
        )

    async def forget(self, node_id: str) -> bool:
        """Remove a member that is down (no alive key) for every node: its record goes in a
        transaction that holds only while it has no alive key, so a node that registered
        again meanwhile stays. If it comes back later it registers anew, as any joiner; but
        a drain mark is the operator's, not the timer's: the record of a draining member
        leaves a drain mark in the same transaction, and the node, back, drains again."""
        if node_id == self.self_id:
            return False
        kv = await self.s.kv()
        node_key, alive_key = self._node_key(node_id), self._alive_key(node_id)
        for _ in range(8):
            got = await self.s.call("member read", kv.get(node_key))
            compares = [KVService.txn_compare_create_revision(alive_key, 0)]
            ops = [KVService.txn_op_delete(node_key)]
            if got.kvs:
                compares.append(compare_mod_revision(node_key, got.kvs[0].mod_revision))
                doc = msgpack.unpackb(got.kvs[0].value, raw=False)
                if doc.get("state") == DRAINING:
                    mark = {"id": node_id, "state": DRAINING, "forgotten": time.time()}
                    if "since" in doc:
                        mark["since"] = doc["since"]
                    ops.append(
                        KVService.txn_op_put(
                            self._drained_key(node_id), msgpack.packb(mark, use_bin_type=True)
                        )
                    )
            reply = await self.s.call("member removal", kv.txn(compares, ops))
            if reply.succeeded:
                if got.kvs:
                    log.warning(
                        "member %s was down past gone_after: removed from the members", node_id
                    )
                return True
            back = await self.s.call("member read", kv.get(alive_key))
            if back.kvs:
                return False  # registered again meanwhile: it stays
            # Its record changed between the read and the removal (a drain mark set or
            # lifted): read it again.
        raise CoordinatorUnavailable(f"member {node_id} keeps changing: not removed")

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Register (waits up to ``start_timeout`` for etcd), read the members, then keep
        the lease alive and watch in the background."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                await self._register()
                await self._reload()
                break
            except CoordinatorUnavailable as exc:
                if time.monotonic() > deadline:
                    raise CoordinatorUnavailable(
                        f"node {self.self_id} could not join through etcd: {exc}"
                    ) from exc
                await asyncio.sleep(0.5)
        self._keepalive = asyncio.create_task(self._keepalive_loop(), name="etcd-lease")
        self._tasks = [
            self._keepalive,
            asyncio.create_task(self._watch_loop(), name="etcd-watch"),
            asyncio.create_task(self._probe_loop(), name="etcd-probe"),
        ]

    async def leaving(self) -> None:
        """Revoke this node's lease now (its alive key goes) and stop renewing it: every
        node's watch takes it out of placement within an etcd round trip, while it drains.
        It stays a member, down, and registers again when it starts again."""
        if self._keepalive is not None:
            # First: a keepalive that found the lease gone would register it again.
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._keepalive
            self._keepalive = None
        if not self._lease:
            return
        try:
            # No longer than the lease would live anyway, now that nothing renews it.
            async with asyncio.timeout(self.ttl):
                lease = await self.s.lease()
                await self.s.call("lease revoke", lease.revoke(self._lease))
        except (TimeoutError, CoordinatorUnavailable) as exc:
            log.warning("node %s stopping: lease not revoked (%s); it expires", self.self_id, exc)
            return
        self._lease = 0
        log.info("node %s stopping: out of placement (its lease is revoked)", self.self_id)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.drains.is_draining(self.self_id):
            # A drained node that stops leaves the cluster: it is no longer listed as a
            # member (down), so nothing waits for it; started again, it joins anew.
            with contextlib.suppress(CoordinatorUnavailable):
                await self.leave()
                log.info("node %s was draining: it left the cluster", self.self_id)
        if self._lease:
            # Going down on purpose: the others see it now, not after the TTL.
            lease = await self.s.lease()
            with contextlib.suppress(CoordinatorUnavailable):
                await self.s.call("lease revoke", lease.revoke(self._lease))
            self._lease = 0
        await self._probe.close()
        await self.s.close()

    # ---- registration and the lease --------------------------------------------------------
    async def _register(self) -> None:
        lease = await self.s.lease()
        kv = await self.s.kv()
        spec = self._spec
        node_key, drained_key = self._node_key(spec.id), self._drained_key(spec.id)
        granted = await self.s.call("lease grant", lease.grant(self.ttl))
        for _ in range(8):
            # A drain mark outlives the node's restarts: keep the state etcd has for it. So
            # does the mark a member forgotten while draining left behind (``forget``): the
            # registration moves it into the record. Both reads hold in the transaction, so
            # a mark set, lifted or left meanwhile is read again, never undone.
            got = await self.s.call("member read", kv.get(node_key))
            left = await self.s.call("member read", kv.get(drained_key))
            kept = (
                msgpack.unpackb((got.kvs or left.kvs)[0].value, raw=False)
                if (got.kvs or left.kvs)
                else {}
            )
            state = str(kept.get("state", ACTIVE))
            member: dict[str, Any] = {
                "id": spec.id,
                "url": spec.url,
                "peer": spec.peer,
                "state": state,
            }
            if spec.domain:
                member["domain"] = spec.domain
            if "since" in kept:
                member["since"] = kept["since"]
            alive = {"id": spec.id, "since": time.time()}
            reply = await self.s.call(
                "registration",
                kv.txn(
                    [
                        compare_mod_revision(node_key, got.kvs[0].mod_revision if got.kvs else 0),
                        compare_mod_revision(
                            drained_key, left.kvs[0].mod_revision if left.kvs else 0
                        ),
                    ],
                    [
                        KVService.txn_op_put(node_key, msgpack.packb(member, use_bin_type=True)),
                        KVService.txn_op_put(
                            self._alive_key(spec.id),
                            msgpack.packb(alive, use_bin_type=True),
                            lease=int(granted.ID),
                        ),
                        KVService.txn_op_delete(drained_key),
                    ],
                ),
            )
            if reply.succeeded:
                break
        else:
            raise CoordinatorUnavailable(f"member {spec.id} keeps changing: not registered")
        if not got.kvs and left.kvs:
            log.warning("node %s was forgotten while draining: it registers draining", spec.id)
        self._state = state
        self._lease = int(granted.ID)
        self._renewed = time.monotonic()
        log.info("node %s registered in etcd (lease %x, ttl %d s)", spec.id, self._lease, self.ttl)

    def coordinator_reachable(self) -> bool:
        # The lease's last renewal is the freshest sign that etcd hears us.
        return time.monotonic() - self._renewed < self.ttl

    async def _keep_alive_once(self) -> bool:
        """One keepalive of the lease; False if etcd says it expired."""
        lease = await self.s.lease()

        async def once() -> int:
            stream = lease.keep_alive(self._lease)
            try:
                async for response in stream:
                    return int(response.TTL)
                return 0
            finally:
                stream.cancel()

        alive = await self.s.call("lease keepalive", once()) > 0
        if alive:
            self._renewed = time.monotonic()
        return alive

    async def _keepalive_loop(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self._keep_alive_once():
                    log.warning("node %s: its etcd lease expired; registering again", self.self_id)
                    await self._register()
            except CoordinatorUnavailable as exc:
                log.warning("node %s: etcd unreachable for the lease: %s", self.self_id, exc)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The loop must outlive any one failure: a lease that nobody renews takes
                # the node out of placement.
                log.exception("node %s: lease keepalive failed; trying again", self.self_id)

    # ---- the view ----------------------------------------------------------------------------
    async def _reload(self) -> None:
        """Read every member and alive key at one revision."""
        kv = await self.s.kv()
        prefix = self.s.key("membership", "")
        reply = await self.s.call(
            "membership read",
            kv.txn([], [KVService.txn_op_get(prefix, range_end=self.s.range_end(prefix))]),
        )
        members: dict[str, tuple[NodeSpec, str]] = {}
        alive: set[str] = set()
        for item in kv_response(reply):
            self._apply(bytes(item.key).decode(), bytes(item.value), members, alive)
        members.setdefault(self.self_id, (self._spec, self._state))
        now = time.time()
        for node_id in members.keys() - alive:
            # Down before this node saw it: count from now (it can only delay "gone").
            self._down_at.setdefault(node_id, now)
        self._members, self._alive = members, alive | {self.self_id}
        self._revision = int(reply.header.revision)

    def _apply(
        self,
        key: str,
        value: bytes | None,
        members: dict[str, tuple[NodeSpec, str]],
        alive: set[str],
    ) -> None:
        nodes, alives = self._node_key(), self._alive_key()
        if key.startswith(nodes):
            node_id = key[len(nodes) :]
            if value is None:
                members.pop(node_id, None)
                return
            doc = msgpack.unpackb(value, raw=False)
            spec = NodeSpec(
                str(doc["id"]), str(doc["url"]), str(doc["peer"]), domain=str(doc.get("domain", ""))
            )
            members[node_id] = (spec, str(doc.get("state", ACTIVE)))
            since = doc.get("since")
            if isinstance(since, int | float):
                self._draining_since[node_id] = float(since)
        elif key.startswith(alives):
            node_id = key[len(alives) :]
            if value is None:
                alive.discard(node_id)
                self._down_at.setdefault(node_id, time.time())
            else:
                alive.add(node_id)
                self._failed.discard(node_id)  # registered anew: it answers again
                self._down_at.pop(node_id, None)

    async def _watch_loop(self) -> None:
        prefix = self.s.key("membership", "")
        while True:
            try:
                watch = await self.s.watch()
                stream = watch.watch(
                    prefix, range_end=self.s.range_end(prefix), start_revision=self._revision + 1
                )
                async for response in stream:
                    if response.canceled or response.compact_revision:
                        break  # events were lost: read the whole view again
                    self._on_events(response)
                await self._reload_when_possible()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("membership watch failed (%s); reading the view again", exc)
                await asyncio.sleep(0.5)
                await self._reload_when_possible()

    def _on_events(self, response: Any) -> None:
        members, alive = dict(self._members), set(self._alive)
        for event in response.events:
            # mvccpb.Event.type: 0 = PUT, 1 = DELETE
            value = None if event.type == 1 else bytes(event.kv.value)
            self._apply(bytes(event.kv.key).decode(), value, members, alive)
        members.setdefault(self.self_id, (self._spec, self._state))
        before = (set(self._members), self._alive)
        self._members, self._alive = members, alive | {self.self_id}
        self._revision = max(self._revision, int(response.header.revision))
        if before != (set(self._members), self._alive):
            log.info("membership: %s alive of %s", sorted(self._alive), sorted(self._members))

    async def _reload_when_possible(self) -> None:
        while True:
            try:
                await self._reload()
                return
            except CoordinatorUnavailable:
                await asyncio.sleep(0.5)

    async def _probe_loop(self) -> None:
        """Ping the peers reported failed (one that answers counts alive again), and a few
        live ones for their figures."""
        while True:
            await asyncio.sleep(max(self.ttl / 3.0, 0.2))
            failed = list(self._failed)
            await asyncio.gather(
                *(self._probe_failed(node_id) for node_id in failed),
                # A live peer that does not answer keeps its last figures: liveness is the
                # lease's business, and a data-path call that fails to connect reports it.
                *(self._ping(node_id) for node_id in self._figures_round(set(failed))),
            )

    async def _ping(self, node_id: str) -> dict[str, Any] | None:
        """The peer's ping reply (kept as its figures), or None if it did not answer."""
        entry = self._members.get(node_id)
        if entry is None:
            return None
        try:
            reply, _ = await self._probe.call(
                self.config.dial_addr(entry[0]), "ping", {}, timeout=2.0
            )
        except Exception:
            return None
        self._info[node_id] = reply
        return reply

    async def _probe_failed(self, node_id: str) -> None:
        if node_id not in self._members:
            self._failed.discard(node_id)
            return
        if await self._ping(node_id) is None:
            return
        log.info("peer %s is back", node_id)
        self._failed.discard(node_id)
        if node_id in self._alive:
            self._down_at.pop(node_id, None)

    def _figures_round(self, skip: set[str]) -> list[str]:
        """The next ``FIGURES_PER_ROUND`` live peers in id order, wrapping around."""
        peers = sorted(n for n in self._alive if n != self.self_id and n not in skip)
        if not peers:
            return []
        start = self._figures_from % len(peers)
        count = min(FIGURES_PER_ROUND, len(peers))
        self._figures_from = start + count
        return [peers[(start + k) % len(peers)] for k in range(count)]


class EtcdDrainMarks(DrainMarks):
    """The drain marks in etcd: a member's mark is its record's ``state`` (``since``: when it
    was set), so every node's watch sees it; a member forgotten while draining leaves
    ``membership/drained/<id>`` (see ``EtcdMembership.forget``)."""

    shared = True

    def __init__(self, membership: EtcdMembership) -> None:
        self._m = membership

    def is_draining(self, node_id: str) -> bool:
        entry = self._m._members.get(node_id)
        return entry is not None and entry[1] == DRAINING

    def draining_since(self, node_id: str) -> float | None:
        return self._m._draining_since.get(node_id) if self.is_draining(node_id) else None

    def draining(self) -> frozenset[str]:
        return frozenset(n for n, (_, st) in self._m._members.items() if st == DRAINING)

    async def mark(self, node_id: str, draining: bool = True) -> None:
        """Set ``node_id``'s state (``draining`` or back to ``active``) for every node."""
        m = self._m
        kv = await m.s.kv()
        key = m._node_key(node_id)
        for _ in range(8):
            got = await m.s.call("member read", kv.get(key))
            if not got.kvs:
                if not draining and await self._lift_drained(node_id):
                    return
                raise KeyError(node_id)
            doc = msgpack.unpackb(got.kvs[0].value, raw=False)
            doc["state"] = DRAINING if draining else ACTIVE
            doc["since"] = time.time()  # when it was marked (as the embedded marks keep it)
            reply = await m.s.call(
                "member update",
                kv.txn(
                    [compare_mod_revision(key, got.kvs[0].mod_revision)],
                    [KVService.txn_op_put(key, msgpack.packb(doc, use_bin_type=True))],
                ),
            )
            if reply.succeeded:
                if node_id == m.self_id:
                    m._state = doc["state"]
                return
        raise CoordinatorUnavailable(f"member {node_id} keeps changing: state not set")

    async def _lift_drained(self, node_id: str) -> bool:
        """Lift the drain mark a member forgotten while draining left (``forget``), while it
        is still not a member; False if it left none."""
        m = self._m
        kv = await m.s.kv()
        reply = await m.s.call(
            "drain mark removal",
            kv.txn(
                [
                    KVService.txn_compare_create_revision(m._node_key(node_id), 0),
                    KVService.txn_compare_create_revision(
                        m._drained_key(node_id), 0, result=Compare.NOT_EQUAL
                    ),
                ],
                [KVService.txn_op_delete(m._drained_key(node_id))],
            ),
        )
        if reply.succeeded:
            log.info("the drain mark left by forgotten member %s is lifted", node_id)
        return bool(reply.succeeded)


def open_etcd(
    config: Config, *, ttl: int = 3
) -> tuple[EtcdMembership, Callable[[DataPlane], EtcdCatalogue]]:
    """The etcd membership and catalogue factory for ``Node.open``, from
    ``config.coordinator`` (one session: the membership closes it)."""
    session = EtcdSession(config.coordinator)
    membership = EtcdMembership(config, session, ttl=ttl)
    return membership, lambda node: EtcdCatalogue(node, session)
