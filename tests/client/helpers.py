"""Helpers shared by the client tests, against in-process nodes (``InprocCluster``) or node
processes (``LocalCluster``) alike."""

from __future__ import annotations

import asyncio
from typing import Any

from storaged.client import Client
from storaged.client.client import ClusterInfo
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import FAST_SETTINGS, TOKEN
from tests.service.inproc import InprocCluster

#: Settings of the client tests' in-process clusters (over ``INPROC_SETTINGS``): the chunk
#: size limit and the tier capacities of the process clusters (``FAST_SETTINGS``), so that a
#: test moved off processes meets the same limits.
CLIENT_SETTINGS: dict[str, Any] = {
    "max_chunk_size": FAST_SETTINGS["max_chunk_size"],
    "memory_capacity": 512 * 2**20,
    "nvme_capacity": 4 * 2**30,
    "cold_capacity": 4 * 2**30,
}

#: a cluster a client test runs against
Served = LocalCluster | InprocCluster


def token_of(cluster: Served) -> str:
    """The client token of ``cluster`` (in-process clusters all use ``TOKEN``)."""
    return cluster.token if isinstance(cluster, LocalCluster) else TOKEN


def client_for(cluster: Served, **kwargs: Any) -> Client:
    """A (not yet opened) client of ``cluster`` with its token."""
    return Client(cluster.urls, token=token_of(cluster), **kwargs)


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
