"""A real full disk (issue 17): a node's nvme and cold tiers on small tmpfs mounts, filled to
the last page, so the drain and the fragment stores meet ENOSPC from the filesystem (the
configured capacities are far larger). The cluster says so at once and by name: PUTs are
refused with 507 ``nvme_full`` naming the node long before the RAM wait, ``storaged save
--wait nvme|cold`` fails with the cause, ``storaged nodes`` marks the tier; once space is
freed, saves succeed again and nothing acknowledged was lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from storaged.ids import chunk_id_of
from storaged.tools.local_cluster import ClusterError, LocalCluster, free_port_block
from tests.conftest import FAST_SETTINGS, TOKEN, _node_env
from tests.service.http import Api, random_chunk

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root"),
]

REPO = Path(__file__).resolve().parents[2]
#: how long a PUT may wait for RAM here: a refusal for a full disk must come well before
PUT_WAIT = 8.0
#: each small disk (tmpfs: more than the node's RAM, which drains there once freed), and
#: the node whose disks they are
DISK_BYTES = 48 * 2**20
SMALL = 1
FILL_NAME = ".test-fill"  # at a tier's root: the tier's scan only looks two levels down


@dataclass
class SmallDisks:
    """Node ``SMALL``'s nvme and cold directories as tmpfs mounts of ``DISK_BYTES``."""

    root: Path
    mounts: dict[str, Path] = field(default_factory=dict)

    def mount(self) -> None:
        for tier in ("nvme", "cold"):
            path = self.root / tier
            path.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
                check=True,
                capture_output=True,
            )
            self.mounts[tier] = path

    def fill(self, tier: str) -> int:
        """Fill ``tier``'s disk to the last page; the bytes written."""
        written = 0
        fd = os.open(self.mounts[tier] / FILL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            step = 2**20
            while step >= 4096:  # halve the writes once ENOSPC comes: to the brim
                try:
                    written += os.write(fd, b"\0" * step)
                except OSError:
                    step //= 2
        finally:
            os.close(fd)
        return written

    def free(self, tier: str) -> None:
        (self.mounts[tier] / FILL_NAME).unlink(missing_ok=True)

    def unmount(self) -> None:
        for path in self.mounts.values():
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
        self.mounts.clear()


@pytest.fixture
def small_disk_cluster() -> Iterator[tuple[LocalCluster, SmallDisks]]:
    """Three nodes (every chunk on all three), node ``SMALL``'s disks on small tmpfs
    mounts; RAM 24 MiB a node, so that a full disk fills it within a few dozen chunks."""
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    disks = SmallDisks(root / "c" / f"n{SMALL}")
    cluster: LocalCluster | None = None
    try:
        disks.mount()
        for attempt in range(2):
            port = free_port_block(7)
            cluster = LocalCluster(
                nodes=3,
                data=root / "c",
                port=port,
                peer_port=port + 3,
                token=TOKEN,
                settings={
                    **FAST_SETTINGS,
                    "put_wait": PUT_WAIT,
                    # what RAM cannot drain to a full disk: a stop waits this long for it
                    "stop_timeout": 10.0,
                    "tiers": {**FAST_SETTINGS["tiers"], "memory_capacity": "24MiB"},
                },
                env=_node_env(),
            )
            try:
                cluster.start()
                break
            except ClusterError:
                cluster.stop()
                if attempt:
                    raise
        assert cluster is not None
        yield cluster, disks
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                for tier in list(disks.mounts):
                    disks.free(tier)
            cluster.stop()
        disks.unmount()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def storaged(cluster: LocalCluster, *args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    """The real ``storaged`` command against ``cluster``: (exit status, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "storaged", *args, "--url", ",".join(cluster.urls)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), "STORAGED_TOKEN": TOKEN},
        cwd=REPO,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout, proc.stderr


async def _run(cluster: LocalCluster, *args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    return await asyncio.to_thread(storaged, cluster, *args, timeout=timeout)


async def _tier(api: Api, node: str, tier: str) -> dict[str, object]:
    doc = (await api.request("GET", "/v1/cluster")).doc
    entry = next(n for n in doc["nodes"] if n["id"] == node)
    return dict(entry[tier])


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


async def test_full_nvme_is_refused_at_once_by_name_and_heals(
    small_disk_cluster: tuple[LocalCluster, SmallDisks],
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    cluster, disks = small_disk_cluster
    name, url = f"n{SMALL}", cluster.url(SMALL)
    entry, other = Api(session, url, TOKEN), Api(session, cluster.url(0), TOKEN)
    assert (await _tier(other, name, "nvme"))["state"] == "ok"
    assert disks.fill("nvme") > DISK_BYTES // 2

    # A save is acked into RAM (by design), but --wait nvme fails with the cause, well
    # before its timeout: the drain met ENOSPC on n1.
    saved = tmp_path / "a.bin"
    saved.write_bytes(os.urandom(3 * 2**20 + 12345))
    began = time.monotonic()
    status, out, err = await _run(
        cluster, "save", str(saved), "full/a", "--format", "raw", "--chunk-size", "1MiB",
        "--wait", "nvme", "--timeout", "90", "--no-progress",
    )  # fmt: skip
    took = time.monotonic() - began
    assert status == 1, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("storaged save: error:")]
    assert len(lines) == 1, err
    assert "nvme_full" in lines[0] and f"node {name} ({url})" in lines[0], lines[0]
    assert "No space left on device" in lines[0], lines[0]
    assert took < 45, f"--wait nvme took {took:.0f} s to fail (its timeout: 90 s)"
    status, out, _ = await _run(cluster, "status", "full/a")
    assert status == 0 and "state   memory" in out, out

    # storaged nodes marks the tier, and says why under the table.
    status, out, err = await _run(cluster, "nodes")
    assert status == 0, (out, err)
    row = next(line for line in out.splitlines() if line.startswith(f"{name} "))
    assert " FULL" in row, out
    assert f"{name}: nvme FULL since" in out and "nvme_full" in out, out
    assert not any(
        line.startswith(f"n{i} ") and " FULL" in line for line in out.splitlines() for i in (0, 2)
    ), out

    # PUTs fill n1's RAM with chunks that cannot drain; then the refusal names n1, whether
    # n1 is the entry node or a replica, long before the RAM wait.
    acked: dict[str, bytes] = {}
    refusals = []
    for i in range(80):
        data = random_chunk(2**20 + i)
        api = entry if i % 2 else other
        began = time.monotonic()
        r = await api.put_chunk(data)
        took = time.monotonic() - began
        if r.status in (200, 201):
            acked[chunk_id_of(data)] = data
            continue
        assert r.status == 507 and r.error == "nvme_full", r.raw
        assert "Retry-After" not in r.headers  # not backpressure: waiting does not clear it
        refusals.append((api.url, took, r.doc))
        if {u for u, _, _ in refusals} == {entry.url, other.url}:
            break
    assert {u for u, _, _ in refusals} == {entry.url, other.url}, "RAM never filled"
    assert acked, "nothing was acked before RAM filled"
    for _, took, doc in refusals:
        assert f"nvme tier full on node {name} ({url})" in doc["message"], doc
        assert doc["full"] == [{"node": name, "url": url, "tier": "nvme"}], doc
        assert took < PUT_WAIT / 2, f"refused after {took:.1f} s: the RAM wait, not the disk's"
    nvme = await _tier(other, name, "nvme")
    assert nvme["state"] == "full" and "No space left" in str(nvme["cause"]), nvme

    # Space back: the mark clears, saves succeed again, everything acked is on disk.
    disks.free("nvme")

    async def cleared() -> bool:
        return (await _tier(other, name, "nvme"))["state"] != "full"

    await _until("n1's nvme mark clears", cleared)

    async def takes_puts() -> bool:
        data = random_chunk(2**20 + 999)
        r = await entry.put_chunk(data)
        if r.status in (200, 201):
            acked[chunk_id_of(data)] = data
            return True
        assert r.status in (503, 507), r.raw  # RAM still draining
        return False

    await _until("n1 takes PUTs again", takes_puts)
    status, out, err = await _run(cluster, "save", str(saved), "full/b", "--format", "raw",
                                  "--chunk-size", "1MiB", "--wait", "nvme", "--timeout", "90",
                                  "--no-progress")  # fmt: skip
    assert status == 0, (out, err)
    await entry.wait_state("full/a", "nvme", timeout=90)
    for cid, data in acked.items():
        got = await other.get_chunk(cid, url=url)
        assert got.status == 200 and got.raw == data, cid
    status, out, err = await _run(cluster, "restore", "full/a", str(tmp_path / "back.bin"),
                                  "--format", "raw", "--no-progress")  # fmt: skip
    assert status == 0, (out, err)
    assert (tmp_path / "back.bin").read_bytes() == saved.read_bytes()
    status, out, _ = await _run(cluster, "nodes")
    assert status == 0 and " FULL" not in out, out


async def test_full_cold_tier_fails_wait_cold_by_name(
    small_disk_cluster: tuple[LocalCluster, SmallDisks],
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    cluster, disks = small_disk_cluster
    name, url = f"n{SMALL}", cluster.url(SMALL)
    api = Api(session, cluster.url(0), TOKEN)
    disks.fill("cold")
    saved = tmp_path / "c.bin"
    saved.write_bytes(os.urandom(2 * 2**20 + 7))
    # nvme has room: --wait nvme succeeds, --wait cold fails naming n1's cold tier.
    status, out, err = await _run(
        cluster, "save", str(saved), "cold/a", "--format", "raw", "--chunk-size", "1MiB",
        "--wait", "cold", "--timeout", "120", "--no-progress",
    )  # fmt: skip
    assert status == 1, (out, err)
    line = next(x for x in err.splitlines() if x.startswith("storaged save: error:"))
    assert "cold_full" in line and f"cold tier full on node {name} ({url})" in line, line
    status, _, _ = await _run(
        cluster, "save", str(saved), "cold/a2", "--format", "raw", "--chunk-size", "1MiB",
        "--wait", "nvme", "--no-progress",
    )  # fmt: skip
    assert status == 0
    doc = (await api.request("GET", "/v1/checkpoints/cold/a?status")).doc
    assert [(b["node"], b["tier"]) for b in doc["blocked"]] == [(name, "cold")], doc
    status, out, _ = await _run(cluster, "nodes")
    assert f"{name}: cold FULL since" in out, out

    disks.free("cold")
    await api.wait_state("cold/a", "cold", timeout=120)
    doc = (await api.request("GET", "/v1/checkpoints/cold/a?status")).doc
    assert doc["blocked"] == [], doc
