"""``Evacuation`` on real in-process nodes (embedded marks): ``can_leave`` is false for a
node that is not draining, false while a chunk it holds lacks its copies on the nodes that
stay or while a PUT is under way on it, and true once every chunk has ``replication`` hot
copies elsewhere; a mark is told to every live peer and survives the marked node's
restart (kept in its data directory).

Background passes and the encoders are kept out of the way: nothing moves a copy unless
the test does.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from storaged.coord.membership import ACTIVE, DRAINING
from storaged.ids import chunk_id_of
from storaged.node import Node
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

QUIET: dict[str, Any] = {
    "repair_interval": 3600.0,
    "gc_interval": 3600.0,
    "scrub_interval": 3600.0,
}


async def _start(inproc: InprocFactory) -> InprocCluster:
    cluster = await inproc.start(5, **QUIET)
    for i in cluster.running():
        await cluster.node(i).encoder.close()
    return cluster


async def _put(cluster: InprocCluster) -> tuple[bytes, str, list[int]]:
    data = os.urandom(32 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    assert (await put_bytes(cluster.node(order[0]), data))[0] == 201
    return data, chunk_id, order


async def _can_leave(node: Node) -> bool:
    progress = await node.evacuation.local_progress()
    return bool(progress["can_leave"])


async def test_can_leave_only_once_every_chunk_has_its_copies_elsewhere(
    inproc: InprocFactory,
) -> None:
    cluster = await _start(inproc)
    data, chunk_id, order = await _put(cluster)
    leaving = cluster.node(order[0])
    assert not await _can_leave(leaving)  # not draining: never

    reply = await cluster.node(order[1]).drain(leaving.id)
    assert reply["state"] == DRAINING and reply["was"] == ACTIVE
    assert reply["unreached"] == []
    assert all(cluster.node(i).membership.drains.is_draining(leaving.id) for i in range(5))
    progress = await leaving.evacuation.local_progress()
    assert progress["state"] == DRAINING
    assert progress["chunks"] == 1 and progress["chunks_pending"] == 1
    assert not progress["can_leave"]  # two copies stay, replication wants three

    newcomer = cluster.node(order[3])
    assert await newcomer.writes.keep_copy(chunk_id, memoryview(data))
    await wait_until("can leave", lambda: _can_leave(leaving), 30.0)
    # and the answer comes from any node, by asking the draining one
    assert (await cluster.node(order[2]).drain_progress(leaving.id))["can_leave"]


async def test_a_put_under_way_on_the_draining_node_keeps_it(inproc: InprocFactory) -> None:
    cluster = await _start(inproc)
    leaving = cluster.node(0)
    await cluster.node(1).drain(leaving.id)
    await wait_until("can leave", lambda: _can_leave(leaving), 30.0)

    data = os.urandom(32 << 10)
    go_on = asyncio.Event()

    async def body() -> AsyncIterator[memoryview]:
        await go_on.wait()
        yield memoryview(data)

    put = asyncio.create_task(leaving.put_chunk(chunk_id_of(data), len(data), body()))
    await wait_until("the PUT is under way", lambda: leaving.writes.inflight > 0, 10.0)
    assert not await _can_leave(leaving)
    go_on.set()
    status, _ = await put
    assert status == 201
    assert leaving.id not in cluster.hot_holders(chunk_id_of(data))  # placed elsewhere
    await wait_until("can leave again", lambda: _can_leave(leaving), 30.0)


@pytest.mark.embedded_only(
    "the embedded marks are kept in the data directory; with etcd the mark is etcd's"
)
async def test_a_mark_survives_the_restart_of_the_marked_node(inproc: InprocFactory) -> None:
    """Restarted with every peer down, the node has only its own data directory to learn
    its mark from; the same for the mark's cancellation."""
    cluster = await _start(inproc)
    await cluster.node(1).drain(cluster.node_id(2))
    for i in (0, 1, 3, 4):
        await cluster.kill(i)
    await cluster.restart(2)
    node = cluster.node(2)
    assert node.membership.drains.is_draining(node.id)
    assert node.placement().is_draining(node.id)
    assert (await node.evacuation.local_progress())["state"] == DRAINING

    reply = await node.drain(node.id, cancel=True)
    assert reply["state"] == ACTIVE and reply["was"] == DRAINING
    await cluster.restart(2)
    assert not cluster.node(2).membership.drains.is_draining(node.id)
