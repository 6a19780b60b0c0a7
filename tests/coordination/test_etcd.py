"""The etcd coordinator against a real 3-member etcd on loopback: the catalogue and
membership conformance suites with in-process nodes, and what only etcd has to show — a
member killed during commits, etcd entirely down, leases that expire, manifests and
chunk lists too big for one etcd request."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import blake3
import pytest

from storaged.config import ConfigError, load_config
from storaged.coord.catalogue import Catalogue, CatalogueUnavailable, CommitConflict
from storaged.coord.etcd import EtcdSession
from storaged.coord.etcd_catalogue import EtcdCatalogue, pack_ids, unpack_ids
from storaged.coord.etcd_membership import EtcdMembership
from storaged.coord.manifest_store import CheckpointNotFound
from storaged.tools.local_cluster import free_port_block
from tests.conftest import TOKEN
from tests.coordination.catalogue_conformance import CatalogueTests, cid, fresh, record
from tests.coordination.membership_conformance import (
    InprocMembers,
    Members,
    MembershipTests,
    as_a_crash,
)
from tests.etcd import EtcdCluster, etcd_binary
from tests.service.http import Api, manifest_for, random_chunk
from tests.service.inproc import SECRET, EtcdInprocCluster, wait_until

pytestmark = pytest.mark.skipif(
    etcd_binary() is None or importlib.util.find_spec("etcd3aio") is None,
    reason="needs etcd (apt-get install etcd-server; scripts/test does it as root) and the "
    "etcd extra (pip install -e .[etcd])",
)

T = TypeVar("T")

#: generous: etcd elections and lease expiry on a loaded 2-core machine
SLOW = 60.0


class EtcdRig:
    """An etcd cluster and the node clusters started on it (each under its own prefix)."""

    def __init__(self, root: Path, etcd: EtcdCluster) -> None:
        self.root = root
        self.etcd = etcd
        self.clusters: list[EtcdInprocCluster] = []

    async def start(
        self, nodes: int = 4, *, catalogue_options: dict[str, Any] | None = None
    ) -> EtcdInprocCluster:
        cluster = EtcdInprocCluster(
            self.root / f"etcd-nodes{len(self.clusters)}",
            nodes,
            {"coordinator": self.etcd.fresh_prefix()},
            catalogue_options=dict(catalogue_options or {}),
        )
        self.clusters.append(cluster)
        await cluster.start()
        return cluster

    def session(self, cluster: EtcdInprocCluster) -> EtcdSession:
        """A session of its own on ``cluster``'s keys (the caller closes it)."""
        return EtcdSession(cluster.node(cluster.running()[0]).config.coordinator)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdCluster]:
    root = tmp_path / "etcd"
    root.mkdir()
    cluster = EtcdCluster(root)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()


@pytest.fixture
async def rig(tmp_path: Path, etcd: EtcdCluster) -> AsyncIterator[EtcdRig]:
    """Nodes stop before etcd does (their leases are revoked, not left to expire)."""
    rig = EtcdRig(tmp_path, etcd)
    try:
        yield rig
    finally:
        if not all(etcd.running(m.index) for m in etcd.members):
            await etcd.start_all()
        for cluster in rig.clusters:
            await cluster.close()


async def retried(what: str, call: Callable[[], Awaitable[T]], tries: int = 60) -> T:
    """``call`` until it does not raise ``CatalogueUnavailable`` (a client's retry)."""
    for _ in range(tries):
        try:
            return await call()
        except CatalogueUnavailable:
            await asyncio.sleep(0.25)
    raise AssertionError(f"{what}: still unavailable after {tries} tries")


# ---- the conformance suites ----------------------------------------------------------------
class TestEtcdCatalogue(CatalogueTests):
    @pytest.fixture
    async def catalogues(self, rig: EtcdRig) -> AsyncIterator[list[Catalogue]]:
        cluster = await rig.start(4)
        yield [cluster.node(i).catalogue for i in range(4)]


class TestEtcdMembership(MembershipTests):
    forgets = True

    @pytest.fixture
    async def members(self, rig: EtcdRig) -> AsyncIterator[Members]:
        cluster = await rig.start(4)
        yield InprocMembers(cluster)


# ---- membership: leases, joins, leaves, draining ------------------------------------------
async def test_a_node_whose_lease_expires_goes_down_and_its_restart_comes_back(
    rig: EtcdRig,
) -> None:
    """A crashed node revokes nothing: its lease runs out and the others see it down."""
    cluster = await rig.start(4)
    victim = cluster.node(3)
    assert isinstance(victim.membership, EtcdMembership)
    victim.membership._lease = 0  # as after a crash: close() has no lease to revoke
    await cluster.kill(3)
    others = [cluster.node(i).membership for i in range(3)]
    await wait_until("n3 down after its lease expired", lambda: all(
        not m.is_alive("n3") for m in others), SLOW)  # fmt: skip
    for m in others:
        assert m.all_ids() == ["n0", "n1", "n2", "n3"]  # down, still a member
        since = m.down_since("n3")
        assert since is not None and since <= time.time()
        assert m.down_since("n0") is None
        view = m.view()
        assert view.alive == {"n0", "n1", "n2"} and view.revision > 0
    await cluster.start_node(3)
    await cluster.wait_converged(SLOW)
    assert all(m.down_since("n3") is None for m in others)


async def test_joins_leaves_and_draining_reach_every_node(rig: EtcdRig) -> None:
    cluster = await rig.start(3)
    views = [cluster.node(i).membership for i in range(3)]
    # a node that joins at run time (not in anyone's configuration)
    cfg = load_config(
        None,
        "x9",
        overrides={
            "coordinator": cluster.node(0).config.coordinator,
            "url": "http://127.0.0.1:1",
            "peer": "127.0.0.1:2",
            "data": str(rig.root / "x9"),
            "cluster_secret": cluster.node(0).config.cluster_secret,
        },
    )
    joiner = EtcdMembership(cfg, EtcdSession(cfg.coordinator))
    await joiner.start()
    try:
        await wait_until("x9 joined everywhere", lambda: all(
            "x9" in v.alive_ids() for v in views), SLOW)  # fmt: skip
        assert views[0].node("x9").url == "http://127.0.0.1:1"
        assert set(joiner.alive_ids()) == {"n0", "n1", "n2", "x9"}
        await views[1].drains.mark("x9")
        await wait_until("x9 draining everywhere", lambda: all(
            v.view().draining == {"x9"} for v in [*views, joiner]), SLOW)  # fmt: skip
        await views[1].drains.mark("x9", draining=False)
        await wait_until("x9 active again", lambda: all(
            not v.view().draining for v in views), SLOW)  # fmt: skip
        with pytest.raises(KeyError):
            await views[0].drains.mark("no-such-node")
        await joiner.leave()
        await wait_until("x9 left everywhere", lambda: all(
            "x9" not in v.all_ids() for v in views), SLOW)  # fmt: skip
    finally:
        await joiner.close()
    assert all(v.view().members == views[0].nodes() for v in views)
    assert [n.id for n in views[0].nodes()] == ["n0", "n1", "n2"]


async def test_the_mark_a_member_forgotten_while_draining_left_can_be_lifted(
    rig: EtcdRig,
) -> None:
    """Forgotten while draining, a member leaves a drain mark (it comes back draining: the
    conformance suite); a cancel lifts that mark while it is away, and it comes back
    active. Marking a forgotten member draining is refused as for any stranger."""
    cluster = await rig.start(4)
    views = [cluster.node(i).membership for i in range(3)]
    await views[0].drains.mark("n3")
    await wait_until("n3 draining everywhere", lambda: all(
        v.drains.is_draining("n3") for v in views), SLOW)  # fmt: skip
    as_a_crash(cluster.node(3).membership)
    await cluster.kill(3)
    await wait_until("n3 down", lambda: not views[0].is_alive("n3"), SLOW)
    assert await views[1].forget("n3")
    await wait_until("n3 forgotten everywhere", lambda: all(
        "n3" not in v.all_ids() for v in views), SLOW)  # fmt: skip
    with pytest.raises(KeyError):
        await views[2].drains.mark("n3")  # a stranger now
    await views[2].drains.mark("n3", draining=False)  # lifts the mark it left
    with pytest.raises(KeyError):
        await views[2].drains.mark("n3", draining=False)  # nothing left to lift
    await cluster.start_node(3)
    await cluster.wait_converged(SLOW)
    back = cluster.node(3).membership
    for v in [*views, back]:
        assert v.alive_ids() == ["n0", "n1", "n2", "n3"]
        assert not v.drains.is_draining("n3")


# ---- the catalogue: what does not fit in one etcd request ---------------------------------
async def test_a_big_manifest_lives_on_the_data_plane_and_gc_keeps_it(rig: EtcdRig) -> None:
    cluster = await rig.start(4, catalogue_options={"inline_manifest": 1024})
    a, b = cluster.node(0).catalogue, cluster.node(2).catalogue
    name = fresh("big")
    rec = record(name, [cid(7)])
    rec.manifest = bytes(range(256)) * 64  # 16 KiB: over the inline limit
    manifest_id = blake3.blake3(rec.manifest).hexdigest()
    assert await a.commit(rec) is True
    got = await b.get(name)
    assert got.manifest == rec.manifest and got.chunks == [cid(7)]
    # three RAM copies on the data plane, only its id in etcd
    assert len(cluster.hot_holders(manifest_id)) == 3
    session = rig.session(cluster)
    try:
        kv = await session.kv()
        stored = await kv.get(session.key("manifest", f"{name}#{rec.digest}"))
        assert not stored.kvs
    finally:
        await session.close()
    refs = await b.references()
    assert manifest_id in refs.chunks and cid(7) in refs.chunks
    assert await b.commit(record(name, [cid(7)])) is False  # the retry: same digest
    await a.delete(name)
    assert manifest_id not in (await b.references()).chunks

    # over max_chunk_size (4 MiB here): in pieces, each a chunk
    huge = record(fresh("big"), [cid(8)])
    huge.manifest = bytes(range(256)) * (9 * 2**20 // 256)  # 9 MiB: three pieces
    pieces = [huge.manifest[i : i + 4 * 2**20] for i in range(0, len(huge.manifest), 4 * 2**20)]
    piece_ids = {blake3.blake3(p).hexdigest() for p in pieces}
    assert await b.commit(huge) is True
    assert (await a.get(huge.name)).manifest == huge.manifest
    assert piece_ids <= (await a.references()).chunks


async def test_chunk_lists_over_one_request_are_written_in_parts(rig: EtcdRig) -> None:
    cluster = await rig.start(4, catalogue_options={"inline_refs": 4096})
    a, b = cluster.node(1).catalogue, cluster.node(3).catalogue
    name = fresh("many")
    ids = [cid(100_000 + i) for i in range(20_000)]  # 640 KB of ids: three parts
    rec = record(name, ids)
    rec.digest = blake3.blake3(rec.digest.encode()).hexdigest()  # as long as a real one
    assert await a.commit(rec) is True
    assert (await b.get(name)).chunks == ids
    refs = await b.references()
    assert set(ids) <= refs.chunks
    [live] = [r for r in refs.live if r.name == name]
    assert live.chunks == ids
    # a delete takes the parts with it; the name can be committed again
    await b.delete(name)
    assert not set(ids) & (await a.references()).chunks
    assert await a.commit(record(name, ids[:5], salt="again")) is True
    assert (await b.get(name)).chunks == ids[:5]


def test_chunk_id_parts_round_trip() -> None:
    ids = [cid(i) for i in range(5)]
    assert unpack_ids(pack_ids(ids)) == ids
    assert len(pack_ids(ids)) == 1 + 32 * 5
    odd = ["not-hex", cid(1)]
    assert unpack_ids(pack_ids(odd)) == odd
    with pytest.raises(ValueError):
        unpack_ids(b"\x07junk")


async def test_tombstones_are_compacted_and_the_name_is_free_after(rig: EtcdRig) -> None:
    cluster = await rig.start(4)
    cat = cluster.node(0).catalogue
    assert isinstance(cat, EtcdCatalogue)
    keep, gone = fresh("tomb"), fresh("tomb")
    assert await cat.commit(record(keep, [cid(1)]))
    assert await cat.commit(record(gone, [cid(2)]))
    await cat.delete(gone)
    assert await cat.compact_tombstones(older_than=3600.0) == 0  # too young
    found = await cat.find(gone)
    assert found is not None and found.deleted is not None
    assert await cat.compact_tombstones(older_than=0.0) == 1
    assert await cat.find(gone) is None
    assert (await cat.get(keep)).chunks == [cid(1)]
    with pytest.raises(CheckpointNotFound):
        await cat.delete(gone)
    assert await cat.commit(record(gone, [cid(3)], salt="new")) is True


# ---- etcd members fail --------------------------------------------------------------------
async def test_the_leader_killed_during_commits_loses_and_duplicates_none(
    rig: EtcdRig, etcd: EtcdCluster
) -> None:
    cluster = await rig.start(4)
    catalogues = [cluster.node(i).catalogue for i in range(4)]
    names = [fresh("stream") for _ in range(60)]
    created: dict[str, int] = {n: 0 for n in names}
    halfway = asyncio.Event()

    async def writer(w: int) -> None:
        for i, name in enumerate(names[w::4]):
            if i == 5:
                halfway.set()
            rec = record(name, [cid(i)])
            if await retried(name, lambda: catalogues[w].commit(rec)):  # noqa: B023 - awaited here
                created[name] += 1

    async def chaos() -> None:
        await halfway.wait()
        leader = await etcd.leader()
        await etcd.kill(leader)
        await asyncio.sleep(1.0)  # commits go on against the other two members
        await etcd.start_member(leader)

    await asyncio.gather(*(writer(w) for w in range(4)), chaos())
    listed = [r.name for r in await retried("list", lambda: catalogues[1].list("stream/"))]
    assert sorted(listed) == sorted(names)  # none lost, none twice
    # a retry after a lost answer returns False: so at most one True per name
    assert all(count <= 1 for count in created.values()), created
    refs = await retried("references", catalogues[2].references)
    assert {n for n in names} <= {r.name for r in refs.live}


async def test_etcd_entirely_down_reads_go_on_catalogue_fails_fast_then_recovers(
    rig: EtcdRig, etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await rig.start(4)
    node = cluster.node(0)
    data = b"held through the outage" * 1000
    chunk = blake3.blake3(data).hexdigest()

    async def body() -> AsyncIterator[bytes]:
        yield data

    status, _ = await node.put_chunk(chunk, len(data), body())
    assert status == 201
    name = fresh("outage")
    assert await node.catalogue.commit(record(name, [chunk]))
    alive_before = node.membership.alive_ids()

    await etcd.kill_all()
    # reads of what the nodes hold go on, membership keeps its last view
    for i in range(4):
        got, _ = await cluster.node(i).read_chunk(chunk)
        assert bytes(got) == data
    assert node.membership.alive_ids() == alive_before
    # every catalogue call gives up with CatalogueUnavailable, bounded by its deadline
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: node.catalogue.commit(record(fresh("outage"), [chunk])),
        lambda: node.catalogue.find(name),
        lambda: node.catalogue.list("outage/"),
        lambda: node.catalogue.delete(name),
        node.catalogue.references,
    ]
    for call in calls:
        async with asyncio.timeout(SLOW):
            with pytest.raises(CatalogueUnavailable):
                await call()
    # over HTTP: chunk reads served; writes and commits 503 coordinator_unavailable
    async with aiohttp.ClientSession() as http:
        api = Api(http, cluster.url(2), TOKEN)
        assert (await api.get_chunk(chunk)).raw == data
        other = random_chunk(4321)
        await wait_until(
            "the node notices its lease is not renewed",
            lambda: not cluster.node(2).membership.coordinator_reachable(),
            SLOW,
        )
        for reply in (
            await api.put_chunk(other),
            await api.commit(fresh("outage"), manifest_for([data])),
        ):
            assert reply.status == 503, reply.raw
            assert reply.doc["error"] == "coordinator_unavailable", reply.raw
            assert "Retry-After" in reply.headers
        # What needs the catalogue says so (503 with Retry-After, never 500 internal).
        for path in ("/v1/checkpoints", f"/v1/checkpoints/{name}?plan", "/v1/cluster"):
            answer = await api.request("GET", path)
            assert answer.status in (200, 503), (path, answer.status, answer.raw)
            if answer.status == 503:
                assert "Retry-After" in answer.headers, (path, answer.raw)
    # Background passes (GC, repair, encode) meet the outage on every node for a while:
    # each logs a line, not a traceback (the nemesis's etcd soak found tracebacks here).
    await asyncio.sleep(3.0)
    tracebacks = [
        f"{r.name}: {r.getMessage()}" for r in caplog.records
        if r.exc_info and r.name.startswith("storaged")
    ]  # fmt: skip
    assert not tracebacks, tracebacks

    await etcd.start_all()
    assert (await retried("get", lambda: node.catalogue.get(name))).chunks == [chunk]
    again = fresh("outage")
    assert await retried("commit", lambda: cluster.node(1).catalogue.commit(record(again, [chunk])))
    await cluster.wait_converged(SLOW)
    with pytest.raises(CommitConflict):
        await cluster.node(2).catalogue.commit(record(again, [chunk], salt="other"))


# ---- configuration ---------------------------------------------------------------------------
def test_coordinator_setting_is_checked() -> None:
    base = {"cluster_secret": "s" * 32, "url": "http://127.0.0.1:7400", "peer": "127.0.0.1:8400",
            "data": "/tmp/x"}  # fmt: skip
    cfg = load_config(None, "n0", overrides={**base, "coordinator": "etcd://a:1,b:2/p"})
    assert cfg.node.url == "http://127.0.0.1:7400" and cfg.node.peer == "127.0.0.1:8400"
    for bad, says in [
        ("http://a:1", "etcd://"),
        ("etcd://", "names no endpoint"),
        ("etcd://a:b", "not host:port"),
        ("etcd://a:1/x#y", "'#'"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, "n0", overrides={**base, "coordinator": bad})
    with pytest.raises(ConfigError, match="url"):
        load_config(None, "n0", overrides={**base, "coordinator": "etcd://a:1", "url": "x"})
    with pytest.raises(ConfigError, match=r"no \[\[nodes\]\]"):
        load_config(None, "n0", overrides=base)  # without a coordinator: a cluster file


# ---- storaged serve --coordinator, no cluster file ---------------------------------------
async def test_serve_with_a_coordinator_and_no_cluster_file(
    rig: EtcdRig, etcd: EtcdCluster, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    coordinator = rig.etcd.fresh_prefix()
    base = free_port_block(6)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    env = {**os.environ, "STORAGED_CLUSTER_SECRET": SECRET, "STORAGED_TOKEN": TOKEN}
    procs = []
    try:
        for i in range(3):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "storaged.cli",
                    "serve",
                    "--coordinator",
                    coordinator,
                    "--node",
                    f"s{i}",
                    "--url",
                    urls[i],
                    "--peer",
                    f"127.0.0.1:{base + 3 + i}",
                    "--data",
                    str(tmp_path / f"s{i}"),
                    "--memory-capacity",
                    "128MiB",
                    "--nvme-capacity",
                    "1GiB",
                    "--cold-capacity",
                    "1GiB",
                    "--prefault-fraction",
                    "0",
                    "--log-level",
                    "WARNING",
                    stdin=asyncio.subprocess.DEVNULL,
                    env=env,
                )
            )
        api = Api(http, urls[0], TOKEN)

        async def all_alive() -> bool:
            try:
                r = await api.request("GET", "/v1/cluster")
            except aiohttp.ClientError:
                return False
            nodes = r.doc["nodes"] if r.status == 200 else []
            return sorted(n["id"] for n in nodes if n["alive"]) == ["s0", "s1", "s2"]

        await wait_until("three nodes joined through etcd", all_alive, SLOW)
        data = random_chunk(64 * 1024)
        assert (await api.put_chunk(data)).status == 201
        assert (await api.commit("served/ckpt-1", manifest_for([data]))).status == 201
        got = await api.request("GET", "/v1/checkpoints/served/ckpt-1", url=urls[2])
        assert got.status == 200 and got.doc["shards"][0]["chunks"][0][1] == len(data)
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                async with asyncio.timeout(SLOW):
                    await p.wait()
            except TimeoutError:
                p.kill()
                await p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0]


async def test_orphan_chunk_id_parts_go_and_a_commit_in_flight_survives_it(rig: EtcdRig) -> None:
    # Each node's catalogue compacts at its first repair pass, then not for an hour: once
    # every one has, the calls below are the only compactions (their counts are exact).
    options = {"inline_refs": 16, "compact_interval": 3600.0}
    cluster = await rig.start(4, catalogue_options=options)
    cat = cluster.node(0).catalogue
    assert isinstance(cat, EtcdCatalogue)
    catalogues = [cluster.node(i).catalogue for i in range(4)]
    await wait_until(
        "every node's first compaction",
        lambda: all(getattr(c, "_last_compaction", None) is not None for c in catalogues),
        SLOW,
    )
    name = fresh("orphan")
    winner, loser = record(name, [cid(1), cid(2)]), record(name, [cid(3)], salt="lost")
    assert await cat.commit(winner) is True
    with pytest.raises(CommitConflict):
        await cat.commit(loser)  # its parts were written before its transaction lost
    session = rig.session(cluster)
    try:
        kv = await session.kv()
        prefix = session.key("refs", "")

        async def parts() -> int:
            got = await kv.get(prefix, session.range_end(prefix), keys_only=True)
            return len(got.kvs)

        assert await parts() == 2  # the winner's and the loser's
        assert await cat.compact_orphans() == 0  # the first scan only sets the horizon
        assert await cat.compact_orphans() == 1
        assert await parts() == 1
        assert (await cat.get(name)).chunks == [cid(1), cid(2)]
        refs = await cat.references()
        assert {cid(1), cid(2)} <= refs.chunks and cid(3) not in refs.chunks

        # A commit whose parts go between their write and its transaction (as a
        # compaction or a delete of the name would do) writes them again, never commits
        # a record without its chunk ids.
        real_put_parts = cat._put_parts
        calls = 0

        async def put_then_lose(keys: list[str], parts: list[bytes]) -> None:
            nonlocal calls
            await real_put_parts(keys, parts)
            calls += 1
            if calls == 1:
                await kv.delete(keys[0])

        cat._put_parts = put_then_lose  # type: ignore[method-assign]
        other = fresh("orphan")
        assert await cat.commit(record(other, [cid(4), cid(5)])) is True
        assert calls == 2
        assert (await cluster.node(1).catalogue.get(other)).chunks == [cid(4), cid(5)]
        assert {cid(4), cid(5)} <= (await cat.references()).chunks
    finally:
        await session.close()
