"""ColdTier: the conformance suite (values are erasure fragments), then fragment specifics."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from erasure import HEADER_SIZE as FRAGMENT_HEADER_SIZE
from erasure import Fragment, build_fragment, fragment_key, make_codec, parse_fragment
from storaged.ids import chunk_id_of
from tests.tiers.tier_conformance import KiB, TierTests, all_keys
from tiers._durable import HEADER_SIZE, QUARANTINE
from tiers.base import CorruptChunk, InvalidKey, Tier
from tiers.cold import ColdTier


def fragment(
    rng: random.Random, size: int, index: int = 0, chunk_id: str | None = None
) -> Fragment:
    payload = rng.randbytes(size)
    cid = chunk_id or chunk_id_of(payload)
    return build_fragment(
        codec="zfec", k=2, n=4, index=index, length=2 * size, chunk_id=cid, payload=payload
    )


class TestColdTierConformance(TierTests):
    persistent = True

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        return await ColdTier.open(path, capacity)

    def make_value(self, rng: random.Random, size: int) -> tuple[str, bytes]:
        frag = fragment(rng, max(0, size - FRAGMENT_HEADER_SIZE), index=rng.randrange(4))
        return fragment_key(frag.chunk_id, frag.index), frag.to_bytes()

    def bad_keys(self) -> list[str]:
        cid = "0" * 64
        return [
            *super().bad_keys(),
            cid,  # a chunk id without an index
            f"{cid}.",
            f"{cid}.01",
            f"{cid}.256",
            f"{cid}.-1",
            f"{cid}.1.2",
            f"{'0' * 63}.1",
        ]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(5)


@pytest.fixture
async def cold(tmp_path: Path) -> AsyncIterator[ColdTier]:
    tier = await ColdTier.open(tmp_path / "cold", 1 << 30)
    yield tier
    await tier.close()


def path_of(tier: ColdTier, key: str) -> Path:
    return tier.root / key[:2] / key[2:4] / key


async def test_put_parts_writes_header_and_payload_without_joining(
    cold: ColdTier, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    frag = fragment(rng, 300 * KiB, index=3)
    key = fragment_key(frag.chunk_id, 3)
    calls: list[list[Any]] = []
    real = os.writev

    def spy(fd: int, buffers: list[Any]) -> int:
        calls.append(list(buffers))
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", spy)
    await cold.put_parts(key, frag.parts())
    monkeypatch.undo()
    assert len(calls[0]) == 3  # file header, fragment header, fragment payload
    assert memoryview(calls[0][2]).obj is frag.payload.obj
    got = await cold.get(key)
    parsed = parse_fragment(got)
    assert (parsed.chunk_id, parsed.index) == (frag.chunk_id, 3)
    assert bytes(got) == frag.to_bytes()
    assert path_of(cold, key).stat().st_size == HEADER_SIZE + frag.nbytes


@pytest.mark.parametrize("cuts", [[], [10], [80], [79, 81], [0, 40, 80, 1000], [5000]])
async def test_put_parts_checks_fragments_split_anywhere(
    cold: ColdTier, rng: random.Random, cuts: list[int]
) -> None:
    frag = fragment(rng, 10 * KiB, index=1)
    key = fragment_key(frag.chunk_id, 1)
    whole = frag.to_bytes()
    bounds = [0, *cuts, len(whole)]
    parts = [memoryview(whole)[a:b] for a, b in itertools.pairwise(bounds)]
    bad = bytearray(whole)
    bad[-1] ^= 1
    bad_parts = [memoryview(bad)[a:b] for a, b in itertools.pairwise(bounds)]
    with pytest.raises(CorruptChunk):
        await cold.put_parts(key, bad_parts)
    with pytest.raises(CorruptChunk):
        await cold.put_parts(key, parts[:-1] if len(parts) > 1 else [whole[:-1]])
    assert not cold.has(key)
    await cold.put_parts(key, parts)
    assert bytes(await cold.get(key)) == whole


async def test_a_fragment_must_name_the_chunk_and_index_of_its_key(
    cold: ColdTier, rng: random.Random
) -> None:
    frag = fragment(rng, 1000, index=2)
    other_chunk = "ab" * 32
    for key in (fragment_key(frag.chunk_id, 1), fragment_key(other_chunk, 2)):
        with pytest.raises(CorruptChunk):
            await cold.put(key, frag.to_bytes())
        with pytest.raises(CorruptChunk):
            await cold.put_parts(key, frag.parts())
    assert cold.usage().count == 0


async def test_keys_for_lists_the_fragments_of_a_chunk(cold: ColdTier, rng: random.Random) -> None:
    data = rng.randbytes(100 * KiB)
    cid = chunk_id_of(data)
    codec = make_codec("zfec", 3, 5)
    frags = await codec.encode_async(cid, data)
    assert await cold.put_fragment(frags[4]) == fragment_key(cid, 4)
    await cold.put_parts(fragment_key(cid, 0), frags[0].parts())
    await cold.put(fragment_key(cid, 2), frags[2].to_bytes())
    other = fragment(rng, 100)
    await cold.put_fragment(other, verified=True)
    assert cold.keys_for(cid) == [0, 2, 4]
    assert cold.keys_for("cd" * 32) == []
    assert sorted(cold.chunk_ids()) == sorted([cid, other.chunk_id])
    got = {i: await cold.get(fragment_key(cid, i)) for i in cold.keys_for(cid)}
    assert await codec.decode_async(cid, got) == data  # any k = 3 of them rebuild it
    await cold.delete(fragment_key(cid, 2))
    assert cold.keys_for(cid) == [0, 4]
    with pytest.raises(KeyError):
        await cold.get(fragment_key(cid, 1))
    with pytest.raises(InvalidKey):
        await cold.get(cid)  # a chunk id is not a fragment key


async def test_stored_fragments_are_rebuilt_from_after_reopen(
    tmp_path: Path, rng: random.Random
) -> None:
    data = rng.randbytes(300 * KiB + 7)
    cid = chunk_id_of(data)
    codec = make_codec("zfec", 2, 4)
    frags = await codec.encode_async(cid, data)
    tier = await ColdTier.open(tmp_path / "c", 1 << 30)
    for f in frags:
        await tier.put_fragment(f)
    await tier.close()
    tier = await ColdTier.open(tmp_path / "c", 1 << 30)
    try:
        assert tier.keys_for(cid) == [0, 1, 2, 3]
        picked = {i: await tier.get(fragment_key(cid, i)) for i in (1, 3)}
        assert await codec.decode_async(cid, picked) == data
    finally:
        await tier.close()


@pytest.mark.parametrize("offset", [0, HEADER_SIZE + 3, HEADER_SIZE + 79, -1])
async def test_a_corrupt_fragment_file_is_quarantined(
    cold: ColdTier, rng: random.Random, offset: int
) -> None:
    frag = fragment(rng, 20 * KiB, index=0)
    key = fragment_key(frag.chunk_id, 0)
    await cold.put_parts(key, frag.parts())
    path = path_of(cold, key)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(raw)
    with pytest.raises(CorruptChunk):
        await cold.get(key)
    assert not cold.has(key) and cold.keys_for(frag.chunk_id) == []
    assert len(list((cold.root / QUARANTINE).iterdir())) == 1
    assert await all_keys(cold) == []
