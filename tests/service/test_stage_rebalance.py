"""``Rebalance.rebalance_one`` on real in-process nodes, for a chunk not yet cold: a copy
outside the placement goes only once every placement target holds the chunk on nvme and
witnessed it; a target lacking a copy gets one first (and the drop waits for the next
pass); a witness that holds nothing keeps the misplaced copy where it is; copies are
paced at ``rebalance_rate``.

The encoders and rebalance workers are stopped right after the start and background passes
kept away: each test calls ``rebalance_one`` itself with the holdings it chooses.
"""

from __future__ import annotations

import os
import time
from typing import Any

from storaged.ids import chunk_id_of
from storaged.node import Node
from storaged.node.pipeline.rebalance import HOT
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

QUIET: dict[str, Any] = {
    "repair_interval": 3600.0,
    "gc_interval": 3600.0,
    "scrub_interval": 3600.0,
}


async def _start(inproc: InprocFactory, **settings: Any) -> InprocCluster:
    cluster = await inproc.start(5, **{**QUIET, **settings})
    for i in cluster.running():
        await cluster.node(i).encoder.close()
        await cluster.node(i).rebalance.close()
    return cluster


async def _misplaced(cluster: InprocCluster) -> tuple[bytes, str, list[Node], Node]:
    """A chunk on its placement targets and one copy more, on the next node of its order,
    all on nvme: (bytes, id, the targets, the misplaced holder)."""
    data = os.urandom(64 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    assert (await put_bytes(cluster.node(order[0]), data))[0] == 201
    targets = [cluster.node(i) for i in order[:3]]
    extra = cluster.node(order[3])
    await extra.writes.keep_copy(chunk_id, memoryview(data))
    everyone = [*targets, extra]

    def on_disk(node: Node) -> bool:
        dirty = node.memory_has(chunk_id) and node.memory.is_dirty(chunk_id)
        return node.nvme_has(chunk_id) and not dirty

    await wait_until("on nvme everywhere", lambda: all(on_disk(n) for n in everyone))
    return data, chunk_id, targets, extra


async def _rebalance(leader: Node, chunk_id: str) -> None:
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    await leader.rebalance.rebalance_one(chunk_id, held, placement)


async def test_a_misplaced_copy_is_dropped_once_the_targets_witnessed_theirs(
    inproc: InprocFactory,
) -> None:
    cluster = await _start(inproc)
    _, chunk_id, targets, extra = await _misplaced(cluster)
    leader = targets[0]
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    assert leader.rebalance.misplaced(chunk_id, held, placement) == [(extra.id, HOT)]

    await leader.rebalance.rebalance_one(chunk_id, held, placement)
    assert sorted(cluster.hot_holders(chunk_id)) == sorted(t.id for t in targets)
    assert chunk_id not in extra.index
    assert all(t.rebalance.pinned(chunk_id) for t in targets)  # each witness pinned it


async def test_a_target_lacking_a_copy_gets_one_before_any_drop(inproc: InprocFactory) -> None:
    """A target lost its copy: the pass copies the chunk to it and drops nothing (the new
    copy is on nvme only later); the next pass, with the copy on disk, drops the extra."""
    cluster = await _start(inproc)
    data, chunk_id, targets, extra = await _misplaced(cluster)
    lost = targets[2]
    await lost.memory.delete(chunk_id)
    await lost.nvme.delete(chunk_id)

    await _rebalance(targets[0], chunk_id)
    assert extra.holds_hot(chunk_id)
    assert lost.holds_hot(chunk_id)
    assert await lost.memory.get(chunk_id) == data or await lost.nvme.get(chunk_id) == data
    await wait_until("the new copy on disk", lambda: lost.nvme_has(chunk_id))

    await _rebalance(targets[0], chunk_id)
    assert sorted(cluster.hot_holders(chunk_id)) == sorted(t.id for t in targets)


async def test_a_witness_holding_nothing_keeps_the_misplaced_copy(
    inproc: InprocFactory,
) -> None:
    """The leader's holdings are out of date: a target it counts lost its copy since. The
    misplaced holder asks it to witness, it holds nothing: the copy is not dropped."""
    cluster = await _start(inproc)
    _, chunk_id, targets, extra = await _misplaced(cluster)
    leader = targets[0]
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    await targets[1].memory.delete(chunk_id)
    await targets[1].nvme.delete(chunk_id)

    await leader.rebalance.rebalance_one(chunk_id, held, placement)
    assert extra.holds_hot(chunk_id)
    assert chunk_id in extra.index
    assert not await extra.rebalance.drop_misplaced(chunk_id, HOT, [t.id for t in targets])
    assert extra.holds_hot(chunk_id)


async def test_copies_are_paced_at_the_rebalance_rate(inproc: InprocFactory) -> None:
    """Two targets lacking a copy of a 64 KiB chunk at 64 KiB/s: the second copy waits for
    the first one's second (a lower bound only: a loaded machine is only slower)."""
    rate = 64 << 10
    cluster = await _start(inproc, rebalance_rate=rate)
    _, chunk_id, targets, _ = await _misplaced(cluster)
    for lost in targets[1:]:
        await lost.memory.delete(chunk_id)
        await lost.nvme.delete(chunk_id)
    leader = targets[0]

    started = time.monotonic()
    await _rebalance(leader, chunk_id)
    took = time.monotonic() - started
    assert all(t.holds_hot(chunk_id) for t in targets)
    assert took >= 0.9 * (64 << 10) / rate
    assert leader.metrics.rebalanced.labels("copy")._value.get() == 2
