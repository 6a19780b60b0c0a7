"""Degraded reads: cold chunks decoded by the client from fragments it fetches itself
(``storaged.client.degraded``, extension E12), against in-process nodes (real nodes in
the test's event loop, ``tests/service/inproc.py``): a node killed with ``kill`` is a
process killed with SIGKILL to the client (its connections drop, its RAM is gone), and
the fragments are damaged or removed in the nodes' data directories as on a process's."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from erasure import build_fragment, make_codec, parse_fragment
from storaged.client import (
    ByteRange,
    ChunkNotFound,
    Client,
    degraded,
    restore_checkpoint,
    save_checkpoint,
)
from storaged.client.client import Holder
from storaged.client.degraded import Decoded, FragmentBuffers, decode_cold, fetch_order
from storaged.client.errors import FragmentNotFound, NotEnoughFragments, StoragedError
from storaged.ids import chunk_id_of
from tests.client.helpers import CLIENT_SETTINGS, client_for
from tests.conftest import ADMIN_TOKEN, TOKEN
from tests.service.inproc import InprocCluster, InprocFactory, start_with_shm

CHUNK = 256 << 10


def _state(seed: int) -> np.ndarray:
    # 2 MiB of distinct bytes per test: 8 chunks, no dedup with another test's.
    return np.random.default_rng(seed).standard_normal(512 * 1024).astype(np.float32)


async def _save_cold(client: Client, name: str, g: np.ndarray) -> dict[str, list[Holder]]:
    """Save ``g``, wait until every chunk is cold, evict the hot copies; the cold-only plan."""
    await save_checkpoint(client, name, {0: {"g": g}}, chunk_size=CHUNK)
    await client.wait(name, "cold", timeout=120)
    for level in ("memory", "nvme"):
        await client.evict(name, level, admin_token=ADMIN_TOKEN)
    plan = await client.plan(name)
    assert plan and all(h.tier == "cold" and h.fragments for hs in plan.values() for h in hs)
    return plan


def _fragment_files(cluster: InprocCluster, chunk_id: str) -> dict[int, tuple[int, Path]]:
    """Fragment index -> (node number, file) of one chunk, as the nodes' disks hold them
    (a directory walk: called in a thread, off the nodes' loop)."""
    found: dict[int, tuple[int, Path]] = {}
    for i in range(cluster.nodes):
        for path in (cluster.root / cluster.node_id(i) / "cold").rglob(f"{chunk_id}.*"):
            if path.is_file() and "quarantine" not in path.parts:
                found[int(path.name.rpartition(".")[2])] = (i, path)
    return found


def _flip_middle_byte(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


async def test_cold_restore_decodes_on_the_client_skipping_a_corrupt_fragment_and_a_dead_node(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    g = _state(1)
    async with client_for(cluster) as client:
        plan = await _save_cold(client, "degraded/a", g)
        k = client.cluster.erasure.k if client.cluster.erasure else 0
        victim_chunk = sorted(plan)[0]
        on_disk = await asyncio.to_thread(_fragment_files, cluster, victim_chunk)
        # A primary fragment: asked for first, so the client meets the bad copy.
        _, corrupt_file = on_disk[0]
        await asyncio.to_thread(_flip_middle_byte, corrupt_file)

        dst = np.zeros_like(g)
        client.stats.reset()
        await restore_checkpoint(client, "degraded/a", {"g": dst}, holders=plan)
        assert dst.tobytes() == g.tobytes()
        # Every chunk came through the client's own decode, none from a node's.
        assert client.stats.chunks_decoded == len(plan) == client.stats.chunks_downloaded
        assert client.stats.fragments_skipped >= 1
        assert client.stats.fragments_downloaded >= len(plan) * k
        # The holder quarantined its bad copy: it is off the chunk's fragments now.
        assert 0 not in await asyncio.to_thread(_fragment_files, cluster, victim_chunk)

    # Kill a node holding one fragment of the damaged chunk: 6 - 1 bad - 1 dead >= k left.
    on_disk = await asyncio.to_thread(_fragment_files, cluster, victim_chunk)
    holders = [node for node, _ in on_disk.values()]
    victim = next(i for i in range(cluster.nodes) if holders.count(i) == 1)
    await cluster.kill(victim)
    async with client_for(cluster) as client:
        dst = np.zeros_like(g)
        await restore_checkpoint(client, "degraded/a", {"g": dst})
        assert dst.tobytes() == g.tobytes()
        assert client.stats.chunks_decoded == len(plan)
        # One chunk decoded straight into a caller's buffer, then ranges of it.
        out = bytearray(CHUNK + 100)
        fresh = await client.plan("degraded/a")
        before = client.stats.chunks_decoded
        whole = await client.get_chunk(victim_chunk, out, holders=fresh[victim_chunk])
        assert chunk_id_of(whole) == victim_chunk and whole.obj is out
        assert len(whole) == CHUNK and bytes(out[CHUNK:]) == bytes(100)
        for start in (100, 5000):
            part = await client.get_chunk(
                victim_chunk, None, ByteRange(start, start + 200), holders=fresh[victim_chunk]
            )
            assert bytes(part) == bytes(out[start : start + 200])
        # One decode into ``out``, one for both ranges: the second is served by the first's.
        assert client.stats.chunks_decoded == before + 2
        with pytest.raises(ValueError, match=r"out holds|output buffer"):
            await client.get_chunk(victim_chunk, bytearray(10), holders=fresh[sorted(plan)[1]])
    async with client_for(cluster, decode_cache_bytes=0) as client:
        fresh = await client.plan("degraded/a")
        for start in (0, 1000):
            part = await client.get_chunk(
                victim_chunk, None, ByteRange(start, start + 10), holders=fresh[victim_chunk]
            )
            assert bytes(part) == bytes(out[start : start + 10])
        assert client.stats.chunks_decoded == 2  # no cache: each range decodes


async def test_a_cold_restore_holds_the_fragments_of_a_few_chunks_at_once(
    inproc_cluster: InprocCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client made on "one core": two chunks fetched and decoded at once. Its restore of
    # 8 cold chunks (32 fragments) receives them into the buffers of those two chunks,
    # reused: fragments are not fetched far ahead of the decodes, each into fresh memory.
    cluster = inproc_cluster
    g = _state(5)
    async with client_for(cluster) as client:
        plan = await _save_cold(client, "degraded/few", g)
    with monkeypatch.context() as patched:
        patched.setattr(os, "cpu_count", lambda: 1)
        client = client_for(cluster, shm=False)  # every chunk through the decode here
    at_once = [0, 0]  # now, most

    async def counted(*args: Any, **kwargs: Any) -> Decoded:
        at_once[0] += 1
        at_once[1] = max(at_once)
        try:
            await asyncio.sleep(0.01)  # a slow decode: the restore has 8 chunks to start
            return await decode_cold(*args, **kwargs)
        finally:
            at_once[0] -= 1

    monkeypatch.setattr(degraded, "decode_cold", counted)
    async with client:
        dst = np.zeros_like(g)
        await restore_checkpoint(client, "degraded/few", {"g": dst}, holders=plan)
        assert dst.tobytes() == g.tobytes()
        cold = client._reads.cold
        assert cold.chunks_at_once == 2 and client.stats.chunks_decoded == len(plan) == 8
        assert at_once[1] == 2
        n = client.cluster.erasure.n if client.cluster.erasure else 0
        assert client.stats.fragments_downloaded >= 32
        assert cold.buffers().made <= (cold.chunks_at_once + 1) * n < 32


async def test_fewer_than_k_fragments_is_a_clear_error(inproc: InprocFactory) -> None:
    cluster = await start_with_shm(inproc, 4, **CLIENT_SETTINGS, repair_interval=3600.0)
    g = _state(2)
    async with client_for(cluster) as client:
        plan = await _save_cold(client, "degraded/b", g)
        chunk = sorted(plan)[0]
        k = client.cluster.erasure.k if client.cluster.erasure else 0
        # Remove fragments on disk until k - 1 remain (the holders' indexes do not know yet:
        # the plan and the nodes still name them, and each read finds the file gone).
        files = await asyncio.to_thread(_fragment_files, cluster, chunk)
        for index in sorted(files)[k - 1 :]:
            await asyncio.to_thread(files[index][1].unlink)
        with pytest.raises(NotEnoughFragments) as caught:
            await client.get_chunk(chunk, holders=plan[chunk])
        assert caught.value.needed == k and caught.value.available == k - 1
        assert f"{k - 1} fragment(s) passed" in str(caught.value)
        assert isinstance(caught.value, ChunkNotFound)  # callers that catch that still do


def _fragments(data: bytes, k: int = 4, n: int = 6) -> tuple[str, dict[int, memoryview]]:
    cid = chunk_id_of(data)
    codec = make_codec("zfec", k, n)
    return cid, {f.index: memoryview(f.to_bytes()) for f in codec.encode(cid, data)}


async def test_decode_cold_drops_a_fragment_failing_its_crc_and_fetches_another() -> None:
    # A fragment damaged on the wire (the node checked it on disk): the client's own check.
    data = np.random.default_rng(3).bytes(100_000)
    cid, frags = _fragments(data)
    damaged = bytearray(frags[1])
    damaged[len(damaged) // 2] ^= 0x01
    served = {**frags, 1: memoryview(damaged)}
    asked: list[int] = []

    async def fetch(index: int) -> memoryview:
        asked.append(index)
        if index == 2:
            raise FragmentNotFound(message="not here")
        return served[index]

    sources = {i: ["n0"] for i in frags}
    decoded = await decode_cold(cid, make_codec("zfec", 4, 6), sources, fetch, asyncio.Semaphore(1))
    assert decoded.data == data
    assert sorted(asked[:4]) == [0, 1, 2, 3]  # primaries first
    assert set(asked[4:]) == {4, 5}  # one per failure: index 2 refused, index 1 bad CRC
    assert (decoded.fetched, decoded.skipped) == (5, 2)


async def test_decode_cold_gives_up_when_the_indexes_run_out() -> None:
    data = np.random.default_rng(4).bytes(10_000)
    cid, frags = _fragments(data)

    async def fetch(index: int) -> memoryview:
        if index >= 3:
            raise FragmentNotFound(message=f"fragment {index} gone")
        return frags[index]

    with pytest.raises(NotEnoughFragments, match="fragment 5 gone") as caught:
        await decode_cold(
            cid, make_codec("zfec", 4, 6), {i: ["n0"] for i in frags}, fetch, asyncio.Semaphore(1)
        )
    assert (caught.value.available, caught.value.needed) == (3, 4)
    assert isinstance(caught.value, StoragedError)


def _forged(raw: memoryview) -> memoryview:
    """``raw`` with one payload byte changed and its CRC-32C recomputed: it passes its own
    checks, and only the chunk's BLAKE3 can tell."""
    frag = parse_fragment(raw)
    payload = bytearray(frag.payload)
    payload[len(payload) // 2] ^= 0x40
    forged = build_fragment(
        codec=frag.codec, k=frag.k, n=frag.n, index=frag.index, length=frag.length,
        chunk_id=frag.chunk_id, payload=payload,
    )  # fmt: skip
    return memoryview(forged.to_bytes())


async def test_several_decodes_in_flight_each_refuse_their_corrupt_fragment() -> None:
    # Six chunks decoded at once on two decode slots, receive buffers shared through one
    # pool: each chunk has a primary failing its CRC and another forged (good CRC, wrong
    # bytes); every decode drops the first, sees through the second, returns its own bytes.
    pool = FragmentBuffers(64 << 20)
    slots = asyncio.Semaphore(2)
    chunks = [np.random.default_rng(10 + i).bytes(300_000 + 1000 * i) for i in range(6)]

    async def one(i: int, data: bytes) -> bytes:
        cid, frags = _fragments(data)
        damaged = bytearray(frags[i % 4])
        damaged[len(damaged) // 2] ^= 0x01
        served = {**frags, i % 4: memoryview(damaged), (i + 1) % 4: _forged(frags[(i + 1) % 4])}

        async def fetch(index: int) -> memoryview:
            await asyncio.sleep(0.001 * index)  # interleave the chunks' receives
            view = pool.take(len(served[index]))
            view[:] = served[index]
            return view

        decoded = await decode_cold(
            cid, make_codec("zfec", 4, 6), {j: ["n0"] for j in frags}, fetch, slots, None, pool
        )
        assert decoded.skipped == 1  # the CRC failure; the forged one was outvoted
        return bytes(decoded.data)

    results = await asyncio.gather(*(one(i, d) for i, d in enumerate(chunks)))
    assert results == chunks


async def test_a_decode_into_the_destination_leaves_no_wrong_byte_there() -> None:
    # A forged primary is decoded into ``out`` first (its wrong bytes land there), fails the
    # chunk's BLAKE3, and the subset that hashes right is decoded over it: what the caller
    # gets back, and every byte of ``out`` up to the chunk's length, is the chunk.
    data = np.random.default_rng(20).bytes(200_003)
    cid, frags = _fragments(data)
    served = {**frags, 0: _forged(frags[0])}

    async def fetch(index: int) -> memoryview:
        return served[index]

    out = bytearray(b"\xaa" * (len(data) + 64))
    decoded = await decode_cold(
        cid, make_codec("zfec", 4, 6), {i: ["n0"] for i in frags}, fetch, asyncio.Semaphore(1),
        memoryview(out),
    )  # fmt: skip
    assert isinstance(decoded.data, memoryview) and decoded.data.obj is out
    assert bytes(decoded.data) == data == bytes(out[: len(data)])
    assert bytes(out[len(data) :]) == b"\xaa" * 64  # nothing written past the chunk
    assert decoded.fetched == 5  # the forged one could only be outvoted with a spare


async def test_fragment_buffers_come_back_after_a_decode_and_not_after_a_cancel() -> None:
    data = np.random.default_rng(30).bytes(100_000)
    cid, frags = _fragments(data)
    codec = make_codec("zfec", 4, 6)
    pool = FragmentBuffers(1 << 20)
    handed: list[memoryview] = []

    async def fetch(index: int) -> memoryview:
        view = pool.take(len(frags[index]))
        view[:] = frags[index]
        handed.append(view)
        return view

    sources = {i: ["n0"] for i in frags}
    decoded = await decode_cold(cid, codec, sources, fetch, asyncio.Semaphore(1), None, pool)
    assert decoded.data == data
    first = {id(v.obj) for v in handed}
    handed.clear()
    # The next decode receives into the same four buffers: no fresh memory per fragment.
    assert (await decode_cold(cid, codec, sources, fetch, asyncio.Semaphore(1), None, pool)).data
    assert {id(v.obj) for v in handed} == first
    # A decode cancelled while its fragments may still be read keeps them out of the pool.
    handed.clear()
    held = asyncio.Semaphore(0)  # the decode waits for a slot that never frees
    task = asyncio.create_task(decode_cold(cid, codec, sources, fetch, held, None, pool))
    while len(handed) < 4:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not {id(v.obj) for v in handed} & {id(pool.take(len(frags[0])).obj) for _ in range(4)}
    # Buffers the pool did not make are never taken in (a caller's own bytes).
    foreign = memoryview(bytearray(len(frags[0])))
    pool.give_back([foreign])
    assert pool.take(len(frags[0])).obj is not foreign.obj


def test_fetch_order_asks_for_primaries_first() -> None:
    assert fetch_order({5: ["a"], 0: ["b"], 4: ["c"], 2: ["a"], 3: ["d"]}, 4) == [0, 2, 3, 4, 5]


async def test_the_fragment_endpoint_answers_only_for_what_the_node_holds(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    async with client_for(cluster) as client:
        data = np.random.default_rng(5).bytes(50_000)
        cid = await client.put_chunk(data)  # in RAM only: no node holds a fragment yet
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def get(path: str) -> tuple[int, dict[str, object]]:
            async with session.get(cluster.urls[0] + path) as resp:
                return resp.status, await resp.json()

        assert await get(f"/v1/chunks/{cid}/fragments/0") == (
            404,
            {"error": "fragment_not_found", "message": f"fragment 0 of {cid} is not held by"
             " this node"},
        )  # fmt: skip
        for bad in ("x", "07", "6", "-1"):
            status, doc = await get(f"/v1/chunks/{cid}/fragments/{bad}")
            assert (status, doc["error"]) == (400, "bad_request"), bad
        status, doc = await get(f"/v1/chunks/{'A' * 64}/fragments/0")
        assert (status, doc["error"]) == (400, "bad_chunk_id")
        url = f"{cluster.urls[0]}/v1/chunks/{cid}/fragments/0"
        async with aiohttp.ClientSession() as anonymous, anonymous.get(url) as resp:
            assert resp.status == 401
