"""NvmeTier: the conformance suite, then the file format, corruption, errors and cancellation."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest

from storaged.ids import chunk_id_of
from tests.tiers.tier_conformance import KiB, MiB, TierTests, all_keys
from tiers._durable import HEADER_SIZE, MAGIC, QUARANTINE, write_file_durably
from tiers.base import ByteRange, ChunkNotFound, CorruptChunk, Tier, TierError, TierFull
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier


class TestNvmeTierConformance(TierTests):
    persistent = True

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        return await NvmeTier.open(path, capacity)

    def bad_keys(self) -> list[str]:
        return [*super().bad_keys(), "0" * 64 + ".1"]  # a fragment key is not a chunk id


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def rng() -> random.Random:
    return random.Random(7)


@pytest.fixture
async def nvme(tmp_path: Path) -> AsyncIterator[NvmeTier]:
    tier = await NvmeTier.open(tmp_path / "nvme", 1 << 30)
    yield tier
    await tier.close()


def chunk(rng: random.Random, size: int) -> tuple[str, bytes]:
    data = rng.randbytes(size)
    return chunk_id_of(data), data


def path_of(tier: NvmeTier, key: str) -> Path:
    return tier.root / key[:2] / key[2:4] / key


def quarantined(tier: NvmeTier) -> list[str]:
    qdir = tier.root / QUARANTINE
    return sorted(p.name for p in qdir.iterdir()) if qdir.exists() else []


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


# --- the file format ----------------------------------------------------------------------------


async def test_one_file_per_chunk_under_fan_out_dirs_with_a_checked_header(
    nvme: NvmeTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 5000)
    await nvme.put(key, data)
    raw = path_of(nvme, key).read_bytes()
    assert len(raw) == HEADER_SIZE + len(data)
    assert raw[:8] == MAGIC
    _magic, version, kind, index, length, digest, reserved, crc = struct.unpack(
        "<8sHHIQ32sII", raw[:HEADER_SIZE]
    )
    assert (version, kind, index, length, reserved) == (1, 1, 0, len(data), 0)
    assert digest == bytes.fromhex(key)
    assert crc == crc32c.crc32c(raw[:60])
    assert raw[HEADER_SIZE:] == data


async def test_header_and_payload_are_written_with_writev_without_joining(
    nvme: NvmeTier, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, data = chunk(rng, 1 * MiB)
    source = bytearray(data)
    calls: list[list[Any]] = []
    real = os.writev

    def spy(fd: int, buffers: list[Any]) -> int:
        calls.append(list(buffers))
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", spy)
    await nvme.put(key, memoryview(source))
    assert calls, "the tier must write with os.writev"
    first = calls[0]
    assert len(first) == 2 and memoryview(first[0]).nbytes == HEADER_SIZE
    assert memoryview(first[1]).obj is source  # the caller's buffer itself: no copy


# --- corruption on disk -------------------------------------------------------------------------


def flip_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + (len(raw) - HEADER_SIZE) // 2] ^= 0x10
    path.write_bytes(raw)


def flip_magic(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0x01
    path.write_bytes(raw)


def flip_header_length(path: Path) -> None:
    """A consistent header (good CRC) claiming one byte less than the file holds."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", raw, 16)
    struct.pack_into("<Q", raw, 16, length - 1)
    struct.pack_into("<I", raw, 60, crc32c.crc32c(bytes(raw[:60])))
    path.write_bytes(raw)


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)


def extend(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


def cut_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: HEADER_SIZE // 2])


def swap_with_other_chunk(path: Path) -> None:
    """A whole, valid file of another chunk under this chunk's name."""
    other = bytes(reversed(path.read_bytes()[HEADER_SIZE:]))
    other_key = chunk_id_of(other)
    header = bytearray(path.read_bytes()[:HEADER_SIZE])
    header[24:56] = bytes.fromhex(other_key)
    struct.pack_into("<I", header, 60, crc32c.crc32c(bytes(header[:60])))
    path.write_bytes(bytes(header) + other)


def reuse_header_of_other_payload(path: Path) -> None:
    """The right header, a payload of the right length with other bytes."""
    raw = path.read_bytes()
    path.write_bytes(raw[:HEADER_SIZE] + bytes(reversed(raw[HEADER_SIZE:])))


CORRUPTIONS: list[Callable[[Path], None]] = [
    flip_payload,
    flip_magic,
    flip_header_length,
    truncate,
    extend,
    cut_header,
    swap_with_other_chunk,
    reuse_header_of_other_payload,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("how", ["get", "range", "read_into"])
async def test_a_corrupt_file_is_quarantined_and_never_served(
    nvme: NvmeTier, rng: random.Random, corrupt: Callable[[Path], None], how: str
) -> None:
    key, data = chunk(rng, 100 * KiB)
    good_key, good = chunk(rng, 10 * KiB)
    await nvme.put(key, data)
    await nvme.put(good_key, good)
    corrupt(path_of(nvme, key))
    with pytest.raises(CorruptChunk) as info:
        if how == "get":
            await nvme.get(key)
        elif how == "range":
            await nvme.get(key, ByteRange(0, 10))  # a range still checks the whole chunk
        else:
            await nvme.read_into(key, memoryview(bytearray(len(data))))
    assert info.value.key == key
    assert not path_of(nvme, key).exists()
    assert [name.split(".")[0] for name in quarantined(nvme)] == [key]
    assert not nvme.has(key) and not await nvme.exists(key)
    with pytest.raises(ChunkNotFound):
        await nvme.get(key)
    assert nvme.usage().count == 1 and nvme.usage().used == len(good)
    assert bytes(await nvme.get(good_key)) == good
    await nvme.put(key, data)  # the good bytes may be stored again
    assert bytes(await nvme.get(key)) == data


async def test_verified_put_skips_the_check_but_reads_still_catch_it(
    nvme: NvmeTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 10 * KiB)
    await nvme.put(key, data[::-1], verified=True)  # the caller vouched wrongly
    with pytest.raises(CorruptChunk):
        await nvme.get(key)
    assert quarantined(nvme) and not nvme.has(key)


async def test_a_file_shorter_than_a_header_is_quarantined_at_open(
    tmp_path: Path, rng: random.Random
) -> None:
    tier = await NvmeTier.open(tmp_path / "n", 1 << 30)
    key, data = chunk(rng, 1000)
    await tier.put(key, data)
    await tier.close()
    cut_header(path_of(tier, key))
    tier = await NvmeTier.open(tmp_path / "n", 1 << 30)
    try:
        assert not tier.has(key) and len(quarantined(tier)) == 1
    finally:
        await tier.close()


# --- open: index rebuild, temp files, strays, lock ---------------------------------------------


async def test_open_removes_temp_files_and_ignores_strays(
    tmp_path: Path, rng: random.Random
) -> None:
    root = tmp_path / "n"
    tier = await NvmeTier.open(root, 1 << 30)
    key, data = chunk(rng, 1000)
    await tier.put(key, data)
    await tier.close()
    d = path_of(tier, key).parent
    (d / f".{key}.123.0.tmp").write_bytes(b"half a chunk")
    (d / "README").write_text("not a chunk")
    other_key, _ = chunk(rng, 10)
    (d / other_key).write_bytes(b"x" * 100)  # a chunk file in the wrong directory
    (root / "zz").mkdir()  # not a fan-out directory
    tier = await NvmeTier.open(root, 1 << 30)
    try:
        assert tier.removed_temp_files == 1
        assert temp_files(root) == []
        assert await all_keys(tier) == [key]
        assert (d / "README").exists()  # strays are left for a human
    finally:
        await tier.close()


async def test_a_root_is_opened_by_one_tier_at_a_time(tmp_path: Path) -> None:
    tier = await NvmeTier.open(tmp_path / "n", 1 << 30)
    with pytest.raises(TierError):
        await NvmeTier.open(tmp_path / "n", 1 << 30)
    await tier.close()
    again = await NvmeTier.open(tmp_path / "n", 1 << 30)
    await again.close()


async def test_the_constructor_is_not_the_way_in(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        NvmeTier(tmp_path, 1)


# --- disk errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["writev", "fsync"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
async def test_disk_full_on_write_or_fsync_is_tier_full_and_leaves_nothing(
    nvme: NvmeTier,
    rng: random.Random,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
    code: int,
) -> None:
    key, data = chunk(rng, 200 * KiB)
    real = getattr(os, failing)

    def full(*args: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, failing, full)
    with pytest.raises(TierFull):
        await nvme.put(key, data)
    monkeypatch.setattr(os, failing, real)
    assert not nvme.has(key) and nvme.usage().used == 0
    assert temp_files(nvme.root) == []
    assert not path_of(nvme, key).exists()
    await nvme.put(key, data)  # and once there is room again, it works
    assert bytes(await nvme.get(key)) == data


async def test_other_io_errors_propagate_and_leave_nothing(
    nvme: NvmeTier, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, data = chunk(rng, 1000)

    def broken(*args: Any) -> Any:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError) as info:
        await nvme.put(key, data)
    assert info.value.errno == errno.EIO and not isinstance(info.value, TierError)
    monkeypatch.undo()
    assert temp_files(nvme.root) == [] and not nvme.has(key)


async def test_a_failed_directory_fsync_takes_the_file_back(
    nvme: NvmeTier, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, data = chunk(rng, 1000)
    await nvme.put(key, data)
    await nvme.delete(key)  # its fan-out directories exist now: no mkdir on the next put
    real = os.fsync
    file_synced = False

    def fsync(fd: int) -> None:
        nonlocal file_synced
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            assert file_synced, "the directory is synced after the file"
            raise OSError(errno.ENOSPC, "no space")
        file_synced = True
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(TierFull):
        await nvme.put(key, data)
    monkeypatch.undo()
    assert not path_of(nvme, key).exists() and not nvme.has(key)


async def test_capacity_counts_concurrent_writes_in_flight(
    tmp_path: Path, rng: random.Random
) -> None:
    tier = await NvmeTier.open(tmp_path / "n", 3 * MiB)
    try:
        values = [chunk(rng, 1 * MiB) for _ in range(6)]
        results = await asyncio.gather(*(tier.put(k, v) for k, v in values), return_exceptions=True)
        assert sum(r is None for r in results) == 3
        assert all(r is None or isinstance(r, TierFull) for r in results)
        assert tier.usage().count == 3 and tier.usage().used == 3 * MiB
    finally:
        await tier.close()


# --- reads into caller buffers, cancellation -----------------------------------------------------


async def test_read_into_a_memory_tier_buffer_then_store_it_by_reference(
    nvme: NvmeTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 2 * MiB)
    await nvme.put(key, data)
    memory = MemoryTier(8 * MiB)
    try:
        buf = await memory.allocate((await nvme.stat(key)).size)
        await nvme.read_into(key, buf.view)
        await memory.put(key, buf, verified=True)  # read_into checked it
        memory.mark_clean(key)  # it is on disk already
        assert bytes(await memory.get(key)) == data
        with pytest.raises(ValueError):
            await nvme.read_into(key, memoryview(bytearray(10)))
        with pytest.raises(ValueError):
            await nvme.read_into(key, memoryview(bytes(len(data))))  # read-only
    finally:
        await memory.close()


async def test_a_cancelled_put_completes_or_leaves_nothing(
    tmp_path: Path, rng: random.Random
) -> None:
    root = tmp_path / "n"
    tier = await NvmeTier.open(root, 1 << 30)
    values = dict(chunk(rng, 512 * KiB) for _ in range(8))
    tasks = [asyncio.ensure_future(tier.put(k, v)) for k, v in values.items()]
    await asyncio.sleep(0.005)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await tier.close()  # waits for the shielded writes
    for k in values:
        assert tier.has(k) == path_of(tier, k).exists()
    tier = await NvmeTier.open(root, 1 << 30)
    try:
        assert sorted(await all_keys(tier)) == sorted(values)  # shielded: all completed
        for k, v in values.items():
            assert bytes(await tier.get(k)) == v
        assert temp_files(root) == []
    finally:
        await tier.close()


async def test_delete_while_reading_serves_whole_bytes_or_not_found(
    nvme: NvmeTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 4 * MiB)
    await nvme.put(key, data)
    reads = [asyncio.ensure_future(nvme.get(key)) for _ in range(4)]
    await asyncio.sleep(0)
    await nvme.delete(key)
    for r in await asyncio.gather(*reads, return_exceptions=True):
        assert isinstance(r, ChunkNotFound) or bytes(r) == data  # type: ignore[arg-type]
    assert quarantined(nvme) == []


# --- the helper other modules use ----------------------------------------------------------------


def test_write_file_durably_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "manifest"
    write_file_durably(target, b"one")
    write_file_durably(target, [b"tw", memoryview(b"o!")])
    assert target.read_bytes() == b"two!"
    assert list(tmp_path.iterdir()) == [target]
    with pytest.raises(FileNotFoundError):
        write_file_durably(tmp_path / "missing-dir" / "x", b"")


async def test_a_file_removed_behind_the_tiers_back_is_not_found_and_forgotten(
    nvme: NvmeTier, rng: random.Random
) -> None:
    key, data = chunk(rng, 1000)
    await nvme.put(key, data)
    path_of(nvme, key).unlink()
    with pytest.raises(ChunkNotFound):
        await nvme.get(key)
    assert not nvme.has(key) and nvme.usage().count == 0
