"""``WritePath._finish_streams`` alone, on real in-process nodes: the replicas' verdicts
on a PUT's streams, the copies sent again or elsewhere when one fails, and the refusal
when too few nodes hold the chunk.

Each test opens the entry node's streams to the first replicas of the chunk's order and
sends the bytes itself (as ``_put_new`` does), breaking something on the way: a replica
marked draining once its stream is open refuses the copy when its bytes are in (as a
replica does that cannot keep it), one that saw damaged bytes says so.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest

from storaged.errors import InsufficientStorage, Unavailable
from storaged.ids import chunk_id_of
from storaged.node import Node
from storaged.node.write import Replicas
from storaged.peer import PeerError
from tests.service.inproc import InprocCluster, InprocFactory, wait_until

QUIET: dict[str, Any] = {"repair_interval": 3600.0, "gc_interval": 3600.0}


async def _streams(
    cluster: InprocCluster, data: bytes, sent: bytes | None = None, refusing: int = 0
) -> tuple[Node, list[str], Replicas]:
    """The entry node (first of the order), the order's node ids, and open streams to the
    next ``replication - 1`` nodes that got ``sent`` (``data`` by default); the last
    ``refusing`` of those are marked draining before the bytes go."""
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    entry = cluster.node(order[0])
    ids = [cluster.node_id(i) for i in order]
    rf = entry.config.replication
    streams = await entry.writes._open_streams(chunk_id, len(data), ids[1:rf])
    assert sorted(streams) == sorted(ids[1:rf])
    for node_id in ids[rf - refusing : rf]:
        await entry.drain(node_id)
        replica = cluster.node(cluster.index_of(node_id))
        await wait_until(
            "the mark reached it", partial(replica.membership.drains.is_draining, node_id)
        )
    replicas = Replicas(streams)
    await entry.writes._send_all(memoryview(sent or data), replicas)
    assert replicas.refused == []
    return entry, ids, replicas


async def test_a_replica_that_refuses_is_replaced_by_the_next_node(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(4, **QUIET)
    data = os.urandom(96 << 10)
    chunk_id = chunk_id_of(data)
    entry, ids, replicas = await _streams(cluster, data, refusing=1)

    holders, created = await entry.writes._finish_streams(chunk_id, memoryview(data), replicas, ids)
    assert holders == [ids[0], ids[1], ids[3]]  # in placement order
    assert sorted(created) == sorted([ids[1], ids[3]])
    assert await cluster.node(cluster.index_of(ids[3])).memory.get(chunk_id) == data
    assert [(n, e.code) for n, e in replicas.refused] == [(ids[2], "draining")]
    assert not cluster.node(cluster.index_of(ids[2])).holds_hot(chunk_id)


async def test_damaged_bytes_on_the_way_are_sent_again(inproc: InprocFactory) -> None:
    """Both replicas saw other bytes than the entry's checked copy: each is sent the copy
    again and holds the right bytes; the client's upload does not fail."""
    cluster = await inproc.start(4, **QUIET)
    data = os.urandom(96 << 10)
    chunk_id = chunk_id_of(data)
    damaged = bytearray(data)
    damaged[1000] ^= 0xFF
    entry, ids, replicas = await _streams(cluster, data, bytes(damaged))

    holders, created = await entry.writes._finish_streams(chunk_id, memoryview(data), replicas, ids)
    assert holders == ids[:3]
    assert sorted(created) == sorted(ids[1:3])
    assert replicas.refused == []
    for node_id in ids[1:3]:
        assert await cluster.node(cluster.index_of(node_id)).memory.get(chunk_id) == data
    assert not cluster.node(cluster.index_of(ids[3])).holds_hot(chunk_id)


async def test_too_few_holders_is_refused_and_says_why(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4, **QUIET)
    data = os.urandom(96 << 10)
    chunk_id = chunk_id_of(data)
    entry, ids, replicas = await _streams(cluster, data, refusing=2)
    await cluster.kill(cluster.index_of(ids[3]))  # and the next node of the order is dead

    with pytest.raises(Unavailable) as caught:
        await entry.writes._finish_streams(chunk_id, memoryview(data), replicas, ids)
    assert caught.value.code == "insufficient_replicas"
    assert "only 1 node(s)" in caught.value.message

    # What the refusals said decides the code: full disks first, then RAM, then stopping.
    writes = entry.writes
    full = writes._too_few_holders(1, [(ids[1], PeerError("nvme_full", "n1 full"))])
    assert isinstance(full, InsufficientStorage) and full.code == "nvme_full"
    url = cluster.url(cluster.index_of(ids[1]))
    assert full.extra["full"] == [{"node": ids[1], "url": url, "tier": "nvme"}]
    ram = writes._too_few_holders(1, [(ids[1], PeerError("memory_full", "no room"))])
    assert isinstance(ram, Unavailable) and ram.code == "memory_full"
    entry.stopping = True
    try:
        stopping = writes._too_few_holders(1, [(ids[1], PeerError("nvme_full", "n1 full"))])
    finally:
        entry.stopping = False
    assert isinstance(stopping, Unavailable) and stopping.code == "shutting_down"
