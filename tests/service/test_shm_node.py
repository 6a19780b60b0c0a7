"""Node side of the co-located path: the drain's re-check, replicas checking the CRC.

The drain re-checks a chunk handed over in shared memory before it reaches disk.

The kernel's seals keep a sealed segment's pages from changing (``tests/client/
test_shm.py`` shows every write refused), so bytes that fail their id can only come
from below the kernel's promise (a memory fault) or a bug here. Such bytes, stored as a
node's RAM copy of a chunk, must never become its durable copy: the drain refuses them,
drops the RAM copy and counts it; reads then find a good copy elsewhere.
"""

from __future__ import annotations

import contextlib
import mmap
import re

import aiohttp
import numpy as np
import pytest

from storaged.ids import chunk_id_of, crc32c_of
from storaged.node import Node
from storaged.peer import PeerError
from tests.conftest import TOKEN
from tests.service.inproc import InprocFactory, wait_until
from tiers.memory import Allocation, size_class


async def _stage_shared(node: Node, data: bytes) -> Allocation:
    """``data`` in a sealed shared segment of ``node``'s RAM tier, as a client leaves it."""
    seg = await node.memory.lease_shared(len(data))
    with mmap.mmap(seg.fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[:] = data
    return await node.memory.seal_shared(seg, len(data))


def _corrupt_count(node: Node) -> float:
    text = node.metrics.render().decode()
    match = re.search(r'^storaged_corrupt_total\{tier="memory"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_drain_refuses_shared_bytes_that_fail_their_id(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await inproc.start(3, drain_defer=0.0)
    good = np.random.default_rng(4).bytes(1 << 20)
    cid = chunk_id_of(good)
    url = cluster.url(0)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with http.put(f"{url}/v1/chunks/{cid}", data=good, headers=headers) as resp:
        assert resp.status == 201
    victim = cluster.node(cluster.order(cid)[0])
    await wait_until("the victim drained its copy", lambda: victim.nvme_has(cid))
    # The victim loses its copies and gets, as its RAM copy, a sealed segment whose bytes
    # differ from the id by one bit.
    await victim.memory.delete(cid)
    await victim.nvme.delete(cid)
    flipped = bytearray(good)
    flipped[12345] ^= 0x10
    view = await _stage_shared(victim, bytes(flipped))
    assert await victim.writes.store_local(cid, view)
    assert victim.memory.is_shared(cid)
    before = _corrupt_count(victim)
    await wait_until("the drain refused the copy", lambda: not victim.memory.has(cid))
    assert not victim.nvme_has(cid), "bytes that fail their id reached the disk"
    assert _corrupt_count(victim) == before + 1
    # What the victim serves now comes from a good copy elsewhere (a holder or fragments).
    data, _ = await victim.read_chunk(cid)
    assert bytes(data) == good


async def test_drain_writes_good_shared_bytes(inproc: InprocFactory) -> None:
    cluster = await inproc.start(3, drain_defer=0.0)
    node = cluster.node(0)
    data = np.random.default_rng(5).bytes(300_000)
    cid = chunk_id_of(data)
    view = await _stage_shared(node, data)
    used = node.memory.usage().used
    assert await node.writes.store_local(cid, view)
    assert node.memory.usage().used == used  # adopted: no copy, no new room taken
    await wait_until("drained", lambda: node.nvme_has(cid) and not node.memory.is_dirty(cid))
    assert bytes(await node.nvme.get(cid)) == data
    await node.memory.delete(cid)
    assert node.memory.usage().used == used - size_class(len(data))  # the segment is freed


async def test_replica_checks_the_crc_it_is_given(inproc: InprocFactory) -> None:
    """A copy sent with its CRC-32C (the sealed path's replicas) is checked against it:
    a damaged body is refused as it would be by BLAKE3, a good one is stored."""
    cluster = await inproc.start(3)
    entry, replica = cluster.node(0), cluster.node_id(1)
    data = np.random.default_rng(6).bytes(700_000)
    cid = chunk_id_of(data)
    crc = crc32c_of(data)
    damaged = bytearray(data)
    damaged[99] ^= 1
    with pytest.raises(PeerError) as refused:
        await entry.writes.push_copy(replica, cid, memoryview(damaged), crc)
    assert refused.value.code == "checksum_mismatch"
    assert not cluster.node(1).holds_hot(cid)
    with pytest.raises(PeerError) as wrong:
        await entry.writes.push_copy(replica, cid, memoryview(data), crc ^ 1)
    assert wrong.value.code == "checksum_mismatch"
    reply = await entry.writes.push_copy(replica, cid, memoryview(data), crc)
    assert reply == {"new": True}
    got, _ = await cluster.node(1).read_chunk(cid)
    assert bytes(got) == data


async def test_replicas_hold_background_work_back_for_ack_copies_only(
    inproc: InprocFactory,
) -> None:
    """A replica counts a copy that a client's PUT waits for as an ack under way (its
    drain and encode give way, as to its own PUTs: co-located clients make every PUT
    enter through one node, so the replicas have none of their own); a repair's or a
    rebalance's copy is background work and holds nothing back."""
    cluster = await inproc.start(3, drain_defer=0.0)
    entry = cluster.node(0)
    replicas = [cluster.node(1), cluster.node(2)]
    rng = np.random.default_rng(8)
    for node in replicas:
        node.writes.copy_seen = -1.0
    data = rng.bytes(300_000)
    status, doc = await entry.writes.put_sealed(
        chunk_id_of(data), await _stage_shared(entry, data), crc32c_of(data)
    )
    assert status == 201 and len(doc["replicas"]) == 3
    seen = [node.writes.copy_seen for node in replicas]
    assert all(at > 0 for at in seen), seen
    # A background copy (no ack waits for it) leaves the marker where it was.
    other = rng.bytes(300_000)
    await entry.writes.push_copy(cluster.node_id(1), chunk_id_of(other), memoryview(other))
    assert cluster.node(1).holds_hot(chunk_id_of(other))
    assert replicas[0].writes.copy_seen == seen[0]
    # busy() is the marker's age against _COPY_QUIET, or a PUT in flight.
    from storaged.node import write as write_module

    replicas[0].writes.copy_seen = -1.0
    assert not replicas[0].writes.busy()
    replicas[0].writes.ack_copy_arriving()
    assert replicas[0].writes.busy()
    replicas[0].writes.copy_seen -= write_module._COPY_QUIET
    assert not replicas[0].writes.busy()


async def test_shared_copy_that_fails_its_id_is_never_served(inproc: InprocFactory) -> None:
    """A byte flipped in a node's sealed shared copy (below the seal's promise: a memory
    fault) is never served to a co-located client: its shared-memory read fails the id,
    and the client reads another holder's copy over HTTP, checked, never the same node's
    RAM copy again (a node serves RAM as it holds it)."""
    from storaged.client import Client
    from storaged.front.http import http_error
    from storaged.front.shm import ShmListener, socket_path
    from storaged.wire import ByteRange

    cluster = await inproc.start(3, drain_workers=0, encode_workers=0)
    good = np.random.default_rng(9).bytes(1 << 20)
    cid = chunk_id_of(good)
    victim = cluster.node(0)
    # The in-process harness runs no shared-memory listener: node 0 gets one, as serve does.
    listener = ShmListener(victim, socket_path(victim.config.data_dir), http_error)
    await listener.start()
    victim.shm_info = listener.info()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(listener.close)
        client = await stack.enter_async_context(Client(cluster.urls, token=TOKEN))
        result = await client.put_chunk_result(good)
        assert set(result.replicas) == {cluster.node_id(i) for i in range(3)}
        assert client.shm is not None and client.shm.node_id == victim.id
        flipped = bytearray(good)
        flipped[777] ^= 0x04
        await victim.memory.delete(cid)
        assert await victim.writes.store_local(cid, await _stage_shared(victim, bytes(flipped)))
        assert victim.memory.is_shared(cid)
        for _ in range(3):  # whichever holder the client would have asked first
            assert bytes(await client.get_chunk(cid)) == good
            part = await client.get_chunk(cid, None, ByteRange(700, 800))
            assert bytes(part) == good[700:800]
        assert client.stats.shm_chunks_downloaded == 0
        assert client.stats.chunks_downloaded == 6


async def test_entry_node_keeps_a_local_copy_that_counts_for_nothing(
    inproc: InprocFactory,
) -> None:
    """A chunk sealed through a node that is not one of its holders stays there as a local
    copy: the co-located client reads it back through shared memory (a job restarted in
    place restores every chunk it saved from its own host), but no holding reports it, it
    is never drained, and a copy of the chunk's own that later lands here makes it a held,
    dirty copy (drained like any other)."""
    from storaged.client import Client
    from storaged.front.http import http_error
    from storaged.front.shm import ShmListener, socket_path

    # A node counted down under load (down_after 1.5 s) makes the PUT or repair place a
    # real copy on the entry node, which the test would then take for its local copy.
    cluster = await inproc.start(4, drain_defer=0.0, down_after=8.0)
    entry = cluster.node(0)
    listener = ShmListener(entry, socket_path(entry.config.data_dir), http_error)
    await listener.start()
    entry.shm_info = listener.info()
    rng = np.random.default_rng(10)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(listener.close)
        client = await stack.enter_async_context(Client(cluster.urls, token=TOKEN))
        assert client.shm is not None and client.shm.node_id == entry.id
        saved: dict[str, bytes] = {}
        elsewhere: list[str] = []
        for _ in range(40):
            data = rng.bytes(256 * 1024)
            result = await client.put_chunk_result(data)
            assert len(result.replicas) == 3
            saved[result.chunk] = data
            if entry.id not in result.replicas:
                elsewhere.append(result.chunk)
            if len(elsewhere) >= 3:
                break
        assert elsewhere, "every chunk was placed on the entry node in 40 tries"
        for cid in elsewhere:
            assert entry.memory.has(cid) and entry.memory.is_local_copy(cid)
            assert not entry.memory_has(cid) and not entry.holds_hot(cid)
            answers = (await cluster.node(1).holdings(cluster.node(1).placement().alive, [cid]))[
                cid
            ]
            # Copies: the 3 replicas, not the local one. (The entry may hold a fragment by
            # now, once the chunk's owner encoded it: a full run at load 25-40 saw one.)
            copies = {h.node for h in answers if h.memory or h.nvme}
            assert entry.id not in copies and len(copies) == 3, answers
        client.stats.reset()
        for cid, data in saved.items():
            assert bytes(await client.get_chunk(cid)) == data
        assert client.stats.shm_chunks_downloaded == len(saved)
        # The holders drain their copies; the local copy never reaches the entry's disk.
        cid = elsewhere[0]
        holders = [cluster.node(i) for i in range(1, 4) if cluster.node(i).holds_hot(cid)]
        await wait_until("the holders drained", lambda: all(n.nvme_has(cid) for n in holders))
        assert not entry.nvme_has(cid) and not entry.memory.is_dirty(cid)
        # A copy of its own lands here (as a repair or a rebalance puts one): held, drained.
        await holders[0].writes.push_copy(entry.id, cid, memoryview(saved[cid]))
        assert entry.memory_has(cid) and not entry.memory.is_local_copy(cid)
        await wait_until("the entry drained its own copy", lambda: entry.nvme_has(cid))
