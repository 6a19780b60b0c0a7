"""The ``Collector`` (GC) on real in-process nodes, its passes called by the test: an
unreferenced chunk goes only once it has been unused for the grace, a referenced one never
(I3); a pass whose snapshot is past the freshness bound collects nothing; a pass that
cannot take a complete snapshot frees nothing and, past the grace, is a stall reported
with its cause; a chunk touched while the pass waits for its lock is spared.

Background GC and repair passes are kept out of the way (``gc_interval``,
``repair_interval``); the grace is short so that a test can outlast it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.node import Node
from storaged.node.pipeline.gc import Collector
from storaged.node.referenced import ReferencedSet
from tests.service.http import manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

GRACE = 2.0
SETTINGS: dict[str, Any] = {
    "gc_interval": 3600.0,
    "repair_interval": 3600.0,
    "scrub_interval": 3600.0,
    "gc_grace": GRACE,
    "commit_window": 1.0,
}


async def _put(cluster: InprocCluster) -> tuple[bytes, str, list[Node]]:
    """A new chunk PUT through the first node of its order: (bytes, id, its hot holders)."""
    data = os.urandom(32 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    status, _ = await put_bytes(cluster.node(order[0]), data)
    assert status == 201
    holders = [cluster.node(cluster.index_of(n)) for n in cluster.hot_holders(chunk_id)]
    assert len(holders) == holders[0].config.replication
    return data, chunk_id, holders


async def _past_grace(nodes: list[Node], chunk_id: str) -> None:
    """Until the chunk has been unused on each of ``nodes`` for longer than the grace
    (its drain and encode may use it meanwhile: each use moves the end on)."""
    deadline = time.monotonic() + 30.0
    while (wait := max(n.index[chunk_id].last_use for n in nodes) + GRACE + 0.2 - time.time()) > 0:
        assert time.monotonic() < deadline, "the chunk is still used"
        await asyncio.sleep(min(wait, 0.2))


async def test_unreferenced_goes_after_the_grace_and_referenced_stays(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(4, **SETTINGS)
    _, loose, loose_holders = await _put(cluster)
    kept, kept_id, kept_holders = await _put(cluster)
    entry = cluster.node(0)
    status, _ = await entry.commit("gc/kept", check_manifest(manifest_for([kept]), 2**30))
    assert status == 201

    for node in loose_holders:  # unused for less than the grace: spared
        await node.gc_pass()
    assert len(cluster.hot_holders(loose)) == len(loose_holders)

    await _past_grace(loose_holders, loose)
    # The commit touched its chunk until well past the commit window (the next GC interval
    # on): made old here, so that only the reference keeps it.
    for node in kept_holders:
        node.index[kept_id].last_use = 0.0
    for node in {n.id: n for n in [*loose_holders, *kept_holders]}.values():
        await node.gc_pass()
        assert node.referenced.status()["stalled_since"] is None
    assert cluster.hot_holders(loose) == []
    assert all(loose not in n.index for n in loose_holders)
    assert len(cluster.hot_holders(kept_id)) == len(kept_holders)  # referenced: never


async def test_a_snapshot_past_the_freshness_bound_collects_nothing(
    inproc: InprocFactory,
) -> None:
    """A Collector whose referenced set holds no snapshot fresh (bound 0: any snapshot is
    too old to act on by the time the pass looks at a chunk) frees nothing; the node's own
    Collector, same catalogue and chunk, then frees it."""
    cluster = await inproc.start(4, **SETTINGS)
    _, loose, holders = await _put(cluster)
    await _past_grace(holders, loose)
    node = holders[0]
    stale = Collector(
        node.local,
        node.cluster,
        referenced=ReferencedSet(0.0, GRACE),
        leadership=node.leadership,
        catalogue=node.catalogue,
    )
    await stale.gc_pass()
    assert node.holds_hot(loose)
    assert not stale.is_garbage(loose)

    await node.gc_pass()
    assert not node.holds_hot(loose)


@pytest.mark.embedded_only(
    "the embedded catalogue's snapshot needs answers from all nodes but replication - 1"
)
async def test_an_incomplete_snapshot_frees_nothing_and_is_a_stall_past_the_grace(
    inproc: InprocFactory,
) -> None:
    """Three of four nodes down: the survivor's catalogue snapshot cannot be complete. Its
    passes free nothing; once they have failed for longer than the grace, the stall is
    reported with its cause."""
    cluster = await inproc.start(4, **SETTINGS)
    _, loose, holders = await _put(cluster)
    survivor = holders[0]
    await survivor.gc_pass()  # one complete pass first: the stall counts from it
    last = survivor.referenced.last_pass
    assert last is not None
    for i in cluster.running():
        if cluster.node(i) is not survivor:
            await cluster.kill(i)
    await _past_grace([survivor], loose)

    await survivor.gc_pass()
    assert survivor.holds_hot(loose)
    status = survivor.referenced.status()
    assert status["last_pass"] == last
    assert status["failed_passes"] >= 1
    assert status["stalled_since"] == last
    assert "incomplete" in status["cause"]
    assert survivor.metrics.gc_stalled._value.get() > GRACE
    assert not survivor.collector.is_garbage(loose)  # nothing is garbage once stale


async def test_a_chunk_touched_while_the_pass_waits_for_its_lock_is_spared(
    inproc: InprocFactory,
) -> None:
    """The pass finds the chunk garbage and waits for its lock; a ``/missing`` answer
    touches it meanwhile: checked again under the lock, it is spared."""
    cluster = await inproc.start(4, **SETTINGS)
    _, loose, holders = await _put(cluster)
    await _past_grace(holders, loose)
    node = holders[0]
    async with node.locks.hold(loose):
        gc = asyncio.create_task(node.gc_pass())
        # the pass has found it garbage and waits for the lock (a second user of it)
        await wait_until("the pass waits", lambda: node.locks.users(loose) == 2, 10.0)
        assert await node.missing([loose]) == []
    await gc
    assert node.holds_hot(loose)
    assert loose in node.index
