"""Draining a node of a cluster that has about ``n`` nodes.

With ``n`` fragments and ``n - k`` of them allowed on one node, the nodes that stay may be
too few to hold a cold chunk's fragments (6 nodes, k=5, n=6: five nodes would need two
fragments on one). Repair then keeps the chunk as a hot one, at ``replication`` copies on
the nodes that stay (decoded from the fragments where no copy is left), so that the drain
can end. Before, the draining node's fragments had nowhere to go and ``can_leave`` never
turned true.
"""

from __future__ import annotations

import random

from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from tests.service.http import manifest_for
from tests.service.inproc import InprocFactory, put_bytes, wait_until


async def test_a_drain_ends_where_the_fragments_cannot_be_spread_without_the_node(
    inproc: InprocFactory,
) -> None:
    # A node counted down under load (a missed heartbeat past down_after) refuses the PUTs
    # with insufficient_replicas: a full run at load 25-40 saw "1 live node".
    cluster = await inproc.start(6, drain_defer=0.0, encode_defer=0.0, down_after=8.0)
    entry = cluster.node(0)
    assert (entry.config.k, entry.config.n) == (5, 6)
    rng = random.Random(61)
    chunks = [rng.randbytes(32 * 1024) for _ in range(8)]
    for data in chunks:
        assert (await put_bytes(entry, data))[0] == 201
    checked = check_manifest(manifest_for(chunks), entry.config.max_chunk_size)
    assert (await entry.commit("spread/a", checked))[0] == 201
    ids = [chunk_id_of(c) for c in chunks]
    await wait_until("every chunk is cold", lambda: all(
        len(cluster.fragments(c)) == 6 for c in ids), 60)  # fmt: skip
    # Only fragments are left of them: the drain must rebuild copies from those.
    await entry.evict("spread/a", nvme=True)
    await wait_until("no hot copy is left", lambda: not any(
        cluster.hot_holders(c) for c in ids), 60)  # fmt: skip
    leaving = "n3"
    await entry.drain(leaving)

    async def can_leave() -> bool:
        return bool((await entry.drain_progress(leaving))["can_leave"])

    await wait_until(f"{leaving} can leave", can_leave, 120)
    for cid in ids:
        hot = [n for n in cluster.hot_holders(cid) if n != leaving]
        assert len(hot) >= 3, (cid, hot)
    await cluster.kill(3)
    for data in chunks:
        got, _ = await cluster.node(1).read_chunk(chunk_id_of(data))
        assert bytes(got) == data
    # With the node gone for good the chunks are safe as hot ones: nothing stays "lacking".
    await wait_until("repair reports nothing lacking", lambda: all(
        cluster.node(i).repairer.backlog == 0 for i in cluster.running()), 60)  # fmt: skip
