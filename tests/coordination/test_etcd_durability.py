"""The etcd catalogue's durability through races with its own upkeep (issue 16), on the
session's real 3-member etcd: interleavings driven step by step, not left to timing.

``StagedSession`` is orchestration, not a mock: every request it lets through reaches etcd
as it would; it can hold a call (until the test lets it go) or lose a call's reply (the
request applied, or never sent, and the caller told it timed out), which is what a
timed-out etcd request is.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from storaged.coord.catalogue import CoordinatorUnavailable
from storaged.coord.etcd import EtcdSession
from storaged.coord.etcd_catalogue import EtcdCatalogue
from storaged.coord.manifest_store import CatalogRecord, CheckpointNotFound
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.node.checkpoints import record_of
from storaged.peer import PeerUnavailable
from tests.conftest import TOKEN, healthy_rig
from tests.coordination.catalogue_conformance import cid, fresh, record
from tests.etcd import etcd_binary
from tests.service.http import Api, random_chunk
from tests.service.inproc import EtcdInprocCluster, wait_until

pytestmark = pytest.mark.skipif(
    etcd_binary() is None or importlib.util.find_spec("etcd3aio") is None,
    reason="needs etcd (apt-get install etcd-server) and the etcd extra (pip install -e .[etcd])",
)

T = TypeVar("T")


@dataclass
class Gate:
    """Holds the ``skip + 1``-th call whose label starts with ``what``: ``reached`` is set
    when it arrives, and it goes on to etcd once ``go`` is set."""

    what: str
    skip: int = 0
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    seen: int = 0


@dataclass
class Loss:
    """The next call whose label starts with ``what`` answers ``CoordinatorUnavailable``:
    after etcd applied it (``applied``: its reply was lost) or without sending it."""

    what: str
    applied: bool
    done: bool = False


async def reached(gate: Gate, task: asyncio.Task[Any]) -> None:
    """Until ``gate`` holds a call of ``task`` (30 s at most); if ``task`` ends first, its
    outcome (an error, or an AssertionError) instead."""
    waiter = asyncio.ensure_future(gate.reached.wait())
    done, _ = await asyncio.wait({waiter, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if waiter in done:
        return
    waiter.cancel()
    if task.done():
        task.result()
        raise AssertionError(f"ended before its call {gate.what!r} was held")
    raise AssertionError(f"no call {gate.what!r} within 30 s")


class StagedSession(EtcdSession):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gates: list[Gate] = []
        self.losses: list[Loss] = []

    def hold(self, what: str, *, skip: int = 0) -> Gate:
        gate = Gate(what, skip)
        self.gates.append(gate)
        return gate

    def lose(self, what: str, *, applied: bool) -> Loss:
        loss = Loss(what, applied)
        self.losses.append(loss)
        return loss

    async def call(self, what: str, op: Awaitable[T]) -> T:
        for gate in self.gates:
            if what.startswith(gate.what):
                gate.seen += 1
                if gate.seen == gate.skip + 1:
                    gate.reached.set()
                    await gate.go.wait()
        for loss in self.losses:
            if what.startswith(loss.what) and not loss.done:
                loss.done = True
                if loss.applied:
                    await super().call(what, op)
                elif inspect.iscoroutine(op):
                    op.close()
                raise CoordinatorUnavailable(f"etcd did not answer {what} (its reply was lost)")
        return await super().call(what, op)


class Catalogues:
    """Catalogues on one fresh key prefix, each with a session of its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sessions: list[EtcdSession] = []

    def open(self, **options: Any) -> tuple[EtcdCatalogue, StagedSession]:
        session = StagedSession(self.url)
        self.sessions.append(session)
        return EtcdCatalogue(None, session, **options), session

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


@pytest.fixture
def etcd_url(request: pytest.FixtureRequest) -> Callable[[], str]:
    """Fresh coordinator URLs on the session's etcd (sync: the rig starts outside a loop)."""
    return healthy_rig(request).fresh_prefix


@pytest.fixture
async def catalogues(etcd_url: Callable[[], str]) -> AsyncIterator[Catalogues]:
    opened = Catalogues(etcd_url())
    try:
        yield opened
    finally:
        await opened.close()


# ---- orphan compaction against a commit (issue 16, 1) ---------------------------------------
@pytest.mark.parametrize("before", ["absent", "tombstone"])
async def test_orphan_compaction_spares_a_retried_commit_landing_after_its_scan(
    catalogues: Catalogues, before: str
) -> None:
    """A commit over ``inline_refs`` whose first attempt timed out (its parts are then older
    than the compactor's previous scan), retried so that its transaction lands between the
    compactor's read of the records and its deletes, keeps every part: the checkpoint
    stays readable and ``references()`` works. The old compaction compared only each
    part's own revision and deleted the part under the committed record."""
    committer, committing = catalogues.open(inline_refs=16)
    compactor, compacting = catalogues.open(inline_refs=16)
    reader, _ = catalogues.open(inline_refs=16)
    name = fresh("late")
    ids = [cid(1), cid(2), cid(3)]  # 97 bytes of ids: over inline_refs, so in parts
    assert await committer.commit(record(fresh("other"), [cid(8)])) is True  # not alone
    held_txn = 0
    if before == "tombstone":
        assert await committer.commit(record(name, [cid(9)], salt="old")) is True
        await committer.delete(name)
        held_txn = 1  # the retry's first transaction expects a free name and fails
    rec = record(name, ids)

    committing.lose("commit of", applied=False)  # the first attempt: parts, then a timeout
    with pytest.raises(CoordinatorUnavailable):
        await committer.commit(rec)
    assert await compactor.compact_orphans() == 0  # its scan sets the horizon past the parts

    # The retry writes its parts again and stops before the transaction that succeeds.
    committed = committing.hold("commit of", skip=held_txn)
    commit = asyncio.create_task(committer.commit(rec))
    await reached(committed, commit)
    # The compactor reads: no record owns those parts yet, and they are old enough.
    scanned = compacting.hold("orphan compaction")
    compaction = asyncio.create_task(compactor.compact_orphans())
    await reached(scanned, compaction)
    committed.go.set()
    assert await asyncio.wait_for(commit, 30) is True  # answered 201
    scanned.go.set()
    await asyncio.wait_for(compaction, 30)

    assert (await reader.get(name)).chunks == ids
    refs = await reader.references()
    assert set(ids) <= refs.chunks
    assert [r.chunks for r in refs.live if r.name == name] == [ids]
    assert await compactor.compact_orphans() == 0  # owned: later passes leave them too
    assert (await reader.get(name)).chunks == ids


async def test_orphan_parts_go_also_where_no_record_was_ever_committed(
    catalogues: Catalogues,
) -> None:
    """The horizon is set by a scan that finds no record at all (it used to take its
    revision from the records it read, so a catalogue without one kept its orphans)."""
    committer, committing = catalogues.open(inline_refs=16)
    compactor, _ = catalogues.open(inline_refs=16)
    name = fresh("alone")
    committing.lose("commit of", applied=False)  # parts written, the transaction never sent
    with pytest.raises(CoordinatorUnavailable):
        await committer.commit(record(name, [cid(1), cid(2)]))
    assert await compactor.compact_orphans() == 0  # sets the horizon
    assert await compactor.compact_orphans() == 1
    assert await compactor.find(name) is None


# ---- a record short of a part is repaired (issue 16, 2) -----------------------------------
def two_rank_manifest(chunks: list[bytes]) -> dict[str, Any]:
    """Rank 0 streams every chunk but the last, rank 1 the last two: the chunk list of the
    record is the distinct ids in first-seen order (the second-to-last is named twice)."""

    def shard(rank: int, stream: list[bytes]) -> dict[str, Any]:
        total = sum(len(c) for c in stream)
        item = {"key": f"r{rank}", "dtype": "uint8", "global_shape": [total], "offsets": [0],
                "shape": [total], "start": 0, "length": total}  # fmt: skip
        chunks = [[chunk_id_of(c), len(c)] for c in stream]
        return {"rank": rank, "chunks": chunks, "items": [item]}

    return {"format": 1, "created": 1764403200.0, "meta": {},
            "shards": [shard(0, chunks[:-1]), shard(1, chunks[-2:])]}  # fmt: skip


def checked_record(name: str, chunks: list[bytes]) -> CatalogRecord:
    """The record ``Checkpoints.commit`` makes of ``two_rank_manifest(chunks)``."""
    return record_of(name, check_manifest(two_rank_manifest(chunks), 2**20))


async def drop_parts(session: EtcdSession, name: str) -> int:
    """Delete every chunk-id part of ``name`` in etcd behind the catalogue's back."""
    kv = await session.kv()
    prefix = session.key("refs", f"{name}#")
    return int((await kv.delete(prefix, session.range_end(prefix))).deleted)


@pytest.mark.parametrize("manifest_in", ["etcd", "data plane"])
async def test_a_record_short_of_its_chunk_id_parts_is_repaired_from_its_manifest(
    tmp_path: Path,
    etcd_url: Callable[[], str],
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    manifest_in: str,
) -> None:
    """A committed checkpoint whose chunk-id part is gone from etcd answers 503 and stops
    ``references()`` (fail safe) until a node's repair pass rewrites the part from the
    manifest (inline in etcd, or in chunks on the data plane): then it reads back with the
    same chunk list, in order, and GC's snapshot works again."""
    options: dict[str, Any] = {"inline_refs": 16}
    if manifest_in == "data plane":
        options["inline_manifest"] = 64
    url = etcd_url()
    cluster = EtcdInprocCluster(tmp_path / "nodes", 3, {"coordinator": url},
                                catalogue_options=options)  # fmt: skip
    session = EtcdSession(url)
    try:
        await cluster.start()
        api = Api(http, cluster.url(0), TOKEN)
        chunks = [random_chunk(1000 + i) for i in range(4)]
        for c in chunks:
            assert (await api.put_chunk(c)).status == 201
        name = fresh("damaged")
        assert (await api.commit(name, two_rank_manifest(chunks))).status == 201
        expected = [chunk_id_of(c) for c in chunks]
        catalogue = cluster.node(1).catalogue
        assert (await catalogue.get(name)).chunks == expected

        assert await drop_parts(session, name) == 1
        reply = await api.request("GET", f"/v1/checkpoints/{name}")
        assert reply.status == 503, reply.raw
        with pytest.raises(CoordinatorUnavailable, match="incomplete"):
            await catalogue.references()  # GC frees nothing meanwhile

        with caplog.at_level(logging.WARNING, logger="storaged.coord.catalogue"):
            await cluster.node(1).repair_pass()
        assert (await catalogue.get(name)).chunks == expected
        assert any(
            r.levelno == logging.WARNING and name in r.getMessage() for r in caplog.records
        ), caplog.text
        refs = await catalogue.references()
        assert set(expected) <= refs.chunks
        assert [r.chunks for r in refs.live if r.name == name] == [expected]
        reply = await api.request("GET", f"/v1/checkpoints/{name}")
        assert reply.status == 200, reply.raw
        await cluster.node(1).repair_pass()  # nothing left to do: the record is whole
        assert (await cluster.node(2).catalogue.get(name)).chunks == expected
    finally:
        await cluster.close()
        await session.close()


async def test_a_damaged_record_whose_manifest_does_not_give_its_chunks_stays_refused(
    catalogues: Catalogues, caplog: pytest.LogCaptureFixture
) -> None:
    """Repair writes only what the manifest proves: a record whose manifest is not the
    checked manifest of its digest keeps refusing reads, with an ERROR naming it."""
    cat, session = catalogues.open(inline_refs=16)
    name = fresh("unprovable")
    assert await cat.commit(record(name, [cid(1), cid(2)])) is True  # not a real manifest
    assert await drop_parts(session, name) == 1
    with pytest.raises(CoordinatorUnavailable, match="incomplete"):
        await cat.find(name)
    with caplog.at_level(logging.ERROR, logger="storaged.coord.catalogue"):
        assert await cat.repair() == 0
    assert any(r.levelno == logging.ERROR and name in r.getMessage() for r in caplog.records)
    with pytest.raises(CoordinatorUnavailable, match="incomplete"):
        await cat.references()


async def test_a_repair_racing_a_delete_writes_nothing_for_the_tombstone(
    catalogues: Catalogues,
) -> None:
    """Each part a repair writes checks the record unchanged: a delete landing between the
    repair's read and its write wins, and no part is left under the tombstone."""
    repairer, repairing = catalogues.open(inline_refs=16)
    other, session = catalogues.open(inline_refs=16)
    name = fresh("gone")
    rec = checked_record(name, [random_chunk(100 + i) for i in range(3)])
    assert await repairer.commit(rec) is True
    assert await drop_parts(session, name) == 1
    with pytest.raises(CoordinatorUnavailable, match="incomplete"):
        await repairer.find(name)
    writing = repairing.hold("repair of")
    repair = asyncio.create_task(repairer.repair())
    await reached(writing, repair)
    await other.delete(name)
    writing.go.set()
    assert await asyncio.wait_for(repair, 30) == 0
    assert await drop_parts(session, name) == 0  # none written under the tombstone
    found = await other.find(name)
    assert found is not None and found.deleted is not None


# ---- a lost answer from etcd (issue 16, 3) ------------------------------------------------
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not applied"])
async def test_a_delete_whose_answer_is_lost_succeeds(
    catalogues: Catalogues, applied: bool
) -> None:
    """A delete's transaction that etcd applied (or never got) but whose answer timed out:
    the call reads its own tombstone back (or deletes again) and succeeds. It used to
    answer 503, and the client's retry then 404, for a delete that had gone in."""
    cat, session = catalogues.open()
    reader, _ = catalogues.open()
    name = fresh("lost")
    assert await cat.commit(record(name, [cid(1)])) is True
    loss = session.lose("delete of", applied=applied)
    await cat.delete(name)
    assert loss.done
    found = await reader.find(name)
    assert found is not None and found.deleted is not None
    with pytest.raises(CheckpointNotFound):
        await reader.delete(name)  # another delete of it finds it gone, as before


async def test_a_delete_whose_answer_is_lost_never_deletes_a_newer_commit(
    catalogues: Catalogues,
) -> None:
    """Between the lost answer and the read that follows it, a new commit takes the name:
    the delete is done (the record it meant is gone) and the new checkpoint stays."""
    cat, session = catalogues.open()
    other, _ = catalogues.open()
    name = fresh("lost")
    assert await cat.commit(record(name, [cid(1)])) is True
    session.lose("delete of", applied=True)
    reading = session.hold("read of", skip=1)  # the read after the lost answer
    delete = asyncio.create_task(cat.delete(name))
    await reached(reading, delete)
    newer = record(name, [cid(2)], salt="newer")
    assert await other.commit(newer) is True
    reading.go.set()
    await asyncio.wait_for(delete, 30)
    assert (await other.get(name)).digest == newer.digest


@pytest.mark.parametrize("inline_refs", [512 * 2**10, 16], ids=["inline", "in parts"])
async def test_a_commit_whose_answer_is_lost_is_completed_by_its_retry(
    catalogues: Catalogues, inline_refs: int
) -> None:
    """A commit's transaction applied but answered with a timeout (503 to the client): the
    retry of the same record finds it there, answers False (200), and the record is whole."""
    cat, session = catalogues.open(inline_refs=inline_refs)
    reader, _ = catalogues.open(inline_refs=inline_refs)
    name = fresh("lost")
    rec = record(name, [cid(1), cid(2), cid(3)])
    session.lose("commit of", applied=True)
    with pytest.raises(CoordinatorUnavailable):
        await cat.commit(rec)
    assert await cat.commit(rec) is False
    assert (await reader.get(name)).chunks == rec.chunks
    assert [r.chunks for r in (await reader.references()).live if r.name == name] == [rec.chunks]


# ---- a graceful stop leaves placement (issue 16, 4) ----------------------------------------
async def test_a_node_stopping_gracefully_on_etcd_leaves_placement_while_it_drains(
    tmp_path: Path, etcd_url: Callable[[], str], http: aiohttp.ClientSession
) -> None:
    """``Node.shutdown`` on etcd: while a PUT in flight holds the stop, the other nodes
    already count the stopping node down (``/v1/cluster``, placement), and a new PUT through
    them is placed on the others only. It used to stay in placement until it exited (its
    lease lived on), so their PUTs kept choosing it and meeting its refusals."""
    cluster = EtcdInprocCluster(tmp_path / "nodes", 4, {"coordinator": etcd_url()})
    try:
        await cluster.start()
        victim, others = cluster.node(3), [0, 1, 2]
        data = random_chunk(64 * 1024)
        arrived, finish = asyncio.Event(), asyncio.Event()

        async def slow_body() -> AsyncIterator[bytes]:
            yield data[:1024]
            arrived.set()
            await finish.wait()
            yield data[1024:]

        put = asyncio.create_task(victim.put_chunk(chunk_id_of(data), len(data), slow_body()))
        await asyncio.wait_for(arrived.wait(), 30)
        stop = asyncio.create_task(victim.shutdown(timeout=120))
        await wait_until(
            "n3 out of the other nodes' placement",
            lambda: all("n3" not in cluster.node(i).placement().alive for i in others),
            30,
        )
        assert not stop.done()  # still stopping: the PUT in flight holds it
        api = Api(http, cluster.url(0), TOKEN)
        listed = await api.request("GET", "/v1/cluster")
        assert {n["id"]: n["alive"] for n in listed.doc["nodes"]}["n3"] is False, listed.raw
        fresh_data = random_chunk(4096)
        assert (await api.put_chunk(fresh_data)).status == 201
        assert "n3" not in cluster.hot_holders(chunk_id_of(fresh_data))
        finish.set()
        status, _ = await asyncio.wait_for(put, 30)
        assert status == 201  # the PUT it had taken before it began stopping
        assert await asyncio.wait_for(stop, 120) is True  # drained, then closed
    finally:
        await cluster.close()


# ---- a member removed while an operation holds a view naming it (issue 16, §2) ---------------
async def test_an_operation_whose_view_names_a_member_removed_meanwhile_does_not_fail(
    tmp_path: Path, etcd_url: Callable[[], str], http: aiohttp.ClientSession
) -> None:
    """A gone member's record leaves etcd while other nodes still hold views that name it
    (their restore plans, repairs and reads had taken one). Its addresses must still be
    known for those views, and a call to it fails as a call to any dead node does. Before,
    ``Node.spec`` raised ``KeyError`` out of ``?plan`` (500) and of repair's reads (a
    traceback in the nemesis's etcd run, seed 2)."""
    cluster = EtcdInprocCluster(tmp_path / "nodes", 5, {"coordinator": etcd_url()})
    try:
        await cluster.start()
        node = cluster.node(0)
        view = node.placement()
        assert "n4" in view.alive
        spec = node.spec("n4")
        await cluster.kill(4)
        await wait_until("n4 counted down", lambda: not node.membership.is_alive("n4"), 30)
        assert await node.membership.forget("n4")
        await wait_until("n4 removed from n0's members", lambda: "n4" not in {
            m.id for m in node.membership.view().members}, 30)  # fmt: skip
        assert node.spec("n4") == spec  # as the view had it
        with pytest.raises(PeerUnavailable):
            await node.call("n4", "ping", {})
        held = await node.holdings(view.alive, ["0" * 64])
        assert held == {"0" * 64: []}
    finally:
        await cluster.close()
