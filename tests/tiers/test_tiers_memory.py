"""MemoryTier: the conformance suite, then the buffer pool, eviction, backpressure, leases."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from storaged.ids import chunk_id_of
from tests.tiers.tier_conformance import KiB, MiB, TierTests
from tiers.base import (
    ByteRange,
    ChunkNotFound,
    CorruptChunk,
    InvalidKey,
    InvalidRange,
    Tier,
    TierFull,
)
from tiers.memory import Allocation, MemoryTier, size_class


class TestMemoryTierConformance(TierTests):
    persistent = False

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        return MemoryTier(capacity, put_timeout=0.05)


# --- helpers -------------------------------------------------------------------------------


def chunk(rng: random.Random, size: int) -> tuple[str, bytes]:
    data = rng.randbytes(size)
    return chunk_id_of(data), data


@pytest.fixture
def rng() -> random.Random:
    return random.Random(99)


@pytest.fixture
async def small() -> AsyncIterator[MemoryTier]:
    """Room for exactly four 1 MiB buffers."""
    tier = MemoryTier(4 * MiB, put_timeout=0.05)
    yield tier
    await tier.close()


async def put_allocated(tier: MemoryTier, key: str, data: bytes) -> None:
    buf = await tier.allocate(len(data))
    buf.view[:] = data
    await tier.put(key, buf)


def check_bound(tier: MemoryTier) -> None:
    s = tier.stats()
    assert s.used + s.free_bytes <= s.capacity
    assert s.used >= 0 and s.free_bytes >= 0


# --- size classes ----------------------------------------------------------------------------


def test_size_classes_are_page_multiples_close_above_the_size() -> None:
    assert size_class(0) == 0
    assert size_class(1) == 4096
    assert size_class(4096) == 4096
    assert size_class(8 * MiB) == 8 * MiB
    assert size_class(8 * MiB - 1) == 8 * MiB
    assert size_class(5 * MiB) == 5 * MiB
    for size in [4097, 12345, 100_000, 1 * MiB + 1, 8 * MiB + 1, 123_456_789]:
        c = size_class(size)
        assert c >= size and c % 4096 == 0
        assert c - size < max(4096, size // 8), size
    with pytest.raises(ValueError):
        size_class(-1)


# --- allocate, put by reference, release -------------------------------------------------------


async def test_allocate_gives_exact_writable_prefaulted_buffers_that_are_pooled(
    small: MemoryTier,
) -> None:
    buf = await small.allocate(1 * MiB)
    assert isinstance(buf, Allocation) and buf.outstanding
    assert not buf.view.readonly and buf.view.nbytes == 1 * MiB
    buf.view[:4] = b"abcd"
    assert small.usage().used == 1 * MiB
    small.release(buf)
    assert not buf.outstanding
    assert small.usage().used == 0
    assert small.stats().free_bytes == 1 * MiB
    again = await small.allocate(1 * MiB - 100)  # same class: the pooled buffer comes back
    assert again.view.nbytes == 1 * MiB - 100
    assert small.stats().free_bytes == 0
    assert bytes(again.view[:4]) == b"abcd"  # reused, not re-mapped (and not zeroed)
    small.release(again)


async def test_put_of_an_allocated_buffer_stores_it_by_reference(
    small: MemoryTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 300 * KiB)
    buf = await small.allocate(len(data))
    buf.view[:] = data
    await small.put(key, buf)
    assert small.stats().allocations == 0 and not buf.outstanding
    async with small.lease(key) as view:
        # the stored bytes are the very buffer the caller filled: no copy was made
        assert view.obj is buf.view.obj
        assert view == data
    with pytest.raises(ValueError):
        small.release(buf)  # it belongs to the tier now


async def test_corrupt_allocated_buffer_is_rejected_and_released(
    small: MemoryTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 300 * KiB)
    buf = await small.allocate(len(data))
    buf.view[:] = data
    buf.view[0] ^= 0xFF
    with pytest.raises(CorruptChunk):
        await small.put(key, buf)
    assert not small.has(key)
    s = small.stats()
    assert s.allocations == 0 and s.used == 0 and s.free_bytes == size_class(len(data))
    # the same goes for a bad key: the buffer is taken back whatever the outcome
    buf = await small.allocate(10)
    with pytest.raises(ValueError):
        await small.put("not-a-chunk-id", buf)
    assert small.stats().allocations == 0 and small.usage().used == 0


async def test_verified_put_skips_the_hash(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 100 * KiB)
    buf = await small.allocate(len(data))
    buf.view[:] = data
    buf.view[5] ^= 1  # wrong, but the caller vouches for it: stored as given
    await small.put(key, buf, verified=True)
    assert small.has(key)


async def test_release_twice_is_refused(small: MemoryTier) -> None:
    buf = await small.allocate(100)
    small.release(buf)
    used, free = small.usage().used, small.stats().free_bytes
    with pytest.raises(ValueError):
        small.release(buf)
    # the refusal changed nothing: the buffer is in the pool once, not twice
    assert (small.usage().used, small.stats().free_bytes) == (used, free)
    assert small.stats().free_buffers == 1


async def test_put_after_release_is_refused(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 1000)
    buf = await small.allocate(len(data))
    buf.view[:] = data
    small.release(buf)
    again = await small.allocate(len(data))  # the released buffer, someone else's now
    with pytest.raises(ValueError):
        await small.put(key, buf)
    assert not small.has(key) and again.outstanding
    with pytest.raises(ValueError):
        await small.put_local_copy(key, buf)
    assert not small.has(key)
    small.release(again)


async def test_release_or_put_after_put_is_refused(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 1000)
    buf = await small.allocate(len(data))
    buf.view[:] = data
    await small.put(key, buf)
    with pytest.raises(ValueError):
        small.release(buf)
    with pytest.raises(ValueError):
        await small.put(key, buf)
    assert small.has(key) and bytes(await small.get(key)) == data
    assert small.stats().allocations == 0 and small.usage().used == size_class(len(data))
    # a refused put took the handle over all the same: it cannot be put again either
    other = await small.allocate(10)
    with pytest.raises(InvalidKey):
        await small.put("not-a-chunk-id", other)
    with pytest.raises(ValueError):
        small.release(other)


async def test_a_view_is_no_handle(small: MemoryTier) -> None:
    buf = await small.allocate(100)
    with pytest.raises(ValueError):
        small.release(cast(Any, buf.view))  # the bare view, not its handle
    assert buf.outstanding
    small.release(buf)


async def test_a_foreign_handle_is_refused(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 1000)
    other = MemoryTier(1 * MiB)
    try:
        foreign = await other.allocate(len(data))
        foreign.view[:] = data
        with pytest.raises(ValueError):
            small.release(foreign)
        with pytest.raises(ValueError):
            await small.put(key, foreign)
        assert not small.has(key) and foreign.outstanding
        assert small.usage().used == 0 and other.stats().allocations == 1
        other.release(foreign)  # still its own tier's to give back
        assert other.usage().used == 0
    finally:
        await other.close()


async def test_put_of_a_view_of_an_allocation_copies(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 1000)
    buf = await small.allocate(2000)
    buf.view[:1000] = data
    await small.put(key, buf.view[:1000])  # bytes, not the handle: copied
    assert small.stats().allocations == 1 and buf.outstanding
    small.release(buf)
    assert bytes(await small.get(key)) == data


# --- backpressure and eviction -------------------------------------------------------------------


async def test_allocate_waits_for_room_then_raises_tier_full(small: MemoryTier) -> None:
    held = [await small.allocate(1 * MiB) for _ in range(4)]
    with pytest.raises(TierFull):
        await small.allocate(1 * MiB, timeout=0.05)
    waiter = asyncio.ensure_future(small.allocate(1 * MiB, timeout=5))
    await asyncio.sleep(0.02)
    assert not waiter.done()  # it waits...
    small.release(held.pop())
    buf = await asyncio.wait_for(waiter, 5)  # ...and the release wakes it
    assert buf.view.nbytes == 1 * MiB
    check_bound(small)
    with pytest.raises(TierFull):  # larger than the whole tier: no waiting at all
        await small.allocate(5 * MiB, timeout=60)


async def test_dirty_values_are_never_evicted(small: MemoryTier, rng: random.Random) -> None:
    values = [chunk(rng, 1 * MiB) for _ in range(4)]
    for key, data in values:
        await put_allocated(small, key, data)
    assert sorted(small.dirty_keys()) == sorted(k for k, _ in values)
    with pytest.raises(TierFull):
        await small.allocate(1 * MiB, timeout=0.05)
    extra_key, extra = chunk(rng, 1 * MiB)
    with pytest.raises(TierFull):
        await small.put(extra_key, extra)  # a copying put waits put_timeout, then gives up
    for key, data in values:
        assert bytes(await small.get(key)) == data
    assert not small.has(extra_key)


async def test_mark_clean_wakes_a_waiter_which_evicts_the_clean_value(rng: random.Random) -> None:
    evicted: list[str] = []
    tier = MemoryTier(2 * MiB, put_timeout=5, on_evict=evicted.append)
    try:
        (k1, d1), (k2, d2) = chunk(rng, 1 * MiB), chunk(rng, 1 * MiB)
        await tier.put(k1, d1)
        await tier.put(k2, d2)
        waiter = asyncio.ensure_future(tier.allocate(1 * MiB))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        assert tier.mark_clean(k2) is True
        buf = await asyncio.wait_for(waiter, 5)
        assert evicted == [k2]
        assert not tier.has(k2) and tier.has(k1)
        assert tier.is_dirty(k1)
        with pytest.raises(ChunkNotFound):
            tier.is_dirty(k2)
        assert tier.mark_clean(k2) is False  # gone: nothing to mark
        tier.release(buf)
    finally:
        await tier.close()


async def test_clean_values_are_evicted_least_recently_used_first(rng: random.Random) -> None:
    evicted: list[str] = []
    tier = MemoryTier(3 * MiB, put_timeout=0.05, on_evict=evicted.append)
    try:
        values = [chunk(rng, 1 * MiB) for _ in range(3)]
        for key, data in values:
            await tier.put(key, data)
            tier.mark_clean(key)
        (a, _), (b, _), (c, _) = values
        await tier.get(a)  # a is now the most recently used
        async with tier.lease(b):
            pass  # b after it
        new_key, new = chunk(rng, 1 * MiB)
        await tier.put(new_key, new)
        assert evicted == [c]
        await tier.put(*chunk(rng, 1 * MiB))
        assert evicted == [c, a]
        assert tier.has(b) and tier.has(new_key)
        assert tier.is_dirty(new_key) and not tier.is_dirty(b)
    finally:
        await tier.close()


async def test_no_eviction_when_it_would_not_make_enough_room(rng: random.Random) -> None:
    evicted: list[str] = []
    tier = MemoryTier(3 * MiB, put_timeout=0.05, on_evict=evicted.append)
    try:
        k1, d1 = chunk(rng, 1 * MiB)
        await tier.put(k1, d1)
        tier.mark_clean(k1)
        await tier.put(*chunk(rng, 1 * MiB))  # dirty
        with pytest.raises(TierFull):
            await tier.allocate(2 * MiB + 1)  # even evicting k1 leaves too little room
        assert evicted == [] and tier.has(k1)
    finally:
        await tier.close()


async def test_free_buffers_count_toward_capacity_and_are_trimmed_for_other_sizes(
    small: MemoryTier,
) -> None:
    bufs = [await small.allocate(1 * MiB) for _ in range(4)]
    for b in bufs:
        small.release(b)
    assert small.stats().free_bytes == 4 * MiB
    big = await small.allocate(3 * MiB)  # trims three 1 MiB buffers to map a 3 MiB one
    s = small.stats()
    assert s.used == 3 * MiB and s.free_bytes == 1 * MiB and s.free_buffers == 1
    check_bound(small)
    small.release(big)
    assert small.trim() == 4 * MiB
    assert small.stats().free_bytes == 0


async def test_pool_stays_bounded_under_random_churn(rng: random.Random) -> None:
    tier = MemoryTier(8 * MiB, put_timeout=0.01)
    held: list[Allocation] = []
    try:
        for _ in range(300):
            if held and rng.random() < 0.5:
                tier.release(held.pop(rng.randrange(len(held))))
            else:
                with contextlib.suppress(TierFull):
                    held.append(await tier.allocate(rng.choice([0, 1, 5000, 300 * KiB, 2 * MiB])))
            check_bound(tier)
            assert tier.usage().used == sum(size_class(b.view.nbytes) for b in held)
    finally:
        await tier.close()


async def test_prefault_fills_the_pool_within_capacity(small: MemoryTier) -> None:
    assert await small.prefault(1 * MiB, 10) == 4
    assert small.stats().free_buffers == 4
    bufs = [await small.allocate(1 * MiB) for _ in range(4)]
    assert small.stats().free_buffers == 0
    for b in bufs:
        small.release(b)


# --- leases ------------------------------------------------------------------------------------


async def test_a_lease_keeps_its_bytes_across_delete_and_buffer_reuse(
    rng: random.Random,
) -> None:
    tier = MemoryTier(1 * MiB, put_timeout=0.05)
    try:
        key, data = chunk(rng, 1 * MiB)
        await put_allocated(tier, key, data)
        async with tier.lease(key) as view:
            assert view.readonly
            await tier.delete(key)
            assert not tier.has(key)
            with pytest.raises(ChunkNotFound):
                await tier.get(key)
            # the only buffer of the tier is still under the lease: no room for another
            with pytest.raises(TierFull):
                await tier.allocate(1 * MiB)
            assert view == data
        # lease over: the buffer is back in the pool and is reused
        assert tier.usage().used == 0
        buf = await tier.allocate(1 * MiB)
        buf.view[:] = b"\xee" * (1 * MiB)
        with pytest.raises(ValueError):
            view.tobytes()  # the lease's view was released with the lease
        tier.release(buf)
    finally:
        await tier.close()


async def test_a_waiter_gets_room_when_the_last_lease_on_a_deleted_value_ends(
    rng: random.Random,
) -> None:
    tier = MemoryTier(1 * MiB, put_timeout=5)
    try:
        key, data = chunk(rng, 1 * MiB)
        await tier.put(key, data)
        async with tier.lease(key), tier.lease(key, ByteRange(10, 20)) as part:
            await tier.delete(key)
            waiter = asyncio.ensure_future(tier.allocate(1 * MiB))
            await asyncio.sleep(0.02)
            assert not waiter.done()
            assert part == data[10:20]
        tier.release(await asyncio.wait_for(waiter, 5))
    finally:
        await tier.close()


async def test_leased_clean_values_are_not_evicted(rng: random.Random) -> None:
    evicted: list[str] = []
    tier = MemoryTier(2 * MiB, put_timeout=0.05, on_evict=evicted.append)
    try:
        (k1, d1), (k2, d2) = chunk(rng, 1 * MiB), chunk(rng, 1 * MiB)
        for k, d in ((k1, d1), (k2, d2)):
            await tier.put(k, d)
            tier.mark_clean(k)
        async with tier.lease(k1):  # k1 is older but leased: k2 goes
            buf = await tier.allocate(1 * MiB)
            assert evicted == [k2]
            with pytest.raises(TierFull):
                await tier.allocate(1 * MiB)  # k1 is leased: nothing left to evict
        more = await tier.allocate(1 * MiB)  # lease over: k1 may go now
        assert evicted == [k2, k1]
        tier.release(buf)
        tier.release(more)
    finally:
        await tier.close()


async def test_lease_of_missing_key_or_bad_range(small: MemoryTier, rng: random.Random) -> None:
    key, data = chunk(rng, 100)
    with pytest.raises(ChunkNotFound):
        async with small.lease(key):
            pass
    await small.put(key, data)
    with pytest.raises(InvalidRange):
        async with small.lease(key, ByteRange(50, 101)):
            pass
    assert small.stats().leases == 0
    async with small.lease(key, ByteRange(90, None)) as tail:
        assert tail == data[90:]


# --- dirty bookkeeping and cancellation --------------------------------------------------------


async def test_dirty_keys_are_in_arrival_order_and_delete_clears_them(
    small: MemoryTier, rng: random.Random
) -> None:
    values = [chunk(rng, 1000 + i) for i in range(5)]
    for k, d in values:
        await small.put(k, d)
    assert small.dirty_keys() == [k for k, _ in values]
    small.mark_clean(values[1][0])
    await small.delete(values[3][0])
    assert small.dirty_keys() == [values[i][0] for i in (0, 2, 4)]
    s = small.stats()
    assert s.dirty_count == 3 and s.dirty_bytes == sum(len(values[i][1]) for i in (0, 2, 4))


async def test_cancelled_copying_put_leaves_no_trace(rng: random.Random) -> None:
    tier = MemoryTier(64 * MiB, put_timeout=5)
    try:
        for _ in range(5):
            key, data = chunk(rng, 8 * MiB)
            task = asyncio.ensure_future(tier.put(key, data))
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await tier.delete(key)  # in case the put won the race
        await asyncio.sleep(0.2)  # threads that were copying let go of their buffers
        for _ in range(50):
            if tier.usage().used == 0:
                break
            await asyncio.sleep(0.05)
        assert tier.usage().used == 0 and tier.usage().count == 0
        check_bound(tier)
    finally:
        await tier.close()


async def test_close_fails_waiters(small: MemoryTier) -> None:
    held = [await small.allocate(1 * MiB) for _ in range(4)]
    waiter = asyncio.ensure_future(small.allocate(1 * MiB, timeout=5))
    await asyncio.sleep(0.01)
    await small.close()
    with pytest.raises(Exception) as info:
        await asyncio.wait_for(waiter, 5)
    assert not isinstance(info.value, TimeoutError)
    del held
