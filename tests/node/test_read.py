"""The ``ReadPath`` built alone from a ``Local`` on real tiers and a one-node cluster view:
the fastest local tier serves, byte ranges slice, and a copy or fragment that fails its
check is quarantined and reads as absent (never served)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storaged.ids import chunk_id_of
from storaged.node.read import ReadPath
from tests.node.alone import services
from tiers import ByteRange, ChunkNotFound


def _flip_last_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


async def test_ram_first_then_nvme_and_ranges(tmp_path: Path) -> None:
    async with services(tmp_path) as (local, cluster):
        reads = ReadPath(local, cluster)
        data = os.urandom(64 << 10)
        chunk_id = chunk_id_of(data)
        assert await reads.read_hot(chunk_id) == (None, "")
        await local.nvme.put(chunk_id, data)
        got, tier = await reads.read_hot(chunk_id, ByteRange(10, 20))
        assert (bytes(got or b""), tier) == (data[10:20], "nvme")
        await local.memory.put(chunk_id, data, verified=True)
        got, tier = await reads.read_hot(chunk_id)
        assert (bytes(got or b""), tier) == (data, "memory")
        async with reads.local_copy(chunk_id) as copy:
            assert copy is not None and bytes(copy) == data


async def test_a_damaged_nvme_copy_is_quarantined_and_not_served(tmp_path: Path) -> None:
    async with services(tmp_path) as (local, cluster):
        reads = ReadPath(local, cluster)
        data = os.urandom(64 << 10)
        chunk_id = chunk_id_of(data)
        await local.nvme.put(chunk_id, data)
        _flip_last_byte(next((tmp_path / "nvme").rglob(chunk_id)))
        assert await reads.read_hot(chunk_id) == (None, "")
        assert not local.nvme_has(chunk_id)
        async with reads.local_copy(chunk_id) as copy:
            assert copy is None
        corrupt = local.metrics.registry.get_sample_value(
            "storaged_corrupt_total", {"tier": "nvme"}
        )
        assert corrupt == 1


async def test_a_damaged_fragment_is_forgotten_and_reads_as_absent(tmp_path: Path) -> None:
    async with services(tmp_path) as (local, cluster):
        reads = ReadPath(local, cluster)
        data = os.urandom(64 << 10)
        chunk_id = chunk_id_of(data)
        fragments = await local.codec.encode_async(chunk_id, data)
        keys = [await local.cold.put_fragment(f) for f in fragments]
        local.fragments[chunk_id] = {0, 1, 2}
        assert bytes(await reads.local_fragment(chunk_id, 0)) == fragments[0].to_bytes()
        _flip_last_byte(next((tmp_path / "cold").rglob(keys[1])))
        with pytest.raises(ChunkNotFound):
            await reads.local_fragment(chunk_id, 1)
        assert local.fragments[chunk_id] == {0, 2}
