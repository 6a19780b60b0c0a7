"""Draining a node: placement from one view that leaves draining nodes out, the marks in
the embedded mode (broadcast, heartbeats, the data dir), and the evacuation by repair.

The same with real processes, a save and a restore running, and a kill -9 at the end:
``tests/service/test_drain_cluster.py`` (embedded) and
``tests/coordination/test_etcd_drain.py`` (etcd, with a node joining).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from erasure import fragment_key
from storaged.client import Client
from storaged.config import NodeSpec
from storaged.coord.membership import MembershipView
from storaged.errors import NotFound
from storaged.ids import chunk_id_of
from storaged.manifest import CheckedManifest, check_manifest
from storaged.node import Node
from storaged.peer import PeerError
from storaged.placement import Placement, rendezvous_order
from tests.conftest import ADMIN_TOKEN, TOKEN
from tests.service.http import Api, manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, wait_until


def _view(alive: list[str], draining: set[str], members: int = 6) -> MembershipView:
    nodes = tuple(NodeSpec(f"n{i}", f"http://h{i}", f"h{i}:1") for i in range(members))
    return MembershipView(nodes, frozenset(alive), frozenset(draining), 7)


def test_placement_leaves_draining_nodes_out_of_new_placements_only() -> None:
    rng = random.Random(9)
    view = _view(["n0", "n1", "n2", "n3", "n4"], {"n1"})  # n5 down, n1 draining
    p = Placement(view, replication=3, n=6)
    assert p.alive == ["n0", "n1", "n2", "n3", "n4"]
    assert p.placeable == ["n0", "n2", "n3", "n4"]
    seen_first = set()
    for _ in range(200):
        key = rng.randbytes(32).hex()
        # readers still walk to the draining node (it serves what it holds)
        assert p.order(key) == rendezvous_order(key, p.alive)
        seen_first.add(p.order(key)[0])
        assert "n1" not in p.write_order(key) and "n5" not in p.write_order(key)
        assert p.hot_targets(key) == p.write_order(key)[:3]
        assert p.owner(key) == p.write_order(key)[0]
        targets = p.fragment_targets(key)
        assert len(targets) == 6 and "n1" not in targets and set(targets) == set(p.placeable)
        names = p.name_targets(key)
        # the embedded catalogue's primary: first of the order over every member, unchanged
        assert names[0] == rendezvous_order("checkpoint/" + key, [f"n{i}" for i in range(6)])[0]
        assert len(names) == 3 and not {"n1", "n5"} & set(names[1:])
    assert "n1" in seen_first  # the draining node does come first for some keys
    empty = Placement(_view(["n0"], {"n0"}), replication=3, n=6)
    assert empty.owner("x") is None and empty.fragment_targets("x") == []


async def test_one_put_takes_one_membership_view(
    inproc: InprocFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A membership that answers differently on every read must not split a PUT's targets:
    the PUT reads one view, and never asks liveness piecemeal."""
    cluster = await inproc.start(5)
    node = cluster.node(0)
    membership = node.membership
    real_view = membership.view()
    data = random.Random(1).randbytes(64 * 1024)
    cid = chunk_id_of(data)
    # every other read sees the chunk's first hot target draining
    first = Placement(real_view, 3, 6).hot_targets(cid)[0]
    flipped = MembershipView(
        real_view.members, real_view.alive, frozenset({first}), real_view.revision
    )
    in_put: contextvars.ContextVar[bool] = contextvars.ContextVar("in_put", default=False)
    reads: list[str] = []
    views = iter([real_view, flipped] * 10)

    def view() -> MembershipView:
        if not in_put.get():
            return real_view
        reads.append("view")
        return next(views)

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any) -> Any:
            if in_put.get():
                reads.append(name)
            return real(*args)

        return read

    monkeypatch.setattr(membership, "view", view)
    for name in ("alive_ids", "is_alive", "all_ids"):
        monkeypatch.setattr(membership, name, spy(name, getattr(membership, name)))

    async def body() -> Any:
        yield memoryview(data)

    async def put() -> tuple[int, dict[str, Any]]:
        in_put.set(True)
        return await node.put_chunk(cid, len(data), body())

    status, reply = await _in_context(put)
    assert status == 201
    assert reads == ["view"]
    assert reply["replicas"] == Placement(real_view, 3, 6).hot_targets(cid)
    # the "already stored" path asks the holders with the same one view
    reads.clear()
    status, reply = await _in_context(put)
    assert status == 200 and reads == ["view"]
    # counted where the copies are (the second view only moved new placements away)
    assert set(reply["replicas"]) == set(Placement(real_view, 3, 6).hot_targets(cid))


async def _in_context(call: Callable[[], Any]) -> Any:
    # A copy of the context, so the flag set inside stays inside.
    return await contextvars.copy_context().run(call)


@pytest.mark.embedded_only(
    "the embedded marks' broadcast, heartbeats and files; with etcd the mark is etcd's "
    "(tests/coordination/test_etcd_drain.py)"
)
async def test_embedded_marks_reach_a_node_down_during_the_broadcast_and_survive_restarts(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(4)
    await cluster.kill(3)
    await wait_until("n3 seen down", lambda: all(
        not cluster.node(i).membership.is_alive("n3") for i in range(3)))  # fmt: skip
    marked = await cluster.node(0).drain("n2")
    assert marked == {"node": "n2", "state": "draining", "was": "active", "unreached": ["n3"]}
    assert all(cluster.node(i).membership.drains.is_draining("n2") for i in range(3))
    assert all(cluster.node(i).placement().view.draining == {"n2"} for i in range(3))
    # n3 comes back with no mark of its own, and learns it from its peers' heartbeats
    await cluster.start_node(3)
    await wait_until(
        "n3 learnt that n2 drains", lambda: cluster.node(3).membership.drains.is_draining("n2")
    )
    # a cancel set later wins over the older mark everywhere
    await cluster.node(1).drain("n2", cancel=True)
    await wait_until("n2 active everywhere", lambda: not any(
        cluster.node(i).membership.drains.is_draining("n2") for i in range(4)))  # fmt: skip
    await cluster.node(3).drain("n1")
    # a whole-cluster stop: each node has the mark from its own data dir, no peer to ask
    for i in range(4):
        await cluster.kill(i)
    await cluster.start_node(2)
    node = cluster.node(2)
    assert node.membership.drains.is_draining("n1") and not node.membership.drains.is_draining("n2")
    with pytest.raises(NotFound, match="no member"):
        await node.drain("n9")


async def test_repair_evacuates_a_draining_node_and_it_can_leave(inproc: InprocFactory) -> None:
    """Copies and fragments on the draining node do not count: repair puts them where
    placement without it says; ``can_leave`` turns true only then, and after a kill of the
    drained node every chunk has ``replication`` copies or ``n`` fragments elsewhere."""
    cluster = await inproc.start(5, drain_defer=0.0, encode_defer=0.0)
    entry = cluster.node(0)
    rng = random.Random(5)
    chunks = [rng.randbytes(48 * 1024) for _ in range(24)]
    for data in chunks:
        status, _ = await _put(entry, data)
        assert status == 201
    status, _ = await entry.commit("drain/cold", await _checked(entry, chunks[:12]))
    assert status == 201
    # half cold (fragments on every node), half left hot: nothing to encode them yet
    await wait_until("the first half is cold", lambda: all(
        len(cluster.fragments(chunk_id_of(c))) == 6 for c in chunks[:12]), 60)  # fmt: skip
    # the cold half loses its hot copies: its fragments are all there is of it
    assert (await entry.evict("drain/cold", nvme=True))["nvme"] > 0
    await wait_until("the cold half has no hot copy", lambda: not any(
        cluster.hot_holders(chunk_id_of(c)) for c in chunks[:12]), 60)  # fmt: skip
    victim = cluster.node(4)
    held_before = await victim.drain_progress("n4")
    assert held_before["state"] == "active" and held_before["can_leave"] is False
    assert held_before["chunks"] + held_before["fragments"] > 0
    await entry.drain("n4")
    await _seen(cluster, "n4")
    assert (await entry.drain_progress("n4"))["state"] == "draining"
    # a copy a peer sends the draining node (its view older than the mark) is refused,
    # at the start and at the end of the body: the sender places it on its next node
    late = rng.randbytes(48 * 1024)
    with pytest.raises(PeerError, match="draining"):
        await victim.writes.receive_chunk(chunk_id_of(late), len(late))
    used = victim.memory.usage().used
    buf = await victim.memory.allocate(len(late))
    buf.view[:] = late
    with pytest.raises(PeerError, match="draining"):
        await victim.writes.chunk_received(chunk_id_of(late), buf)
    assert not victim.holds_hot(chunk_id_of(late))
    assert victim.memory.usage().used == used  # the buffer went back to the pool
    status, reply = await _put(entry, late)
    assert status == 201 and "n4" not in reply["replicas"]

    async def can_leave() -> bool:
        return bool((await entry.drain_progress("n4"))["can_leave"])

    await wait_until("n4 can leave", can_leave, 120)
    done = await entry.drain_progress("n4")
    assert done["chunks_pending"] == 0 and done["fragments_pending"] == 0
    # n4's fragments of the cold half moved as they were (no whole copy to encode from)
    moved = sum(
        cluster.node(i).metrics.registry.get_sample_value(
            "storaged_repaired_total", {"kind": "fragment_moved"}
        )
        or 0.0
        for i in range(5)
    )
    assert moved > 0
    await cluster.kill(4)
    for data in [*chunks, late]:
        cid = chunk_id_of(data)
        copies = len(cluster.hot_holders(cid))
        assert copies >= 3 or len(cluster.fragments(cid)) == 6, (cid, copies)
        got, _ = await cluster.node(1).read_chunk(cid)
        assert bytes(got) == data


async def _seen(cluster: InprocCluster, node_id: str, draining: bool = True) -> None:
    """Until every running node's view has ``node_id`` draining (or not): with etcd a mark
    reaches the other nodes by watch, a moment after the call that set it returned."""
    await wait_until(f"{node_id} draining={draining} everywhere", lambda: all(
        cluster.node(i).membership.drains.is_draining(node_id) == draining
        for i in cluster.running()), 30)  # fmt: skip


async def _put(node: Node, data: bytes) -> tuple[int, dict[str, Any]]:
    async def body() -> Any:
        yield memoryview(data)

    return await node.put_chunk(chunk_id_of(data), len(data), body())


async def _checked(node: Node, chunks: list[bytes]) -> CheckedManifest:
    return check_manifest(manifest_for(chunks), node.config.max_chunk_size)


async def test_the_client_sends_no_put_to_a_draining_node(inproc: InprocFactory) -> None:
    """A draining node takes no copy: a PUT sent to it would cost one more hop. The client
    sees the state in ``/v1/cluster`` and uses the other nodes as entries."""
    cluster = await inproc.start(4)
    await cluster.node(0).drain("n1")
    await _seen(cluster, "n1")
    rng = random.Random(3)
    async with Client(cluster.urls, token=TOKEN) as client:
        info = await client.refresh_cluster()
        assert [n.id for n in info.nodes if n.draining] == ["n1"]
        for _ in range(24):
            result = await client.put_chunk_result(rng.randbytes(8 * 1024))
            assert "n1" not in result.replicas
    entries = [
        cluster.node(i).metrics.registry.get_sample_value("storaged_put_bytes_total") or 0.0
        for i in range(4)
    ]
    assert entries[1] == 0 and sum(entries) == 24 * 8 * 1024, entries


async def test_drain_over_http_needs_the_admin_token_and_checks_what_it_is_given(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await inproc.start(4)
    api = Api(http, cluster.url(0), TOKEN)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = await api.request("POST", "/v1/nodes/n2/drain")
    assert (r.status, r.error) == (403, "forbidden")
    r = await api.request("GET", "/v1/nodes/n2/drain")
    assert (r.status, r.error) == (403, "forbidden")
    assert not any(cluster.node(i).membership.drains.is_draining("n2") for i in range(4))
    r = await api.request("POST", "/v1/nodes/n9/drain", headers=admin)
    assert (r.status, r.error) == (404, "node_not_found")
    r = await api.request("POST", "/v1/nodes/n2/drain", doc={"cancel": "yes"}, headers=admin)
    assert (r.status, r.error) == (400, "bad_request")
    r = await api.request("POST", "/v1/nodes/n2/drain", headers=admin)
    assert r.status == 200 and r.doc == {
        "node": "n2", "state": "draining", "was": "active", "unreached": []}  # fmt: skip
    await _seen(cluster, "n2")
    r = await api.request("GET", "/v1/nodes/n2/drain", headers=admin, url=cluster.url(3))
    assert r.status == 200 and r.doc["node"] == "n2" and r.doc["state"] == "draining"
    assert set(r.doc) == {"node", "state", "chunks", "fragments", "chunks_pending",
                          "fragments_pending", "can_leave"}  # fmt: skip
    r = await api.request("GET", "/v1/cluster")
    assert {n["id"]: n["state"] for n in r.doc["nodes"]} == {
        "n0": "active", "n1": "active", "n2": "draining", "n3": "active"}  # fmt: skip
    r = await api.request("POST", "/v1/nodes/n2/drain", doc={"cancel": True}, headers=admin)
    assert r.status == 200 and (r.doc["state"], r.doc["was"]) == ("active", "draining")
    await _seen(cluster, "n2", draining=False)
    # a cancel of a node that is not draining: 200, and it says what it was
    r = await api.request("POST", "/v1/nodes/n2/drain", doc={"cancel": True}, headers=admin)
    assert r.status == 200 and (r.doc["state"], r.doc["was"]) == ("active", "active")
    # the node a progress request names does not answer: 503, not a guess
    await cluster.kill(2)
    r = await api.request("GET", "/v1/nodes/n2/drain", headers=admin)
    assert (r.status, r.error) == (503, "node_unavailable")


async def test_a_draining_node_takes_no_fragment_and_waits_for_one_in_flight(
    inproc: InprocFactory,
) -> None:
    """Draining means no new data of any kind. A fragment sent by a peer whose view predates
    the mark is refused and nothing of it is stored; one that arrived before the mark keeps
    ``can_leave`` false for as long as it is under way (and is refused at its store); a
    repair's local copy is refused too. The code before stored both fragments, and answered
    ``can_leave: true`` while the first was still on its way to the disk."""
    cluster = await inproc.start(4, repair_interval=3600.0, gc_interval=3600.0)
    sender, victim = cluster.node(0), cluster.node(3)
    data = random.Random(11).randbytes(100_000)
    cid = chunk_id_of(data)
    fragments = await sender.codec.encode_async(cid, data)

    async def send(index: int) -> None:
        key = fragment_key(cid, index)
        await sender.call(
            "n3", "put_fragment", {"key": key, "size": len(data)}, fragments[index].to_bytes()
        )

    def stored() -> bool:
        return bool(victim.fragments.get(cid)) or any(victim.config.data_dir.rglob(f"{cid}.*"))

    async with victim.locks.hold(cid):
        in_flight = asyncio.create_task(send(0))
        # the call arrived (its body with it) and waits for the chunk's lock held here
        await wait_until("the fragment is under way", lambda: victim.locks.users(cid) == 2)
        await sender.drain("n3")
        await _seen(cluster, "n3")
        progress = await victim.evacuation.local_progress()
        assert progress["state"] == "draining" and progress["chunks"] == 0
        assert progress["can_leave"] is False, "can_leave while a fragment is on its way here"
    with pytest.raises(PeerError) as refused:
        await in_flight
    assert refused.value.code == "draining"
    assert (await victim.evacuation.local_progress())["can_leave"] is True
    # a sender whose view predates the mark
    with pytest.raises(PeerError) as refused:
        await send(1)
    assert refused.value.code == "draining"
    with pytest.raises(PeerError, match="draining"):
        await victim.writes.keep_copy(cid, memoryview(data))
    assert not stored() and not victim.holds_hot(cid)
    assert (await victim.evacuation.local_progress())["can_leave"] is True
