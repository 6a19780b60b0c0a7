"""Retention's archive clauses on in-process nodes whose archive is a real one: the node's
own archive stage (``node/archive.py``) over ``tiers.archive.ArchiveTier`` on a ``file://``
directory, which the node hands its retention stage (``archive(name)``: every chunk, then
the manifest; ``archived(name)``).

A checkpoint the policy must archive is kept until the archive holds it, whatever else the
policy says; once archived it may go. A node without an archive refuses such a policy.
Background passes are kept out of the way: the test runs the leader's passes itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from storaged.config import ConfigError
from storaged.manifest import check_manifest
from storaged.node import Node
from storaged.retention import AWAITING_ARCHIVE, Policy, Rule
from tests.service.http import manifest_for
from tests.service.inproc import InprocCluster, put_bytes
from tiers.archive import ArchiveTier

POLICY = Policy((Rule("job/", keep_last=1, archive_every=2),))
SETTINGS: dict[str, Any] = {
    "retention": POLICY,
    "retention_interval": 3600.0,
    "gc_interval": 3600.0,
    "repair_interval": 3600.0,
    "scrub_interval": 3600.0,
}


def archive_out_of_reach(node: Node) -> list[bool]:
    """Make ``node``'s retention archive through its own archive stage unless the flag
    returned is set (an archive out of reach: every call fails, as the stage's 503 does)."""
    failing = [False]
    real = node.archive.archive

    async def archive(name: str) -> object:
        if failing[0]:
            raise OSError("the archive is out of reach")
        return await real(name)

    node.retention.archive = archive
    return failing


async def _commit(node: Node, name: str) -> bytes:
    data = os.urandom(48 << 10)
    status, _ = await put_bytes(node, data)
    assert status == 201
    status, _ = await node.commit(name, check_manifest(manifest_for([data]), 2**30))
    assert status == 201
    return data


async def _live(node: Node) -> list[str]:
    return [r.name for r in await node.list_checkpoints("job/")]


async def test_archive_clauses_keep_until_archived(tmp_path: Path) -> None:
    settings = {**SETTINGS, "archive": f"file://{tmp_path / 'archive'}"}
    cluster = InprocCluster(tmp_path / "nodes", 4, settings)
    tier = None
    try:
        await cluster.start()
        leader = cluster.node(0)
        # the node hands its retention stage its own archive's calls
        assert leader.retention.archive == leader.archive.archive
        assert leader.retention.is_archived == leader.archive.archived
        failing = archive_out_of_reach(leader)
        saved = {f"job/step-{s}": await _commit(leader, f"job/step-{s}") for s in range(1, 6)}

        failing[0] = True
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.deleted == ("job/step-1", "job/step-3")
        assert report.archived == ()
        assert report.decision.archive == ("job/step-2", "job/step-4")
        assert report.decision.kept["job/step-2"] == (AWAITING_ARCHIVE,)
        assert await _live(leader) == ["job/step-2", "job/step-4", "job/step-5"]
        # a node that is not the leader runs no pass
        assert await cluster.node(1).retention.retention_pass() is None

        failing[0] = False
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.archived == ("job/step-2", "job/step-4")
        assert report.deleted == ()  # decided before they were archived: kept this pass
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.deleted == ("job/step-2", "job/step-4")
        assert await _live(leader) == ["job/step-5"]

        # the archive holds them whole: manifest, then every chunk, byte for byte
        tier = await ArchiveTier.open(f"file://{tmp_path / 'archive'}", 1 << 30)
        assert await tier.list_manifests("job/") == ["job/step-2", "job/step-4"]
        for name in ("job/step-2", "job/step-4"):
            manifest = check_manifest(manifest_for([saved[name]]), 2**30)
            assert bytes(await tier.get_manifest(name)) == manifest.encoded
            (cid,) = manifest.chunks
            assert bytes(await tier.get(cid)) == saved[name]
    finally:
        await cluster.close()
        if tier is not None:
            await tier.close()


async def test_a_node_without_an_archive_refuses_archive_clauses(tmp_path: Path) -> None:
    cluster = InprocCluster(tmp_path / "nodes", 4, dict(SETTINGS))
    try:
        with pytest.raises(
            ConfigError, match=r"'job/' archive checkpoints, and this node has no archive"
        ):
            await cluster.start()
    finally:
        await cluster.close()
