"""Saving and restoring sharded state through an in-process store (no cluster): the save
protocol (upload, then one commit), the async saver's staging, and restore into any layout."""

from __future__ import annotations

import asyncio
import itertools
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
)
from storaged.client.client import BytesLike
from storaged.client.errors import Exists, MissingChunks, Unavailable
from storaged.client.layout import KeyNotSaved, RegionNotCovered
from tests.client.memstore import MemoryStore


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


async def restore_on(
    store: MemoryStore, name: str, m: dict[str, np.ndarray[Any, Any]], ranks: int
) -> None:
    """Restore on ``ranks`` ranks with another uneven split, strided destinations included."""
    for r in range(ranks):
        lo, hi = 300 * r // ranks, 300 * (r + 1) // ranks + (r == 0)
        hi = min(hi, 300)
        emb = np.zeros((hi - lo, 64), np.float32)
        w_full = np.zeros((64, 96))
        w = w_full[:, ::2]  # a non-contiguous destination
        values = await restore_checkpoint(
            store,
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


@pytest.mark.parametrize(("saved_on", "restored_on"), [(1, 3), (3, 2), (4, 4), (5, 1)])
async def test_save_n_restore_m(saved_on: int, restored_on: int) -> None:
    store = MemoryStore()
    m = model()
    result = await save_checkpoint(
        store, "job/step-100", states_of(m, saved_on), meta={"step": 100}, chunk_size=4096
    )
    assert result.created and result.chunks == len(store.chunks)
    await restore_on(store, "job/step-100", m, restored_on)
    everything = await restore_checkpoint(store, "job/step-100")
    assert set(everything) == {"emb", "w", "b", "step", "cfg"}
    assert everything["cfg"] == {"lr": 0.1, "r": 0}  # the lowest rank's value
    assert np.array_equal(everything["emb"], m["emb"])


async def test_ranks_in_separate_processes_hand_over_msgpack_entries() -> None:
    store = MemoryStore()
    m = model(1)
    states = states_of(m, 3)
    # Each "process" uploads its shard and ships its entry as bytes to the coordinator.
    wire = [await save_shard(store, rank, state, chunk_size=2048) for rank, state in states.items()]
    gathered = [msgpack.unpackb(msgpack.packb(entry)) for entry in reversed(wire)]
    assert not store.manifests  # nothing visible before the coordinator commits
    await commit_checkpoint(store, "job/step-1", gathered, meta={"world": 3})
    assert (await store.get_manifest("job/step-1"))["meta"] == {"world": 3}
    await restore_on(store, "job/step-1", m, 2)


async def test_a_failed_rank_leaves_no_checkpoint() -> None:
    store = MemoryStore()
    m = model(2)
    states = states_of(m, 3)
    calls = 0

    def fail_third_upload(_: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Unavailable(message="node died", status=503)

    store.on_put = fail_third_upload
    with pytest.raises(Unavailable):
        await save_checkpoint(store, "job/step-2", states, chunk_size=4096)
    assert not store.manifests
    store.on_put = None
    await save_checkpoint(store, "job/step-2", states, chunk_size=4096)
    await restore_on(store, "job/step-2", m, 1)


async def test_unchanged_state_uploads_only_what_changed() -> None:
    store = MemoryStore()
    m = model(3)
    await save_checkpoint(store, "job/step-1", states_of(m, 2), chunk_size=4096)
    first = store.put_bytes
    await save_checkpoint(store, "job/step-2", states_of(m, 2), chunk_size=4096)
    assert store.put_bytes == first  # every chunk was already held
    m["w"][0, 0] += 1.0  # one element of one array changes
    states = states_of(m, 2)
    states[0]["step"] = 300
    await save_checkpoint(store, "job/step-3", states, chunk_size=4096)
    changed = store.put_bytes - first
    assert 0 < changed <= 2 * 4096 + 4096  # w's one chunk, rank 0's packed small items
    assert (await restore_checkpoint(store, "job/step-3", {"w": None}))["w"][0, 0] == m["w"][0, 0]


async def test_checkpoints_are_immutable() -> None:
    store = MemoryStore()
    m = model(4)
    await save_checkpoint(store, "job/x", states_of(m, 1))
    with pytest.raises(Exists):
        await save_checkpoint(store, "job/x", states_of(model(5), 1))
    await restore_on(store, "job/x", m, 1)


class ForgetfulStore(MemoryStore):
    """Loses one chunk right after acknowledging it (as if collected before the commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.forgotten = False

    async def put_chunks(self, chunks: Any, chunk_ids: Any = None) -> list[str]:
        ids = await super().put_chunks(chunks, chunk_ids)
        if not self.forgotten and ids:
            del self.chunks[ids[-1]]
            self.forgotten = True
        return ids


async def test_commit_resends_chunks_the_cluster_lost() -> None:
    store = ForgetfulStore()
    m = model(6)
    await save_checkpoint(store, "job/lost", states_of(m, 2), chunk_size=4096)
    assert store.forgotten
    await restore_on(store, "job/lost", m, 3)


async def test_commit_of_missing_chunks_from_elsewhere_is_refused() -> None:
    store = MemoryStore()
    entry = await save_shard(store, 0, {"x": np.arange(10)})
    store.chunks.clear()
    with pytest.raises(MissingChunks) as info:
        await commit_checkpoint(store, "job/m", [entry])
    assert len(info.value.missing) == 1 and not store.manifests


async def test_restore_errors_before_any_read() -> None:
    store = MemoryStore()
    g = np.zeros((10, 4), np.float32)
    await save_checkpoint(store, "job/e", {0: {"g": Shard(g[:5], (10, 4), (0, 0))}})
    store.gets.clear()
    with pytest.raises(KeyNotSaved):
        await restore_checkpoint(store, "job/e", {"h": np.zeros(3)})
    with pytest.raises(RegionNotCovered):
        await restore_checkpoint(store, "job/e", {"g": np.zeros((10, 4), np.float32)})
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((10, 4), np.float32)
        ro.flags.writeable = False
        await restore_checkpoint(store, "job/e", {"g": Shard(ro[:5], (10, 4), (0, 0))})
    assert store.gets == []


# --------------------------------------------------------------------------- async saver


class GatedStore(MemoryStore):
    """Uploads wait for ``gate``: the test decides when the network is done."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str:
        await self.gate.wait()
        return await super().put_chunk(data, chunk_id)


async def test_async_save_returns_after_staging_and_ignores_later_mutation() -> None:
    store = GatedStore()
    m = model(7)
    originals = {k: v.copy() for k, v in m.items()}
    async with AsyncSaver(store, chunk_size=4096) as saver:
        handle = await saver.save("job/async", states_of(m, 2), meta={"step": 7})
        assert handle.staged_bytes > 0 and handle.stall_seconds >= 0
        for array in m.values():  # the training loop moves on
            array[...] = 0
        await asyncio.sleep(0.01)
        assert not handle.done() and not store.manifests  # still uploading
        store.gate.set()
        result = await handle.acked()
        assert result.commit is not None and result.commit.created
        assert sorted(result.shards) == [0, 1]
        status = await handle.durable("cold", timeout=5)
        assert status.state == "cold"
    await restore_on(store, "job/async", originals, 3)


async def test_async_saver_reuses_staging_and_applies_backpressure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pointers: list[int] = []
    reserve = StagingBuffer.reserve

    def recording(self: StagingBuffer, size: int) -> Any:
        view = reserve(self, size)
        pointers.append(view.__array_interface__["data"][0])
        return view

    monkeypatch.setattr(StagingBuffer, "reserve", recording)
    store = GatedStore()
    m = model(8)
    saver = AsyncSaver(store, chunk_size=4096, buffers=1)
    first = await saver.save("job/s1", {0: m})
    second = asyncio.ensure_future(saver.save("job/s2", {0: m}))
    await asyncio.sleep(0.01)
    assert not second.done()  # the only staging buffer is still uploading
    store.gate.set()
    await first.acked()
    handle = await second
    await handle.acked()
    await saver.aclose()
    assert len(pointers) == 2 and pointers[0] == pointers[1]


async def test_failed_async_save_commits_nothing_and_frees_its_buffers() -> None:
    store = MemoryStore()
    m = model(9)

    def refuse(_: str) -> None:
        raise Unavailable(message="cluster down", status=503)

    store.on_put = refuse
    saver = AsyncSaver(store, chunk_size=4096)
    handle = await saver.save("job/f", states_of(m, 2))
    with pytest.raises(Unavailable):
        await handle.acked()
    assert not store.manifests
    store.on_put = None
    handle = await saver.save("job/f", states_of(m, 2))  # the buffers came back
    await handle.acked()
    await saver.aclose()
    await restore_on(store, "job/f", m, 1)


async def test_async_save_without_commit_yields_entries_for_a_coordinator() -> None:
    store = MemoryStore()
    m = model(10)
    async with AsyncSaver(store) as saver:
        handle = await saver.save("job/c", states_of(m, 2), commit=False)
        result = await handle.acked()
        assert result.commit is None and not store.manifests
        with pytest.raises(RuntimeError):
            await handle.durable()
    await commit_checkpoint(store, "job/c", list(result.shards.values()))
    await restore_on(store, "job/c", m, 2)
