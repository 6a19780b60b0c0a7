"""A cold chunk whose fragments sit on too few nodes is repaired at once, not paced.

Seen in the nemesis (seed 1, CI shape, under load): fragment indexes are placed
``order[i % nodes]``, so each membership change moves some of them. A node that held
indexes 0 and 5 with five placeable nodes got index 4 too while one drained (four
placeable), and still held all three when the fifth came back: the paced rebalance had
not moved them yet. One node's data (its files flipped) then took three of six fragments
with k=4, and an acknowledged chunk was lost. Repair now counts such a chunk as lacking
and moves its indexes to their targets at once; GC keeps its nvme copies meanwhile, and a
drain is not done while what it leaves is so concentrated.
"""

from __future__ import annotations

import random
import time

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.placement import exposed, failure_budget
from tests.service.http import manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until


def test_exposure_follows_the_failure_model() -> None:
    assert [failure_budget(p, 3, 4, 6) for p in (6, 5, 4, 3, 2, 1)] == [2, 1, 1, 1, 0, 0]
    spread = {f"n{i}": [i] for i in range(6)}
    assert not exposed(spread, 4, 2)
    # Two nodes' loss takes two fragments of six: k=4 are left. Three on one node are not.
    assert exposed({"a": [0, 4, 5], "b": [1], "c": [2], "d": [3]}, 4, 1)
    assert not exposed({"a": [0, 5], "b": [1], "c": [2], "d": [3], "e": [4]}, 4, 1)
    # A copy of the third index elsewhere: the holder is no longer its only one.
    assert not exposed({"a": [0, 4, 5], "b": [1, 5], "c": [2], "d": [3]}, 4, 1)
    # Over six nodes the budget is two: two nodes with two indexes each are too many.
    assert exposed({"a": [0, 1], "b": [2, 3], "c": [4], "d": [5]}, 4, 2)
    # No promise (too few nodes to spread over): nothing to hold to.
    assert not exposed({"a": [0, 1, 2, 3, 4, 5]}, 4, 0)


def holdings(cluster: InprocCluster, cid: str) -> dict[str, set[int]]:
    return {
        cluster.node_id(i): set(cluster.node(i).fragments.get(cid, ()))
        for i in cluster.running()
        if cluster.node(i).fragments.get(cid)
    }


async def test_repair_spreads_fragments_concentrated_on_one_node_at_once(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(5, k=4, n=6, drain_defer=0.0, encode_defer=0.0)
    entry = cluster.node(0)
    data = random.Random(83).randbytes(64 * 1024)
    cid = chunk_id_of(data)
    assert (await put_bytes(entry, data))[0] == 201
    checked = check_manifest(manifest_for([data]), entry.config.max_chunk_size)
    assert (await entry.commit("conc/a", checked))[0] == 201
    await wait_until("the chunk is cold", lambda: len(cluster.fragments(cid)) == 6, 60)
    # The paced rebalance has no budget left: only repair can move anything now.
    for i in cluster.running():
        cluster.node(i).rebalance.throttle._free_at = time.monotonic() + 3600.0
    # Only fragments are left: a node's loss must be survived by them alone.
    await entry.evict("conc/a", nvme=True)
    await wait_until("no hot copy is left", lambda: not cluster.hot_holders(cid), 60)

    # The holder of two indexes (5 nodes, 6 fragments) takes a third from its only holder.
    held = holdings(cluster, cid)
    heavy = next(n for n, f in held.items() if len(f) == 2)
    donor, index = next((n, min(f)) for n, f in held.items() if len(f) == 1)
    key = fragment_key(cid, index)
    src, dst = cluster.node(cluster.index_of(donor)), cluster.node(cluster.index_of(heavy))
    blob = await src.cold.get(key)
    await dst.writes.store_fragment(key, memoryview(blob), len(data))
    await src.cold.delete(key)
    src.forget_fragment(key)
    assert exposed(holdings(cluster, cid), 4, 1), holdings(cluster, cid)

    await wait_until(
        "repair spread the fragments again",
        lambda: not exposed(holdings(cluster, cid), 4, 1),
        30,
    )
    # The proof: the heavy node's loss leaves enough to read the chunk.
    await cluster.kill(cluster.index_of(heavy))
    reader = cluster.node(next(i for i in cluster.running()))
    got, _ = await reader.read_chunk(cid)
    assert bytes(got) == data
