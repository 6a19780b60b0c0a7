"""``Checkpoints`` on real in-process nodes (the embedded catalogue): a commit naming a
chunk the cluster does not hold is a ``Conflict`` ``missing_chunks`` (409) and commits
nothing; an identical re-commit is 200 with a holder down, and even once no node holds
one of its chunks (identity before availability, I4); a committed checkpoint's status and
restore plan say where its chunks are.

Background passes and the encoders are kept out of the way: the chunks stay hot.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from storaged.errors import Conflict, NotFound
from storaged.ids import chunk_id_of
from storaged.manifest import CheckedManifest, check_manifest
from tests.service.http import manifest_for
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

QUIET: dict[str, Any] = {
    "repair_interval": 3600.0,
    "gc_interval": 3600.0,
    "scrub_interval": 3600.0,
}


async def _start(inproc: InprocFactory) -> InprocCluster:
    cluster = await inproc.start(5, **QUIET)
    for i in cluster.running():
        await cluster.node(i).encoder.close()
    return cluster


async def _stored(cluster: InprocCluster, count: int) -> list[bytes]:
    chunks = [os.urandom(16 << 10) for _ in range(count)]
    for data in chunks:
        assert (await put_bytes(cluster.node(0), data))[0] == 201
    return chunks


def _manifest(chunks: list[bytes]) -> CheckedManifest:
    return check_manifest(manifest_for(chunks), 2**30)


def _drained(cluster: InprocCluster, chunk_id: str) -> bool:
    """No RAM copy of ``chunk_id`` is dirty: no drain of it is under way or to come."""
    for i in cluster.running():
        memory = cluster.node(i).memory
        if memory.holds(chunk_id) and memory.is_dirty(chunk_id):
            return False
    return True


async def _forget_everywhere(cluster: InprocCluster, chunk_id: str) -> None:
    # A drain in flight holds a lease on the RAM copy and writes the nvme copy after the
    # RAM copy's delete: wait the drains out, or that copy outlives the forget (a full
    # run saw the status say ``memory`` where it had to say ``lost``).
    await wait_until(f"{chunk_id[:8]} drained everywhere", lambda: _drained(cluster, chunk_id))
    for i in cluster.running():
        node = cluster.node(i)
        if node.memory_has(chunk_id):
            await node.memory.delete(chunk_id)
        if node.nvme_has(chunk_id):
            await node.nvme.delete(chunk_id)
    assert cluster.hot_holders(chunk_id) == []


async def test_a_commit_with_missing_chunks_is_409_and_commits_nothing(
    inproc: InprocFactory,
) -> None:
    cluster = await _start(inproc)
    chunks = await _stored(cluster, 2)
    absent = os.urandom(16 << 10)  # never stored
    entry = cluster.node(1)
    with pytest.raises(Conflict) as refused:
        await entry.checkpoints.commit("ck/missing", _manifest([*chunks, absent]))
    assert refused.value.code == "missing_chunks"
    assert refused.value.extra["missing"] == [chunk_id_of(absent)]
    for i in cluster.running():
        with pytest.raises(NotFound):
            await cluster.node(i).checkpoints.get("ck/missing")

    # Stored since: the same commit goes through.
    assert (await put_bytes(cluster.node(0), absent))[0] == 201
    status, reply = await entry.checkpoints.commit("ck/missing", _manifest([*chunks, absent]))
    assert status == 201
    assert reply["chunks"] == [chunk_id_of(c) for c in [*chunks, absent]]


async def test_an_identical_recommit_is_200_with_a_holder_down_or_a_chunk_gone(
    inproc: InprocFactory,
) -> None:
    cluster = await _start(inproc)
    chunks = await _stored(cluster, 2)
    checked = _manifest(chunks)
    entry = cluster.node(0)
    assert (await entry.checkpoints.commit("ck/again", checked))[0] == 201

    first = chunk_id_of(chunks[0])
    # not the name's catalogue primary: while that one is down, commits of the name are 503
    primary = entry.placement().name_targets("ck/again")[0]
    holder = next(n for n in cluster.hot_holders(first) if n not in (entry.id, primary))
    await cluster.kill(cluster.index_of(holder))
    assert (await entry.checkpoints.commit("ck/again", checked))[0] == 200

    await _forget_everywhere(cluster, first)
    assert (await entry.checkpoints.commit("ck/again", checked))[0] == 200
    # other contents under the name: refused, whatever is held
    with pytest.raises(Conflict) as other:
        await entry.checkpoints.commit("ck/again", _manifest(chunks[1:]))
    assert other.value.code == "exists"


async def test_status_and_plan_of_a_committed_checkpoint(inproc: InprocFactory) -> None:
    cluster = await _start(inproc)
    chunks = await _stored(cluster, 3)
    entry = cluster.node(2)
    assert (await entry.checkpoints.commit("ck/status", _manifest(chunks)))[0] == 201
    ids = [chunk_id_of(c) for c in chunks]
    rf = entry.config.replication

    status = await entry.checkpoints.status("ck/status")
    assert status["chunks"] == 3 and status["memory"] == 3
    assert status["lost"] == 0 and status["under_replicated"] == 0
    assert status["now"]["memory"] == 3 and status["now"]["cold"] == 0
    assert status["state"] in ("memory", "nvme")

    plan = (await entry.checkpoints.restore_plan("ck/status"))["chunks"]
    assert sorted(plan) == sorted(ids)
    for cid in ids:
        assert sorted(s["node"] for s in plan[cid]) == sorted(cluster.hot_holders(cid))
        assert len(plan[cid]) == rf
        for source in plan[cid]:
            assert source["url"] == cluster.url(cluster.index_of(source["node"]))
            assert source["tier"] in ("memory", "nvme")

    await _forget_everywhere(cluster, ids[0])
    status = await entry.checkpoints.status("ck/status")
    assert status["state"] == "lost" and status["lost"] == 1
    assert (await entry.checkpoints.restore_plan("ck/status"))["chunks"][ids[0]] == []
    with pytest.raises(NotFound):
        await entry.checkpoints.status("ck/none")
