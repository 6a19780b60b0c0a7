"""Nodes join, drain and leave a running etcd-mode cluster of real processes, with no
config edit, while a save and a restore run: a joining node (``serve --coordinator ...
--node ID --url ... --peer ... --data DIR``) takes new placements at once; a drained node
(``storaged drain NODE --wait``) is killed with SIGKILL and nothing acked is lost or
under-replicated; forgotten once down past gone_after, restarted it is still draining, and
stopped it leaves the members."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal

import aiohttp
import pytest

from storaged.tools.local_cluster import LocalCluster, LocalEtcd, etcd_binary, free_port_block
from tests.conftest import FAST_SETTINGS, TOKEN, ClusterFactory
from tests.service.drain_workload import (
    DrainWorkload,
    assert_the_workload_came_through,
    drain_under_the_workload,
    storaged_cli,
)
from tests.service.http import Api
from tests.service.inproc import wait_until

pytestmark = pytest.mark.skipif(
    etcd_binary() is None or importlib.util.find_spec("etcd3aio") is None,
    reason="needs etcd (apt-get install etcd-server) and the etcd extra (pip install -e .[etcd])",
)

#: generous bounds: etcd, five nodes and the workload on a loaded 2-core machine
SLOW = 120.0


def _etcd_cluster(factory: ClusterFactory, nodes: int) -> LocalCluster:
    """A cluster of ``nodes`` slots on one local etcd member, not started; the factory
    stops it (nodes, then etcd) and keeps its logs after a failure."""
    binary = etcd_binary()
    assert binary is not None
    root = factory.root / f"cluster{len(factory.clusters)}"
    port = free_port_block(nodes * 2 + 1)
    cluster = LocalCluster(
        nodes=nodes,
        data=root,
        port=port,
        peer_port=port + nodes,
        token=TOKEN,
        # gone_after: time to see the killed node listed down before it is forgotten
        settings={**FAST_SETTINGS, "drain_defer": 0.0, "encode_defer": 0.0, "gone_after": 10.0},
        env={"PYTHONASYNCIODEBUG": ""},
        etcd=LocalEtcd(root / "etcd", binary),
    )
    factory.clusters.append(cluster)
    return cluster


def _start_first(cluster: LocalCluster, count: int) -> None:
    """Etcd, then the first ``count`` nodes (the others' ports stay free for joins)."""
    assert cluster.etcd is not None
    cluster.write_config()
    cluster.etcd.start(avoid=cluster._ports())
    cluster.etcd.wait_healthy(timeout=SLOW)
    for i in range(count):
        cluster.start_node(i)
    cluster.wait_healthy(list(range(count)), timeout=SLOW)
    cluster.wait_converged(timeout=SLOW)


def _join(cluster: LocalCluster, i: int) -> None:
    cluster.start_node(i)  # serve --coordinator --url --peer --data: no member list anywhere
    cluster.wait_healthy([i], timeout=SLOW)
    cluster.wait_converged(timeout=SLOW)


def _restart(cluster: LocalCluster, i: int) -> None:
    cluster.start_node(i)
    cluster.wait_healthy([i], timeout=SLOW)


async def test_a_node_joins_another_drains_and_leaves_under_a_save_and_a_restore(
    cluster_factory: ClusterFactory, http: aiohttp.ClientSession
) -> None:
    cluster = _etcd_cluster(cluster_factory, 5)
    await asyncio.to_thread(_start_first, cluster, 4)
    config_before = cluster.config_path.read_bytes()
    urls = cluster.urls
    api = Api(http, urls[0], TOKEN)
    work = DrainWorkload(api, urls[:3], "etcd")
    for i in range(3):
        await work.save(1000 + i)
    assert len(work.acked) == 3, work.failed_saves
    await api.wait_state(sorted(work.acked)[0], "cold", SLOW)

    tasks = [asyncio.create_task(work.saver()), asyncio.create_task(work.restorer())]
    try:
        await wait_until("saves go on", lambda: len(work.acked) >= 6, SLOW)
        # n4 joins while the save and the restore run
        await asyncio.to_thread(_join, cluster, 4)
        joined_at = len(work.acked)
        await wait_until("saves after the join", lambda: len(work.acked) >= joined_at + 4, SLOW)
        # acked is in the order of the acks (the first three, saved before the saver ran,
        # sort after its names by number: a sort would take them for saves after the join)
        after_join = list(work.acked)[joined_at:]
        holders = await _hot_holders(api, after_join)
        assert any("n4" in h for h in holders.values()), "the joiner got no new placements"
        # then n3 drains while they still run
        await drain_under_the_workload(work, urls[4], "n3", SLOW)
    finally:
        work.stop.set()
        await asyncio.gather(*tasks)
    assert_the_workload_came_through(work)

    # n3 leaves the hard way: SIGKILL, its lease runs out
    await asyncio.to_thread(cluster.kill, 3, signal.SIGKILL)

    async def n3_down_everywhere() -> bool:
        for url in (urls[0], urls[1], urls[2], urls[4]):
            r = await api.request("GET", "/v1/cluster", url=url)
            n3 = [n for n in r.doc["nodes"] if n["id"] == "n3"]
            assert n3, "n3 forgotten before it was seen down"
            if n3[0]["alive"] or n3[0]["state"] != "draining":
                return False
        return True

    await wait_until("n3 down (and draining) everywhere", n3_down_everywhere, SLOW)
    await work.check_after(urls[4])  # through the node that joined

    async def n3_is(alive: bool | None) -> bool:
        for url in (urls[0], urls[1], urls[2], urls[4]):
            r = await api.request("GET", "/v1/cluster", url=url)
            n3 = [n for n in r.doc["nodes"] if n["id"] == "n3"]
            if alive is None and n3:
                return False
            if alive is not None and not (n3 and n3[0]["alive"] == alive):
                return False
            if n3 and n3[0]["state"] != "draining":
                return False
        return True

    # Down past gone_after, n3 is forgotten: listed nowhere, its copies restored elsewhere.
    await wait_until("n3 forgotten", lambda: n3_is(None), SLOW)
    await work.check_after(urls[1])
    # Back again, n3 is still draining (the mark is etcd's, and outlived the forgetting:
    # the timer does not undo the operator's drain); stopped, it leaves for good.
    await asyncio.to_thread(_restart, cluster, 3)
    await wait_until("n3 back, still draining", lambda: n3_is(True), SLOW)
    await asyncio.to_thread(cluster.kill, 3, signal.SIGTERM)
    await wait_until("n3 left: listed nowhere", lambda: n3_is(None), SLOW)
    status, out, err = await storaged_cli("nodes", "--json", "--url", urls[0])
    assert status == 0, (out, err)  # no node down: the one that left is not a member
    assert sorted(row["id"] for row in json.loads(out)["nodes"]) == ["n0", "n1", "n2", "n4"]
    await work.check_after(urls[0])
    assert cluster.config_path.read_bytes() == config_before  # no config edit


async def _hot_holders(api: Api, names: list[str]) -> dict[str, set[str]]:
    """The nodes holding a hot copy of each chunk of ``names``, as their ``?plan`` says."""
    out: dict[str, set[str]] = {}
    for name in names:
        plan = await api.request("GET", f"/v1/checkpoints/{name}?plan")
        assert plan.status == 200, (name, plan.status)
        for cid, sources in plan.doc["chunks"].items():
            hot = {s["node"] for s in sources if s["tier"] in ("memory", "nvme")}
            out.setdefault(cid, set()).update(hot)
    return out
