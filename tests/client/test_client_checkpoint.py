"""Saving and restoring sharded state against real nodes: the save protocol (upload, then
one commit), the async saver's staging, and restore into any layout.

The nodes are in-process (real nodes serving HTTP and the peer protocol on 127.0.0.1 in
the test's event loop, ``tests/service/inproc.py``), a cluster of 4 per test:
``inproc_cluster`` for the plain cases, ``fragile`` (short GC grace) for the tests that
kill nodes or wait for GC. Failures are real ones: dead nodes (stopped with ``kill``, as
SIGKILL stops a process), a name already taken, a manifest naming chunks never
uploaded, chunks the cluster garbage-collected between the upload and the commit; every
test that kills nodes restarts them before it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import numpy as np
import pytest

from storaged.client.checkpoint import (
    AsyncSaver,
    Shard,
    StagingBuffer,
    commit_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    save_shard,
    stage_shard,
)
from storaged.client.client import Client, CommitResult
from storaged.client.errors import (
    CheckpointNotFound,
    ChunkNotFound,
    Exists,
    MissingChunks,
    Unavailable,
)
from storaged.client.layout import (
    KeyNotSaved,
    Manifest,
    RegionNotCovered,
    ShardEntry,
    ShardGap,
    ShardOverlap,
)
from storaged.client.retry import RetryPolicy
from storaged.ids import chunk_id_of
from tests.client.helpers import CLIENT_SETTINGS, client_for, client_sees_all_alive
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster, InprocFactory, start_with_shm

pytestmark = pytest.mark.timeout(120)

#: GC grace of the ``fragile`` cluster: uncommitted chunks older than this are collected.
FRAGILE_GC_GRACE = 2.0


@pytest.fixture
async def fragile(inproc: InprocFactory) -> InprocCluster:
    """4 in-process nodes whose GC collects uncommitted chunks after ``FRAGILE_GC_GRACE``
    s, for the tests that kill nodes (they restart them) or wait for the collector."""
    return await start_with_shm(
        inproc, 4, **CLIENT_SETTINGS, gc_grace=FRAGILE_GC_GRACE, commit_window=FRAGILE_GC_GRACE
    )


async def all_alive(client: Client, cluster: InprocCluster) -> None:
    """Until every node sees every other alive, and so does the client's view."""
    await every_node_sees_all_alive(cluster)
    await client_sees_all_alive(client)


@asynccontextmanager
async def nodes_down(cluster: InprocCluster, indexes: Sequence[int]) -> AsyncIterator[None]:
    """Kill these nodes (``kill``: as SIGKILL); restart them on the way out."""
    for i in indexes:
        await cluster.kill(i)
    try:
        yield
    finally:
        await restart_dead(cluster, indexes)


async def restart_dead(cluster: InprocCluster, indexes: Sequence[int]) -> None:
    """Restart those of ``indexes`` that are dead; return once every node sees all alive."""
    for i in indexes:
        if i not in cluster.running():
            await cluster.start_node(i)
    await every_node_sees_all_alive(cluster)


async def every_node_sees_all_alive(cluster: InprocCluster) -> None:
    """Until each node's membership has every running node alive (after a start or a restart
    the views differ for a moment, and a PUT counts the live nodes its receiver sees)."""
    await cluster.wait_converged(30.0)


def row_split(g: np.ndarray[Any, Any], bounds: list[int], axis: int = 0) -> list[Shard]:
    shards = []
    for lo, hi in itertools.pairwise(bounds):
        index = [slice(None)] * g.ndim
        index[axis] = slice(lo, hi)
        offsets = [0] * g.ndim
        offsets[axis] = lo
        shards.append(Shard(g[tuple(index)], g.shape, tuple(offsets)))
    return shards


def model(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {
        "emb": rng.standard_normal((300, 64)).astype(np.float32),
        "w": rng.standard_normal((64, 48)).astype(np.float64),
        "b": np.arange(48, dtype=np.int16),
    }


def states_of(m: dict[str, np.ndarray[Any, Any]], ranks: int) -> dict[int, dict[str, Any]]:
    """``ranks`` uneven row splits of emb, column splits of w, b replicated, plus values."""
    emb_bounds = [0, *sorted({(300 * i * i) // (ranks * ranks) for i in range(1, ranks)}), 300]
    w_bounds = [0, *[48 * i // ranks + i % 2 for i in range(1, ranks)], 48]
    emb = row_split(m["emb"], emb_bounds)
    w = row_split(m["w"], w_bounds, axis=1)
    return {
        r: {"emb": emb[r], "w": w[r], "b": m["b"], "step": 100, "cfg": {"lr": 0.1, "r": r}}
        for r in range(ranks)
    }


def chunk_ids_of(manifest: Mapping[str, Any]) -> set[str]:
    return {c for shard in manifest["shards"] for c, _ in shard["chunks"]}


async def names(client: Client, prefix: str) -> list[str]:
    return [c.name for c in await client.list(prefix)]


async def restore_on(
    client: Client, name: str, m: dict[str, np.ndarray[Any, Any]], ranks: int
) -> None:
    """Restore on ``ranks`` ranks with another uneven split, strided destinations included."""
    for r in range(ranks):
        lo, hi = 300 * r // ranks, 300 * (r + 1) // ranks + (r == 0)
        hi = min(hi, 300)
        emb = np.zeros((hi - lo, 64), np.float32)
        w_full = np.zeros((64, 96))
        w = w_full[:, ::2]  # a non-contiguous destination
        values = await restore_checkpoint(
            client,
            name,
            {
                "emb": Shard(emb, (300, 64), (lo, 0)),
                "w": w,
                "b": None,
                "step": None,
            },
            max_tile=4096,
        )
        assert np.array_equal(emb, m["emb"][lo:hi])
        assert np.array_equal(w, m["w"])
        assert np.array_equal(values["b"], m["b"]) and values["step"] == 100


# --------------------------------------------------------------------------- the plain cases


@pytest.mark.parametrize(
    ("saved_on", "restored_on"),
    [(1, 3), pytest.param(3, 2, marks=pytest.mark.quick), (4, 4), (5, 1)],
)
async def test_save_n_restore_m(
    inproc_cluster: InprocCluster, saved_on: int, restored_on: int
) -> None:
    name = f"nm/{saved_on}-to-{restored_on}"
    m = model()
    async with client_for(inproc_cluster) as client:
        result = await save_checkpoint(
            client, name, states_of(m, saved_on), meta={"step": 100}, chunk_size=4096
        )
        manifest = await client.get_manifest(name)
        ids = chunk_ids_of(manifest)
        assert result.created and result.chunks == len(ids)
        plan = await client.plan(name)
        assert set(plan) == ids and all(plan.values())  # every chunk has a holder
        await restore_on(client, name, m, restored_on)
        everything = await restore_checkpoint(client, name)
        assert set(everything) == {"emb", "w", "b", "step", "cfg"}
        assert everything["cfg"] == {"lr": 0.1, "r": 0}  # the lowest rank's value
        assert np.array_equal(everything["emb"], m["emb"])


async def test_ranks_in_separate_processes_hand_over_msgpack_entries(
    inproc_cluster: InprocCluster,
) -> None:
    m = model(1)
    states = states_of(m, 3)
    async with client_for(inproc_cluster) as client:
        # Each "process" uploads its shard and ships its entry as bytes to the coordinator.
        wire = [
            await save_shard(client, rank, state, chunk_size=2048) for rank, state in states.items()
        ]
        gathered = [msgpack.unpackb(msgpack.packb(entry)) for entry in reversed(wire)]
        # Nothing is visible before the coordinator commits, though every chunk is held.
        assert await names(client, "handover/") == []
        with pytest.raises(CheckpointNotFound):
            await client.get_manifest("handover/step-1")
        ids = [c for entry in wire for c, _ in entry["chunks"]]
        assert await client.missing_chunks(ids) == []
        await commit_checkpoint(client, "handover/step-1", gathered, meta={"world": 3})
        assert (await client.get_manifest("handover/step-1"))["meta"] == {"world": 3}
        await restore_on(client, "handover/step-1", m, 2)


async def test_unchanged_state_uploads_only_what_changed(inproc_cluster: InprocCluster) -> None:
    m = model(3)
    async with client_for(inproc_cluster) as client:
        await save_checkpoint(client, "changed/step-1", states_of(m, 2), chunk_size=4096)
        first = client.stats.bytes_uploaded
        assert first > 0
        await save_checkpoint(client, "changed/step-2", states_of(m, 2), chunk_size=4096)
        assert client.stats.bytes_uploaded == first  # every chunk was already held
        m["w"][0, 0] += 1.0  # one element of one array changes
        states = states_of(m, 2)
        states[0]["step"] = 300
        await save_checkpoint(client, "changed/step-3", states, chunk_size=4096)
        changed = client.stats.bytes_uploaded - first
        assert 0 < changed <= 2 * 4096 + 4096  # w's one chunk, rank 0's packed small items
        restored = await restore_checkpoint(client, "changed/step-3", {"w": None})
        assert restored["w"][0, 0] == m["w"][0, 0]


async def test_checkpoints_are_immutable(inproc_cluster: InprocCluster) -> None:
    m = model(4)
    async with client_for(inproc_cluster) as client:
        await save_checkpoint(client, "immutable/x", states_of(m, 1))
        with pytest.raises(Exists):
            await save_checkpoint(client, "immutable/x", states_of(model(5), 1))
        await restore_on(client, "immutable/x", m, 1)


async def test_commit_of_chunks_never_uploaded_is_refused(inproc_cluster: InprocCluster) -> None:
    # A shard entry made here but never uploaded: its chunk is unknown to the cluster.
    data = np.random.default_rng(99).integers(0, 1 << 30, 1000)
    staged = await asyncio.to_thread(stage_shard, 0, {"x": data})
    entry = staged.entry([chunk_id_of(c) for c in staged.chunks])
    async with client_for(inproc_cluster) as client:
        with pytest.raises(MissingChunks) as info:
            await commit_checkpoint(client, "missing/m", [entry])
        assert info.value.missing == [chunk_id_of(staged.chunks[0])]
        assert await names(client, "missing/") == []


async def test_restore_errors_before_any_read(inproc_cluster: InprocCluster) -> None:
    g = np.zeros((10, 4), np.float32)
    async with client_for(inproc_cluster) as client:
        # Half of g, committed as a foreign client may (this one refuses gaps at save time).
        entry = await save_shard(client, 0, {"g": Shard(g[:5], (10, 4), (0, 0))})
        partial = Manifest(time.time(), {}, (ShardEntry.from_wire(entry),))
        await client.commit("early/e", partial.to_wire())
        client.stats.reset()
        with pytest.raises(KeyNotSaved):
            await restore_checkpoint(client, "early/e", {"h": np.zeros(3)})
        with pytest.raises(RegionNotCovered):
            await restore_checkpoint(client, "early/e", {"g": np.zeros((10, 4), np.float32)})
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros((10, 4), np.float32)
            ro.flags.writeable = False
            await restore_checkpoint(client, "early/e", {"g": Shard(ro[:5], (10, 4), (0, 0))})
        assert client.stats.chunks_downloaded == 0 and client.stats.bytes_downloaded == 0
        # The same client does read once the request is valid.
        out = np.ones((5, 4), np.float32)
        await restore_checkpoint(client, "early/e", {"g": Shard(out, (10, 4), (0, 0))})
        assert client.stats.chunks_downloaded > 0 and not out.any()


async def test_async_save_without_commit_yields_entries_for_a_coordinator(
    inproc_cluster: InprocCluster,
) -> None:
    m = model(10)
    async with client_for(inproc_cluster) as client:
        async with AsyncSaver(client) as saver:
            handle = await saver.save("coord/c", states_of(m, 2), commit=False)
            result = await handle.acked()
            assert result.commit is None and sorted(result.shards) == [0, 1]
            assert await names(client, "coord/") == []
            with pytest.raises(RuntimeError):
                await handle.durable()
        await commit_checkpoint(client, "coord/c", list(result.shards.values()))
        await restore_on(client, "coord/c", m, 2)


async def test_gaps_and_overlaps_are_refused_before_any_upload(
    inproc_cluster: InprocCluster,
) -> None:
    g = np.arange(40, dtype=np.float32).reshape(10, 4)
    gap = {0: {"g": Shard(g[:4], (10, 4), (0, 0))}, 1: {"g": Shard(g[5:], (10, 4), (5, 0))}}
    overlap = {0: {"g": Shard(g[:6], (10, 4), (0, 0))}, 1: {"g": Shard(g[5:], (10, 4), (5, 0))}}
    async with client_for(inproc_cluster) as client:
        with pytest.raises(ShardGap, match=r"g: gap at element \[4, 0\]") as missing:
            await save_checkpoint(client, "tiling/sync", gap)
        assert [rank for rank, _ in missing.value.boxes] == [0, 1]
        assert client.stats.chunks_uploaded == client.stats.chunks_skipped == 0
        saver = AsyncSaver(client, buffers=1)
        try:
            with pytest.raises(ShardOverlap, match=r"element \[5, 0\]: rank 0") as twice:
                await saver.save("tiling/async", overlap)
            assert twice.value.key == "g"
            assert client.stats.chunks_uploaded == client.stats.chunks_skipped == 0
            # Without commit the coordinator finds out, before its one request.
            handle = await saver.save("tiling/entries", gap, commit=False)
            entries = list((await handle.acked()).shards.values())
            with pytest.raises(ShardGap):
                await commit_checkpoint(client, "tiling/entries", entries)
            # The refused save gave its staging buffers back.
            whole = {
                0: {"g": Shard(g[:5], (10, 4), (0, 0))},
                1: {"g": Shard(g[5:], (10, 4), (5, 0))},
            }
            handle = await asyncio.wait_for(saver.save("tiling/whole", whole), 60)
            assert (await handle.acked()).commit is not None
        finally:
            await saver.aclose()
        assert await names(client, "tiling/") == ["tiling/whole"]
        restored = await restore_checkpoint(client, "tiling/whole")
        assert np.array_equal(restored["g"], g)


# --------------------------------------------------------------------------- real failures


async def test_failed_saves_commit_nothing_and_the_saver_recovers(fragile: InprocCluster) -> None:
    m = model(2)
    states = states_of(m, 3)
    # Give up fast: the point is the failure, not the patience.
    quick = RetryPolicy(max_attempts=3, max_delay=0.1, max_retry_after=0.1, deadline=10)
    async with client_for(fragile, retry=quick) as client:
        await all_alive(client, fragile)
        saver = AsyncSaver(client, chunk_size=4096, buffers=1)
        async with nodes_down(fragile, [2, 3]):  # fewer live nodes than the replication
            with pytest.raises(Unavailable):
                await save_checkpoint(client, "failed/sync", states, chunk_size=4096)
            handle = await saver.save("failed/async", states)
            with pytest.raises(Unavailable):
                await handle.acked()
            assert await names(client, "failed/") == []
        await all_alive(client, fragile)
        await save_checkpoint(client, "failed/sync", states, chunk_size=4096)
        # The failed save gave its only staging buffer back: this one is not stuck behind it.
        handle = await asyncio.wait_for(saver.save("failed/async", states), 30)
        assert (await handle.acked()).commit is not None
        await saver.aclose()
        assert await names(client, "failed/") == ["failed/async", "failed/sync"]
        await restore_on(client, "failed/sync", m, 1)
        await restore_on(client, "failed/async", m, 2)


async def test_async_save_returns_after_staging_and_ignores_later_mutation(
    fragile: InprocCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Observe (not replace) the staging buffers: which memory each save packs into.
    pointers: list[int] = []
    reserve = StagingBuffer.reserve

    def recording(self: StagingBuffer, size: int) -> Any:
        view = reserve(self, size)
        pointers.append(view.__array_interface__["data"][0])
        return view

    monkeypatch.setattr(StagingBuffer, "reserve", recording)
    m = model(7)
    originals = {k: v.copy() for k, v in m.items()}
    # Patient enough to outlast the dead nodes below.
    patient = RetryPolicy(max_attempts=10_000, max_delay=0.2, max_retry_after=0.2, deadline=90)
    async with client_for(fragile, retry=patient) as client:
        await all_alive(client, fragile)
        saver = AsyncSaver(client, chunk_size=4096, buffers=1)
        try:
            # Two of four nodes down: no chunk can be acknowledged until they are back,
            # so the saves below are certainly still uploading when the test looks.
            async with nodes_down(fragile, [2, 3]):
                handle = await saver.save("mutated/1", states_of(m, 2), meta={"step": 7})
                assert handle.staged_bytes > 0 and handle.stall_seconds >= 0
                for array in m.values():  # the training loop moves on
                    array[...] = 0
                second = asyncio.ensure_future(saver.save("mutated/2", states_of(m, 2)))
                await asyncio.sleep(0.5)
                assert not handle.done() and await names(client, "mutated/") == []
                assert not second.done()  # the only staging buffer is still uploading
            result = await asyncio.wait_for(handle.acked(), 60)
            assert result.commit is not None and result.commit.created
            assert sorted(result.shards) == [0, 1]
            status = await handle.durable("nvme", timeout=60)
            assert status.nvme == status.chunks > 0
            later = await asyncio.wait_for(second, 60)
            assert (await later.acked()).commit is not None
        finally:
            await saver.aclose()
        # Both saves packed into the same memory, and each kept the values it was given.
        assert len(pointers) == 4 and set(pointers[:2]) == set(pointers[2:])
        await restore_on(client, "mutated/1", originals, 3)
        zeros = await restore_checkpoint(client, "mutated/2")
        assert not zeros["emb"].any() and not zeros["w"].any()


class SlowCoordinator(Client):
    """A real client whose first commit comes late: only once the cluster has collected
    (GC, past its grace) every chunk the manifest names, as when gathering the ranks'
    entries takes longer than the grace. Its server answers are left as they are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[MissingChunks] = []
        self._late = True

    async def _held(self, chunk_id: str) -> bool:
        try:
            await self.head_chunk(chunk_id)
        except ChunkNotFound:
            return False
        return True

    async def commit(self, name: str, manifest: Mapping[str, Any]) -> CommitResult:
        if self._late:
            self._late = False
            ids = sorted(chunk_ids_of(manifest))
            # HEAD, not /missing: a /missing answer is a use of what it reports held (the
            # client relies on it), and would keep the chunks for another grace period.
            for _ in range(600):
                if not [c for c in ids if await self._held(c)]:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the cluster kept chunks no checkpoint names")
        try:
            return await super().commit(name, manifest)
        except MissingChunks as exc:
            self.refused.append(exc)
            raise


async def test_commit_resends_chunks_the_cluster_lost(fragile: InprocCluster) -> None:
    m = model(6)
    states = states_of(m, 2)
    for state in states.values():
        state["tag"] = "lost"  # no chunk in common with another test's checkpoint
    client = SlowCoordinator(fragile.urls, token=TOKEN)
    async with client:
        await all_alive(client, fragile)
        result = await save_checkpoint(client, "lost/1", states, chunk_size=4096)
        assert client.stats.chunks_skipped == 0
        ids = chunk_ids_of(await client.get_manifest("lost/1"))
        # The first commit was refused naming every chunk; each was sent again, then held.
        assert len(client.refused) == 1 and set(client.refused[0].missing) == ids
        assert result.created and client.stats.chunks_uploaded == 2 * len(ids)
        await restore_on(client, "lost/1", m, 3)


# --------------------------------------------------------------- staging buffer ownership

#: Bounded wait of a gated staging thread for the other save's (seconds): long enough for
#: a loaded machine, and the fixed saver only pays it once per test.
GATE_TIMEOUT = 5.0


class GatedCopies:
    """Orders the staging copies of two saves of key ``"x"`` the way the race needs them.

    The first save's copy of ``x`` (values 1) stops before writing and waits until the
    second save (values 2) has copied its ``x``; the second, after copying, waits until the
    first has written. A saver that hands a buffer out while a staging thread still writes
    into it thus ends up with the first save's bytes in the second save's stream. A saver
    that waits for the thread never runs the second copy before the first ends: the first
    then waits ``GATE_TIMEOUT`` in vain and writes alone. Waits are in the staging threads
    (off the event loop) and bounded.
    """

    def __init__(self, copy: Any) -> None:
        self._copy = copy
        self.first_started = threading.Event()
        self.second_copied = threading.Event()
        self.first_written = threading.Event()

    def __call__(self, item: Any, into: np.ndarray[Any, Any]) -> None:
        if item.key != "x":
            self._copy(item, into)
        elif item.source.flat[0] == 1:
            self.first_started.set()
            self.second_copied.wait(GATE_TIMEOUT)
            self._copy(item, into)
            self.first_written.set()
        else:
            self._copy(item, into)
            self.second_copied.set()
            self.first_written.wait(GATE_TIMEOUT)


def filled(value: int) -> dict[str, Any]:
    return {"x": np.full((64, 1024), value, np.float32), "step": value}


@pytest.mark.parametrize("failure", ["cancelled", "other rank fails"])
async def test_failed_save_gives_its_staging_buffer_back_only_after_its_copies_end(
    inproc_cluster: InprocCluster, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    import storaged.client.checkpoint as checkpoint

    gated = GatedCopies(checkpoint._copy_item)
    monkeypatch.setattr(checkpoint, "_copy_item", gated)
    prefix = f"owned-{'cancel' if failure == 'cancelled' else 'rank'}/"
    async with client_for(inproc_cluster) as client:
        saver = AsyncSaver(client, chunk_size=16384, buffers=1)
        try:
            if failure == "cancelled":
                first = asyncio.ensure_future(saver.save(prefix + "1", {0: filled(1)}))
                assert await asyncio.to_thread(gated.first_started.wait, 30)
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
            else:
                # Rank 1 fails in its staging thread while rank 0's copy is under way.
                broken = {0: filled(1), 1: {"bad": object()}}
                with pytest.raises(TypeError):
                    await saver.save(prefix + "1", broken)
                assert gated.first_started.is_set() or await asyncio.to_thread(
                    gated.first_started.wait, 30
                )
            # The next save reuses the (only) staging buffer set.
            handle = await asyncio.wait_for(saver.save(prefix + "2", {0: filled(2)}), 60)
            assert (await asyncio.wait_for(handle.acked(), 60)).commit is not None
        finally:
            await saver.aclose()
        assert await names(client, prefix) == [prefix + "2"]
        restored = await restore_checkpoint(client, prefix + "2")
        assert restored["step"] == 2
        assert np.array_equal(restored["x"], filled(2)["x"]), "bytes of the failed save"


async def test_failed_upload_gives_its_staging_buffer_back_only_after_its_hashing_ends(
    fragile: InprocCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import storaged.client.checkpoint as checkpoint
    import storaged.client.writes as writes
    import storaged.ids as ids

    ones = np.float32(1).tobytes()
    hashing_first = threading.Event()
    second_copied = threading.Event()
    overlapped: list[bool] = []  # per copy of the second save: was the first still hashing?
    gated: list[int] = []  # sizes of the first save's chunks hashed through the gate
    real_hash, real_copy = ids.chunk_id_of, checkpoint._copy_item

    def gated_hash(data: Any) -> str:
        if len(data) <= 64 << 10 or bytes(memoryview(data)[:4]) != ones:
            return real_hash(data)
        gated.append(len(data))
        hashing_first.set()
        second_copied.wait(GATE_TIMEOUT)  # a saver that does not wait lets the copy in now
        try:
            return real_hash(data)
        finally:
            hashing_first.clear()

    def watched_copy(item: Any, into: np.ndarray[Any, Any]) -> None:
        if item.key == "x" and item.source.flat[0] == 2:
            overlapped.append(hashing_first.is_set())
            second_copied.set()
        real_copy(item, into)

    async def gated_hash_async(data: Any) -> str:  # storaged.ids.chunk_id_of_async's rule
        if len(data) <= ids._INLINE_HASH_BYTES:
            return gated_hash(data)
        return await asyncio.to_thread(gated_hash, data)

    # The client's hashing and the saver's own (whichever hashes the staged chunks); not
    # storaged.ids' functions themselves: the nodes, in this process, hash with those.
    monkeypatch.setattr(writes, "chunk_id_of_async", gated_hash_async)
    monkeypatch.setattr(checkpoint, "chunk_id_of", gated_hash)
    monkeypatch.setattr(checkpoint, "_copy_item", watched_copy)
    quick = RetryPolicy(max_attempts=3, max_delay=0.1, max_retry_after=0.1, deadline=10)
    # shm=False: through shared memory the node hashes what it is handed, the client
    # nothing, and the gate is never reached (the test passed testing nothing).
    async with client_for(fragile, retry=quick, shm=False) as client:
        await all_alive(client, fragile)
        saver = AsyncSaver(client, chunk_size=1 << 20, buffers=1)
        try:
            async with nodes_down(fragile, [2, 3]):  # no PUT can be acknowledged
                # Rank 1's one small chunk fails at once; rank 0's is still being hashed.
                first = await saver.save("hashed/1", {0: filled(1), 1: {"step": 1}})
                second = asyncio.ensure_future(saver.save("hashed/2", {0: filled(2)}))
                with pytest.raises(Unavailable):
                    await asyncio.wait_for(first.acked(), 60)
                with pytest.raises(Unavailable):
                    await asyncio.wait_for((await asyncio.wait_for(second, 60)).acked(), 60)
            await all_alive(client, fragile)
            third = await saver.save("hashed/3", {0: filled(3)})
            assert (await asyncio.wait_for(third.acked(), 60)).commit is not None
        finally:
            await saver.aclose()
        assert gated, "the first save's chunk was never hashed through the gate: nothing tested"
        assert overlapped == [False], "the second save copied while the first still hashed"
        assert await names(client, "hashed/") == ["hashed/3"]
        restored = await restore_checkpoint(client, "hashed/3")
        assert np.array_equal(restored["x"], filled(3)["x"])
