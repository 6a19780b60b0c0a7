"""``Repair.repair_one`` alone, on real in-process nodes: the leader of a chunk brings it
back to ``replication`` hot copies from what it was told is held, and its failure paths
(a holder down, a chunk collected meanwhile, a copy that fails) end in ``LACKING`` with
nothing raised, for the next pass to finish.

Background repair passes are kept out of the way (``repair_interval``): each test calls
``repair_one`` itself, with the holdings and the placement it chooses.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from storaged.ids import chunk_id_of
from storaged.node.pipeline.repair import LACKING
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until
from tiers import ChunkNotFound

#: no background repair pass runs during a test
QUIET: dict[str, Any] = {"repair_interval": 3600.0, "gc_interval": 3600.0}


async def _put(cluster: InprocCluster) -> tuple[bytes, str, list[int]]:
    """A new chunk PUT through the first node of its order: (bytes, id, node order)."""
    data = os.urandom(64 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    status, _ = await put_bytes(cluster.node(order[0]), data)
    assert status in (200, 201)
    rf = cluster.node(order[0]).config.replication
    assert sorted(cluster.hot_holders(chunk_id)) == sorted(cluster.node_id(i) for i in order[:rf])
    return data, chunk_id, order


async def test_the_leader_copies_what_a_dead_holder_held(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4, **QUIET)
    data, chunk_id, order = await _put(cluster)
    await cluster.kill(order[1])
    await cluster.wait_converged()
    leader = cluster.node(order[0])
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    assert {h.node for h in held} == {cluster.node_id(order[0]), cluster.node_id(order[2])}
    # Only the leader acts: another holder's call changes nothing.
    assert await cluster.node(order[2]).repairer.repair_one(chunk_id, held, placement) is None
    assert cluster.node_id(order[3]) not in cluster.hot_holders(chunk_id)

    assert await leader.repairer.repair_one(chunk_id, held, placement) == LACKING
    assert sorted(cluster.hot_holders(chunk_id)) == sorted(
        cluster.node_id(i) for i in (order[0], order[2], order[3])
    )
    assert await cluster.node(order[3]).memory.get(chunk_id) == data


async def test_a_chunk_collected_meanwhile_is_not_brought_back_from_nowhere(
    inproc: InprocFactory,
) -> None:
    """The holders reported a copy, and by the time the leader copies it every copy is
    gone (collected): no copy is made, nothing raises, the pass counts it lacking."""
    cluster = await inproc.start(4, **QUIET)
    _, chunk_id, order = await _put(cluster)
    await cluster.kill(order[1])
    await cluster.wait_converged()
    survivors = [cluster.node(order[0]), cluster.node(order[2])]
    leader = survivors[0]
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    # On disk first, so that no drain writes the copy back after it is gone.
    await wait_until("both copies on nvme", lambda: all(n.nvme_has(chunk_id) for n in survivors))
    for node in survivors:
        for tier in (node.memory, node.nvme):
            with contextlib.suppress(ChunkNotFound):
                await tier.delete(chunk_id)
    assert cluster.hot_holders(chunk_id) == []

    assert await leader.repairer.repair_one(chunk_id, held, placement) == LACKING
    assert cluster.hot_holders(chunk_id) == []


async def test_a_copy_that_fails_leaves_the_others_made(inproc: InprocFactory) -> None:
    """Two copies lacking; the first target dies after the leader took its view: that copy
    fails (logged), the other is made, and the chunk is counted lacking."""
    cluster = await inproc.start(5, **QUIET)
    data, chunk_id, order = await _put(cluster)
    await cluster.kill(order[1])
    await cluster.kill(order[2])
    await cluster.wait_converged()
    leader = cluster.node(order[0])
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    assert [h.node for h in held] == [cluster.node_id(order[0])]
    first, second = placement.hot_targets(chunk_id)[1:]
    await cluster.kill(cluster.index_of(first))

    assert await leader.repairer.repair_one(chunk_id, held, placement) == LACKING
    assert sorted(cluster.hot_holders(chunk_id)) == sorted([cluster.node_id(order[0]), second])
    assert await cluster.node(cluster.index_of(second)).memory.get(chunk_id) == data
