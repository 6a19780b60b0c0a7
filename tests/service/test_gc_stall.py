"""A GC that cannot complete a pass (issue 16, §1 items 2 and 3; §2 "one referenced set").

Before the referenced set (``storaged/node/referenced.py``), repair and the evacuation's
``can_leave`` asked GC's *last* complete snapshot whether a chunk was garbage, however old
it was. While GC passes failed for longer than the grace, every chunk committed after the
last good pass counted as garbage: a drained holder said ``can_leave: true`` with 2 of 3
copies on the nodes that stay, repair never brought the third back, and two lost disks
later the chunk of a checkpoint committed with 201 was gone.
"""

from __future__ import annotations

import asyncio
import random
import shutil

import aiohttp

from storaged.errors import Unavailable
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.node import Node
from storaged.node.referenced import ReferencedSet
from tests.conftest import ADMIN_TOKEN
from tests.service.http import Api, manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, PeerLinkProxy, put_bytes, wait_until

GRACE = 2.0
WINDOW = 1.0


async def _commit(node: Node, name: str, chunks: list[bytes]) -> None:
    for data in chunks:
        status, _ = await put_bytes(node, data)
        assert status in (200, 201)
    await _commit_manifest(node, name, chunks)


async def _commit_manifest(node: Node, name: str, chunks: list[bytes]) -> None:
    """Commit ``chunks`` as ``name``, as a client does: a 503 whose manifest missed the
    (short) commit window is retried. A full run at load 16 missed the 1 s window once."""
    checked = check_manifest(manifest_for(chunks), 2**30)
    for attempt in range(5):
        try:
            status, _ = await node.commit(name, checked)
        except Unavailable as exc:
            if exc.code != "insufficient_replicas" or attempt == 4:
                raise
            await asyncio.sleep(0.5)
            continue
        assert status in (200, 201)  # 200: an earlier try was stored after all
        return


async def _pause_gc(cluster: InprocCluster, seconds: float) -> None:
    async with aiohttp.ClientSession() as session:
        for i in cluster.running():
            api = Api(session, cluster.url(i), ADMIN_TOKEN)
            r = await api.request("POST", "/v1/admin/gc", doc={"pause": seconds})
            assert r.status == 200, r.raw
            assert r.doc["node"] == cluster.node_id(i)


def _copies_elsewhere(cluster: InprocCluster, cid: str, leaving: str) -> tuple[int, int]:
    hot = [n for n in cluster.hot_holders(cid) if n != leaving]
    frags: set[int] = set()
    for i in cluster.running():
        if cluster.node_id(i) != leaving:
            frags |= cluster.node(i).fragments.get(cid, set())
    return len(hot), len(frags)


async def test_a_stalled_gc_hides_no_new_chunk_from_can_leave_or_repair(
    inproc: InprocFactory,
) -> None:
    """GC stalls (paused on every node) for longer than the grace; a checkpoint committed
    after its last good pass must count as referenced for ``can_leave`` and repair: the
    drained holder can leave only once its chunks have 3 copies on the nodes that stay,
    and after it leaves and two of those lose their disks, every new chunk still reads."""
    cluster = await inproc.start(
        6,
        k=4,
        n=6,
        gc_grace=GRACE,
        commit_window=WINDOW,
        gc_interval=0.3,
        drain_defer=0.0,
        encode_defer=0.0,
    )
    entry = cluster.node(0)
    rng = random.Random(16)
    control = [rng.randbytes(40 * 1024) for _ in range(4)]
    await _commit(entry, "stall/control", control)
    await wait_until(
        "every node completed a GC pass",
        lambda: all(cluster.node(i).referenced.last_pass is not None for i in range(6)),
        30,
    )
    await _pause_gc(cluster, 600)
    fresh = [rng.randbytes(40 * 1024) for _ in range(6)]
    await _commit(entry, "stall/after", fresh)
    # The commit touched its chunks until WINDOW + 1 s past it: once that and the grace
    # are over they look like garbage to a stale snapshot (which no stage may believe).
    await asyncio.sleep((WINDOW + 1.0 + GRACE) * 1.5)
    await wait_until(
        "the stall is reported in /v1/cluster",
        lambda: all(cluster.node(i).heartbeat()["gc"]["stalled_since"] for i in range(6)),
        30,
    )
    gc = cluster.node(1).heartbeat()["gc"]
    assert "paused by an operator" in gc["cause"]
    assert gc["failed_passes"] > 0

    target = chunk_id_of(fresh[0])
    leaving = cluster.hot_holders(target)[0]
    li = cluster.index_of(leaving)
    await entry.drain(leaving)
    await wait_until(
        "every node sees the mark",
        lambda: all(cluster.node(i).membership.drains.is_draining(leaving) for i in range(6)),
        30,
    )

    async def can_leave() -> bool:
        return bool((await entry.drain_progress(leaving))["can_leave"])

    await wait_until(f"{leaving} can leave", can_leave, 120)
    # The promise can_leave makes, checked against the nodes themselves.
    for data in [*control, *fresh]:
        cid = chunk_id_of(data)
        hot, frags = _copies_elsewhere(cluster, cid, leaving)
        assert hot >= 3 or frags >= 6, (cid, hot, frags)
    await cluster.kill(li)

    # Two of the remaining holders of the target lose their disks.
    others = [n for n in cluster.hot_holders(target) if n != leaving][:2]
    assert len(others) == 2
    for node_id in others:
        i = cluster.index_of(node_id)
        data_dir = cluster.members[i].config.data_dir
        await cluster.kill(i)
        await asyncio.to_thread(shutil.rmtree, data_dir)
    for node_id in others:
        await cluster.start_node(cluster.index_of(node_id))
    reader = next(cluster.node(i) for i in cluster.running() if cluster.node_id(i) not in others)
    # Three nodes' data lost in all is past the failure model for the older, cold chunks
    # (their nvme copies were trimmed before GC stalled); the new chunks are what is at stake.
    for data in fresh:
        got, _ = await reader.read_chunk(chunk_id_of(data))
        assert bytes(got) == data
    status = await reader.checkpoint_status("stall/after")
    assert status["state"] != "lost"

    # Resumed, GC completes a pass and the stall is over.
    await _pause_gc(cluster, 0)
    await wait_until(
        "the stall clears once a pass completes",
        lambda: all(
            cluster.node(i).heartbeat()["gc"]["stalled_since"] is None for i in cluster.running()
        ),
        30,
    )


def test_the_referenced_set_answers_only_from_a_fresh_snapshot() -> None:
    """The freshness rule alone, on a clock the test moves: unreferenced only from a
    complete snapshot younger than ``fresh_for``; before any and past it, referenced."""
    from storaged.coord.catalogue import References

    now = [1000.0]
    refs = ReferencedSet(fresh_for=5.0, grace=10.0, clock=lambda: now[0])
    assert not refs.is_unreferenced("a")  # no snapshot yet: everything is referenced
    refs.update(References(frozenset({"b"}), (), taken_at=1000.0, complete=True), frozenset())
    assert refs.is_unreferenced("a") and not refs.is_unreferenced("b")
    assert refs.is_garbage("a", last_use=989.0) and not refs.is_garbage("a", last_use=995.0)
    now[0] = 1005.0  # as old as GC's own bound: stale
    assert refs.fresh() is None and not refs.is_unreferenced("a")
    refs.failed("etcd out of reach")
    assert refs.stalled_since() is None  # failing, but not yet for longer than the grace
    now[0] = 1010.5
    refs.failed("etcd out of reach")
    assert refs.stalled_since() == 1000.0
    status = refs.status()
    assert status["cause"] == "etcd out of reach" and status["failed_passes"] == 2
    refs.update(References(frozenset(), (), taken_at=1011.0, complete=True), frozenset())
    assert refs.stalled_since() is None and refs.status()["cause"] is None
    assert refs.is_unreferenced("b")


async def test_a_node_cut_off_one_way_counts_new_chunks_as_referenced(
    inproc: InprocFactory,
) -> None:
    """Embedded mode, asymmetric partition (issue 16, §1 item 10): node X cannot reach the
    others, which still reach it. X's GC snapshots are incomplete from then on while the
    others commit checkpoints whose chunks X holds. Once X's last snapshot is stale, X
    must not take those chunks for garbage (it leads repairs and answers ``can_leave``),
    and its stall is reported."""
    cluster = await inproc.start(
        6, k=4, n=6, gc_grace=GRACE, commit_window=WINDOW, gc_interval=0.3, repair_interval=60
    )
    x = 5
    proxies = [
        PeerLinkProxy(("127.0.0.1", cluster.peer_port(i)), "none", flip=False) for i in range(5)
    ]
    try:
        ports = [await p.start() for p in proxies]
        routes = ",".join(f"{cluster.node_id(i)}=127.0.0.1:{ports[i]}" for i in range(5))
        cluster.configure(x, peer_routes=routes)
        await cluster.restart(x)
        node_x = cluster.node(x)
        await wait_until("X completed a GC pass", lambda: node_x.referenced.last_pass is not None)
        for p in proxies:  # X's own calls fail from now on; calls to X still work
            await p.close()
        rng = random.Random(10)
        held: list[str] = []
        for step in range(40):
            data = rng.randbytes(24 * 1024)
            status, reply = await put_bytes(cluster.node(0), data)
            assert status == 201
            if cluster.node_id(x) in reply["replicas"]:
                await _commit_manifest(cluster.node(0), f"cut/{step}", [data])
                held.append(chunk_id_of(data))
            if len(held) >= 3:
                break
        assert held and all(node_x.holds_hot(c) for c in held)
        await asyncio.sleep((WINDOW + 1.0 + GRACE) * 1.5)
        for cid in held:
            assert not node_x.collector.is_garbage(cid), cid
        await wait_until(
            "X reports its stall",
            lambda: node_x.heartbeat()["gc"]["stalled_since"] is not None,
        )
        gc = node_x.heartbeat()["gc"]
        assert "incomplete" in gc["cause"] or "unavailable" in gc["cause"], gc
    finally:
        for p in proxies:
            await p.close()
