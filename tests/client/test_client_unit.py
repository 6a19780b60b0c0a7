"""The client: what needs no server (error mapping, retry policy arithmetic, placement,
small helpers, document parsing) and the request engine's retry, failover and read
decisions against real nodes, in-process (real nodes serving HTTP and the peer protocol
in the test's event loop, ``tests/service/inproc.py``): 503 memory_full with Retry-After
from a cluster whose RAM cannot drain, 503 insufficient_replicas and lost connections
from nodes killed as SIGKILL kills a process (``kill``), a wait that times out, real 4xx
answers, a GET that tries every node, reads into the caller's memory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import time
import types
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest

from storaged.client.client import (
    Client,
    ClusterInfo,
    Holder,
    WaitTimeout,
    range_header,
    writable_view,
)
from storaged.client.errors import (
    BadManifest,
    BadRange,
    BadRequest,
    CheckpointNotFound,
    ChecksumMismatch,
    ChunkNotFound,
    ConnectionFailed,
    Exists,
    MemoryFull,
    MissingChunks,
    NotFound,
    ProtocolError,
    ServerError,
    StoragedError,
    Unauthorized,
    Unavailable,
    error_from_response,
    is_retryable,
    parse_retry_after,
)
from storaged.client.retry import RetryPolicy
from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from storaged.wire import ByteRange, state_at_least
from tests.client.helpers import CLIENT_SETTINGS, client_for, client_sees_all_alive
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster, InprocFactory, start_with_shm

pytestmark = pytest.mark.timeout(120)

# --------------------------------------------------------------------------- errors


def test_errors_map_codes_to_types() -> None:
    body = msgpack.packb({"error": "missing_chunks", "message": "2 missing", "missing": ["a", "b"]})
    err = error_from_response(409, body, "application/msgpack")
    assert isinstance(err, MissingChunks) and err.missing == ["a", "b"]
    assert (err.code, err.message, err.status) == ("missing_chunks", "2 missing", 409)
    assert err.body["missing"] == ["a", "b"]

    doc = json.dumps({"error": "checkpoint_not_found", "message": "no"}).encode()
    err = error_from_response(404, doc, "application/json; charset=utf-8")
    assert isinstance(err, CheckpointNotFound) and isinstance(err, KeyError)
    assert str(err) == "HTTP 404 checkpoint_not_found: no"

    for code, cls in [
        ("exists", Exists),
        ("bad_manifest", BadManifest),
        ("chunk_not_found", ChunkNotFound),
        ("memory_full", MemoryFull),
        ("unauthorized", Unauthorized),
    ]:
        err = error_from_response(400, msgpack.packb({"error": code}), None)
        assert type(err) is cls and err.code == code


def test_unknown_codes_and_garbage_bodies_fall_back_to_the_status() -> None:
    err = error_from_response(409, msgpack.packb({"error": "brand_new", "message": "m"}))
    assert type(err).__name__ == "Conflict" and err.code == "brand_new"
    err = error_from_response(404, b"<html>not here</html>", "text/html")
    assert type(err) is NotFound and err.code == "not_found" and "not here" in err.message
    assert err.foreign == "it answered HTTP 404 text/html, not storaged's JSON or msgpack"
    assert error_from_response(409, msgpack.packb({"error": "x"})).foreign == ""
    assert error_from_response(502, b"<html>bad gateway</html>", "text/html").foreign == ""
    err = error_from_response(500, b"", None)
    assert type(err) is ServerError and err.code == "server_error"
    err = error_from_response(418, b"\xc1\xc1", "application/msgpack")
    assert type(err) is StoragedError and err.code == "http_418"
    err = error_from_response(503, msgpack.packb({"error": "memory_full"}), None, "2.5")
    assert isinstance(err, Unavailable) and err.retry_after == 2.5
    assert MissingChunks(missing=["x"]).missing == ["x"]


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.25 ") == 0.25
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    date = "Sun, 06 Nov 1994 08:49:37 GMT"
    assert parse_retry_after(date, now=784111777.0 - 10) == pytest.approx(10.0)
    assert parse_retry_after(date, now=784111777.0 + 10) == 0.0


def test_what_is_retryable() -> None:
    assert is_retryable(ConnectionFailed())
    assert is_retryable(error_from_response(503, b""))
    assert is_retryable(error_from_response(502, b""))
    assert not is_retryable(error_from_response(500, b""))
    assert not is_retryable(error_from_response(404, b""))
    assert not is_retryable(ValueError())
    # A body the node found too slow (E4): nothing was stored; a congested link may carry
    # the next try faster. A truncated body (the client's own fault) is not retried.
    slow = error_from_response(
        408,
        b'{"error": "body_too_slow", "message": "body too slow: 1 of 2 bytes in 5.0 s"}',
        "application/json",
    )
    assert type(slow).__name__ == "BodyTooSlow" and slow.code == "body_too_slow"
    assert is_retryable(slow) and is_retryable(error_from_response(408, b""))
    assert not is_retryable(error_from_response(400, b'{"error": "truncated"}', "application/json"))


# --------------------------------------------------------------------------- retry policy


def test_backoff_is_jittered_below_a_doubling_ceiling() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    rng = random.Random(7)
    for retry, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (60, 1.0)]:
        draws = [policy.backoff(retry, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.8  # actually spread, not a constant
        assert len(set(draws)) > 100


def test_retry_after_is_a_floor_with_small_jitter() -> None:
    policy = RetryPolicy(base_delay=0.05, max_retry_after=5.0)
    rng = random.Random(1)
    draws = [policy.delay(1, 2.0, rng) for _ in range(100)]
    assert all(2.0 <= d <= 2.05 for d in draws)
    assert all(5.0 <= policy.delay(3, 999.0, rng) <= 5.05 for _ in range(10))
    assert policy.delay(2, None, rng) <= 0.1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"base_delay": -1},
        {"base_delay": 2.0, "max_delay": 1.0},
        {"deadline": 0},
        {"max_retry_after": -1},
    ],
)
def test_retry_policy_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)
    with pytest.raises(ValueError):
        RetryPolicy().backoff(0)


# --------------------------------------------------------------------------- placement


def test_rendezvous_order_follows_its_definition() -> None:
    nodes = [f"node-{i}" for i in range(6)]
    chunk = chunk_id_of(b"x")

    def score(node: str) -> int:
        digest = hashlib.blake2b(f"{node}:{chunk}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    order = rendezvous_order(chunk, nodes)
    assert order == sorted(nodes, key=score, reverse=True)
    assert rendezvous_order(chunk, list(reversed(nodes))) == order


def test_rendezvous_order_is_stable_under_membership_change() -> None:
    nodes = [f"n{i}" for i in range(8)]
    moved = 0
    for i in range(300):
        chunk = chunk_id_of(str(i).encode())
        before = rendezvous_order(chunk, nodes)
        after = rendezvous_order(chunk, [n for n in nodes if n != "n3"])
        assert after == [n for n in before if n != "n3"]
        moved += before[0] == "n3"
    assert 10 < moved < 80  # roughly 1/8 of the chunks had n3 first
    firsts = {rendezvous_order(chunk_id_of(str(i).encode()), nodes)[0] for i in range(300)}
    assert firsts == set(nodes)


def test_rendezvous_ties_order_by_node_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from storaged import placement

    monkeypatch.setattr(placement, "_score", lambda node, chunk: 5)
    assert placement.rendezvous_order("c", ["b", "c", "a"]) == ["a", "b", "c"]


# --------------------------------------------------------------------------- small helpers


def test_range_header_is_inclusive_on_the_wire() -> None:
    assert range_header(ByteRange(0, 10)) == "bytes=0-9"
    assert range_header(ByteRange(5, 6)) == "bytes=5-5"
    assert range_header(ByteRange(7)) == "bytes=7-"
    with pytest.raises(ValueError):
        range_header(ByteRange(5, 5))


def test_writable_view_checks_the_buffer() -> None:
    assert len(writable_view(np.zeros((2, 3), np.float32))) == 24
    with pytest.raises(TypeError, match="read-only"):
        writable_view(memoryview(b"abc"))
    with pytest.raises(TypeError, match="contiguous"):
        writable_view(np.zeros((4, 4))[:, ::2])


def test_durability_levels_are_ordered() -> None:
    assert state_at_least("cold", "nvme") and state_at_least("nvme", "nvme")
    assert not state_at_least("memory", "nvme")
    with pytest.raises(ValueError):
        state_at_least("disk", "memory")


def test_cluster_document_parsing() -> None:
    doc = {
        "nodes": [
            {
                "id": "a",
                "url": "http://127.0.0.1:1/",
                "alive": True,
                "memory": {"used": 1, "capacity": 2},
            },
            {"id": "b", "url": "http://127.0.0.1:2", "alive": False},
        ],
        "replication": 3,
        "erasure": {"codec": "zfec", "k": 4, "n": 6},
        "max_chunk_size": 1024,
    }
    info = ClusterInfo.from_wire(doc)
    assert [n.id for n in info.live] == ["a"] and info.node("a").url == "http://127.0.0.1:1"
    assert info.node("a").tiers["memory"].capacity == 2 and info.erasure is not None
    with pytest.raises(ProtocolError):
        ClusterInfo.from_wire({"nodes": [{"id": "a"}], "replication": 3, "max_chunk_size": 1})


# --------------------------------------------------------------------------- request engine
#
# The request engine against real nodes (in-process): every status, header and lost
# connection below comes from a real server (or a real dead one).


@pytest.fixture
async def starved(inproc: InprocFactory) -> InprocCluster:
    """A 4-node cluster that does not make data durable: no drain runs, so RAM (24 MiB a
    node) fills with dirty data and PUTs are refused with 503 memory_full after
    ``put_wait`` (its disks have room: a full nvme would be 507 nvme_full, E16); no
    encoder runs, so nothing ever reaches cold. Unreferenced chunks are collected
    ``gc_grace`` seconds after upload, or after the commit window that a commit touches
    them for (5 s, not the default 30 s: the full-RAM test waits for its deleted
    checkpoints' chunks to go)."""
    return await start_with_shm(
        inproc,
        4,
        **{**CLIENT_SETTINGS, "memory_capacity": 24 * 2**20},
        put_wait=0.5,
        drain_workers=0,
        encode_workers=0,
        gc_grace=2.0,
        commit_window=5.0,
        stop_timeout=5.0,
    )


async def all_alive(client: Client, cluster: InprocCluster) -> None:
    """Until every node sees every other alive, and so does the client's view."""
    await settled(cluster)
    await client_sees_all_alive(client)


async def settled(cluster: InprocCluster, dead: frozenset[str] = frozenset()) -> None:
    """Until every live node's membership has exactly the ``dead`` nodes down (right after
    start-up, or after a kill, the nodes' views differ for a moment)."""
    running = cluster.running()
    stopped = {cluster.node_id(i) for i in range(cluster.nodes) if i not in running}
    assert stopped == set(dead), f"expected {set(dead)} down, the cluster says {stopped}"
    await cluster.wait_converged(30.0)


@dataclass(frozen=True)
class RecordingPolicy(RetryPolicy):
    """The real policy, remembering each ``Retry-After`` it was given and the wait it chose."""

    waits: list[tuple[float | None, float]] = field(default_factory=list)

    def delay(
        self, retry: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        chosen = RetryPolicy.delay(self, retry, retry_after, rng)
        self.waits.append((retry_after, chosen))
        return chosen


def first_placed_on(node: str, client: Client, rng: np.random.Generator) -> bytes:
    """Random 100 kB whose placement (in the client's view) starts with ``node``."""
    while True:
        data = rng.bytes(100_000)
        if client.placement(chunk_id_of(data))[0] == node:
            return data


def one_chunk_manifest(chunk: str, size: int) -> dict[str, Any]:
    return {
        "format": 1,
        "created": time.time(),
        "meta": {},
        "shards": [{"rank": 0, "chunks": [[chunk, size]], "items": []}],
    }


def traced_session(token: str, calls: list[tuple[str, str]]) -> aiohttp.ClientSession:
    """A real session that records the method and URL of every request it starts."""

    async def on_start(
        session: aiohttp.ClientSession,
        context: types.SimpleNamespace,
        params: aiohttp.TraceRequestStartParams,
    ) -> None:
        calls.append((params.method, str(params.url)))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/msgpack"}
    return aiohttp.ClientSession(headers=headers, trace_configs=[trace])


async def test_full_memory_is_retried_after_retry_after(
    starved: InprocCluster,
) -> None:
    rng = np.random.default_rng(20)
    policy = RecordingPolicy(max_attempts=3, max_retry_after=1.0)
    filled: list[str] = []
    async with client_for(starved, retry=policy) as client:
        await all_alive(client, starved)
        try:
            await fill_then_free(starved, client, policy, rng, filled)
        finally:
            # RAM is left as found, even when the test failed half way.
            for name in filled:
                with contextlib.suppress(StoragedError):
                    await client.delete(name)


async def fill_then_free(
    cluster: InprocCluster,
    client: Client,
    policy: RecordingPolicy,
    rng: np.random.Generator,
    filled: list[str],
) -> None:
    # Fill RAM with 2 MiB chunks, each named by a checkpoint so that GC keeps it.
    full: MemoryFull | None = None
    for i in range(100):
        data = rng.bytes(2 << 20)
        requests, retries = client.stats.requests, client.stats.retries
        try:
            cid = await client.put_chunk(data)
        except MemoryFull as exc:
            full = exc
            break
        await client.commit(f"fill/{i}", one_chunk_manifest(cid, len(data)))
        filled.append(f"fill/{i}")
    assert full is not None, "RAM never filled"
    assert filled, "nothing was acknowledged before RAM filled"
    assert (full.code, full.status) == ("memory_full", 503)
    assert full.retry_after is not None and full.retry_after >= 1
    # Three attempts, the two waits in between at least the server's Retry-After.
    assert client.stats.requests - requests == 3 and client.stats.retries - retries == 2
    assert [ra for ra, _ in policy.waits[-2:]] == [full.retry_after] * 2
    assert all(wait >= min(ra or 0, 1.0) for ra, wait in policy.waits[-2:])

    # A patient client keeps retrying until RAM frees: here, once the filling
    # checkpoints are deleted and GC has collected their chunks.
    patient = RecordingPolicy(max_attempts=200, max_retry_after=0.5, deadline=60)
    async with client_for(cluster, retry=patient) as waiting:
        data = rng.bytes(2 << 20)
        put = asyncio.ensure_future(waiting.put_chunk_result(data))
        for _ in range(300):
            if waiting.stats.retries or put.done():
                break
            await asyncio.sleep(0.05)
        assert waiting.stats.retries >= 1 and not put.done(), "RAM was not full"
        while filled:
            await client.delete(filled.pop())
        result = await asyncio.wait_for(put, 60)
        # ``created`` may be False: an attempt refused while RAM was freeing node by node
        # can leave the entry's copy behind, which the attempt that succeeds then finds.
        assert result.chunk == chunk_id_of(data) and len(set(result.replicas)) == 3
        assert patient.waits and all(ra is not None and ra >= 1 for ra, _ in patient.waits)
        assert bytes(await waiting.get_chunk(result.chunk)) == data


async def test_wait_times_out_with_the_last_status(starved: InprocCluster) -> None:
    data = np.random.default_rng(21).bytes(100_000)
    async with client_for(starved) as client:
        await all_alive(client, starved)
        cid = await client.put_chunk(data)
        await client.commit("slow/1", one_chunk_manifest(cid, len(data)))
        # No encoder runs on this cluster: the checkpoint never gets cold.
        with pytest.raises(WaitTimeout) as info:
            await client.wait("slow/1", "cold", timeout=2)
        assert isinstance(info.value, TimeoutError)
        status = info.value.status
        assert status is not None and status.chunks == 1 and status.cold == 0
        assert status.state in ("memory", "nvme") and not status.reached("cold")
        reached = await client.wait("slow/1", "memory", timeout=10)
        assert reached.memory == 1 and reached.reached("memory")
        with pytest.raises(ValueError):
            await client.wait("slow/1", "disk")


async def test_dead_nodes_fail_over_at_once_then_too_few_replicas_is_retried(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    rng = np.random.default_rng(22)
    # Clients that learned the membership while every node was up.
    # shm=False: the HTTP fail-over is the subject (a co-located client hands chunks to
    # its own node, which replaces a dead holder itself).
    async with client_for(cluster, shm=False) as putter, client_for(cluster, shm=False) as getter:
        await all_alive(putter, cluster)
        await all_alive(getter, cluster)
        stored = rng.bytes(100_000)
        await putter.put_chunk(stored)
        # Two chunks whose placement starts with n3, chosen while the view had n3 alive.
        data, other = first_placed_on("n3", putter, rng), first_placed_on("n3", putter, rng)

        await cluster.kill(3)
        await settled(cluster, frozenset({"n3"}))
        # The clients still think n3 alive: their first attempt goes there and finds
        # nobody; the next node answers at once, with no wait in between.
        before = dataclasses.replace(putter.stats)
        result = await putter.put_chunk_result(data)
        assert result.created and "n3" not in result.replicas
        assert putter.stats.failovers - before.failovers == 1
        assert putter.stats.requests - before.requests == 2
        assert putter.stats.retries == before.retries
        # n3 is now suspect (or, once the client refreshed its view, down): the next
        # chunk placed first on it is not sent there.
        await putter.put_chunk(other)
        assert putter.stats.failovers - before.failovers == 1

        url3 = cluster.url(3)
        view = await getter.get_chunk(chunk_id_of(stored), holders=[Holder("n3", url3, "memory")])
        assert bytes(view) == stored
        assert getter.stats.failovers == 1 and getter.stats.retries == 0

        # Two of four down: fewer live nodes than the replication factor. 503
        # insufficient_replicas is retried, then raised with its code.
        await cluster.kill(2)
        await settled(cluster, frozenset({"n2", "n3"}))
        policy = RecordingPolicy(max_attempts=3, max_retry_after=0.1)
        async with client_for(cluster, retry=policy) as client:
            assert {n.id for n in client.cluster.live} == {"n0", "n1"}
            client.stats.reset()  # count from here, not the membership request of open()
            lost = rng.bytes(1000)
            with pytest.raises(Unavailable) as info:
                await client.put_chunk(lost)
            assert (info.value.code, info.value.status) == ("insufficient_replicas", 503)
            assert info.value.retry_after is not None and info.value.retry_after >= 1
            assert client.stats.requests == 3 and client.stats.retries == 2
            assert client.stats.failovers == 0
            assert [ra for ra, _ in policy.waits] == [info.value.retry_after] * 2
            assert await client.missing_chunks([chunk_id_of(lost)]) == [chunk_id_of(lost)]


# In-process nodes (``tests/service/inproc.py``): the same server code, no processes.


async def test_client_errors_are_not_retried(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    data = np.random.default_rng(23).bytes(5000)
    # shm=False: HTTP requests are counted (through shared memory the range and the wrong
    # id are refused the same way, with no HTTP request; test_shm.py covers that path).
    async with Client(cluster.urls, token=TOKEN, shm=False) as client:
        await client_sees_all_alive(client)
        cid = await client.put_chunk(data)
        await client.commit("once/1", one_chunk_manifest(cid, len(data)))
        client.stats.reset()
        with pytest.raises(BadManifest) as bad:
            await client.commit("once/2", {"format": 1})
        assert bad.value.status == 400
        with pytest.raises(BadRange) as out_of_range:
            await client.get_chunk(cid, None, ByteRange(6000, 6010))
        assert out_of_range.value.status == 416
        with pytest.raises(ChecksumMismatch):
            await client.put_chunk(b"these bytes", chunk_id_of(b"other bytes"))
        with pytest.raises(Exists):
            await client.commit("once/1", one_chunk_manifest(cid, len(data)))
        with pytest.raises(CheckpointNotFound) as gone:
            await client.delete("once/never-saved")
        assert not gone.value.replayed  # no attempt was lost: it truly was not there
        # One request each, no wait, no other node asked.
        assert client.stats.requests == 5
        assert client.stats.retries == 0 and client.stats.failovers == 0
        with pytest.raises(BadRequest):
            await client.commit("../etc", {})  # refused before any request
        assert client.stats.requests == 5
        assert await client.list("once/") != []


async def test_get_tries_every_node_then_raises_not_found(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    never = chunk_id_of(b"never stored anywhere")
    calls: list[tuple[str, str]] = []
    async with traced_session(TOKEN, calls) as session:
        client = Client(cluster.urls, token=TOKEN)
        await client.open(session)
        try:
            await client_sees_all_alive(client)
            calls.clear()
            holder = Holder("n2", cluster.url(2), "memory")
            with pytest.raises(ChunkNotFound):
                await client.get_chunk(never, holders=[holder])
        finally:
            await client.close()
    gets = [url for method, url in calls if method == "GET"]
    assert len(gets) == 4 and gets[0].startswith(cluster.url(2) + "/")
    assert {url.rsplit("/v1/", 1)[0] for url in gets} == set(cluster.urls)  # each node once
    assert all(url.endswith(f"/v1/chunks/{never}") for url in gets)


async def test_direct_get_tries_every_node_then_raises_not_found(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    never = chunk_id_of(b"never stored anywhere, directly")
    async with Client(cluster.urls, token=TOKEN) as client:
        await client_sees_all_alive(client)
        assert client.direct is not None
        client.direct.stats.by_addr.clear()
        holder = Holder("n2", cluster.url(2), "memory")
        with pytest.raises(ChunkNotFound):
            await client.get_chunk(never, holders=[holder])
        asked = client.direct.stats.by_addr
    assert asked == {url.removeprefix("http://"): 1 for url in cluster.urls}  # each node once
    assert client.stats.failovers == 0 and client.stats.retries == 0


async def test_get_reads_into_the_callers_buffer(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    data = np.random.default_rng(24).bytes(300_000)
    async with Client(cluster.urls, token=TOKEN) as client:
        await client_sees_all_alive(client)
        cid = await client.put_chunk(data)
        out = bytearray(len(data) + 64)
        view = await client.get_chunk(cid, out)
        assert view.obj is out and len(view) == len(data) and bytes(view) == data
        view = await client.get_chunk(cid, out, ByteRange(10, 20))
        assert view.obj is out and bytes(view) == data[10:20] and bytes(out[:10]) == data[10:20]
        view = await client.get_chunk(cid, None, ByteRange(1000, 250_000))
        assert bytes(view) == data[1000:250_000]
        view = await client.get_chunk(cid, None, ByteRange(299_990))
        assert bytes(view) == data[299_990:]
        # Into an array of another element type: the bytes land in its memory as they are.
        floats = np.zeros(len(data) // 4, np.float32)
        view = await client.get_chunk(cid, floats)
        assert isinstance(view.obj, np.ndarray) and view.obj is floats
        assert floats.tobytes() == data
        tail = np.zeros(100, np.uint8)
        await client.get_chunk(cid, tail, ByteRange(len(data) - 100, len(data)))
        assert tail.tobytes() == data[-100:]
        requests = client.stats.requests
        with pytest.raises(ValueError, match="output buffer"):
            await client.get_chunk(cid, bytearray(3), ByteRange(0, 10))
        with pytest.raises(TypeError, match="read-only"):
            await client.get_chunk(cid, memoryview(bytes(10)))
        assert len(await client.get_chunk(cid, None, ByteRange(5, 5))) == 0
        assert client.stats.requests == requests  # all three refused without asking


async def test_client_needs_urls_and_hides_its_token() -> None:
    client = Client("http://h0/", token="s3cret")
    assert "s3cret" not in repr(client)
    with pytest.raises(RuntimeError):
        _ = client.cluster
    with pytest.raises(ValueError):
        Client([])


async def test_large_and_small_manifests_decode_whole(inproc_cluster: InprocCluster) -> None:
    """A manifest of more than ``_DECODE_IN_THREAD`` bytes (metadata of 1.5 MiB: decoded in
    a thread) and a small one (decoded on the loop) come back equal to what was committed."""
    from storaged.client.request import _DECODE_IN_THREAD
    from tests.service.http import manifest_for

    data = b"decoded off the loop"
    async with client_for(inproc_cluster) as client:
        cid = await client.put_chunk(data)
        assert cid == chunk_id_of(data)
        for name, meta in (
            ("large/manifest", {f"key-{i:06d}": "v" * 64 for i in range(20_000)}),
            ("small/manifest", {"step": 1}),
        ):
            manifest = {**manifest_for([data]), "meta": meta}
            await client.commit(name, manifest)
            if name.startswith("large"):
                assert len(msgpack.packb(manifest)) > _DECODE_IN_THREAD
            got = await client.get_manifest(name)
            assert got["meta"] == meta and got["shards"] == manifest["shards"]
