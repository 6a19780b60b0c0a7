"""The client against a real 4-node cluster: in-process nodes (real nodes serving their
HTTP app and peer server on 127.0.0.1 in the test's event loop, ``tests/service/inproc.py``),
one cluster per test.

Round trips of random shapes, dtypes and shardings; N -> M resharding; dedup of
unchanged state; the chunk and checkpoint API; async save with the source mutated
after return; a node killed in the middle of a save; restore with nodes dead;
RAM backpressure. A node is killed with ``kill``, as SIGKILL kills a process: its
connections drop (requests in flight get no answer) and its RAM is gone; a restarted one
opens its data directory again.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storaged.client import (
    AsyncSaver,
    BadManifest,
    BadRange,
    ByteRange,
    CheckpointNotFound,
    ChecksumMismatch,
    ChunkNotFound,
    Client,
    Exists,
    MissingChunks,
    Shard,
    StoragedError,
    TooLarge,
    restore_checkpoint,
    save_checkpoint,
)
from storaged.client.errors import BadName, Unauthorized
from storaged.client.retry import RetryPolicy
from storaged.ids import chunk_id_of
from tests.client.helpers import CLIENT_SETTINGS, client_for, client_sees_all_alive
from tests.conftest import ADMIN_TOKEN, TOKEN
from tests.service.inproc import InprocCluster, InprocFactory, start_with_shm

pytestmark = pytest.mark.timeout(240)


Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]
State = dict[int, dict[str, Any]]


def split(shape: tuple[int, ...], axis: int, bounds: list[int]) -> Boxes:
    """(offsets, shape) boxes cutting ``shape`` along ``axis`` at ``bounds``."""
    boxes = []
    for lo, hi in itertools.pairwise(bounds):
        offsets = [0] * len(shape)
        extent = list(shape)
        offsets[axis], extent[axis] = lo, hi - lo
        boxes.append((tuple(offsets), tuple(extent)))
    return boxes


def shards_of(g: np.ndarray[Any, Any], boxes: Boxes) -> list[Shard]:
    return [
        Shard(g[tuple(slice(o, o + n) for o, n in zip(offs, ext, strict=True))], g.shape, offs)
        for offs, ext in boxes
    ]


async def restored_boxes(
    client: Client,
    name: str,
    key: str,
    g: np.ndarray[Any, Any],
    boxes: Boxes,
) -> None:
    """Restore ``key`` box by box (one "rank" each, concurrently) and compare with ``g``."""

    async def one(offs: tuple[int, ...], ext: tuple[int, ...]) -> None:
        dst = np.zeros(ext, g.dtype)
        await restore_checkpoint(client, name, {key: Shard(dst, g.shape, offs)})
        index = tuple(slice(o, o + n) for o, n in zip(offs, ext, strict=True))
        assert dst.tobytes() == g[index].tobytes()

    await asyncio.gather(*(one(o, e) for o, e in boxes))


# --------------------------------------------------------------------------- API


async def test_client_learns_the_cluster_from_one_url(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    async with Client(cluster.urls[2], token=TOKEN) as client:
        assert sorted(n.id for n in client.cluster.nodes) == [cluster.node_id(i) for i in range(4)]
        info = await client_sees_all_alive(client)
        assert info.replication == 3
        assert info.max_chunk_size == 16 << 20 and info.erasure is not None
    with pytest.raises(Unauthorized):
        async with Client(cluster.urls[0], token="wrong"):
            pass


async def test_chunk_api(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    data = np.random.default_rng(1).bytes(300_000)
    async with client_for(cluster) as client:
        await client_sees_all_alive(client)
        result = await client.put_chunk_result(data)
        cid = chunk_id_of(data)
        assert result.chunk == cid and result.size == len(data)
        # The client's placement is the cluster's: the hot copies are on its first three.
        assert set(result.replicas) == set(client.placement(cid)[:3])
        assert await client.missing_chunks([cid, chunk_id_of(b"never")]) == [chunk_id_of(b"never")]
        out = bytearray(len(data) + 10)
        view = await client.get_chunk(cid, out)
        assert view.obj is out and bytes(view) == data
        assert bytes(await client.get_chunk(cid, None, ByteRange(1000, 5000))) == data[1000:5000]
        assert bytes(await client.get_chunk(cid, None, ByteRange(299_990))) == data[299_990:]
        head = await client.head_chunk(cid)
        assert head.size == len(data) and head.tier in ("memory", "nvme", "cold")
        with pytest.raises(ChunkNotFound):
            await client.get_chunk(chunk_id_of(b"never"))
        with pytest.raises(ChunkNotFound):
            await client.head_chunk(chunk_id_of(b"never"))
        with pytest.raises(BadRange):
            await client.get_chunk(cid, None, ByteRange(400_000, 400_010))
        with pytest.raises(ChecksumMismatch):
            await client.put_chunk(b"these bytes", chunk_id_of(b"other bytes"))
        with pytest.raises(TooLarge):
            await client.put_chunk(bytes(client.cluster.max_chunk_size + 1))
        assert client.stats.failovers == 0


async def test_checkpoint_api(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    async with client_for(cluster) as client:
        g = np.arange(5000, dtype=np.float64).reshape(50, 100)
        states = {
            r: {"g": s, "step": 3}
            for r, s in enumerate(shards_of(g, split(g.shape, 0, [0, 20, 50])))
        }
        result = await save_checkpoint(client, "api/step-3", states, meta={"step": 3})
        assert result.created and result.bytes >= g.nbytes
        manifest = await client.get_manifest("api/step-3")
        assert manifest["format"] == 1 and manifest["meta"] == {"step": 3}
        assert [s["rank"] for s in manifest["shards"]] == [0, 1]
        listed = await client.list("api/")
        assert [c.name for c in listed] == ["api/step-3"] and listed[0].bytes == result.bytes
        plan = await client.plan("api/step-3")
        chunk_ids = {c for s in manifest["shards"] for c, _ in s["chunks"]}
        assert set(plan) == chunk_ids and all(plan[c] for c in chunk_ids)
        status = await client.wait("api/step-3", "cold", timeout=60)
        assert status.cold == status.chunks == len(chunk_ids)
        # Immutable; idempotent for the identical manifest.
        again = await client.commit("api/step-3", manifest)
        assert not again.created
        with pytest.raises(Exists):
            await client.commit("api/step-3", {**manifest, "meta": {"step": 4}})
        ghost = chunk_id_of(b"no such chunk")
        orphan = {**manifest, "shards": [{"rank": 0, "chunks": [[ghost, 13]], "items": []}]}
        with pytest.raises(MissingChunks) as missing:
            await client.commit("api/orphan", orphan)
        assert missing.value.missing == [ghost]
        overlapping = {
            **manifest,
            "shards": [
                {**manifest["shards"][0], "rank": 0},
                {**manifest["shards"][0], "rank": 1},
            ],
        }
        with pytest.raises(BadManifest):
            await client.commit("api/overlap", overlapping)
        assert [c.name for c in await client.list("api/")] == ["api/step-3"]
        await client.delete("api/step-3")
        with pytest.raises(CheckpointNotFound):
            await client.get_manifest("api/step-3")
        with pytest.raises(CheckpointNotFound):
            await client.delete("api/step-3")
        assert await client.list("api/") == []


# --------------------------------------------------------------------------- round trips


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], str, int, list[int], int, list[int], int]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(["float32", "float64", "int8", "uint16", "complex64", "bool"]))
    save_axis = draw(st.integers(0, ndim - 1))
    n = draw(st.integers(1, 4))
    save_cuts = sorted(
        draw(st.lists(st.integers(0, shape[save_axis]), min_size=n - 1, max_size=n - 1))
    )
    load_axis = draw(st.integers(0, ndim - 1))
    m = draw(st.integers(1, 4))
    load_cuts = sorted(
        draw(st.lists(st.integers(0, shape[load_axis]), min_size=m - 1, max_size=m - 1))
    )
    return shape, dtype, save_axis, save_cuts, load_axis, load_cuts, draw(st.integers(0, 2**31))


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(layouts())
async def test_random_round_trips(inproc_cluster: InprocCluster, layout: Any) -> None:
    # One cluster for every example of the test (as one process cluster served the module).
    cluster = inproc_cluster
    shape, dtype, save_axis, save_cuts, load_axis, load_cuts, seed = layout
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    g = (raw % 2 if dtype == "bool" else raw).view(dtype).reshape(shape)
    saved = split(shape, save_axis, [0, *save_cuts, shape[save_axis]])
    wanted = split(shape, load_axis, [0, *load_cuts, shape[load_axis]])
    name = f"rt/{seed}-{len(saved)}-{len(wanted)}-{uuid.uuid4().hex[:8]}"  # examples may repeat

    async with client_for(cluster) as client:
        states = {r: {"g": s, "seed": seed} for r, s in enumerate(shards_of(g, saved))}
        await save_checkpoint(client, name, states, chunk_size=1024)
        await restored_boxes(client, name, "g", g, wanted)
        assert (await restore_checkpoint(client, name, {"seed": None}))["seed"] == seed


async def test_uneven_resharding_reads_only_what_each_rank_needs(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    g = np.random.default_rng(5).standard_normal((1000, 512)).astype(np.float32)  # 2 MB
    async with client_for(cluster) as client:
        saved = split(g.shape, 0, [0, 100, 450, 451, 1000])
        states = {r: {"g": s} for r, s in enumerate(shards_of(g, saved))}
        await save_checkpoint(client, "reshard/4", states, chunk_size=256 << 10)
        for bounds in ([0, 333, 999, 1000], [0, 1000], [0, 1, 2, 500, 900, 1000]):
            client.stats.reset()
            await restored_boxes(client, "reshard/4", "g", g, split(g.shape, 0, bounds))
            # Row splits map onto contiguous byte ranges: nothing beyond them is read.
            assert client.stats.bytes_downloaded == g.nbytes
        # Column splits read whole rows of each tile (gaps are cheaper than requests).
        await restored_boxes(client, "reshard/4", "g", g, split(g.shape, 1, [0, 100, 512]))


async def test_unchanged_state_uploads_only_the_manifest(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    rng = np.random.default_rng(6)
    head = rng.standard_normal((64, 64)).astype(np.float32)
    state: dict[str, Any] = {
        "frozen": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB
        "head": head,
        "step": 1,
    }
    async with client_for(cluster) as client:
        await save_checkpoint(client, "dedup/1", {0: state}, chunk_size=1 << 20)
        client.stats.reset()
        await save_checkpoint(client, "dedup/2", {0: state}, chunk_size=1 << 20)
        assert client.stats.bytes_uploaded == 0 and client.stats.chunks_uploaded == 0
        assert client.stats.chunks_skipped > 0
        head += 1.0
        state["step"] = 2
        client.stats.reset()
        await save_checkpoint(client, "dedup/3", {0: state}, chunk_size=1 << 20)
        # Only the packed small items changed; the 2 MiB array kept its chunks.
        assert 0 < client.stats.bytes_uploaded < 64 * 1024
        got = await restore_checkpoint(client, "dedup/3")
        assert np.array_equal(got["head"], head) and got["step"] == 2


async def test_async_save_ignores_mutation_after_return(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    rng = np.random.default_rng(7)
    g = rng.standard_normal((2048, 512)).astype(np.float32)  # 4 MiB
    original = g.copy()
    states = {
        r: {"g": s, "step": 9}
        for r, s in enumerate(shards_of(g, split(g.shape, 0, [0, 700, 2048])))
    }
    async with client_for(cluster) as client, AsyncSaver(client, chunk_size=512 << 10) as saver:
        handle = await saver.save("async/9", states, meta={"step": 9})
        g[...] = -1.0  # the training loop writes the next step into the same memory
        result = await handle.acked()
        assert result.commit is not None and result.commit.created
        status = await handle.durable("nvme", timeout=60)
        assert status.nvme == status.chunks
        await restored_boxes(client, "async/9", "g", original, split(g.shape, 0, [0, 1024, 2048]))
        # The staging buffers are reused: a second save of the mutated state is right too.
        handle = await saver.save("async/10", states)
        await handle.acked()
        await restored_boxes(client, "async/10", "g", g, split(g.shape, 0, [0, 2048]))


async def test_prepared_saver_stages_into_the_buffers_it_faulted_in(
    inproc_cluster: InprocCluster,
) -> None:
    """``AsyncSaver.prepare`` lays out one staging buffer per rank (per buffer set) of the
    size the save packs into, pages touched; the first save uses exactly those buffers,
    and what it saved restores."""
    from storaged.client.checkpoint import staged_size

    cluster = inproc_cluster
    g, states = big_state(31, rows=1024)
    chunk = 512 << 10
    async with (
        client_for(cluster) as client,
        AsyncSaver(client, chunk_size=chunk, buffers=2) as saver,
    ):
        prepared = await saver.prepare(states)
        sizes = {rank: staged_size(state, chunk) for rank, state in states.items()}
        assert prepared == 2 * sum(sizes.values()) > g.nbytes
        sets = list(saver._free._queue)  # type: ignore[attr-defined]
        assert len(sets) == 2
        before = [{r: b._buffer for r, b in bufs.items()} for bufs in sets]
        for buffers in sets:
            assert {r: b.capacity for r, b in buffers.items()} == sizes
        handle = await saver.save("prepared/1", states)
        await handle.acked()
        after = [{r: b._buffer for r, b in bufs.items()} for bufs in sets]
        assert all(a[r] is b[r] for a, b in zip(after, before, strict=True) for r in sizes)
        await restored_boxes(client, "prepared/1", "g", g, split(g.shape, 0, [0, 1024]))
        # A second prepare of the same shapes faults nothing new: same buffers.
        await saver.prepare(states)
        again = [{r: b._buffer for r, b in bufs.items()} for bufs in sets]
        assert all(a[r] is b[r] for a, b in zip(again, after, strict=True) for r in sizes)


# --------------------------------------------------------------------------- failures


def big_state(seed: int, rows: int = 4096) -> tuple[np.ndarray[Any, Any], State]:
    g = np.random.default_rng(seed).standard_normal((rows, 2048)).astype(np.float32)
    boxes = split(g.shape, 0, [0, rows // 3, rows])
    return g, {r: {"g": s, "step": seed} for r, s in enumerate(shards_of(g, boxes))}


async def uploads_reach(client: Client, chunks: int, save: asyncio.Future[Any]) -> None:
    """Return once the save has uploaded ``chunks`` chunks (or ended)."""
    for _ in range(3000):
        if client.stats.chunks_uploaded >= chunks or save.done():
            return
        await asyncio.sleep(0.01)


async def test_node_killed_during_a_save(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    g, states = await asyncio.to_thread(big_state, 11)  # 32 MiB in 256 KiB chunks
    async with client_for(cluster, max_concurrency=4) as client:
        save = asyncio.ensure_future(
            save_checkpoint(client, "kill/1", states, chunk_size=256 << 10)
        )
        await uploads_reach(client, 20, save)
        assert not save.done()  # the kill lands in the middle of the save
        await cluster.kill(3)
        try:
            await save
        except StoragedError as exc:  # allowed: a clear error, and nothing visible
            assert exc.code, exc
            assert [c.name for c in await client.list("kill/")] == []
            return
        # Completed despite the dead node: every byte is back.
        await restored_boxes(client, "kill/1", "g", g, split(g.shape, 0, [0, 1000, 4096]))


async def test_save_that_cannot_complete_is_never_visible(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    _, states = await asyncio.to_thread(big_state, 12, rows=2048)
    policy = RetryPolicy(max_attempts=4, max_delay=0.5, max_retry_after=1.0, deadline=10)
    async with client_for(cluster, max_concurrency=4, retry=policy) as client:
        save = asyncio.ensure_future(
            save_checkpoint(client, "kill/2", states, chunk_size=256 << 10)
        )
        await uploads_reach(client, 10, save)
        assert not save.done()
        # Two of four nodes gone: fewer live nodes than the replication factor.
        await cluster.kill(2)
        await cluster.kill(3)
        with pytest.raises(StoragedError) as failure:
            await save
        assert failure.value.code in ("insufficient_replicas", "connection_failed", "unavailable")
        assert [c.name for c in await client.list("kill/")] == []


async def test_restore_with_nodes_dead(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    g, states = await asyncio.to_thread(big_state, 13, rows=1024)
    async with client_for(cluster) as client:
        await save_checkpoint(client, "dead/1", states, chunk_size=256 << 10)
        # Acked means in RAM on three nodes: losing two of them loses nothing.
        await cluster.kill(0)
        await cluster.kill(1)
        await restored_boxes(client, "dead/1", "g", g, split(g.shape, 0, [0, 500, 1024]))
        await cluster.restart(1)
        await restored_boxes(client, "dead/1", "g", g, split(g.shape, 1, [0, 1000, 2048]))


async def test_full_memory_is_backpressure_not_failure(inproc: InprocFactory) -> None:
    settings = {**CLIENT_SETTINGS, "max_chunk_size": 1 << 20, "memory_capacity": 3 * 2**20}
    cluster = await start_with_shm(inproc, 4, **settings)
    g, states = await asyncio.to_thread(
        big_state, 14, rows=2048
    )  # 16 MiB through 3 MiB of RAM per node
    async with client_for(cluster, max_concurrency=8) as client:
        await save_checkpoint(client, "full/1", states, chunk_size=1 << 20)
        await restored_boxes(client, "full/1", "g", g, split(g.shape, 0, [0, 2048]))


@pytest.mark.parametrize("direct", [False, True], ids=["aiohttp", "direct"])
@pytest.mark.parametrize("tier", ["memory", "cold"])
async def test_restore_spreads_reads_over_the_holders(
    inproc_cluster: InprocCluster, tier: str, direct: bool
) -> None:
    cluster = inproc_cluster
    # Many fetches queued at once behind few request slots must not all pick one holder.
    # From RAM each chunk has its own 3 holders; cold-only, every node holds fragments of
    # every chunk, so the holder lists are identical and any tie bias shows at once (the
    # busiest node served 98 % of a cold restore before 52828fa).
    g = np.arange(48 * 65536, dtype=np.float32).reshape(48, 65536)  # 12 MiB
    g += {"memory": 0.0, "cold": 0.5}[tier]  # distinct chunks: no dedup across the cases
    name = f"spread/{tier}-{'direct' if direct else 'aiohttp'}"
    served: dict[str, int] = {}

    async def on_request(session: Any, ctx: Any, params: aiohttp.TraceRequestStartParams) -> None:
        if params.method == "GET" and "/v1/chunks/" in params.url.path:
            where = f"{params.url.host}:{params.url.port}"
            served[where] = served.get(where, 0) + 1

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request)
    async with client_for(cluster) as writer:
        await save_checkpoint(writer, name, {0: {"g": g}}, chunk_size=256 << 10)
        if tier == "cold":
            await writer.wait(name, "cold", timeout=120)
            for level in ("memory", "nvme"):  # a second variant finds them evicted already
                await writer.evict(name, level, admin_token=ADMIN_TOKEN)
            plan = await writer.plan(name)
            assert plan and all(h.tier == "cold" for hs in plan.values() for h in hs), plan
    dst = np.zeros_like(g)
    # shm=False: the HTTP spreading is the subject (a client on the same host as a holder
    # would read that holder's RAM copies through shared memory instead).
    if direct:  # the client's own session: chunk GETs go the direct way, counted there
        async with client_for(cluster, max_concurrency=4, shm=False) as client:
            await restore_checkpoint(client, name, {"g": dst})
            assert client.direct is not None
            served.update(client.direct.stats.by_addr)
    else:  # a caller's traced session: every request goes through it
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            client = client_for(cluster, max_concurrency=4, shm=False)
            await client.open(session)
            try:
                await restore_checkpoint(client, name, {"g": dst})
            finally:
                await client.close()
    assert dst.tobytes() == g.tobytes()
    total = sum(served.values())
    assert total >= 48, served
    # An even spread over the 4 nodes gives about a quarter each. From RAM each chunk has
    # its own 3 holders drawn by placement, so a node may hold far more of the 48 than
    # another and fairly serve more (up to 45.8 % seen on a loaded machine); a pile-on
    # (98 % before 52828fa) is what this must catch.
    limit = 0.45 if tier == "cold" else 0.55
    assert max(served.values()) <= total * limit, served


async def test_evict_refuses_bad_input_and_unknown_checkpoints(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    async with client_for(cluster) as client:
        with pytest.raises(ValueError, match="tier"):
            await client.evict("spread/memory", "cold", admin_token=ADMIN_TOKEN)
        with pytest.raises(BadName):
            await client.evict("../nope", "memory", admin_token=ADMIN_TOKEN)
        with pytest.raises(CheckpointNotFound):
            await client.evict("evict/never-committed", "memory", admin_token=ADMIN_TOKEN)


class _LosesOneDeleteAnswer:
    """A TCP proxy in front of one node that relays both ways, except the answer to the
    first DELETE it sees: once the node has answered (it carried the delete out), the
    proxy closes the client's connection instead. The lost answer of an applied write."""

    def __init__(self, target: str) -> None:
        url = urlsplit(target)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.deletes_seen = 0
        self.answers_dropped = 0
        self.server: asyncio.Server | None = None
        self.relays: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for relay in self.relays:
            relay.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)

    async def _relay(self, c_in: asyncio.StreamReader, c_out: asyncio.StreamWriter) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        self.relays.add(relay)
        try:
            await self._pump(c_in, c_out)
        except asyncio.CancelledError:
            pass  # the proxy closes: its connections go with it
        finally:
            c_out.transport.abort()

    async def _pump(self, c_in: asyncio.StreamReader, c_out: asyncio.StreamWriter) -> None:
        n_in, n_out = await asyncio.open_connection(self.host, self.port)
        drop = asyncio.Event()

        async def up() -> None:
            while data := await c_in.read(65536):
                if data.startswith(b"DELETE "):
                    self.deletes_seen += 1
                    if self.deletes_seen == 1:
                        drop.set()
                n_out.write(data)
                await n_out.drain()

        async def down() -> None:
            while data := await n_in.read(65536):
                if drop.is_set():
                    self.answers_dropped += 1
                    c_out.transport.abort()  # the node has answered; the client never hears
                    return
                c_out.write(data)
                await c_out.drain()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            n_out.transport.abort()


async def test_a_delete_whose_answer_is_lost_is_not_reported_as_missing(
    inproc_cluster: InprocCluster,
) -> None:
    """A DELETE the node carried out, its answer lost: ``delete()`` returns (the checkpoint
    is gone), not ``CheckpointNotFound``. aiohttp resent such a DELETE unseen; the 404 of
    the resend reached the caller as "no such checkpoint", and the nemesis (etcd soak,
    seed 2027665186) then counted the acknowledged checkpoint as lost once GC freed it."""
    cluster = inproc_cluster
    name = "lost-answer/step-1"
    async with client_for(cluster) as client:
        await save_checkpoint(client, name, {0: {"w": np.arange(4096, dtype=np.int64)}})
    proxy = _LosesOneDeleteAnswer(cluster.urls[0])
    await proxy.start()
    try:
        async with client_for(cluster, shm=False) as client:
            # every node reached through the proxy (a failover finds the real URLs again)
            client._requests.urls = dict.fromkeys(client._requests.urls, proxy.url)
            await client.delete(name)
            assert proxy.answers_dropped == 1, "the proxy lost no answer: nothing was tested"
            with pytest.raises(CheckpointNotFound):
                await client.get_manifest(name)
            with pytest.raises(CheckpointNotFound):
                await client.delete(name)  # a second call of its own: there is none
    finally:
        await proxy.close()
