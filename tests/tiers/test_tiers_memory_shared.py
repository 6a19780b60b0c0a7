"""The memory tier's shared segments: memfds leased to a co-located client, sealed and
adopted without a copy (``MemoryTier.lease_shared`` / ``seal_shared``)."""

from __future__ import annotations

import mmap
import os

import pytest

from storaged.ids import chunk_id_of
from tiers import ChunkNotFound, TierFull
from tiers.memory import Allocation, MemoryTier, SealRefused, size_class

MiB = 1 << 20


def _fill(fd: int, data: bytes) -> None:
    with mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[:] = data


def _ident(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return fd, st.st_dev, st.st_ino


def _still_open(ident: tuple[int, int, int]) -> bool:
    """Whether that descriptor is open on that file (its number may have been reused)."""
    fd, dev, ino = ident
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


async def test_lease_seal_adopt_and_free_account_every_byte() -> None:
    tier = MemoryTier(16 * MiB)
    data = os.urandom(3 * MiB + 5)
    key = chunk_id_of(data)
    seg = await tier.lease_shared(len(data))
    assert tier.usage().used == size_class(len(data))
    _fill(seg.fd, data)
    allocation = await tier.seal_shared(seg, len(data))
    assert allocation.view.readonly and bytes(allocation.view) == data
    await tier.put(key, allocation, verified=True)
    assert tier.is_shared(key) and tier.usage().used == size_class(len(data))
    async with tier.lease_fd(key) as (fd, size):
        assert size == len(data)
        sealed = _ident(fd)
    async with tier.lease(key) as got:
        assert bytes(got) == data
    await tier.delete(key)
    assert tier.usage().used == 0 and tier.stats().free_bytes == 0  # never pooled
    assert not _still_open(sealed)
    await tier.close()


async def test_seal_refused_while_mapped_writable_and_for_bad_lengths() -> None:
    tier = MemoryTier(8 * MiB)
    seg = await tier.lease_shared(MiB)
    mapping = mmap.mmap(seg.fd, MiB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(SealRefused):
        await tier.seal_shared(seg, MiB)
    mapping.close()
    for length in (0, MiB + 1):
        with pytest.raises(SealRefused):
            await tier.seal_shared(seg, length)
    sealed = await tier.seal_shared(seg, 100)  # a prefix is fine
    assert len(sealed.view) == 100
    tier.release(sealed)
    assert tier.usage().used == 0
    await tier.close()


async def test_release_and_full_tier() -> None:
    tier = MemoryTier(4 * MiB, put_timeout=0.05)
    seg = await tier.lease_shared(3 * MiB)
    first = _ident(seg.fd)
    with pytest.raises(TierFull):
        await tier.lease_shared(2 * MiB)
    with pytest.raises(ValueError):
        await tier.lease_shared(0)
    tier.release_shared(seg)
    tier.release_shared(seg)  # idempotent
    assert tier.usage().used == 0 and not _still_open(first)
    again = _ident((await tier.lease_shared(4 * MiB)).fd)  # the room is back
    await tier.close()
    assert not _still_open(again)
    with pytest.raises(ChunkNotFound):
        async with MemoryTier(MiB).lease_fd("0" * 64):
            pass


async def _sealed(tier: MemoryTier, data: bytes) -> Allocation:
    seg = await tier.lease_shared(len(data))
    _fill(seg.fd, data)
    return await tier.seal_shared(seg, len(data))


async def test_local_copy_serves_reads_and_is_no_held_copy_until_put() -> None:
    """A local copy (``put_local_copy``): readable and shared, but not held, not dirty (never
    drained), evicted first like any clean value; a later ``put`` of the key makes it a
    held, dirty value without another buffer."""
    tier = MemoryTier(16 * MiB)
    data = os.urandom(3 * MiB)
    key = chunk_id_of(data)
    assert await tier.put_local_copy(key, await _sealed(tier, data))
    assert tier.has(key) and not tier.holds(key) and tier.is_local_copy(key)
    assert tier.is_shared(key) and not tier.is_dirty(key) and key not in tier.dirty_keys()
    async with tier.lease(key) as got:
        assert bytes(got) == data
    assert tier.stats().evictable_bytes == size_class(len(data))
    # A second local copy of the same key is refused and its buffer given back.
    used = tier.usage().used
    assert not await tier.put_local_copy(key, await _sealed(tier, data))
    assert tier.usage().used == used
    # The node comes to hold it (a replica's copy arrives): same pages, now dirty and held.
    other = await tier.allocate(len(data))
    other.view[:] = data
    await tier.put(key, other, verified=True)
    assert tier.holds(key) and not tier.is_local_copy(key) and tier.is_dirty(key)
    assert tier.dirty_keys() == [key] and tier.usage().used == used
    assert tier.stats().evictable_bytes == 0
    await tier.close()


async def test_local_copies_make_room_when_needed() -> None:
    tier = MemoryTier(8 * MiB)
    data = os.urandom(4 * MiB)
    key = chunk_id_of(data)
    assert await tier.put_local_copy(key, await _sealed(tier, data))
    # Room for two more 4 MiB values only if the local copy goes.
    for _ in range(2):
        buf = await tier.allocate(4 * MiB, timeout=0)
        buf.view[:] = os.urandom(4 * MiB)
        await tier.put(chunk_id_of(buf.view), buf, verified=True)
    assert not tier.has(key) and not tier.is_local_copy(key)
    with pytest.raises(ChunkNotFound):
        await tier.stat(key)
    await tier.close()
