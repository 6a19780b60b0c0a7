"""A draining node and the nodes whose view of membership is older than its mark.

In the embedded mode a drain mark reaches a node that was down (or just back) only with the
next heartbeat it hears; with etcd, a watch delivers it a moment late. Until then such a
node counts what the draining node holds as staying. Two stages removed data on that
count: rebalance dropped a misplaced fragment with the draining node as its witness, and
GC trimmed the nvme copies of a cold chunk one of whose fragments the draining node held.
If the draining node's ``can_leave`` had counted the copies removed, it left with the last
one (the nemesis's embedded run, seed 1: a fragment lost after a drain, three good ones
left after the next flip). Now a draining node witnesses nothing, and says that it drains
in every ``chunk_info`` answer, which GC and ``can_leave`` heed whatever their view says.
"""

from __future__ import annotations

import random
from typing import Any

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from tests.service.http import manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

#: heartbeats rare enough that a mark set on one node alone stays unknown to the others
#: for the length of the test
SLOW_MARKS: dict[str, Any] = {"heartbeat_interval": 5.0, "down_after": 30.0}


async def _cold_chunk(cluster: InprocCluster, seed: int) -> str:
    entry = cluster.node(0)
    data = random.Random(seed).randbytes(64 * 1024)
    assert (await put_bytes(entry, data))[0] == 201
    checked = check_manifest(manifest_for([data]), entry.config.max_chunk_size)
    assert (await entry.commit(f"stale/{seed}", checked))[0] == 201
    cid = chunk_id_of(data)
    await wait_until("cold", lambda: len(cluster.fragments(cid)) == 6, 60)
    return cid


async def test_a_draining_node_witnesses_no_drop(inproc: InprocFactory) -> None:
    cluster = await inproc.start(
        6, k=4, n=6, encode_defer=0.0, repair_interval=3600.0, **SLOW_MARKS
    )
    cid = await _cold_chunk(cluster, 1)
    leaving = next(i for i in range(6) if cluster.node(i).fragments.get(cid))
    index = min(cluster.node(leaving).fragments[cid])
    other = (leaving + 1) % 6
    key = fragment_key(cid, index)
    # A second, misplaced copy of the same fragment on another node.
    blob = await cluster.node(leaving).read_fragment(cid, index)
    await cluster.node(other).call(
        cluster.node_id(other), "put_fragment", {"key": key, "size": 64 * 1024}, bytes(blob)
    )
    assert index in cluster.node(other).fragments[cid]
    # The mark known to the leaving node only (the others' views are older than it).
    await cluster.node(leaving).membership.drains.mark(cluster.node_id(leaving))
    dropped = await cluster.node(other).rebalance.drop_misplaced(
        cid, index, [cluster.node_id(leaving)]
    )
    assert dropped is False
    assert index in cluster.node(other).fragments[cid]


async def test_gc_trims_no_copy_on_the_strength_of_a_draining_nodes_fragment(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(
        6,
        k=4,
        n=6,
        encode_defer=0.0,
        repair_interval=3600.0,
        gc_interval=3600.0,
        retain_newest=0,
        **SLOW_MARKS,
    )
    cid = await _cold_chunk(cluster, 2)
    hot = cluster.hot_holders(cid)
    assert hot, "the cold chunk's nvme copies are gone already: nothing to test"
    trimmer = cluster.index_of(hot[0])
    leaving = next(i for i in range(6) if i != trimmer and cluster.node(i).fragments.get(cid))
    await cluster.node(leaving).membership.drains.mark(cluster.node_id(leaving))
    assert not cluster.node(trimmer).placement().is_draining(cluster.node_id(leaving))
    await cluster.node(trimmer).gc_pass()
    # Five of the six fragments stay: the nvme copy is what the chunk has beyond them.
    assert cluster.node(trimmer).nvme_has(cid)
