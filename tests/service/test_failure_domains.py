"""A whole failure domain lost at once (issue 19 §1), on real node processes.

Six nodes in three domains of two (``[[nodes]] domain``; on etcd ``--domain``):

- the same fault on the same six nodes, with and without domains declared: chunks acked
  with two copies, then the whole of one domain gone for good (both nodes SIGKILLed, their
  disks wiped: the rack is not coming back) before anything went cold. Placed blind, the
  chunks whose two copies the rendezvous order put in that domain are gone; placed over
  the domains, every chunk kept a copy elsewhere and restores byte-exact;
- with the default three copies, one domain SIGKILLed during saves: every acknowledged
  checkpoint restores byte-exact from the other two domains while it is down, and
  ``?status`` / ``storaged nodes`` say what the data and the cluster survive.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np
import pytest

from storaged.client import ChunkNotFound, Client, StoragedError
from storaged.client.documents import Survives
from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import TOKEN, ClusterFactory
from tests.service.http import manifest_for

RACKS = {0: "rack-a", 1: "rack-a", 2: "rack-b", 3: "rack-b", 4: "rack-c", 5: "rack-c"}
RACK_A = (0, 1)
NODE_IDS = [f"n{i}" for i in range(6)]


def _client(cluster: LocalCluster, *nodes: int) -> Client:
    urls = [cluster.url(i) for i in (nodes or range(cluster.nodes))]
    return Client(urls, token=TOKEN)


def _chunks_blind_placement_puts_in_rack_a(count: int, size: int) -> list[bytes]:
    """Chunks whose first two nodes in the plain rendezvous order are rack-a's two: placed
    blind with two copies, both copies are in rack-a."""
    rng = random.Random(19)
    found: list[bytes] = []
    while len(found) < count:
        data = rng.randbytes(size)
        if set(rendezvous_order(chunk_id_of(data), NODE_IDS)[:2]) == {"n0", "n1"}:
            found.append(data)
    return found


def _lose_rack_a(cluster: LocalCluster) -> None:
    """Both rack-a nodes SIGKILLed at once, then their disks gone with the rack."""
    for i in RACK_A:
        proc = cluster.procs.get(i)
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
    for i in RACK_A:
        cluster.kill(i)  # reaps the killed process
        shutil.rmtree(cluster.data / cluster.node_id(i), ignore_errors=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("declared", [True, False], ids=["domains", "blind"])
async def test_a_lost_domain_takes_copies_placed_blind_and_none_placed_over_domains(
    cluster_factory: ClusterFactory, declared: bool
) -> None:
    cluster = await cluster_factory.start(
        6,
        domains=RACKS if declared else None,
        replication=2,
        k=4,
        n=6,
        # No fragment fits the cold tier: the loss comes before anything went cold, the
        # window a rack's power loss right after a save hits.
        tiers={"cold_capacity": "64KiB"},
    )
    chunks = _chunks_blind_placement_puts_in_rack_a(4, 512 * 1024)
    ids = [chunk_id_of(c) for c in chunks]
    async with _client(cluster) as client:
        for data in chunks:
            await client.put_chunk(data)
        await client.commit("rack/ckpt", manifest_for(chunks))
        plan = await client.plan("rack/ckpt")
        holders = {cid: {h.node for h in plan[cid]} for cid in ids}
        status = await client.status("rack/ckpt")
    if declared:
        # Two copies, two racks, for every chunk.
        assert all(len({RACKS[int(n[1:])] for n in held}) == 2 for held in holders.values())
        assert status.survives == Survives(1, True)
        assert str(status.survives) == "one domain or one node"
    else:
        assert all(held == {"n0", "n1"} for held in holders.values()), holders
        assert status.survives == Survives(1, False)

    await asyncio.to_thread(_lose_rack_a, cluster)

    async with _client(cluster, 2, 3, 4, 5) as client:
        got: dict[str, bytes | None] = {}
        for cid in ids:
            try:
                got[cid] = bytes(await client.get_chunk(cid))
            except (ChunkNotFound, StoragedError):
                got[cid] = None
    if declared:
        assert all(got[chunk_id_of(c)] == c for c in chunks)
    else:
        # The same fault, placed blind: every one of these chunks is gone.
        assert all(got[cid] is None for cid in ids), [cid for cid in ids if got[cid]]


async def _command(
    cluster: LocalCluster, *args: str, nodes: tuple[int, ...] = ()
) -> tuple[int, str]:
    """The real ``storaged`` command, a process: its exit status and its output."""
    urls = ",".join(cluster.url(i) for i in (nodes or range(cluster.nodes)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "storaged.cli", *args, "--url", urls, "--token", TOKEN,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONASYNCIODEBUG": ""},
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _saver(cluster: LocalCluster, stop: threading.Event, acked: dict[str, str]) -> None:
    """Saves small checkpoints until ``stop``, recording each acknowledged one's digest."""

    async def run() -> None:
        from storaged.client import save_checkpoint

        rng = np.random.default_rng(7)
        async with _client(cluster) as client:
            for step in range(10_000):
                if stop.is_set():
                    return
                value = rng.random(96 * 1024)  # 768 KiB: a chunk or so
                name = f"dom/step{step}"
                try:
                    await save_checkpoint(client, name, {0: {"w": value}})
                except StoragedError:
                    await asyncio.sleep(0.2)  # a save cut by the kill: not acked, not counted
                    continue
                acked[name] = hashlib.sha256(value.tobytes()).hexdigest()

    asyncio.run(run())


@pytest.mark.timeout(300)
async def test_one_whole_domain_killed_during_saves_loses_nothing_acked(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory.start(6, domains=RACKS, k=4, n=6)
    code, out = await _command(cluster, "nodes")
    assert code == 0, out
    assert (
        "placement survives the loss of one domain or 2 nodes (failure domains: "
        "rack-a: n0 n1; rack-b: n2 n3; rack-c: n4 n5)"
    ) in out
    stop = threading.Event()
    acked: dict[str, str] = {}
    saver = threading.Thread(target=_saver, args=(cluster, stop, acked), daemon=True)
    saver.start()
    try:
        deadline = time.monotonic() + 60
        while len(acked) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(acked) >= 5, "no saves before the fault"
        for i in RACK_A:  # both at once
            proc = cluster.procs[i]
            proc.send_signal(signal.SIGKILL)
        before = len(acked)
        deadline = time.monotonic() + 60
        while len(acked) < before + 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(acked) >= before + 5, "saves did not go on with one domain down"
    finally:
        stop.set()
        await asyncio.to_thread(saver.join, 60)
    for i in RACK_A:
        await asyncio.to_thread(cluster.kill, i)
    code, out = await _command(cluster, "status", max(acked), nodes=(2, 3, 4, 5))
    assert code == 0, out
    assert "survives the loss of one node (as its copies are held now)" in out, out

    from storaged.client import restore_checkpoint

    async with _client(cluster, 2, 3, 4, 5) as client:
        for name, digest in sorted(acked.items()):
            state = await restore_checkpoint(client, name)
            assert hashlib.sha256(np.asarray(state["w"]).tobytes()).hexdigest() == digest, name
        doc = await client.cluster_document()
    # Four nodes in two domains stay: a domain would take 3 of 6 fragments, so placement
    # over them promises one node's loss (2 fragments a node), not a domain's.
    assert doc["survives"] == {"nodes": 1, "domain": False, "domains": 2}
    assert {n["id"]: n["domain"] for n in doc["nodes"]} == {
        f"n{i}": rack for i, rack in RACKS.items()
    }

    # The rack comes back (RAM gone, disks kept): repair and rebalance put every chunk
    # where placement over three racks says, so each survives one rack's loss again, and
    # ?status says so for every checkpoint.
    for i in RACK_A:
        await asyncio.to_thread(cluster.start_node, i)
    await asyncio.to_thread(cluster.wait_healthy, list(RACK_A))

    async def spread_again() -> list[str]:
        """What is not yet where placement over three racks puts it: every node's repair
        and misplaced backlogs (what the saves made while rack-a was down had on two racks
        only sits outside its placement now), and what each checkpoint survives."""
        async with _client(cluster) as client:
            doc = await client.cluster_document()
            short = [
                f"{n['id']}: {n['repair_backlog']} lacking, {n['misplaced_backlog']} misplaced"
                for n in doc["nodes"]
                if n["repair_backlog"] != 0 or n["misplaced_backlog"] != 0
            ]
            for name in sorted(acked):
                status = await client.status(name)
                if status.survives != Survives(2, True):
                    short.append(f"{name}: {status.survives}")
            return short

    deadline = time.monotonic() + 120
    while (short := await spread_again()) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    assert not short, short
