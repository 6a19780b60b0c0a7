"""A hung node (SIGSTOPped: it accepts connections and never answers) costs a command a
few seconds, not the 30 s of a read timeout (issue 17).

Through the real ``storaged`` command: ``ls``, ``status``, ``nodes`` and ``restore`` with
the first ``--url`` node stopped. Through the client: chunk reads whose holders include
the stopped node are hedged to the next holder and return the right bytes; a node that
sends wrong bytes, slowly or fast, loses the race and is asked last from then on. A DCP
load with a node stopped completes. The old figure every bound here is compared with is
``OLD_TIMEOUT`` (aiohttp's ``sock_read`` and the peer protocol's ``io_timeout``).

Node processes (``LocalCluster``), not in-process nodes: a hung node is a SIGSTOPped
process (its kernel still accepts connections, nothing answers), which a node in the
test's own event loop cannot be; the commands are processes too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from storaged.client import Client
from storaged.client.client import Holder
from storaged.client.deadlines import Bandwidth, Deadlines
from storaged.ids import chunk_id_of
from storaged.tools.local_cluster import LocalCluster
from tests.client.helpers import client_sees_all_alive
from tests.conftest import TOKEN, ClusterFactory

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
#: What a command waited for a hung node before (and what it must now stay well under).
OLD_TIMEOUT = 30.0
#: The production liveness figures: peers call a stopped node down after 3 s, not sooner.
LIVENESS: dict[str, Any] = {"heartbeat_interval": 0.5, "down_after": 3.0}


@contextmanager
def stopped(cluster: LocalCluster, i: int) -> Iterator[None]:
    """Node ``i`` SIGSTOPped for the block, continued after whatever happens."""
    pid = cluster.procs[i].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _storaged(cluster: LocalCluster, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The ``storaged`` command in a process of its own; (result, seconds it took)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    began = time.monotonic()
    argv = [*args, "--url", ",".join(cluster.urls), "--token", TOKEN]
    done = subprocess.run(
        [sys.executable, "-m", "storaged", *argv],
        capture_output=True,
        text=True,
        timeout=3 * OLD_TIMEOUT,
        env=env,
        cwd=REPO,
    )
    return done, time.monotonic() - began


def _fast(took: float, baseline: float, what: str) -> None:
    # Relative to the same command without a hung node (interpreter start, imports), and
    # far below what one hung node cost before.
    assert took - baseline < OLD_TIMEOUT / 3, f"{what} took {took:.1f} s ({baseline:.1f} s idle)"


def test_commands_with_the_first_url_hung(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    cluster = cluster_factory(4, **LIVENESS)
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((6, 1 << 20), dtype=np.float32)  # 24 MiB
    src = tmp_path / "in.npz"
    np.savez(src, w=weights)
    name = "hung/ckpt"
    saved, _ = _storaged(cluster, "save", str(src), name, "--chunk-size", "1MiB", "--no-progress")
    assert saved.returncode == 0, saved.stderr
    assert "(transfer " in saved.stdout

    async def holders() -> dict[str, list[Holder]]:
        async with Client(cluster.urls, token=TOKEN) as client:
            return await client.plan(name)

    plan = asyncio.run(holders())
    hung = cluster.node_id(0)  # the first --url: every command's first seed
    assert sum(any(h.node == hung for h in hs) for hs in plan.values()) >= len(plan) // 2

    baseline: dict[str, float] = {}
    for command in (["ls"], ["status", name]):
        idle, baseline[command[0]] = _storaged(cluster, *command)
        assert idle.returncode == 0, idle.stderr
    idle, baseline["restore"] = _storaged(
        cluster, "restore", name, str(tmp_path / "idle.npz"), "--no-progress"
    )
    assert idle.returncode == 0, idle.stderr
    baseline["nodes"] = baseline["ls"]

    with stopped(cluster, 0):
        listed, took = _storaged(cluster, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [c["name"] for c in json.loads(listed.stdout)["checkpoints"]] == [name]
        _fast(took, baseline["ls"], "ls")

        status, took = _storaged(cluster, "status", name, "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["chunks"] == len(plan)
        _fast(took, baseline["status"], "status")

        nodes, took = _storaged(cluster, "nodes", "--json")
        _fast(took, baseline["nodes"], "nodes")
        assert nodes.returncode == 3, nodes.stderr  # a node down or not answering
        doc = json.loads(nodes.stdout)
        assert hung in doc["down"] or hung in doc["not_answering"], doc
        row = next(r for r in doc["nodes"] if r["id"] == hung)
        assert not row["answering"]
        others = [r for r in doc["nodes"] if r["id"] != hung]
        assert all(r["alive"] and r["answering"] for r in others), others
        assert hung in nodes.stderr

        out = tmp_path / "out.npz"
        restored, took = _storaged(cluster, "restore", name, str(out), "--no-progress")
        assert restored.returncode == 0, restored.stderr
        _fast(took, baseline["restore"], "restore")
        # The figure printed is the command's wall time, the transfer's beside it.
        line = restored.stdout.strip().splitlines()[-1]
        wall = float(line.split(" in ")[-1].split(" s ")[0])
        transfer = float(line.split("(transfer ")[1].split(" s")[0])
        assert transfer <= wall <= took, line
        with np.load(out) as z:
            assert np.array_equal(z["w"], weights)


# --------------------------------------------------------------------------- client level


def _blocks(count: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]


@pytest.mark.parametrize("direct", [True, False])
async def test_hedged_reads_get_past_a_hung_holder(
    cluster_factory: ClusterFactory, direct: bool
) -> None:
    # Peers would not call it down for a minute: only the client's deadlines help here.
    cluster = await cluster_factory.start(4, heartbeat_interval=0.5, down_after=60.0)
    blocks = _blocks(24, 1 << 20, 3)
    async with Client(cluster.urls, token=TOKEN, shm=False) as writer:
        await client_sees_all_alive(writer)
        ids = await writer.put_chunks(blocks)
        holders = {cid: writer.placement(cid)[: writer.cluster.replication] for cid in ids}
    hung = cluster.node_id(1)
    held = [cid for cid in ids if hung in holders[cid]]
    assert held, "the hung node holds some of the chunks"

    with stopped(cluster, 1):
        began = time.monotonic()
        async with Client(
            cluster.urls, token=TOKEN, shm=False, direct_reads=direct, max_concurrency=4
        ) as client:
            outs = [bytearray(len(b)) for b in blocks]
            got = await asyncio.gather(
                *(
                    client.get_chunk(cid, out, holders=holders[cid])
                    for cid, out in zip(ids, outs, strict=True)
                )
            )
            took = time.monotonic() - began
            for view, out, block in zip(got, outs, blocks, strict=True):
                assert view.obj is out and bytes(out) == block  # into the caller's buffer
            # Only the reads that were on their way to it when it first missed a
            # deadline paid one: then it is asked last.
            assert 1 <= client.stats.hedges <= 4, client.stats
            assert client.stats.hedge_wins >= 1
            assert hung in client.slow_nodes()
            if client.direct is not None:
                hung_port = int(cluster.urls[1].rsplit(":", 1)[1])
                # The cancelled attempts dropped their connections.
                assert not [c for c in client.direct._conns if c.addr[1] == hung_port]
            # Later reads of its chunks do not wait for it at all.
            hedges = client.stats.hedges
            again = time.monotonic()
            for cid in held[:4]:
                await client.get_chunk(cid, holders=holders[cid])
            assert client.stats.hedges == hedges
            assert time.monotonic() - again < client.deadlines.read_floor * 4
    assert took < OLD_TIMEOUT / 3, took


class FakeHolder:
    """A node that claims a chunk and answers its GETs with wrong bytes: ``delay`` s per
    64 KiB piece (0: all at once). Counts the requests it got."""

    def __init__(self, size: int, delay: float) -> None:
        self.size = size
        self.delay = delay
        self.requests = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        wrong = bytes(self.size)  # zeros: not the chunk's bytes
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
        resp.content_length = self.size
        await resp.prepare(request)
        step = 64 * 1024
        for start in range(0, self.size, step):
            if self.delay:
                await asyncio.sleep(self.delay)
            await resp.write(wrong[start : start + step])
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serving(fake: FakeHolder) -> AsyncIterator[FakeHolder]:
    app = web.Application()
    app.router.add_get("/v1/chunks/{chunk}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("direct", [True, False])
async def test_wrong_bytes_lose_the_race_and_their_node_is_asked_last(
    cluster: LocalCluster, direct: bool
) -> None:
    size = 1 << 20
    [block] = _blocks(1, size, 11 + direct)
    cid = chunk_id_of(block)
    deadlines = Deadlines(read_floor=0.5)
    async with (
        serving(FakeHolder(size, delay=0.5)) as slow_wrong,  # 8 s for the whole body
        serving(FakeHolder(size, delay=0.0)) as fast_wrong,
        Client(
            cluster.urls, token=TOKEN, shm=False, direct_reads=direct, deadlines=deadlines
        ) as client,
    ):
        await client.put_chunk(block)
        holders = [
            Holder("slow-wrong", slow_wrong.url, "memory"),  # asked first
            Holder("fast-wrong", fast_wrong.url, "cold"),  # then: a hedge, wrong at once
        ]
        out = bytearray(size)
        began = time.monotonic()
        view = await client.get_chunk(cid, out, holders=holders)
        took = time.monotonic() - began
        # The hedge's wrong answer came first and failed its check (verified whatever
        # the source); a real holder answered; the slow wrong body was cut off.
        assert bytes(out) == block and view.obj is out
        assert slow_wrong.requests == 1 and fast_wrong.requests == 1
        assert client.stats.hedges >= 1
        assert {"slow-wrong", "fast-wrong"} <= set(client.slow_nodes())
        assert took < 8 * 0.5, took  # not the slow body's 8 s

        # From now on both are asked last: the real holders answer first.
        for _ in range(3):
            assert bytes(await client.get_chunk(cid, holders=holders)) == block
        assert slow_wrong.requests == 1 and fast_wrong.requests == 1


def test_dcp_load_with_a_hung_node(cluster_factory: ClusterFactory) -> None:
    # Synchronous, as the DCP API is (and importing torch would hold a test's loop).
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from storaged.client.dcp import StoragedReader, StoragedWriter

    cluster = cluster_factory(4, **LIVENESS)
    gen = torch.Generator().manual_seed(5)
    state = {f"layer{i}.weight": torch.randn(512, 1024, generator=gen) for i in range(4)}
    name = "hung/dcp"

    def save() -> None:
        writer = StoragedWriter(cluster.urls, name, TOKEN, chunk_size=1 << 20)
        dcp_save(state, storage_writer=writer, no_dist=True)

    def load() -> tuple[dict[str, Any], float]:
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        began = time.monotonic()
        dcp_load(loaded, storage_reader=StoragedReader(cluster.urls, name, TOKEN), no_dist=True)
        return loaded, time.monotonic() - began

    save()
    _, idle = load()
    with stopped(cluster, 0):
        loaded, took = load()
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
    _fast(took, idle, "DCP load")


# --------------------------------------------------------------------------- the figures


def test_read_deadlines_follow_the_measured_bandwidth() -> None:
    d = Deadlines(read_floor=1.0, read_share=0.25, bandwidth_prior=100e6)
    bw = Bandwidth(d)
    assert bw.deadline(0) == 1.0
    assert bw.deadline(100_000_000) == pytest.approx(1.0 + 4.0)  # the prior, 4x slack
    bw.observe(4096, 1.0)  # too small to say anything about bandwidth
    assert bw.measured is None
    for _ in range(50):
        bw.observe(8 << 20, (8 << 20) / 1e9)  # 1 GB/s
    assert bw.measured == pytest.approx(1e9)
    assert bw.deadline(1_000_000_000) == pytest.approx(1.0 + 4.0)
    for _ in range(50):
        bw.observe(8 << 20, (8 << 20) / 1e7)  # then 10 MB/s: the deadline grows with it
    assert bw.measured == pytest.approx(1e7, rel=0.05)


def test_deadlines_from_the_environment() -> None:
    env = {"STORAGED_METADATA_DEADLINE": "0.75", "STORAGED_MAX_HEDGES": "1"}
    d = Deadlines.from_env(env)
    assert d.metadata == 0.75 and d.max_hedges == 1 and d.read_floor == Deadlines().read_floor
    with pytest.raises(ValueError, match="STORAGED_READ_DEADLINE"):
        Deadlines.from_env({"STORAGED_READ_DEADLINE": "soon"})
    with pytest.raises(ValueError, match="STORAGED_METADATA_DEADLINE"):
        Deadlines.from_env({"STORAGED_METADATA_DEADLINE": "0"})
    with pytest.raises(ValueError, match="read_share"):
        Deadlines(read_share=2.0)
    assert Deadlines.from_env({}) == Deadlines()


def test_a_bad_deadline_variable_is_one_line_and_changes_nothing() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "STORAGED_READ_DEADLINE": "-1"}
    done = subprocess.run(
        [sys.executable, "-m", "storaged", "ls", "--url", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert "STORAGED_READ_DEADLINE" in done.stderr and "Traceback" not in done.stderr


def test_a_save_just_after_a_node_hangs(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    """A node SIGSTOPped just before a save, while its peers still call it alive: the
    client's first (hedged) metadata call finds it slow and orders it last, so no chunk
    PUT or commit waits out the 30 s read timeout there; the nodes stop calling it once
    they call it down (``down_after``). The checkpoint comes back whole. (Writes are not
    hedged: a node that hangs in the middle of a save still holds the PUTs already sent
    to it; docs/OPERATIONS.md.)"""
    cluster = cluster_factory(4, **LIVENESS)
    rng = np.random.default_rng(11)
    src = tmp_path / "in.npz"
    np.savez(src, w=rng.standard_normal((6, 1 << 20), dtype=np.float32))  # 24 MiB
    idle, baseline = _storaged(
        cluster, "save", str(src), "hung/idle", "--chunk-size", "1MiB", "--no-progress"
    )
    assert idle.returncode == 0, idle.stderr
    later = rng.standard_normal((6, 1 << 20), dtype=np.float32)  # new bytes: no dedup
    np.savez(src, w=later)
    with stopped(cluster, 0):
        saved, took = _storaged(
            cluster, "save", str(src), "hung/later", "--chunk-size", "1MiB", "--no-progress"
        )
        assert saved.returncode == 0, saved.stderr
        _fast(took, baseline, "save")
    out = tmp_path / "out.npz"
    back, _ = _storaged(cluster, "restore", "hung/later", str(out), "--no-progress")
    assert back.returncode == 0, back.stderr
    with np.load(out) as z:
        assert np.array_equal(z["w"], later)
