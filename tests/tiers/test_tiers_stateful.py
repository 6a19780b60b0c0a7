"""Hypothesis state machines: the memory and nvme tiers against a plain dict.

The memory model is exact: evictions are reported through ``on_evict``, so every value
the model holds must be readable, only clean values may ever be evicted, and ``TierFull``
may only happen when the dirty values and outstanding allocations leave no room.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from storaged.ids import chunk_id_of
from tiers.base import ByteRange, ChunkNotFound, CorruptChunk, TierFull
from tiers.memory import Allocation, MemoryTier, size_class
from tiers.nvme import NvmeTier

KiB = 1 << 10

_rng = random.Random(11)
# A fixed pool of values, so that the same key comes up again (duplicate puts, re-puts).
VALUES: list[bytes] = [
    _rng.randbytes(n) for n in (0, 1, 100, 4096, 5000, 9 * KiB, 17 * KiB, 30 * KiB)
]
VALUES += [_rng.randbytes(12 * KiB) for _ in range(4)]
KEYS = [chunk_id_of(v) for v in VALUES]
BY_KEY = dict(zip(KEYS, VALUES, strict=True))

value_index = st.integers(0, len(VALUES) - 1)
SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class MemoryTierMachine(RuleBasedStateMachine):
    CAPACITY = 64 * KiB

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.evicted: list[str] = []
        self.tier = MemoryTier(self.CAPACITY, put_timeout=0, on_evict=self.evicted.append)
        self.model: dict[str, bytes] = {}
        self.dirty: set[str] = set()
        self.held: list[Allocation] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.tier.close())
        self.loop.close()

    def no_room_for(self, size: int) -> bool:
        pinned = sum(size_class(len(self.model[k])) for k in self.dirty)
        pinned += sum(size_class(b.view.nbytes) for b in self.held)
        return pinned + size_class(size) > self.CAPACITY

    def settle_evictions(self) -> None:
        for key in self.evicted:
            assert key in self.model and key not in self.dirty, "only clean values are evicted"
            del self.model[key]
        self.evicted.clear()

    def stored(self, key: str) -> None:
        if key not in self.model:
            self.model[key] = BY_KEY[key]
            self.dirty.add(key)

    @rule(i=value_index, by_reference=st.booleans())
    def put(self, i: int, by_reference: bool) -> None:
        key, value = KEYS[i], VALUES[i]
        already = key in self.model
        if by_reference:
            try:
                buf = self.run(self.tier.allocate(len(value)))
            except TierFull:
                assert self.no_room_for(len(value))
                self.settle_evictions()
                return
            buf.view[:] = value
            self.settle_evictions()
            self.run(self.tier.put(key, buf))
        else:
            try:
                self.run(self.tier.put(key, value))
            except TierFull:
                assert not already and self.no_room_for(len(value))
                self.settle_evictions()
                return
            self.settle_evictions()
        self.stored(key)

    @rule(i=value_index)
    def put_corrupt(self, i: int) -> None:
        key, value = KEYS[i], VALUES[i]
        bad = bytes(value[:-1]) if value else b"x"
        before = self.tier.has(key)
        try:
            self.run(self.tier.put(key, bad))
            raise AssertionError("corrupt data was accepted")
        except CorruptChunk:
            pass
        self.settle_evictions()
        assert self.tier.has(key) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        value = self.model[key]
        start = data.draw(st.integers(0, len(value)))
        end = data.draw(st.integers(start, len(value)))
        assert bytes(self.run(self.tier.get(key, ByteRange(start, end)))) == value[start:end]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        delete_under_lease = data.draw(st.booleans())

        async def read() -> bytes:
            async with self.tier.lease(key) as view:
                if delete_under_lease:
                    await self.tier.delete(key)
                return bytes(view)

        assert self.run(read()) == self.model[key]
        if not self.tier.has(key):
            del self.model[key]
            self.dirty.discard(key)

    @rule(i=value_index)
    def delete(self, i: int) -> None:
        self.run(self.tier.delete(KEYS[i]))
        self.model.pop(KEYS[i], None)
        self.dirty.discard(KEYS[i])

    @rule(i=value_index)
    def mark_clean(self, i: int) -> None:
        assert self.tier.mark_clean(KEYS[i]) == (KEYS[i] in self.model)
        self.dirty.discard(KEYS[i])

    @rule(size=st.sampled_from([0, 1, 4096, 20 * KiB, 40 * KiB]))
    def hold_allocation(self, size: int) -> None:
        try:
            self.held.append(self.run(self.tier.allocate(size)))
        except TierFull:
            assert self.no_room_for(size)
        self.settle_evictions()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_allocation(self, data: st.DataObject) -> None:
        self.tier.release(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @invariant()
    def matches_the_model(self) -> None:
        assert not self.evicted
        assert sorted(self.run(_keys(self.tier))) == sorted(self.model)
        assert set(self.tier.dirty_keys()) == self.dirty
        stats = self.tier.stats()
        assert stats.used == sum(size_class(len(v)) for v in self.model.values()) + sum(
            size_class(b.view.nbytes) for b in self.held
        )
        assert stats.used + stats.free_bytes <= self.CAPACITY
        assert stats.leases == 0


class NvmeTierMachine(RuleBasedStateMachine):
    CAPACITY = 60 * KiB

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="nvme-machine-"))
        self.tier = self.run(NvmeTier.open(self.dir, self.CAPACITY))
        self.model: dict[str, bytes] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.tier.close())
        self.loop.close()
        shutil.rmtree(self.dir)

    @rule(i=value_index)
    def put(self, i: int) -> None:
        key, value = KEYS[i], VALUES[i]
        used = sum(map(len, self.model.values()))
        try:
            self.run(self.tier.put(key, value))
        except TierFull:
            assert key not in self.model and used + len(value) > self.CAPACITY
            return
        self.model[key] = value

    @rule(i=value_index)
    def put_corrupt(self, i: int) -> None:
        key, value = KEYS[i], VALUES[i]
        try:
            self.run(self.tier.put(key, value + b"!"))
            raise AssertionError("corrupt data was accepted")
        except CorruptChunk:
            pass

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        value = self.model[key]
        start = data.draw(st.integers(0, len(value)))
        assert bytes(self.run(self.tier.get(key, ByteRange(start)))) == value[start:]

    @rule(i=value_index)
    def get_missing_or_held(self, i: int) -> None:
        try:
            got = bytes(self.run(self.tier.get(KEYS[i])))
        except ChunkNotFound:
            assert KEYS[i] not in self.model
        else:
            assert got == self.model[KEYS[i]]

    @rule(i=value_index)
    def delete(self, i: int) -> None:
        self.run(self.tier.delete(KEYS[i]))
        self.model.pop(KEYS[i], None)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def rot_a_byte_on_disk(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if v)))
        path = self.dir / key[:2] / key[2:4] / key
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x80
        path.write_bytes(raw)
        try:
            self.run(self.tier.get(key))
            raise AssertionError("a rotten file was served")
        except CorruptChunk:
            pass
        del self.model[key]

    @rule()
    def reopen(self) -> None:
        self.run(self.tier.close())
        self.tier = self.run(NvmeTier.open(self.dir, self.CAPACITY))

    @invariant()
    def matches_the_model(self) -> None:
        assert sorted(self.run(_keys(self.tier))) == sorted(self.model)
        usage = self.tier.usage()
        assert usage.used == sum(map(len, self.model.values())) <= self.CAPACITY
        assert usage.count == len(self.model)


async def _keys(tier: MemoryTier | NvmeTier) -> list[str]:
    return [k async for k in tier.keys()]  # noqa: SIM118


TestMemoryTierMachine = MemoryTierMachine.TestCase
TestMemoryTierMachine.settings = SETTINGS
TestNvmeTierMachine = NvmeTierMachine.TestCase
TestNvmeTierMachine.settings = settings(SETTINGS, max_examples=15)
