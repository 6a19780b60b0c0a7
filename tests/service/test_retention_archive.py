"""Retention's archive clauses on in-process nodes, against a real archive: the leaf
``tiers.archive.ArchiveTier`` over a ``file://`` directory, wrapped in the two calls the
stage is given (``archive(name)``: every chunk, then the manifest; ``is_archived(name)``).

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
from tiers.archive import ArchiveTier, ManifestNotFound

POLICY = Policy((Rule("job/", keep_last=1, archive_every=2),))
SETTINGS: dict[str, Any] = {
    "retention": POLICY,
    "retention_interval": 3600.0,
    "gc_interval": 3600.0,
    "repair_interval": 3600.0,
    "scrub_interval": 3600.0,
}


class ArchivingCluster(InprocCluster):
    """In-process nodes whose retention stage archives into ``tier``; ``failing`` makes
    every archive call fail (an archive out of reach)."""

    tier: ArchiveTier
    failing: bool = False

    async def open_node(self, config: Any) -> Node:
        node = await Node.open(config)

        async def archive(name: str) -> None:
            if self.failing:
                raise OSError("the archive is out of reach")
            record = await node.checkpoints.get(name)
            for cid in dict.fromkeys(record.chunks):
                data, _ = await node.read_chunk(cid)
                await self.tier.put(cid, data)
            assert record.manifest is not None
            await self.tier.put_manifest(name, record.manifest)

        async def is_archived(name: str) -> bool:
            try:
                await self.tier.get_manifest(name)
            except ManifestNotFound:
                return False
            return True

        node.retention.archive, node.retention.is_archived = archive, is_archived
        return node


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
    cluster = ArchivingCluster(tmp_path / "nodes", 4, dict(SETTINGS))
    cluster.tier = await ArchiveTier.open(f"file://{tmp_path / 'archive'}", 1 << 30)
    try:
        await cluster.start()
        leader = cluster.node(0)
        saved = {f"job/step-{s}": await _commit(leader, f"job/step-{s}") for s in range(1, 6)}

        cluster.failing = True
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.deleted == ("job/step-1", "job/step-3")
        assert report.archived == ()
        assert report.decision.archive == ("job/step-2", "job/step-4")
        assert report.decision.kept["job/step-2"] == (AWAITING_ARCHIVE,)
        assert await _live(leader) == ["job/step-2", "job/step-4", "job/step-5"]
        # a node that is not the leader runs no pass
        assert await cluster.node(1).retention.retention_pass() is None

        cluster.failing = False
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.archived == ("job/step-2", "job/step-4")
        assert report.deleted == ()  # decided before they were archived: kept this pass
        report = await leader.retention.retention_pass()
        assert report is not None
        assert report.deleted == ("job/step-2", "job/step-4")
        assert await _live(leader) == ["job/step-5"]

        # the archive holds them whole: manifest, then every chunk, byte for byte
        assert await cluster.tier.list_manifests("job/") == ["job/step-2", "job/step-4"]
        for name in ("job/step-2", "job/step-4"):
            manifest = check_manifest(manifest_for([saved[name]]), 2**30)
            assert bytes(await cluster.tier.get_manifest(name)) == manifest.encoded
            (cid,) = manifest.chunks
            assert bytes(await cluster.tier.get(cid)) == saved[name]
    finally:
        await cluster.close()
        await cluster.tier.close()


async def test_a_node_without_an_archive_refuses_archive_clauses(tmp_path: Path) -> None:
    cluster = InprocCluster(tmp_path / "nodes", 4, dict(SETTINGS))
    try:
        with pytest.raises(
            ConfigError, match=r"'job/' archive checkpoints, and this node has no archive"
        ):
            await cluster.start()
    finally:
        await cluster.close()
