"""The retention stage (``node/pipeline/retention.py``) on in-process nodes, its passes run
by the test: a member that may be serving a restore without saying so (down for less than
``gone_after``) holds every delete back, and the pass that follows its return deletes; a
read hold lasts its time and no longer; only the leader runs a pass.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from storaged.errors import unavailable
from storaged.manifest import check_manifest
from storaged.node import Node
from storaged.node.pipeline.retention import ReadHolds
from storaged.retention import Policy, Rule
from tests.service.http import manifest_for
from tests.service.inproc import InprocFactory, put_bytes

SETTINGS: dict[str, Any] = {
    "retention": Policy((Rule("job/", keep_last=1),)),
    "retention_interval": 3600.0,
    "gc_interval": 3600.0,
    "repair_interval": 3600.0,
    "scrub_interval": 3600.0,
    "gone_after": 600.0,
}


async def _commit(node: Node, name: str) -> None:
    data = os.urandom(16 << 10)
    assert (await put_bytes(node, data))[0] == 201
    assert (await node.commit(name, check_manifest(manifest_for([data]), 2**30)))[0] == 201


async def test_a_member_down_holds_deletes_back_until_it_returns(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4, **SETTINGS)
    leader = cluster.node(0)
    for s in range(1, 4):
        await _commit(leader, f"job/step-{s}")
    await cluster.kill(3)
    await cluster.wait_converged()

    report = await leader.retention.retention_pass()
    assert report is not None
    assert report.decision.delete == ("job/step-1", "job/step-2")
    assert report.deleted == ()
    assert "n3 is down and may be serving a restore" in report.held_back
    assert len(await leader.list_checkpoints("job/")) == 3

    await cluster.restart(3)
    await cluster.wait_converged()
    report = await leader.retention.retention_pass()
    assert report is not None
    assert report.held_back == ""
    assert report.deleted == ("job/step-1", "job/step-2")
    assert [r.name for r in await leader.list_checkpoints("job/")] == ["job/step-3"]


async def test_only_the_leader_runs_a_pass(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4, **SETTINGS)
    for s in range(1, 3):
        await _commit(cluster.node(1), f"job/step-{s}")
    for i in (1, 2, 3):
        assert await cluster.node(i).retention.retention_pass() is None
    assert len(await cluster.node(1).list_checkpoints("job/")) == 2
    report = await cluster.node(0).retention.retention_pass()
    assert report is not None and report.deleted == ("job/step-1",)


async def test_a_read_hold_lasts_its_time() -> None:
    holds = ReadHolds(0.3)
    holds.hold("job/step-2")
    holds.hold("job/step-1")
    assert holds.names() == ["job/step-1", "job/step-2"]
    await asyncio.sleep(0.2)
    holds.hold("job/step-2")  # served again: held from now
    await asyncio.sleep(0.2)
    assert holds.names() == ["job/step-2"]
    await asyncio.sleep(0.35)
    assert holds.names() == []


async def test_a_catalogue_out_of_reach_ends_the_deletes_until_the_next_pass(
    inproc: InprocFactory, caplog: Any
) -> None:
    """A delete the catalogue cannot make now (etcd cut off, a leader change: the rm path's
    503 ``coordinator_unavailable``) ends that pass's deletes with a warning line, not a
    traceback out of the pass; the next pass decides again and deletes the rest."""
    cluster = await inproc.start(4, **SETTINGS)
    leader = cluster.node(0)
    for s in range(1, 5):
        await _commit(leader, f"job/step-{s}")
    rm = leader.retention.delete
    out_of_reach = {"job/step-2"}

    async def delete(name: str) -> None:
        if name in out_of_reach:
            raise unavailable("coordinator_unavailable", "etcd failed read: leader changed")
        await rm(name)

    leader.retention.delete = delete
    report = await leader.retention.retention_pass()
    assert report is not None
    assert report.decision.delete == ("job/step-1", "job/step-2", "job/step-3")
    assert report.deleted == ("job/step-1",)  # step-3 waits: the pass stopped at step-2
    assert "deleting job/step-2" in caplog.text and "next pass" in caplog.text
    names = [r.name for r in await leader.list_checkpoints("job/")]
    assert names == ["job/step-2", "job/step-3", "job/step-4"]

    out_of_reach.clear()  # etcd back
    report = await leader.retention.retention_pass()
    assert report is not None and report.deleted == ("job/step-2", "job/step-3")
    assert [r.name for r in await leader.list_checkpoints("job/")] == ["job/step-4"]
