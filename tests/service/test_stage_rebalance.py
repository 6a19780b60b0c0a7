"""``Rebalance.rebalance_one`` on real in-process nodes, for a chunk not yet cold: a copy
outside the placement goes only once every placement target holds the chunk on nvme and
witnessed it; a target lacking a copy gets one first (and the drop waits for the next
pass); a witness that holds nothing keeps the misplaced copy where it is; copies are
paced at ``rebalance_rate``; and the repair pass counts a copy outside the placement as
misplaced while its drop waits for a new copy's drain.

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
from storaged.node.pipeline.repair import MISPLACED
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


async def test_a_copy_outside_the_placement_is_misplaced_while_a_new_copy_drains(
    inproc: InprocFactory,
) -> None:
    """A target's new copy is still in RAM: nothing moves or drops this pass (the drop
    waits for the drain), but the copy outside the placement is there all the same, and
    the repair pass counts the chunk misplaced. It said "nothing" before, and a test that
    waited for 0 misplaced found four copies of a chunk after a join (a full run, stop 29)."""
    cluster = await _start(inproc)
    data, chunk_id, targets, _ = await _misplaced(cluster)
    leader, late = targets[0], targets[2]
    await late.drainer.close()  # its copy stays in RAM
    await late.memory.delete(chunk_id)
    await late.nvme.delete(chunk_id)
    assert await late.writes.keep_copy(chunk_id, memoryview(data))
    assert late.memory.is_dirty(chunk_id) and not late.nvme_has(chunk_id)

    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    assert len([h for h in held if h.hot]) == 4
    assert leader.rebalance.misplaced(chunk_id, held, placement) == []  # the drain first
    assert await leader.repairer.repair_one(chunk_id, held, placement) == MISPLACED


async def test_copies_on_their_targets_only_are_not_misplaced_while_one_drains(
    inproc: InprocFactory,
) -> None:
    """The control: the same copy in RAM, and no copy outside the placement."""
    cluster = await _start(inproc)
    data = os.urandom(64 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    late = cluster.node(order[2])
    await late.drainer.close()
    assert (await put_bytes(cluster.node(order[0]), data))[0] == 201
    assert late.memory.is_dirty(chunk_id)

    leader = cluster.node(order[0])
    placement = leader.placement()
    held = (await leader.holdings(placement.alive, [chunk_id]))[chunk_id]
    assert sorted(h.node for h in held) == sorted(cluster.node_id(i) for i in order[:3])
    assert await leader.repairer.repair_one(chunk_id, held, placement) is None
