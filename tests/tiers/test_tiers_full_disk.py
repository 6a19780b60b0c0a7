"""A really full disk: nvme and cold tiers on a small tmpfs that the test mounts.

Skipped, with the reason, when not root or when the mount fails (e.g. in an unprivileged
container).
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from erasure import build_fragment, fragment_key
from storaged.ids import chunk_id_of
from tiers._durable import DurableTier
from tiers.base import TierFull
from tiers.cold import ColdTier
from tiers.nvme import NvmeTier

MiB = 1 << 20
DISK_BYTES = 6 * MiB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def chunk_value(rng: random.Random, size: int) -> tuple[str, bytes]:
    data = rng.randbytes(size)
    return chunk_id_of(data), data


def fragment_value(rng: random.Random, size: int) -> tuple[str, bytes]:
    payload = rng.randbytes(size - 80)
    frag = build_fragment(
        codec="zfec", k=2, n=3, index=1, length=size, chunk_id=chunk_id_of(payload), payload=payload
    )
    return fragment_key(frag.chunk_id, frag.index), frag.to_bytes()


KINDS: list[tuple[type[DurableTier], Callable[[random.Random, int], tuple[str, bytes]]]] = [
    (NvmeTier, chunk_value),
    (ColdTier, fragment_value),
]


@pytest.mark.parametrize("tier_cls,make", KINDS, ids=["nvme", "cold"])
async def test_full_disk_is_tier_full_leaves_nothing_half_written_and_recovers(
    small_disk: Path,
    tier_cls: type[DurableTier],
    make: Callable[[random.Random, int], tuple[str, bytes]],
) -> None:
    rng = random.Random(3)
    root = small_disk / "store"
    tier = await tier_cls.open(root, 1 << 40)  # the disk, not the capacity, is the limit
    stored: dict[str, bytes] = {}
    try:
        with pytest.raises(TierFull):
            for _ in range(20):
                key, value = make(rng, 1 * MiB + 12345)  # the last write fails part-way
                await tier.put(key, value)
                stored[key] = value
        assert 2 <= len(stored) < 6
        failed_key, failed_value = key, value
        assert not tier.has(failed_key)
        assert not list(root.rglob("*.tmp")), "the temp file of the failed write is gone"
        assert {p.name for p in root.glob("??/??/*")} == set(stored)
        assert tier.usage().count == len(stored)
        for k, v in stored.items():
            assert bytes(await tier.get(k)) == v
        # Room again after a delete: the write that failed now succeeds.
        gone = next(iter(stored))
        await tier.delete(gone)
        del stored[gone]
        await tier.put(failed_key, failed_value)
        stored[failed_key] = failed_value
    finally:
        await tier.close()
    tier = await tier_cls.open(root, 1 << 40)
    try:
        assert sorted([k async for k in tier.keys()]) == sorted(stored)  # noqa: SIM118
        for k, v in stored.items():
            assert bytes(await tier.get(k)) == v
        assert tier.removed_temp_files == 0
    finally:
        await tier.close()
