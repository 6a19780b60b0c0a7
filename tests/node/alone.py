"""A node's services without a ``Node``: a ``Local`` on real tiers in a directory and the
cluster view of a one-node membership that is never started (nothing is sent anywhere),
for building one stage at a time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from erasure import make_codec
from storaged.config import Config, NodeSpec
from storaged.coord.manifest_store import Catalog
from storaged.coord.membership import StaticMembership
from storaged.node.cluster import Cluster
from storaged.node.index import StateLog
from storaged.node.local import Local
from storaged.peer import PeerClient
from tiers.cold import ColdTier
from tiers.memory import MemoryTier
from tiers.nvme import NvmeTier


def one_node_config(root: Path) -> Config:
    spec = NodeSpec("n0", "http://127.0.0.1:1", "127.0.0.1:2", str(root))
    return dataclasses.replace(
        Config(node_id="n0", nodes=(spec,), token="t" * 32, cluster_secret="s" * 32),
        k=2,
        n=3,
        replication=1,
        memory_capacity=16 * 2**20,
        drain_defer=0.0,
    )


async def open_local(root: Path) -> Local:
    config = one_node_config(root)
    state_log = StateLog(root / "chunks.state")
    return Local(
        config,
        MemoryTier(config.memory_capacity),
        await NvmeTier.open(root / "nvme", 2**30),
        await ColdTier.open(root / "cold", 2**30),
        make_codec(config.codec, config.k, config.n),
        await Catalog.open(root / "catalog"),
        state_log,
        state_log.load(),
    )


async def close_local(local: Local) -> None:
    for task in list(local.tasks):
        task.cancel()
    await asyncio.gather(*local.tasks, return_exceptions=True)
    for tier in (local.memory, local.nvme, local.cold):
        await tier.close()
    local.state_log.close()


async def _unused_ping(spec: NodeSpec) -> dict[str, object]:
    raise AssertionError("the membership is never started")


@contextlib.asynccontextmanager
async def services(root: Path) -> AsyncIterator[tuple[Local, Cluster]]:
    """(local, cluster) of node ``n0``, alone in its cluster; closed on exit."""
    local = await open_local(root)
    peers = PeerClient("n0", b"s" * 32)
    membership = StaticMembership("n0", local.config.nodes, _unused_ping)
    try:
        yield local, Cluster(local.config, membership, peers)
    finally:
        await peers.close()
        await close_local(local)
