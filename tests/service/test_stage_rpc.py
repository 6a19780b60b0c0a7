"""``PeerRpc``'s guards, called over the real peer protocol between in-process nodes: a
draining node vouches for nothing (``witness`` is false though it holds the copy); only a
cold chunk's nvme copy may be dropped by a peer's ``drop_nvme``; a chunk being collected
is reported held by no one; an unknown method is refused.

Background passes and the encoders are kept out of the way: the chunks stay hot.
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import pytest

from storaged.ids import chunk_id_of
from storaged.node.pipeline.rebalance import HOT, PIN_SECONDS
from storaged.peer import PeerError, PeerUnavailable
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

QUIET: dict[str, Any] = {
    "repair_interval": 3600.0,
    "gc_interval": 3600.0,
    "scrub_interval": 3600.0,
}


async def _on_nvme(inproc: InprocFactory) -> tuple[InprocCluster, str, list[int]]:
    """4 nodes, one chunk on nvme on its holders: (cluster, id, node order)."""
    cluster = await inproc.start(4, **QUIET)
    for i in cluster.running():
        await cluster.node(i).encoder.close()
    data = os.urandom(16 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    assert (await put_bytes(cluster.node(order[0]), data))[0] == 201
    holders = [cluster.node(i) for i in order[:3]]
    await wait_until("on nvme", lambda: all(n.nvme_has(chunk_id) for n in holders))
    return cluster, chunk_id, order


async def test_a_draining_node_vouches_for_nothing(inproc: InprocFactory) -> None:
    cluster, chunk_id, order = await _on_nvme(inproc)
    asker = cluster.node(order[0])
    witness = cluster.node_id(order[1])
    assert await asker.cluster.witness(witness, chunk_id, HOT, 1.0, timeout=PIN_SECONDS / 4)

    await asker.drain(witness)
    assert cluster.node(order[1]).nvme_has(chunk_id)
    assert not await asker.cluster.witness(witness, chunk_id, HOT, 1.0, timeout=PIN_SECONDS / 4)


async def test_drop_nvme_takes_only_a_cold_chunk_copy(inproc: InprocFactory) -> None:
    cluster, chunk_id, order = await _on_nvme(inproc)
    asker = cluster.node(order[0])
    holder = cluster.node(order[1])
    await asker.cluster.drop_nvme(holder.id, [chunk_id])
    assert holder.nvme_has(chunk_id)  # not cold: the nvme copy is what makes it durable


async def test_a_chunk_being_collected_is_held_by_no_one(inproc: InprocFactory) -> None:
    cluster, chunk_id, order = await _on_nvme(inproc)
    asker = cluster.node(order[0])
    holder = cluster.node(order[1])
    held = (await asker.holdings([holder.id], [chunk_id]))[chunk_id]
    assert [h.node for h in held] == [holder.id]
    holder.collecting.add(chunk_id)
    try:
        assert (await asker.holdings([holder.id], [chunk_id]))[chunk_id] == []
    finally:
        holder.collecting.discard(chunk_id)


async def test_an_unknown_method_is_refused(inproc: InprocFactory) -> None:
    cluster = await inproc.start(3, **QUIET)
    with pytest.raises(PeerError) as refused:
        await cluster.node(0).call("n1", "no_such_call", {})
    assert refused.value.code == "bad_request"


async def test_a_call_abandoned_as_it_fails_leaves_no_unretrieved_exception(
    inproc: InprocFactory,
) -> None:
    """A question asked ``until_down`` whose call fails in the very step its asker is
    cancelled (a caller's timeout): the call's exception is taken, not left for the loop to
    log as a traceback (the etcd soak, run 34: "Task exception was never retrieved")."""
    cluster = await inproc.start(3)
    node = cluster.node(0)
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    asker: asyncio.Task[Any] | None = None

    async def failing_call() -> tuple[dict[str, Any], None]:
        await asyncio.sleep(0.05)
        assert asker is not None
        asker.cancel()  # the asker's caller gives up in the same step the call fails
        raise PeerUnavailable("connection_lost", "reset")

    try:
        asker = asyncio.ensure_future(node.cluster._until_down(node.cluster.id, failing_call()))
        with pytest.raises(asyncio.CancelledError):
            await asker
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert [c for c in unretrieved if "never retrieved" in str(c.get("message"))] == []
