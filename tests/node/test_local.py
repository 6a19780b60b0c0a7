"""The node's local services built alone, from real tiers in a temporary directory: no
``Node``, no network. ``Local`` rebuilds its index from the disks; the ``Scrubber``, built
from a ``Local`` only, forgets the fragments it finds damaged or gone."""

from __future__ import annotations

import os
from pathlib import Path

from storaged.ids import chunk_id_of
from storaged.node.index import NVME
from storaged.node.pipeline.scrub import Scrubber
from tests.node.alone import close_local, open_local


def _flip_last_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


async def test_the_index_is_rebuilt_from_the_disks_and_damaged_fragments_are_quarantined(
    tmp_path: Path,
) -> None:
    local = await open_local(tmp_path)
    data = os.urandom(256 << 10)
    chunk_id = chunk_id_of(data)
    await local.nvme.put(chunk_id, data)
    fragments = await local.codec.encode_async(chunk_id, data)
    keys = [await local.cold.put_fragment(f) for f in fragments]
    await close_local(local)
    _flip_last_byte(next((tmp_path / "cold").rglob(keys[1])))

    local = await open_local(tmp_path)
    try:
        await local.rebuild_index()
        assert local.index[chunk_id].state == NVME
        assert local.index[chunk_id].size == len(data)
        assert local.fragments == {chunk_id: {0, 2}}  # the damaged one is not advertised
        assert local.nvme_has(chunk_id) and local.holds_hot(chunk_id)
        assert not local.memory_has(chunk_id) and not local.is_cold(chunk_id)
    finally:
        await close_local(local)


async def test_scrub_forgets_fragments_damaged_or_gone_since_they_were_indexed(
    tmp_path: Path,
) -> None:
    local = await open_local(tmp_path)
    try:
        data = os.urandom(256 << 10)
        chunk_id = chunk_id_of(data)
        fragments = await local.codec.encode_async(chunk_id, data)
        keys = [await local.cold.put_fragment(f) for f in fragments]
        local.fragments[chunk_id] = {0, 1, 2}
        _flip_last_byte(next((tmp_path / "cold").rglob(keys[0])))
        next((tmp_path / "cold").rglob(keys[2])).unlink()  # behind the tier's back

        await Scrubber(local).scrub_pass()
        assert local.fragments == {chunk_id: {1}}
        corrupt = local.metrics.registry.get_sample_value(
            "storaged_corrupt_total", {"tier": "cold"}
        )
        assert corrupt == 1
    finally:
        await close_local(local)
