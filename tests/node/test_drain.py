"""The ``Drain`` built alone, from a ``Local`` on real tiers in a temporary directory and
the cluster view of a one-node membership (never started: nothing is sent anywhere): a
RAM copy becomes a durable nvme file and is then clean, the owner's encoder is handed
the chunk; a chunk collected meanwhile, or already on disk, is not written (again)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storaged.ids import chunk_id_of
from storaged.node.local import Local
from storaged.node.pipeline.drain import Drain
from storaged.node.write import WritePath
from tests.node.alone import services


class Stage:
    def __init__(self, local: Local, drain: Drain, encoded: list[str]) -> None:
        self.local = local
        self.drain = drain
        self.encoded = encoded


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with services(tmp_path) as (local, cluster):
        drained: list[str] = []
        writes = WritePath(local, cluster, to_drain=drained.append)
        encoded: list[str] = []
        yield Stage(local, Drain(local, cluster, writes=writes, to_encode=encoded.append), encoded)


async def _in_ram(local: Local, data: bytes) -> str:
    chunk_id = chunk_id_of(data)
    await local.memory.put(chunk_id, data, verified=True)
    assert local.memory.is_dirty(chunk_id)
    return chunk_id


async def test_a_ram_copy_is_drained_to_a_durable_file_and_handed_to_its_owner(
    stage: Stage,
) -> None:
    data = os.urandom(128 << 10)
    chunk_id = await _in_ram(stage.local, data)
    await stage.drain.drain(chunk_id)
    assert stage.local.nvme_has(chunk_id)
    assert await stage.local.nvme.get(chunk_id) == data
    assert not stage.local.memory.is_dirty(chunk_id)  # clean: evictable now
    assert stage.encoded == [chunk_id]  # this node owns it: the encoder's turn


async def test_a_chunk_collected_meanwhile_is_not_drained(stage: Stage) -> None:
    chunk_id = await _in_ram(stage.local, os.urandom(4096))
    await stage.local.memory.delete(chunk_id)
    await stage.drain.drain(chunk_id)
    assert not stage.local.nvme_has(chunk_id)
    assert stage.encoded == []


async def test_a_copy_already_on_disk_is_only_marked_clean(stage: Stage) -> None:
    """A drain offered twice (a retry, a restart): the file is not written again."""
    data = os.urandom(64 << 10)
    chunk_id = await _in_ram(stage.local, data)
    await stage.local.nvme.put(chunk_id, data)
    path = next((stage.local.config.data_dir / "nvme").rglob(chunk_id))
    written = path.stat().st_ino  # a new write is a new file renamed into place
    await stage.drain.drain(chunk_id)
    assert path.stat().st_ino == written
    assert not stage.local.memory.is_dirty(chunk_id)
    assert stage.encoded == [chunk_id]
