"""Helpers shared by the client tests that run against a real local cluster."""

from __future__ import annotations

import asyncio
from typing import Any

from storaged.client import Client
from storaged.client.client import ClusterInfo
from storaged.tools.local_cluster import LocalCluster


def client_for(cluster: LocalCluster, **kwargs: Any) -> Client:
    """A (not yet opened) client of ``cluster`` with its token."""
    return Client(cluster.urls, token=cluster.token, **kwargs)


async def client_sees_all_alive(client: Client, attempts: int = 300) -> ClusterInfo:
    """The client's cluster view once every node is alive in it, refreshed every 0.1 s
    (right after start-up or a restart the nodes may not have heard each other yet)."""
    info = client.cluster
    for _ in range(attempts):
        if all(n.alive for n in info.nodes):
            return info
        await asyncio.sleep(0.1)
        info = await client.refresh_cluster()
    raise AssertionError(f"nodes not all alive: {info}")
