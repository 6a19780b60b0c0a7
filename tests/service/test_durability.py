"""Issue 8 ("Durability first"), section 2: each scenario is a named regression test.

Each test drives its scenario against real nodes (in this event loop, see ``inproc.py``, or
as processes where a real signal is needed) and asserts the invariant it broke, not the
mechanism of a fix:

- I1 ack: a 201/200 PUT means ``replication`` nodes hold a verified copy (or all n
  fragments are durable);
- I2 a failed request removes nothing others rely on;
- I3 referenced means kept (an ack, a ``/missing`` answer, a commit refresh a chunk's age);
- I4 a 201/200 commit is on ``replication`` catalogue holders; of racing commits one wins;
- I5 a graceful stop drains; I6 transient failures are retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from storaged.ids import chunk_id_of
from storaged.node import COLD, NVME
from storaged.placement import rendezvous_order
from tests.conftest import ADMIN_TOKEN, TOKEN, ClusterFactory
from tests.service.http import Api, Reply, manifest_for
from tests.service.inproc import (
    InprocCluster,
    InprocFactory,
    PeerLinkProxy,
    hog_memory,
    release_memory,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

#: small enough that a whole body fits in a loopback socket's buffers (a held peer link
#: must not stall the entry node's writes to the other replicas)
CHUNK = 64 * 1024


def new_chunk(size: int = CHUNK) -> tuple[bytes, str]:
    data = os.urandom(size)
    return data, chunk_id_of(data)


def api_of(http: aiohttp.ClientSession, cluster: InprocCluster, i: int) -> Api:
    return Api(http, cluster.url(i), TOKEN)


async def verified_holders(cluster: InprocCluster, chunk_id: str) -> list[str]:
    """Running nodes whose own RAM or nvme copy of ``chunk_id`` hashes to the id."""
    out = []
    for i in cluster.running():
        async with cluster.node(i).local_copy(chunk_id) as data:
            if data is not None and chunk_id_of(data) == chunk_id:
                out.append(cluster.node_id(i))
    return out


async def assert_acked(cluster: InprocCluster, chunk_id: str, reply: Reply) -> None:
    """I1: after a 201/200, ``replication`` nodes hold a verified copy or all n fragments."""
    if reply.status not in (200, 201):
        return
    node = cluster.node(cluster.running()[0])
    holders = await verified_holders(cluster, chunk_id)
    full = cluster.fragments(chunk_id) == set(range(node.config.n))
    assert len(holders) >= node.config.replication or full, (
        f"PUT answered {reply.status} {reply.doc} but only {holders} hold {chunk_id} "
        f"(fragments {sorted(cluster.fragments(chunk_id))})"
    )


@contextlib.contextmanager
def broken_dir(path: Path) -> Iterator[None]:
    """Replace directory ``path`` by a file for the block: every write under it fails with a
    real OS error (ENOTDIR), even as root; the directory comes back as it was."""
    aside = path.with_name(path.name + ".aside")
    path.rename(aside)
    path.write_bytes(b"not a directory")
    try:
        yield
    finally:
        path.unlink()
        aside.rename(path)


async def wait_cold(cluster: InprocCluster, chunk_id: str) -> None:
    owner = cluster.node(cluster.order(chunk_id)[0])
    n = owner.config.n

    def cold() -> bool:
        info = owner.index.get(chunk_id)
        return (
            info is not None and info.state >= COLD and cluster.fragments(chunk_id) == set(range(n))
        )

    await wait_until(f"{chunk_id} is cold", cold, timeout=60)


async def route_through_proxy(
    cluster: InprocCluster, entry: int, target: int, proxy: PeerLinkProxy
) -> None:
    """Restart node ``entry`` dialing node ``target`` through ``proxy`` (before any PUT)."""
    port = await proxy.start()
    cluster.configure(entry, peer_routes=f"{cluster.node_id(target)}=127.0.0.1:{port}")
    await cluster.restart(entry)


# ---- 1 --------------------------------------------------------------------------------------
async def test_scenario_1_failed_reput_of_cold_chunk_keeps_its_fragments(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A re-PUT of a cold chunk lands on nodes that hold only fragments; when it fails
    (targets memory_full), neither it nor the client's retries may delete those fragments."""
    cluster = await inproc.start(4, put_wait=0.5, drain_defer=0.0, encode_defer=0.0)
    data, cid = new_chunk()
    a, b, c, d = cluster.order(cid)
    assert (await api_of(http, cluster, a).put_chunk(data)).status == 201
    api = api_of(http, cluster, a)
    assert (await api.commit("s1/base", manifest_for([data]))).status == 201
    await wait_cold(cluster, cid)
    # Only fragments remain: the hot copies leave RAM and nvme.
    r = await api.request(
        "POST",
        "/v1/admin/evict",
        doc={"checkpoint": "s1/base", "tier": "nvme"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert r.status == 200, r.raw
    assert cluster.hot_holders(cid) == []
    n = cluster.node(a).config.n
    hogs = {i: await hog_memory(cluster.node(i)) for i in (b, c)}
    try:
        # The client's retries, over the entry nodes that will take the body.
        for entry in (d, a, d, a):
            r = await api_of(http, cluster, entry).put_chunk(data)
            assert r.status in (200, 201, 503), r.raw
            await assert_acked(cluster, cid, r)
            assert cluster.fragments(cid) == set(range(n)), (
                f"a re-PUT answered {r.status} and fragments "
                f"{sorted(set(range(n)) - cluster.fragments(cid))} of {cid} are gone"
            )
    finally:
        for i, held in hogs.items():
            release_memory(cluster.node(i), held)
    for i in cluster.running():
        r = await api_of(http, cluster, i).get_chunk(cid)
        assert r.status == 200 and r.raw == data


# ---- 2 --------------------------------------------------------------------------------------
async def test_scenario_2_failed_concurrent_put_keeps_copies_another_put_acked(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Two PUTs of one chunk (data-parallel ranks with identical tensors): the failing one
    must not remove a copy that the other counted in its 201."""
    cluster = await inproc.start(4)
    data, cid = new_chunk()
    a, b, c, d = cluster.order(cid)
    # The failing PUT enters at b; its copy to c is held on the link, then arrives damaged.
    gate = asyncio.Event()
    proxy = PeerLinkProxy(("127.0.0.1", cluster.peer_port(c)), cid, gate=gate)
    try:
        await route_through_proxy(cluster, b, c, proxy)
        failing = asyncio.create_task(api_of(http, cluster, b).put_chunk(data))
        await wait_until("the held PUT reached a", lambda: cluster.node(a).holds_hot(cid))
        await wait_until("the held PUT reached the link to c", proxy.put_seen.is_set)
        acked = await api_of(http, cluster, d).put_chunk(data)
        assert acked.status in (200, 201), acked.raw
        await assert_acked(cluster, cid, acked)
        gate.set()
        other = await failing
    finally:
        gate.set()
        await proxy.close()
    assert other.status in (200, 201, 400, 503), other.raw
    # The first PUT's 201 still holds, whatever became of the second.
    await assert_acked(cluster, cid, acked)
    await assert_acked(cluster, cid, other)


# ---- 3 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("refresh", ["missing", "ack"])
async def test_scenario_3_gc_keeps_old_chunk_that_a_commit_reuses(
    inproc: InprocFactory, http: aiohttp.ClientSession, refresh: str
) -> None:
    """An old unreferenced chunk that ``/missing`` reported held (or a re-PUT acked) is
    reused by a commit while GC runs from a snapshot that predates the commit: the
    checkpoint must commit and restore."""
    grace = 2.0
    # No periodic GC: the test runs the passes itself, at the worst moment.
    cluster = await inproc.start(4, gc_grace=grace, gc_interval=3600.0)
    api = api_of(http, cluster, 0)
    data, cid = new_chunk()
    assert (await api.put_chunk(data)).status == 201

    def older_than_grace() -> bool:
        stamps = [cluster.node(i).index[cid].stored_at for i in cluster.running()
                  if cid in cluster.node(i).index]  # fmt: skip
        return bool(stamps) and time.time() - max(stamps) > grace + 0.5

    await wait_until("the chunk is older than the grace", older_than_grace)
    if refresh == "missing":
        r = await api.request("POST", "/v1/chunks/missing", doc={"chunks": [cid]})
        assert r.status == 200 and r.doc["missing"] == []
    else:
        r = await api.put_chunk(data)
        assert r.status in (200, 201), r.raw
    # GC's snapshot of the catalogue is taken now, before the commit that names the chunk.
    await asyncio.gather(*(cluster.node(i).gc_pass() for i in cluster.running()))
    r = await api.commit("s3/ckpt", manifest_for([data]))
    assert r.status == 201, f"commit after the {refresh} refresh: {r.status} {r.doc}"
    await asyncio.gather(*(cluster.node(i).gc_pass() for i in cluster.running()))
    r = await api.get_chunk(cid)
    assert r.status == 200 and r.raw == data


# ---- 4 --------------------------------------------------------------------------------------
@pytest.mark.embedded_only(
    "the embedded catalogue's record files on the name's holders; on etcd a commit is"
    " one etcd transaction (tests/coordination/test_etcd.py)"
)
async def test_scenario_4_commit_retry_completes_a_partial_catalogue_write(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A commit whose catalogue writes reached 1 of 3 nodes answers 503; the retry's 200 must
    mean the record is on ``replication`` catalogues, so that GC on the other nodes keeps the
    chunks while the first holder is down."""
    grace = 1.0
    cluster = await inproc.start(4, gc_grace=grace, gc_interval=3600.0)
    name = "s4/ckpt"
    chunks = [new_chunk()[0] for _ in range(2)]
    p, q, r_ = (cluster.index_of(t) for t in cluster.node(0).placement().name_targets(name))
    api = api_of(http, cluster, p)
    for data in chunks:
        assert (await api.put_chunk(data)).status == 201
    with (
        broken_dir(cluster.node(q).config.data_dir / "catalog"),
        broken_dir(cluster.node(r_).config.data_dir / "catalog"),
    ):
        r = await api.commit(name, manifest_for(chunks))
        assert r.status == 503, r.raw
    r = await api.commit(name, manifest_for(chunks))
    assert r.status in (200, 201), r.raw
    on = [cluster.node_id(i) for i in (p, q, r_) if cluster.node(i).catalog.raw(name) is not None]
    assert len(on) == 3, f"commit answered {r.status} with the record on {on} only"
    # The first holder goes down; the others collect garbage older than the grace.
    await cluster.kill(p)
    await asyncio.sleep(grace + 0.5)  # the chunks' age must pass the grace: that is the test
    others = cluster.running()
    await asyncio.gather(*(cluster.node(i).gc_pass() for i in others))
    for data in chunks:
        r = await api_of(http, cluster, others[0]).get_chunk(chunk_id_of(data))
        assert r.status == 200 and r.raw == data, "GC deleted a committed checkpoint's chunk"


# ---- 5 --------------------------------------------------------------------------------------
async def test_scenario_5_put_to_a_holder_checks_the_other_copies(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A cancelled PUT leaves one copy; a PUT to that holder must not answer "replicas: 3"
    without making it true."""
    data, cid = new_chunk()
    a, b, c, _ = (int(n[1:]) for n in rendezvous_order(cid, [f"n{i}" for i in range(4)]))
    # No repair passes: the ack must be true when it is given, not once repair caught up.
    # c waits for RAM long enough for the client to give up, not for ever.
    cluster = await inproc.start(4, repair_interval=3600.0, per_node={c: {"put_wait": 5.0}})
    assert cluster.order(cid) == [a, b, c, _]
    hog = await hog_memory(cluster.node(c))
    try:
        put = asyncio.create_task(api_of(http, cluster, a).put_chunk(data))
        await wait_until("b holds the chunk", lambda: cluster.node(b).holds_hot(cid))
        put.cancel()  # the client gives up while c waits for RAM: a cancelled PUT
        with contextlib.suppress(asyncio.CancelledError):
            await put
        await wait_until("the cancelled PUT is over", lambda: cluster.http_connections(a) == 0)
        assert cluster.hot_holders(cid) == [cluster.node_id(b)]
        r = await api_of(http, cluster, b).put_chunk(data)
        assert r.status in (200, 201), r.raw
        await assert_acked(cluster, cid, r)
    finally:
        release_memory(cluster.node(c), hog)


# ---- 6 --------------------------------------------------------------------------------------
async def test_scenario_6_commit_with_a_wrong_chunk_size_is_refused(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A manifest declaring a size other than the stored chunk's is a bad manifest."""
    cluster = await inproc.start(4)
    api = api_of(http, cluster, 0)
    data, cid = new_chunk()
    assert (await api.put_chunk(data)).status == 201
    manifest = manifest_for([data + bytes(1000)])
    manifest["shards"][0]["chunks"] = [[cid, len(data) + 1000]]
    r = await api.commit("s6/ckpt", manifest)
    assert r.status == 400 and r.error == "bad_manifest", (r.status, r.doc)
    assert cid in r.doc["message"], r.doc
    assert (await api.request("GET", "/v1/checkpoints/s6/ckpt")).status == 404


# ---- 7 --------------------------------------------------------------------------------------
async def _slow_put(url: str) -> asyncio.StreamWriter:
    """A PUT that stays in flight: its headers and the first bytes of its body, then nothing
    (the node would abandon it after ``body_timeout``; the test closes it long before)."""
    data, cid = new_chunk(1 << 20)
    host, _, port = url.removeprefix("http://").partition(":")
    _, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data[:4096])
    await writer.drain()
    return writer


async def test_scenario_7_sigterm_drains_acked_data(
    cluster_factory: ClusterFactory, http: aiohttp.ClientSession
) -> None:
    """SIGTERM to every node right after the last ack of a burst, while PUTs in flight make
    the drain wait: after a restart every acked chunk is readable; a PUT to a stopping node
    is refused or, if acked, kept."""
    # Drain yields to PUTs in flight for up to drain_defer per chunk: with a PUT in flight
    # on every node, the burst's chunks are all still RAM-only when the signal comes.
    cluster = await cluster_factory.start(4, drain_defer=60.0)
    apis = [Api(http, url, TOKEN) for url in cluster.urls]
    slow = [await _slow_put(url) for url in cluster.urls]
    acked: dict[str, bytes] = {}
    try:

        async def upload(i: int) -> None:
            data, cid = new_chunk(1 << 20)
            r = await apis[i % 4].put_chunk(data)
            assert r.status == 201, r.raw
            acked[cid] = data

        await asyncio.gather(*(upload(i) for i in range(16)))
        for proc in cluster.procs.values():
            proc.send_signal(signal.SIGTERM)
        late, late_id = new_chunk(1 << 20)
        with contextlib.suppress(aiohttp.ClientError):
            r = await apis[0].put_chunk(late)
            assert r.status in (200, 201, 503), r.raw
            if r.status in (200, 201):
                acked[late_id] = late
    finally:
        for writer in slow:
            writer.transport.abort()
    await asyncio.to_thread(lambda: [p.wait(timeout=120) for p in cluster.procs.values()])
    for i in range(cluster.nodes):
        cluster.start_node(i)
    await asyncio.to_thread(cluster.wait_healthy)
    await asyncio.to_thread(cluster.wait_converged)
    lost = []
    for cid, data in acked.items():
        r = await apis[0].get_chunk(cid)
        if r.status != 200 or r.raw != data:
            lost.append(cid)
    assert not lost, f"{len(lost)} of {len(acked)} acked chunks lost by SIGTERM"


# ---- 8 --------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_scenario_8_failed_drain_is_retried(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A drain that fails with an OS error other than a full disk is retried once the disk
    works again: the chunk reaches nvme."""
    cluster = await inproc.start(4, drain_defer=0.0)
    data, cid = new_chunk()
    a, x, _, _ = cluster.order(cid)
    node = cluster.node(x)
    records = _Records()
    logging.getLogger("storaged").addHandler(records)
    try:
        with broken_dir(node.config.data_dir / "nvme"):
            assert (await api_of(http, cluster, a).put_chunk(data)).status == 201
            await wait_until(
                "the drain failure is reported",
                lambda: any(cid in m for m in records.messages),
            )
    finally:
        logging.getLogger("storaged").removeHandler(records)
    # Retries back off up to 5 s apart: a generous bound for a loaded machine. Once every
    # holder has drained, the owner encodes the chunk and drops the other holders' nvme
    # copies, so x's file may already be gone again: the chunk's recorded state (set only
    # once every hot holder is on nvme) tells that x's drain got through.

    def drained() -> bool:
        info = node.index.get(cid)
        return node.nvme_has(cid) or (info is not None and info.state >= NVME)

    await wait_until("the chunk reaches nvme after the disk is back", drained, timeout=60)


# ---- 10 -------------------------------------------------------------------------------------
async def test_scenario_10_repair_when_first_holder_has_only_fragments(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """An encode that stored only some fragments, then the owner (first in placement order)
    loses its copy: it holds fragments only, and repair must still bring the chunk back to
    ``replication`` copies or all n fragments."""
    cluster = await inproc.start(4, drain_defer=0.0, encode_defer=0.0)
    data, cid = new_chunk()
    a = cluster.order(cid)[0]
    owner = cluster.node(a)
    targets = owner.placement().fragment_targets(cid)
    assert cluster.node_id(a) in targets
    e = next(cluster.index_of(t) for t in targets if t != cluster.node_id(a))
    expected = {i for i, t in enumerate(targets) if t != cluster.node_id(e)}
    n = owner.config.n
    with broken_dir(cluster.node(e).config.data_dir / "cold"):
        assert (await api_of(http, cluster, a).put_chunk(data)).status == 201
        await wait_until("all but e's fragments stored", lambda: cluster.fragments(cid) >= expected)
        # The owner's disk and RAM lose the chunk: it keeps its fragments only.
        await owner.memory.delete(cid)
        await owner.nvme.delete(cid)
    assert not owner.holds_hot(cid) and owner.fragments.get(cid)

    async def repaired() -> bool:
        holders = await verified_holders(cluster, cid)
        return len(holders) >= owner.config.replication or cluster.fragments(cid) == set(range(n))

    await wait_until("repair restores the chunk", repaired, timeout=20)


# ---- 11 -------------------------------------------------------------------------------------
async def test_scenario_11_corruption_on_a_peer_link_is_resent(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """One replica sees a flipped byte on its link (the client's bytes were right): the PUT
    succeeds from the entry node's verified copy, with ``replication`` verified copies."""
    cluster = await inproc.start(4)
    data, cid = new_chunk()
    a, b, _, _ = cluster.order(cid)
    proxy = PeerLinkProxy(("127.0.0.1", cluster.peer_port(b)), cid)
    try:
        await route_through_proxy(cluster, a, b, proxy)
        r = await api_of(http, cluster, a).put_chunk(data)
    finally:
        await proxy.close()
    assert proxy.flipped == 1
    assert r.status == 201, (r.status, r.doc)
    await assert_acked(cluster, cid, r)


# ---- 12 -------------------------------------------------------------------------------------
async def test_scenario_12_racing_commits_of_one_name(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Two commits of different manifests under one name, entering at two of its catalogue
    holders: exactly one 201 and only it visible, or neither visible."""
    cluster = await inproc.start(4)
    data, _ = new_chunk()
    assert (await api_of(http, cluster, 0).put_chunk(data)).status == 201
    manifests = [manifest_for([data], created=1764403200.0 + k) for k in range(2)]
    outcomes = []
    for round_ in range(8):
        name = f"s12/round-{round_}"
        p, q, _ = (cluster.index_of(t) for t in cluster.node(0).placement().name_targets(name))
        replies = await asyncio.gather(
            api_of(http, cluster, p).commit(name, manifests[0]),
            api_of(http, cluster, q).commit(name, manifests[1]),
        )
        statuses = [r.status for r in replies]
        outcomes.append(statuses)
        assert all(s in (201, 409, 503) for s in statuses), [r.raw for r in replies]
        winners = [k for k, s in enumerate(statuses) if s == 201]
        assert len(winners) <= 1, statuses
        got = await api_of(http, cluster, 0).request("GET", f"/v1/checkpoints/{name}")
        if winners:
            assert got.status == 200, f"round {round_}: {statuses}, winner not visible"
            assert got.doc["created"] == manifests[winners[0]]["created"], statuses
        else:
            assert got.status == 404, f"round {round_}: {statuses} yet one is visible"


# ---- 13 -------------------------------------------------------------------------------------
async def test_scenario_13_status_reports_lost_chunks(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Every copy and fragment of a committed checkpoint is gone: ``?status`` says ``lost``."""
    cluster = await inproc.start(4)
    api = api_of(http, cluster, 0)
    chunks = [new_chunk()[0] for _ in range(2)]
    for data in chunks:
        assert (await api.put_chunk(data)).status == 201
    assert (await api.commit("s13/ckpt", manifest_for(chunks))).status == 201
    # Every node dies and loses its disks' chunks; the catalogue survives.
    dirs = [cluster.node(i).config.data_dir for i in cluster.running()]
    for i in cluster.running():
        await cluster.kill(i)
    for d in dirs:
        for tier in ("nvme", "cold"):
            shutil.rmtree(d / tier)
        (d / "chunks.state").unlink(missing_ok=True)
    for i in range(cluster.nodes):
        await cluster.start_node(i)
    await cluster.wait_converged()
    r = await api.request("GET", "/v1/checkpoints/s13/ckpt?status")
    assert r.status == 200, r.raw
    assert r.doc["state"] == "lost" and r.doc.get("lost") == 2, r.doc


# ---- catalogue records lost one holder at a time (found by the nemesis soak) ----------------
@pytest.mark.embedded_only(
    "the embedded catalogue's repair of record files; etcd keeps the records itself"
)
async def test_catalogue_records_survive_their_holders_losing_them_one_at_a_time(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Each holder of a record loses its catalogue (a flipped or replaced disk) in turn, with
    repair passes in between: the record must stay visible and on ``replication`` holders.
    Repair once remembered which holders it had confirmed and never looked again, so three
    such losses spread over time deleted an acknowledged checkpoint (and GC its chunks)."""
    cluster = await inproc.start(4, repair_interval=3600.0)
    name = "cat/lost-one-at-a-time"
    data = new_chunk()[0]
    api = api_of(http, cluster, 0)
    assert (await api.put_chunk(data)).status == 201
    assert (await api.commit(name, manifest_for([data]))).status == 201
    holders = [cluster.index_of(t) for t in cluster.node(0).placement().name_targets(name)]
    for victim in holders:
        await cluster.kill(victim)
        shutil.rmtree(cluster.members[victim].config.data_dir / "catalog")
        await cluster.start_node(victim)
        await cluster.wait_converged()
        assert cluster.node(victim).catalog.raw(name) is None
        for _ in range(2):  # the second pass runs with whatever the first one learnt
            await asyncio.gather(*(cluster.node(i).repair_pass() for i in cluster.running()))
        on = [i for i in holders if cluster.node(i).catalog.raw(name) is not None]
        assert on == holders, f"after repair the record is on {on}, not {holders}"
    r = await api_of(http, cluster, holders[-1]).request("GET", f"/v1/checkpoints/{name}")
    assert r.status == 200, r.raw


# ---- split views and unanswered lookups (found by the nemesis soak) --------------------------
@pytest.mark.embedded_only(
    "the embedded catalogue's primary chosen from a node's view of who is alive; on "
    "etcd racing commits meet in one transaction (scenario 12 runs on both)"
)
async def test_racing_commits_with_split_views_of_who_is_alive(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Two entry nodes disagree on whether the name's primary is up (as under a partition):
    they must not both act as its primary. At most one commit wins, and only it is seen."""
    for round_ in range(3):
        # A cluster per round: a view made wrong on purpose is never corrected here.
        cluster = await inproc.start(4, heartbeat_interval=3600.0, down_after=3600.0)
        data, _ = new_chunk()
        assert (await api_of(http, cluster, 0).put_chunk(data)).status == 201
        manifests = [manifest_for([data], created=1764403200.0 + k) for k in range(2)]
        name = f"split/round-{round_}"
        targets = [cluster.index_of(t) for t in cluster.node(0).placement().name_targets(name)]
        primary = targets[0]
        a, b = [i for i in range(4) if i != primary][:2]
        # a believes the primary is down (a failed call), b does not
        cluster.node(a).membership.report_failure(cluster.node_id(primary))
        replies = await asyncio.gather(
            api_of(http, cluster, a).commit(name, manifests[0]),
            api_of(http, cluster, b).commit(name, manifests[1]),
        )
        statuses = [r.status for r in replies]
        assert statuses[0] == 503, [r.raw for r in replies]  # no primary of its own making
        assert statuses[1] in (201, 409, 503), replies[1].raw
        got = await api_of(http, cluster, primary).request("GET", f"/v1/checkpoints/{name}")
        if statuses[1] == 201:
            assert got.status == 200 and got.doc["created"] == manifests[1]["created"]
        else:
            assert got.status == 404, f"{statuses} yet one is visible"
        await cluster.close()


@pytest.mark.embedded_only(
    "the embedded catalogue's lookup quorum among nodes; on etcd a lookup asks etcd "
    "(etcd down gives 503: tests/coordination/test_etcd.py)"
)
async def test_a_lookup_nobody_answered_is_503_not_404(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """A node cut off from the record's holders must not say the checkpoint does not exist
    (a client would take a 404 as a completed delete, or start anew)."""
    cluster = await inproc.start(4)
    data, _ = new_chunk()
    api = api_of(http, cluster, 0)
    assert (await api.put_chunk(data)).status == 201
    name = next(
        f"cut/{k}"
        for k in range(100)
        if cluster.node_id(3) not in cluster.node(0).placement().name_targets(f"cut/{k}")
    )
    assert (await api.commit(name, manifest_for([data]))).status == 201
    for i in (0, 1, 2):
        await cluster.kill(i)
    survivor = api_of(http, cluster, 3)
    await wait_until(
        "n3 sees the others down",
        lambda: cluster.node(3).membership.alive_ids() == [cluster.node_id(3)],
    )
    for method in ("GET", "DELETE"):
        r = await survivor.request(method, f"/v1/checkpoints/{name}")
        assert r.status == 503 and r.doc["error"] == "catalogue_unavailable", r.raw
    # a name that was never committed is not provably absent either: also 503
    r = await survivor.request("GET", "/v1/checkpoints/cut/never")
    assert r.status == 503, r.raw
    await cluster.start_node(0)
    await cluster.start_node(1)
    await cluster.wait_converged()
    assert (await survivor.request("GET", f"/v1/checkpoints/{name}")).status == 200
    assert (await survivor.request("GET", "/v1/checkpoints/cut/never")).status == 404


# ---- a retry of a commit that succeeded, while a chunk has no live holder --------------------
async def test_retry_of_a_committed_manifest_is_200_while_a_chunk_is_unavailable(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """Identity before availability (docs/API.md): re-committing the identical manifest
    answers 200 even while one of its chunks has no live holder, a different manifest 409
    ``exists``; ``missing_chunks`` stays for manifests nothing was committed of. The
    catalogue still answers (2 of 5 nodes down: the embedded lookup quorum is 3). The
    code before checked the chunks first and answered 409 ``missing_chunks`` to the retry
    of a commit that had succeeded."""
    cluster = await inproc.start(
        5, drain_defer=0.0, repair_interval=3600.0, gc_interval=3600.0, encode_workers=0
    )
    chunks = [new_chunk()[0] for _ in range(3)]
    gone = chunk_id_of(chunks[0])
    h1, h2, h3 = cluster.order(gone)[:3]
    # a name whose (embedded) catalogue primary stays up, committed through a node that does
    name = next(
        f"retry/{k}"
        for k in range(100)
        if cluster.index_of(cluster.node(0).placement().name_targets(f"retry/{k}")[0])
        not in (h1, h2)
    )
    entry = next(i for i in range(5) if i not in (h1, h2, h3))
    api = api_of(http, cluster, entry)
    for data in chunks:
        assert (await api.put_chunk(data)).status == 201
    manifest = manifest_for(chunks)
    assert (await api.commit(name, manifest)).status == 201
    await wait_until(
        "the copies are on nvme",
        lambda: all(cluster.node(i).nvme_has(gone) for i in (h1, h2, h3)),
    )
    # h3 loses its copy (a replaced disk), h1 and h2 go down: no live node holds it
    third = cluster.node(h3)
    await third.memory.delete(gone)
    await third.nvme.delete(gone)
    await cluster.kill(h1)
    await cluster.kill(h2)
    await cluster.wait_converged()
    assert not cluster.hot_holders(gone) and not cluster.fragments(gone)
    r = await api.commit(name, manifest)
    assert r.status == 200, r.raw
    assert r.doc["name"] == name
    r = await api.commit(name, manifest_for(chunks, created=1764403201.0))
    assert (r.status, r.error) == (409, "exists"), r.raw
    r = await api.commit(f"{name}-new", manifest)
    assert (r.status, r.error) == (409, "missing_chunks"), r.raw
    assert r.doc["missing"] == [gone]
    got = await api.request("GET", f"/v1/checkpoints/{name}")
    assert got.status == 200 and got.doc["created"] == manifest["created"]
