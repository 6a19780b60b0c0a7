"""The removal of misplaced copies and fragments (``pipeline/rebalance.py``), driven directly
on in-process nodes: drops asked crosswise, as two nodes that see different memberships
would ask them, never take a chunk below ``replication`` copies or lose a fragment index,
and a damaged witness does not count.

Background repair and GC are off (hour-long intervals), so the drops asked here are the
only ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aiohttp
import pytest

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.node.pipeline.rebalance import HOT
from tests.conftest import TOKEN
from tests.service.http import Api, manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, wait_until
from tests.service.test_durability import broken_dir

QUIET: dict[str, Any] = {"repair_interval": 3600.0, "gc_interval": 3600.0, "drain_defer": 0.0}


def _nvme_holders(cluster: InprocCluster, chunk_id: str) -> list[int]:
    return [i for i in cluster.running() if cluster.node(i).nvme_has(chunk_id)]


def _drained(cluster: InprocCluster, chunk_id: str) -> list[int]:
    """Nodes whose copy is on nvme and no longer dirty in RAM (the drain is done)."""
    return [
        i for i in _nvme_holders(cluster, chunk_id) if not cluster.node(i).memory.is_dirty(chunk_id)
    ]


def _holders_of(cluster: InprocCluster, chunk_id: str, index: int) -> list[int]:
    return [i for i in cluster.running() if index in cluster.node(i).fragments.get(chunk_id, ())]


async def _four_copies_on_nvme(
    cluster: InprocCluster, http: aiohttp.ClientSession, size: int
) -> tuple[bytes, str, list[int]]:
    """A new chunk PUT to its placement's three nodes plus a fourth copy on the next one
    (as a join or a node's return leaves behind), all four drained; (bytes, id, order)."""
    data = os.urandom(size)
    cid = chunk_id_of(data)
    order = cluster.order(cid)
    assert (await Api(http, cluster.url(order[0]), TOKEN).put_chunk(data)).status == 201
    await cluster.node(order[3]).writes.keep_copy(cid, memoryview(data))
    await wait_until("four copies on nvme", lambda: len(_drained(cluster, cid)) == 4)
    return data, cid, order


async def test_crossed_copy_drops_keep_replication_copies(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await inproc.start(4, encode_workers=0, **QUIET)
    data, cid, (a, b, c, d) = await _four_copies_on_nvme(cluster, http, 300_000)
    ids = [cluster.node_id(i) for i in (a, b, c, d)]
    # a thinks d's copy is misplaced and d thinks a's is: each names the other a witness.
    dropped = await asyncio.gather(
        cluster.node(a).rebalance.drop_misplaced(cid, HOT, [ids[1], ids[2], ids[3]]),
        cluster.node(d).rebalance.drop_misplaced(cid, HOT, [ids[0], ids[1], ids[2]]),
    )
    assert dropped.count(True) <= 1, dropped
    assert len(_nvme_holders(cluster, cid)) >= 3, _nvme_holders(cluster, cid)
    # Too few witnesses: refused.
    assert not await cluster.node(b).rebalance.drop_misplaced(cid, HOT, [ids[0], ids[2]])
    for i in cluster.running():
        got = await Api(http, cluster.url(i), TOKEN).get_chunk(cid)
        assert got.status == 200 and got.raw == data

    # Asked alone (another chunk: pins are per chunk), with three sound witnesses: it goes.
    _, oid, (p, q, r, s) = await _four_copies_on_nvme(cluster, http, 200_000)
    witnesses = [cluster.node_id(i) for i in (p, q, r)]
    assert await cluster.node(s).rebalance.drop_misplaced(oid, HOT, witnesses)
    assert sorted(_nvme_holders(cluster, oid)) == sorted([p, q, r])


async def _second_holder(cluster: InprocCluster, chunk_id: str, size: int) -> tuple[int, int]:
    """Copy fragment 0 of ``chunk_id`` to a second node, as a re-encode while its holder was
    gone leaves it; (first holder, second holder)."""
    (x,) = _holders_of(cluster, chunk_id, 0)
    y = next(i for i in cluster.running() if i != x)
    key = fragment_key(chunk_id, 0)
    node_x = cluster.node(x)
    _, blob = await node_x.call(node_x.id, "get_fragment", {"key": key})
    assert blob is not None
    await node_x.call(cluster.node_id(y), "put_fragment", {"key": key, "size": size}, blob)
    assert sorted(_holders_of(cluster, chunk_id, 0)) == sorted([x, y])
    return x, y


async def test_fragment_drops_need_a_sound_witness_and_never_cross(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await inproc.start(4, encode_defer=0.0, **QUIET)
    chunks = [os.urandom(400_000 + i) for i in range(3)]
    crossed, damaged, sound = (chunk_id_of(c) for c in chunks)
    api = Api(http, cluster.url(0), TOKEN)
    for c in chunks:
        assert (await api.put_chunk(c)).status == 201
    assert (await api.commit("drops/f", manifest_for(chunks))).status == 201
    n = cluster.node(0).config.n
    await wait_until(
        "cold",
        lambda: all(cluster.fragments(chunk_id_of(c)) == set(range(n)) for c in chunks),
        timeout=60,
    )
    size = len(chunks[0])

    # Crossed: each holder names the other as the fragment's rightful holder.
    x, y = await _second_holder(cluster, crossed, size)
    dropped = await asyncio.gather(
        cluster.node(x).rebalance.drop_misplaced(crossed, 0, [cluster.node_id(y)]),
        cluster.node(y).rebalance.drop_misplaced(crossed, 0, [cluster.node_id(x)]),
    )
    assert dropped.count(True) <= 1, dropped
    assert _holders_of(cluster, crossed, 0), "fragment 0 is held by no one"

    # A witness whose file is damaged does not count: it reads the fragment back first.
    x, y = await _second_holder(cluster, damaged, size)
    path = next(cluster.node(y).cold.root.rglob(f"{damaged}.0"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not await cluster.node(x).rebalance.drop_misplaced(damaged, 0, [cluster.node_id(y)])
    assert _holders_of(cluster, damaged, 0) == [x]  # the damaged copy was quarantined

    # A sound witness: the misplaced fragment goes, the witness's stays.
    x, y = await _second_holder(cluster, sound, size)
    assert await cluster.node(x).rebalance.drop_misplaced(sound, 0, [cluster.node_id(y)])
    assert _holders_of(cluster, sound, 0) == [y]

    for c in chunks:
        got = await api.get_chunk(chunk_id_of(c))
        assert got.status == 200 and got.raw == c


async def test_a_copy_that_missed_the_encode_is_trimmed_once_the_chunk_is_cold(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await inproc.start(4, encode_defer=0.0, **QUIET)
    data = os.urandom(300_000)
    cid = chunk_id_of(data)
    api = Api(http, cluster.url(0), TOKEN)
    assert (await api.put_chunk(data)).status == 201
    assert (await api.commit("drops/late", manifest_for([data]))).status == 201
    n = cluster.node(0).config.n

    def cold() -> bool:
        holders = [cluster.node(i) for i in cluster.running() if cluster.node(i).holds_hot(cid)]
        return cluster.fragments(cid) == set(range(n)) and all(h.is_cold(cid) for h in holders)

    await wait_until("cold, and its holders told so", cold, timeout=60)
    # A copy that lands after the encoder told the holders "cold" (a rebalance or repair
    # copy racing the encode): its node never heard it.
    late = next(i for i in cluster.running() if not cluster.node(i).holds_hot(cid))
    node = cluster.node(late)
    await node.writes.keep_copy(cid, memoryview(data))
    await wait_until("on nvme", lambda: node.nvme_has(cid) and not node.memory.is_dirty(cid))
    assert not node.is_cold(cid)
    await node.repair_pass()
    assert node.is_cold(cid)
    await node.gc_pass()
    assert not node.nvme_has(cid)  # not the owner: retention keeps no copy here
    got = await api.get_chunk(cid)
    assert got.status == 200 and got.raw == data


async def test_a_misplaced_copy_on_nvme_only_is_dropped_without_a_traceback(
    inproc: InprocFactory, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A misplaced copy evicted from RAM (on nvme only, as most old copies are) is dropped
    when its leader asks, as one still in RAM is; a node asked about a copy it does not
    hold at all says no. Background stages meet every tier state: a traceback in a node's
    log is a defect, and so is one for a witness whose disk fails. The code before raised
    ``ChunkNotFound`` from ``memory.is_dirty`` for the nvme-only copy (the leader's
    ``drop_misplaced`` call failed, logged with a traceback, and the copy stayed)."""
    caplog.set_level(logging.INFO)
    cluster = await inproc.start(4, encode_workers=0, **QUIET)
    _, cid, (p, q, r, s) = await _four_copies_on_nvme(cluster, http, 200_000)
    misplaced = cluster.node(s)
    await misplaced.memory.delete(cid)  # evicted: the copy is on nvme only
    assert misplaced.nvme_has(cid) and not misplaced.memory.has(cid)
    leader, witnesses = cluster.node(p), [cluster.node_id(i) for i in (p, q, r)]
    args = {"id": cid, "slot": HOT, "witnesses": witnesses}
    reply, _ = await leader.call(misplaced.id, "drop_misplaced", args)
    assert reply == {"dropped": True}
    assert sorted(_nvme_holders(cluster, cid)) == sorted([p, q, r])
    assert cid not in misplaced.index
    # asked again, now that it holds nothing of the chunk: no
    reply, _ = await leader.call(misplaced.id, "drop_misplaced", args)
    assert reply == {"dropped": False}
    # a witness whose disk cannot be read (here ENOTDIR) is no witness, and says so
    with broken_dir(cluster.node(q).nvme.root):
        reply, _ = await leader.call(
            cluster.node_id(q), "witness", {"id": cid, "slot": HOT, "pin": 1.0}
        )
    assert reply == {"held": False}
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert not tracebacks, [rec.getMessage() for rec in tracebacks]
