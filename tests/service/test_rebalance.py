"""A node away, a node gone, a node joining: what repair waits for, rebuilds and moves.

Real node processes. Fragments are counted from the files under each node's ``cold/``
(``<chunk id>.<index>``), copies from the files under ``nvme/``; the bytes rebalance moved
from each node's ``storaged_rebalanced_bytes_total``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from storaged.tools.local_cluster import LocalCluster, LocalEtcd, etcd_binary, free_port_block
from tests.conftest import FAST_SETTINGS, TOKEN, ClusterFactory
from tests.service.http import Api, manifest_for, random_chunk

pytestmark = pytest.mark.timeout(300)

#: (node, chunk id, fragment index)
Fragment = tuple[str, str, int]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _fragment_files(cluster: LocalCluster, nodes: list[int]) -> set[Fragment]:
    found: set[Fragment] = set()
    for i in nodes:
        for path in (cluster.data / cluster.node_id(i) / "cold").rglob("*"):
            cid, dot, index = path.name.partition(".")
            if path.is_file() and dot and len(cid) == 64 and index.isdigit():
                found.add((cluster.node_id(i), cid, int(index)))
    return found


def _copy_files(cluster: LocalCluster, nodes: list[int], ids: set[str]) -> dict[str, set[str]]:
    """Chunk id -> the nodes with an nvme file of it."""
    found: dict[str, set[str]] = {cid: set() for cid in ids}
    for i in nodes:
        for path in (cluster.data / cluster.node_id(i) / "nvme").rglob("*"):
            if path.is_file() and path.name in found:
                found[path.name].add(cluster.node_id(i))
    return found


def _by_chunk(fragments: set[Fragment]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _, cid, index in fragments:
        out.setdefault(cid, []).append(index)
    return out


async def _metric(session: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples on one node whose labels contain ``labels`` (0 when
    it has none yet)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with session.get(url + "/metrics", headers=headers) as resp:
        assert resp.status == 200
        text = await resp.text()
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for found, v in pattern.findall(text) if labels in found)


async def _cluster_doc(api: Api, url: str | None = None) -> dict[str, Any]:
    r = await api.request("GET", "/v1/cluster", url=url)
    assert r.status == 200, r.raw
    doc: dict[str, Any] = r.doc
    return doc


async def _wait_for(
    what: str, check: Callable[[], Awaitable[bool]], timeout: float = 120.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


async def _settled(api: Api, urls: list[str], since: float = 0.0) -> bool:
    """Every given node's last repair pass found nothing lacking and nothing misplaced,
    and (with ``since``, wall clock) started after it: a pass from before a join says
    nothing about what the join made misplaced."""
    for url in urls:
        doc = await _cluster_doc(api, url)
        for entry in doc["nodes"]:
            if not entry["alive"]:
                continue
            if entry["repair_backlog"] or entry["misplaced_backlog"]:
                return False
            if (entry.get("repair_pass_at") or 0.0) <= since:
                return False
    return True


async def _restores(api: Api, chunks: list[bytes], urls: list[str]) -> None:
    for i, c in enumerate(chunks):
        got = await api.get_chunk(chunk_id_of(c), url=urls[i % len(urls)])
        assert got.status == 200 and got.raw == c, (got.status, chunk_id_of(c))


async def _cold_checkpoint(api: Api, name: str, count: int, size: int) -> list[bytes]:
    chunks = [random_chunk(size + i) for i in range(count)]
    for c in chunks:
        r = await api.put_chunk(c)
        assert r.status in (200, 201), r.raw
    assert (await api.commit(name, manifest_for(chunks))).status == 201
    await api.wait_state(name, "cold", timeout=120)
    return chunks


async def _wait_dead(api: Api, node: str) -> None:
    async def dead() -> bool:
        doc = await _cluster_doc(api)
        return not any(n["alive"] for n in doc["nodes"] if n["id"] == node)

    await _wait_for(f"{node} seen down", dead, timeout=30)


async def test_node_away_for_less_than_gone_after_is_waited_for(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(5, gone_after=600.0)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = await _cold_checkpoint(api, "away/a", 10, 200_000)
    ids = {chunk_id_of(c) for c in chunks}
    await _wait_for("settled", lambda: _settled(api, cluster.urls))
    before = {f for f in _fragment_files(cluster, list(range(5))) if f[1] in ids}
    assert sorted(map(len, _by_chunk(before).values())) == [6] * len(ids)
    victim, k = 3, 4
    on_victim = _by_chunk({f for f in before if f[0] == "n3"})
    # Chunks that keep k + 1 fragments without n3 wait for it; with fewer (n3 held two of
    # them: 6 fragments over 5 nodes) they are rebuilt at once.
    waiting = {cid for cid in ids if 6 - len(on_victim.get(cid, ())) >= k + 1}
    at_once = ids - waiting
    assert {cid for cid in waiting if on_victim.get(cid)}, "n3 must hold fragments to mean it"
    await asyncio.to_thread(cluster.kill, victim)
    await _wait_dead(api, "n3")
    live_urls = [u for i, u in enumerate(cluster.urls) if i != victim]
    live = [i for i in range(5) if i != victim]

    async def short_seen() -> bool:
        # The chunks short of n3's fragments counted as lacking: passes ran with n3 away.
        total = 0
        for url in live_urls:
            doc = await _cluster_doc(api, url)
            total += sum(n["repair_backlog"] or 0 for n in doc["nodes"] if n["alive"])
        return total > 0

    async def rebuilt_at_once() -> bool:
        held = _by_chunk({f for f in _fragment_files(cluster, live) if f[1] in at_once})
        return all(set(held.get(cid, ())) == set(range(6)) for cid in at_once)

    await _wait_for("repair sees the chunks short", short_seen, timeout=60)
    await _wait_for("chunks short of k + 1 rebuilt at once", rebuilt_at_once, timeout=60)
    # A few more passes (repair runs every second): the waiting chunks stay as they were.
    seen = time.monotonic()
    await _wait_for("three more passes", lambda: _elapsed(seen, 3.0), timeout=30)
    still = {f for f in _fragment_files(cluster, live) if f[1] in waiting}
    assert still == {f for f in before if f[1] in waiting and f[0] != "n3"}
    await _restores(api, chunks, live_urls)  # readable while it is away: k of n decode

    cluster.start_node(victim)
    await asyncio.to_thread(cluster.wait_healthy, [victim])
    await asyncio.to_thread(cluster.wait_converged)
    await _wait_for("settled after the return", lambda: _settled(api, cluster.urls))
    after = {f for f in _fragment_files(cluster, list(range(5))) if f[1] in ids}
    # Nothing of the waiting chunks was written anew; the others' duplicates are gone.
    assert {f for f in after if f[1] in waiting} == {f for f in before if f[1] in waiting}
    held = _by_chunk(after)
    assert all(sorted(held[cid]) == list(range(6)) for cid in ids), held
    rebuilt = [
        await _metric(session, u, "storaged_repaired_total", 'kind="fragment"')
        for u in cluster.urls
    ]
    assert sum(rebuilt) == sum(len(on_victim[cid]) for cid in at_once), rebuilt
    await _restores(api, chunks, cluster.urls)


async def _elapsed(since: float, seconds: float) -> bool:
    return time.monotonic() - since >= seconds


async def test_node_gone_is_rebuilt_elsewhere_and_its_return_is_rebalanced(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession, pytestconfig: pytest.Config
) -> None:
    cluster = await cluster_factory.start(5, gone_after=3.0, rebalance_rate="1MiB")
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = await _cold_checkpoint(api, "gone/a", 8, 200_000)
    ids = {chunk_id_of(c) for c in chunks}
    victim = 3
    assert any(f[0] == "n3" for f in _fragment_files(cluster, [victim]) if f[1] in ids)
    await asyncio.to_thread(cluster.kill, victim)
    await _wait_dead(api, "n3")
    live = [i for i in range(5) if i != victim]

    async def rebuilt() -> bool:
        held = _by_chunk({f for f in _fragment_files(cluster, live) if f[1] in ids})
        return all(set(held.get(cid, ())) == set(range(6)) for cid in ids)

    await _wait_for("n3's fragments rebuilt on the live nodes", rebuilt)
    await _restores(api, chunks, [cluster.urls[i] for i in live])
    # The embedded membership keeps a gone node listed (the cluster file decides); etcd's
    # forgets it.
    expected = [] if pytestconfig.getoption("--coordinator") == "etcd" else [False]

    async def listed_as_expected() -> bool:
        doc = await _cluster_doc(api)
        return [n["alive"] for n in doc["nodes"] if n["id"] == "n3"] == expected

    await _wait_for(f"n3 listed as {expected}", listed_as_expected, timeout=30)

    # It comes back with its old fragments: duplicates now; rebalance drops the misplaced.
    cluster.start_node(victim)
    await asyncio.to_thread(cluster.wait_healthy, [victim])
    await asyncio.to_thread(cluster.wait_converged)

    async def one_each() -> bool:
        held = _by_chunk({f for f in _fragment_files(cluster, list(range(5))) if f[1] in ids})
        exact = all(sorted(held.get(cid, ())) == list(range(6)) for cid in ids)
        return exact and await _settled(api, cluster.urls)

    await _wait_for("every fragment index held once", one_each)
    dropped = [
        await _metric(session, u, "storaged_rebalanced_total", 'kind="dropped"')
        for u in cluster.urls
    ]
    assert sum(dropped) > 0, dropped
    await _restores(api, chunks, cluster.urls)


# ---- a join, on etcd ------------------------------------------------------------------------

#: bytes per second each node may move; the data below takes several seconds at it, and
#: unpaced it would go past the bound at the first look
RATE = 64 * 1024


@pytest.fixture
async def etcd_cluster() -> AsyncIterator[Callable[..., Awaitable[LocalCluster]]]:
    """Start a cluster of ``nodes`` on a local etcd, with room for joiners; stopped after."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    clusters: list[LocalCluster] = []

    async def start(nodes: int, room: int, **settings: Any) -> LocalCluster:
        # One block for the nodes, the joiners and etcd: a joiner's port is not etcd's.
        port = free_port_block(2 * room + 2)
        etcd = LocalEtcd(root / f"etcd{len(clusters)}", binary)
        etcd.client_port, etcd.peer_port = port + 2 * room, port + 2 * room + 1
        cluster = LocalCluster(
            nodes=nodes,
            data=root / f"cluster{len(clusters)}",
            port=port,
            peer_port=port + room,
            token=TOKEN,
            settings={**FAST_SETTINGS, **settings},
            env={"PYTHONASYNCIODEBUG": ""},
            etcd=etcd,
        )
        clusters.append(cluster)
        await asyncio.to_thread(cluster.start)
        return cluster

    try:
        yield start
    finally:
        for cluster in clusters:
            await asyncio.to_thread(cluster.stop)
        await asyncio.to_thread(shutil.rmtree, root, True)


async def _paced_until_settled(
    api: Api,
    session: aiohttp.ClientSession,
    cluster: LocalCluster,
    since: float,
    chunk: int,
    joined_at: float = 0.0,
) -> list[float]:
    """Wait until the cluster settles, checking on every look that no node has moved more
    than ``RATE`` bytes per second since ``since``, plus one transfer (the throttle paces
    the start of each; a transfer counts once done); returns the bytes each node moved."""
    urls = cluster.urls
    deadline = time.monotonic() + 240
    moved = [0.0] * len(urls)
    while time.monotonic() < deadline:
        moved = [await _metric(session, u, "storaged_rebalanced_bytes_total") for u in urls]
        looked = time.monotonic()
        for url, sent in zip(urls, moved, strict=True):
            assert sent <= RATE * (looked - since) + 1.2 * chunk, (url, sent, looked - since)
        if sum(moved) > 0 and await _settled(api, urls, joined_at):
            print(
                f"rebalance: {[int(b) for b in moved]} bytes moved per node in "
                f"{looked - since:.1f} s since the join (limit {RATE} B/s per node)"
            )
            return moved
        await asyncio.sleep(0.5)
    raise AssertionError(f"rebalance not done: moved {moved}")


@pytest.mark.parametrize("tier", ["cold", "hot"])
async def test_join_moves_misplaced_data_at_the_configured_rate(
    etcd_cluster: Callable[..., Awaitable[LocalCluster]],
    session: aiohttp.ClientSession,
    tier: str,
) -> None:
    # Hot: no encoder, so the chunks stay as three nvme copies that must move themselves.
    extra = {"encode_workers": 0} if tier == "hot" else {}
    cluster = await etcd_cluster(4, 5, rebalance_rate=RATE, **extra)
    api = Api(session, cluster.urls[0], TOKEN)
    size = 160_000
    if tier == "cold":
        chunks = await _cold_checkpoint(api, "join/a", 24, size)
    else:
        chunks = [random_chunk(size + i) for i in range(24)]
        for c in chunks:
            assert (await api.put_chunk(c)).status == 201
        assert (await api.commit("join/a", manifest_for(chunks))).status == 201
        await api.wait_state("join/a", "memory")
    ids = {chunk_id_of(c) for c in chunks}

    async def on_disk() -> bool:
        copies = _copy_files(cluster, list(range(4)), ids)
        return tier == "cold" or all(len(nodes) >= 3 for nodes in copies.values())

    await _wait_for("copies on disk", on_disk)
    await _wait_for("settled before the join", lambda: _settled(api, cluster.urls))
    assert [await _metric(session, u, "storaged_rebalanced_bytes_total") for u in cluster.urls] == [
        0.0
    ] * 4

    cluster.nodes = 5
    joined = time.monotonic()
    cluster.start_node(4)
    await asyncio.to_thread(cluster.wait_healthy, [4])
    await asyncio.to_thread(cluster.wait_converged)
    # Settled means: passes that started once every node saw the joiner found nothing.
    moved = await _paced_until_settled(api, session, cluster, joined, size, time.time())
    assert sum(moved) > 0, moved
    if tier == "cold":
        fragments = {f for f in _fragment_files(cluster, list(range(5))) if f[1] in ids}
        assert any(node == "n4" for node, _, _ in fragments), "nothing moved to the joiner"
        held = _by_chunk(fragments)
        assert all(sorted(held[cid]) == list(range(6)) for cid in ids), held
        # Retention's nvme copy (the newest checkpoint) moved to each chunk's new owner.
        members = [cluster.node_id(i) for i in range(5)]
        owners = {cid: rendezvous_order(cid, members)[0] for cid in ids}
        assert "n4" in owners.values(), "the joiner owns none: the check would mean nothing"

        async def retained_at_owners() -> bool:
            copies = _copy_files(cluster, list(range(5)), ids)
            return all(copies[cid] == {owners[cid]} for cid in ids)

        await _wait_for("one nvme copy per chunk, at its owner", retained_at_owners, timeout=60)
    else:
        copies = _copy_files(cluster, list(range(5)), ids)
        assert any("n4" in nodes for nodes in copies.values()), "nothing moved to the joiner"
        assert all(len(nodes) == 3 for nodes in copies.values()), copies
    await _restores(api, chunks, cluster.urls)


async def test_gone_member_leaves_the_etcd_membership(
    etcd_cluster: Callable[..., Awaitable[LocalCluster]], session: aiohttp.ClientSession
) -> None:
    cluster = await etcd_cluster(5, 5, gone_after=3.0)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = await _cold_checkpoint(api, "gone/etcd", 8, 120_000)
    ids = {chunk_id_of(c) for c in chunks}
    await asyncio.to_thread(cluster.kill, 4)
    live = cluster.urls[:4]

    async def forgotten() -> bool:
        for url in live:
            doc = await _cluster_doc(api, url)
            if any(n["id"] == "n4" for n in doc["nodes"]):
                return False
        return True

    await _wait_for("n4 removed from every node's members", forgotten, timeout=60)

    async def rebuilt() -> bool:
        held = _by_chunk({f for f in _fragment_files(cluster, list(range(4))) if f[1] in ids})
        return all(set(held.get(cid, ())) == set(range(6)) for cid in ids)

    await _wait_for("n4's fragments rebuilt on the others", rebuilt)
    await _restores(api, chunks, live)
    # It registers anew when it comes back, as any joiner.
    cluster.start_node(4)
    await asyncio.to_thread(cluster.wait_healthy, [4])
    await asyncio.to_thread(cluster.wait_converged)
    doc = await _cluster_doc(api)
    assert [n["alive"] for n in doc["nodes"] if n["id"] == "n4"] == [True]
