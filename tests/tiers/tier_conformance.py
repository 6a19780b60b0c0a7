"""The conformance suite every tier runs by subclassing ``TierTests``.

A subclass says how to open its tier (``open_tier``), what a valid value is for a key
(``make_value``: a chunk and its id, or a fragment and its fragment key), which keys it
can never hold, and whether values survive a reopen. Everything else is shared: a new
tier gets the whole suite for the price of those few methods.

Every test here also runs under ``no_blocking_io``: file system calls (and large hashes)
made on the event loop's thread fail the test.
"""

from __future__ import annotations

import asyncio
import linecache
import os
import random
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import blake3
import pytest

import tiers
from storaged.ids import chunk_id_of
from tiers.base import (
    ByteRange,
    ChunkNotFound,
    CorruptChunk,
    InvalidKey,
    InvalidRange,
    Tier,
    TierError,
    TierFull,
)

#: hashing up to this much on the loop is allowed (cheaper than a thread hop)
INLINE_HASH_BYTES = 64 * 1024
KiB = 1 << 10
MiB = 1 << 20

_GUARDED_OS_CALLS = (
    "open",
    "read",
    "write",
    "pread",
    "preadv",
    "pwrite",
    "writev",
    "fsync",
    "fdatasync",
    "rename",
    "replace",
    "unlink",
    "mkdir",
    "rmdir",
    "scandir",
    "listdir",
    "stat",
    "fstat",
)


_TIERS_DIR = os.path.dirname(os.path.abspath(tiers.__file__)) + os.sep


# asyncio's debug mode records tracebacks (linecache stats source files) inside any call
# that makes a future: bookkeeping of the test run, not the tier's doing.
_BOOKKEEPING = (traceback.__file__, linecache.__file__)


def _tier_code_on_loop_thread() -> bool:
    """Whether tier code called us on a thread that runs an event loop."""
    if asyncio._get_running_loop() is None:
        return False
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _BOOKKEEPING:
            return False
        if filename.startswith(_TIERS_DIR):
            return True
        frame = frame.f_back
    return False


@contextmanager
def no_blocking_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail on file system calls and large BLAKE3 hashes that tier code makes on the
    event loop's thread (the tests themselves may do as they like).

    Yields the list of offending calls; the caller asserts it is empty (the wrapper also
    raises, but a tier might swallow that).
    """
    offences: list[str] = []

    def guard(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _tier_code_on_loop_thread():
                offences.append(f"os.{name}{args!r:.120}")
                raise AssertionError(f"blocking os.{name} on the event loop thread")
            return real(*args, **kwargs)

        return call

    for name in _GUARDED_OS_CALLS:
        monkeypatch.setattr(os, name, guard(name, getattr(os, name)))
    real_hasher = blake3.blake3

    class GuardedHasher:
        """blake3.blake3 that refuses large inputs on the event loop thread."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._real = real_hasher(*args, **kwargs)

        def update(self, data: Any) -> Any:
            size = memoryview(data).nbytes
            if size > INLINE_HASH_BYTES and _tier_code_on_loop_thread():
                offences.append(f"blake3 of {size} bytes")
                raise AssertionError(f"hashing {size} bytes on the event loop thread")
            return self._real.update(data)

        def hexdigest(self) -> str:
            return str(self._real.hexdigest())

        def digest(self) -> bytes:
            return bytes(self._real.digest())

    monkeypatch.setattr(blake3, "blake3", GuardedHasher)
    try:
        yield offences
    finally:
        monkeypatch.undo()


async def all_keys(tier: Tier) -> list[str]:
    return [key async for key in tier.keys()]  # noqa: SIM118


def random_bytes(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


class TierTests:
    """Shared behaviour of every tier. Subclasses fill in the hooks below."""

    #: values survive ``close`` and a new ``open_tier`` on the same path
    persistent: ClassVar[bool] = False
    #: capacity used by the ``tier`` fixture
    capacity: ClassVar[int] = 64 * MiB

    # --- hooks -------------------------------------------------------------------------

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        raise NotImplementedError

    def make_value(self, rng: random.Random, size: int) -> tuple[str, bytes]:
        """A key and a valid value of about ``size`` bytes for it."""
        data = random_bytes(rng, size)
        return chunk_id_of(data), data

    def bad_keys(self) -> list[str]:
        """Keys this tier can never hold."""
        return ["", "abc", "../" + "0" * 61, "A" * 64, "0" * 63, "0" * 65, "g" * 64]

    def fill_size(self) -> int:
        """Value size for the capacity tests (about a quarter of the fixture's ``capacity``
        divided by 4, so that a 3-value capacity is easy to set)."""
        return 256 * KiB

    # --- fixtures ----------------------------------------------------------------------

    @pytest.fixture
    def rng(self) -> random.Random:
        return random.Random(1234)

    @pytest.fixture(autouse=True)
    def _guard_blocking(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
        with no_blocking_io(monkeypatch) as offences:
            yield
        assert not offences, f"blocking calls on the event loop: {offences}"

    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        tier = await self.open_tier(tmp_path / "tier", self.capacity)
        try:
            yield tier
        finally:
            await tier.close()

    # --- put, get, ranges -------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4095, 4097, 1 * MiB + 3])
    async def test_put_then_get_returns_the_bytes(
        self, tier: Tier, rng: random.Random, size: int
    ) -> None:
        key, value = self.make_value(rng, size)
        await tier.put(key, value)
        got = await tier.get(key)
        assert isinstance(got, memoryview)
        assert bytes(got) == value
        assert (await tier.stat(key)).size == len(value)
        assert await tier.exists(key)

    async def test_put_accepts_bytearray_and_memoryview(
        self, tier: Tier, rng: random.Random
    ) -> None:
        key1, value1 = self.make_value(rng, 10 * KiB)
        key2, value2 = self.make_value(rng, 100 * KiB)
        await tier.put(key1, bytearray(value1))
        await tier.put(key2, memoryview(value2))
        assert bytes(await tier.get(key1)) == value1
        assert bytes(await tier.get(key2)) == value2

    async def test_get_byte_ranges_have_exclusive_end(self, tier: Tier, rng: random.Random) -> None:
        key, value = self.make_value(rng, 100 * KiB)
        await tier.put(key, value)
        n = len(value)
        for start, end in [(0, None), (0, 1), (5, 17), (n - 1, None), (n, None), (3, 3), (0, n)]:
            got = await tier.get(key, ByteRange(start, end))
            assert bytes(got) == value[start:end], (start, end)

    @pytest.mark.parametrize("start,end", [(-1, None), (5, 4), (0, "n+1"), ("n+1", None)])
    async def test_bad_ranges_raise_invalid_range(
        self, tier: Tier, rng: random.Random, start: int | str, end: int | str | None
    ) -> None:
        key, value = self.make_value(rng, 4 * KiB)
        await tier.put(key, value)
        n = len(value)
        s = n + 1 if start == "n+1" else start
        e = n + 1 if end == "n+1" else end
        assert isinstance(s, int) and (e is None or isinstance(e, int))
        with pytest.raises(InvalidRange):
            await tier.get(key, ByteRange(s, e))
        with pytest.raises(ValueError):  # InvalidRange is a ValueError too
            await tier.get(key, ByteRange(s, e))
        assert bytes(await tier.get(key)) == value  # still there, unharmed

    async def test_get_result_stays_valid_after_delete_and_reuse(
        self, tier: Tier, rng: random.Random
    ) -> None:
        key, value = self.make_value(rng, 512 * KiB)
        await tier.put(key, value)
        got = await tier.get(key)
        part = await tier.get(key, ByteRange(100, 200))
        await tier.delete(key)
        for _ in range(4):  # churn: buffers freed above may be reused now
            other_key, other = self.make_value(rng, 512 * KiB)
            await tier.put(other_key, other)
            await tier.delete(other_key)
        assert bytes(got) == value
        assert bytes(part) == value[100:200]

    # --- missing keys, bad keys, bad values -------------------------------------------

    async def test_missing_key_raises_chunk_not_found_which_is_a_key_error(
        self, tier: Tier, rng: random.Random
    ) -> None:
        key, _ = self.make_value(rng, 10)
        for op in (tier.get(key), tier.stat(key), tier.get(key, ByteRange(0, 1))):
            with pytest.raises(ChunkNotFound) as info:
                await op
            assert isinstance(info.value, KeyError)
            assert info.value.key == key
        assert not await tier.exists(key)

    async def test_bad_keys_are_rejected_and_nothing_changes(
        self, tier: Tier, rng: random.Random
    ) -> None:
        _, value = self.make_value(rng, 100)
        for bad in self.bad_keys():
            with pytest.raises(InvalidKey):
                await tier.put(bad, value)
            with pytest.raises(ValueError):
                await tier.get(bad)
            with pytest.raises(InvalidKey):
                await tier.delete(bad)
        assert tier.usage().count == 0
        assert await all_keys(tier) == []

    async def test_corrupt_input_is_rejected_and_nothing_is_stored(
        self, tier: Tier, rng: random.Random
    ) -> None:
        key, value = self.make_value(rng, 200 * KiB)
        other_key, other_value = self.make_value(rng, 200 * KiB)
        flipped = bytearray(value)
        flipped[len(flipped) // 2] ^= 0x01
        for bad in (bytes(flipped), value[:-1], value + b"\0", other_value, b""):
            with pytest.raises(CorruptChunk) as info:
                await tier.put(key, bad)
            assert info.value.key == key
            assert not await tier.exists(key)
        assert tier.usage().count == 0
        assert tier.usage().used == 0
        await tier.put(other_key, other_value)  # the tier still works
        assert bytes(await tier.get(other_key)) == other_value

    async def test_corrupt_input_for_a_held_key_is_still_rejected(
        self, tier: Tier, rng: random.Random
    ) -> None:
        key, value = self.make_value(rng, 50 * KiB)
        await tier.put(key, value)
        with pytest.raises(CorruptChunk):
            await tier.put(key, value[:-1])
        assert bytes(await tier.get(key)) == value

    # --- stat, exists, delete, keys, usage ---------------------------------------------

    async def test_delete_is_idempotent(self, tier: Tier, rng: random.Random) -> None:
        key, value = self.make_value(rng, 10 * KiB)
        await tier.delete(key)  # never held: fine
        await tier.put(key, value)
        await tier.delete(key)
        await tier.delete(key)
        assert not await tier.exists(key)
        with pytest.raises(ChunkNotFound):
            await tier.get(key)
        await tier.put(key, value)  # and it can come back
        assert bytes(await tier.get(key)) == value

    async def test_put_of_a_held_key_is_a_no_op(self, tier: Tier, rng: random.Random) -> None:
        key, value = self.make_value(rng, 10 * KiB)
        await tier.put(key, value)
        before = tier.usage()
        await tier.put(key, value)
        await tier.put(key, bytearray(value))
        assert tier.usage() == before
        assert await all_keys(tier) == [key]

    async def test_keys_and_usage_track_what_is_held(self, tier: Tier, rng: random.Random) -> None:
        values = dict(self.make_value(rng, rng.randrange(0, 300 * KiB)) for _ in range(12))
        await asyncio.gather(*(tier.put(k, v) for k, v in values.items()))
        assert sorted(await all_keys(tier)) == sorted(values)
        usage = tier.usage()
        assert usage.count == len(values)
        assert usage.capacity == self.capacity
        assert sum(map(len, values.values())) <= usage.used <= usage.capacity
        for k, v in values.items():
            assert (await tier.stat(k)).size == len(v)
        doomed = sorted(values)[:5]
        await asyncio.gather(*(tier.delete(k) for k in doomed))
        for k in doomed:
            del values[k]
        assert sorted(await all_keys(tier)) == sorted(values)
        assert tier.usage().count == len(values)
        await asyncio.gather(*(tier.delete(k) for k in list(values)))
        assert tier.usage().count == 0
        assert tier.usage().used == 0

    async def test_concurrent_puts_of_the_same_and_different_keys(
        self, tier: Tier, rng: random.Random
    ) -> None:
        values = [self.make_value(rng, 64 * KiB + i) for i in range(6)]
        await asyncio.gather(*(tier.put(k, v) for k, v in values * 3))
        assert tier.usage().count == len(values)
        for k, v in values:
            assert bytes(await tier.get(k)) == v

    # --- capacity ----------------------------------------------------------------------

    async def test_full_tier_raises_tier_full_and_stores_nothing_partial(
        self, tmp_path: Path, rng: random.Random
    ) -> None:
        size = self.fill_size()
        probe_key, probe = self.make_value(rng, size)
        tier = await self.open_tier(tmp_path / "small", self.capacity_for(3, len(probe)))
        try:
            stored: dict[str, bytes] = {}
            with pytest.raises(TierFull):
                for _ in range(10):
                    key, value = self.make_value(rng, size)
                    await tier.put(key, value)
                    stored[key] = value
            assert len(stored) == 3
            bad_key, bad = self.make_value(rng, size)
            with pytest.raises(CorruptChunk):  # bad input is reported as such, full or not
                await tier.put(bad_key, bad[:-1])
            usage = tier.usage()
            assert usage.count == 3 and usage.used <= usage.capacity
            assert sorted(await all_keys(tier)) == sorted(stored)
            for k, v in stored.items():
                assert bytes(await tier.get(k)) == v
            await tier.delete(next(iter(stored)))
            await tier.put(probe_key, probe)  # room again
            assert bytes(await tier.get(probe_key)) == probe
        finally:
            await tier.close()

    def capacity_for(self, count: int, value_size: int) -> int:
        """A capacity that holds exactly ``count`` values of ``value_size`` bytes."""
        return count * value_size + value_size // 2

    # --- lifecycle ---------------------------------------------------------------------

    async def test_reopen_keeps_every_value(self, tmp_path: Path, rng: random.Random) -> None:
        if not self.persistent:
            pytest.skip(f"{type(self).__name__}: values do not outlive the process")
        path = tmp_path / "persist"
        tier = await self.open_tier(path, self.capacity)
        values = dict(self.make_value(rng, rng.randrange(0, 200 * KiB)) for _ in range(8))
        for k, v in values.items():
            await tier.put(k, v)
        gone = next(iter(values))
        await tier.delete(gone)
        del values[gone]
        before = tier.usage()
        await tier.close()
        tier = await self.open_tier(path, self.capacity)
        try:
            assert tier.usage() == before
            assert sorted(await all_keys(tier)) == sorted(values)
            for k, v in values.items():
                assert bytes(await tier.get(k)) == v
            assert not await tier.exists(gone)
        finally:
            await tier.close()

    async def test_closed_tier_refuses_work(self, tmp_path: Path, rng: random.Random) -> None:
        tier = await self.open_tier(tmp_path / "closing", self.capacity)
        key, value = self.make_value(rng, 1000)
        await tier.put(key, value)
        await tier.close()
        await tier.close()  # idempotent
        with pytest.raises(TierError):
            await tier.put(key, value)
        with pytest.raises(TierError):
            await tier.get(key)
