"""A peer's tier figures before its first heartbeat has reached the node asked.

``GET /v1/cluster`` answers for every member, heard from or not; until a member's heartbeat
reaches the node asked, the figures it would carry are not known there. The document keeps
its numbers (the contract's shape) and says so with ``usage_reported: false``, and
``storaged nodes`` shows such a node's space as ``-``, not as an empty node with no capacity.
Nodes in the test's loop (``tests/service/inproc.py``); the command is the real one, a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from storaged.tools.local_cluster import free_port_block
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster, Member, wait_until

REPO = Path(__file__).resolve().parents[2]


async def _doc(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/cluster", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        doc: dict[str, Any] = await r.json()
        return doc


async def _nodes_command(url: str, *extra: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONASYNCIODEBUG": ""}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "storaged.cli", "nodes", *extra, "--url", url, "--token", TOKEN,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=REPO,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.timeout(120)
async def test_a_member_not_heard_from_has_unknown_usage(tmp_path: Path) -> None:
    cluster = InprocCluster(tmp_path, 4)
    # Only node 0 runs at first: the other three are members it has never heard from.
    cluster.port = free_port_block(cluster.nodes * 2)
    cluster.members = [Member(i, cluster._config(i)) for i in range(cluster.nodes)]
    try:
        await cluster.start_node(0)
        async with aiohttp.ClientSession() as http:
            doc = await _doc(http, cluster.url(0))
            rows = {n["id"]: n for n in doc["nodes"]}
            assert rows[cluster.node_id(0)]["usage_reported"] is True
            assert rows[cluster.node_id(0)]["memory"]["capacity"] > 0
            for i in (1, 2, 3):
                row = rows[cluster.node_id(i)]
                # (alive or not: a fresh node counts its peers up for a grace period)
                assert row["usage_reported"] is False
                # the contract's keys stay, as zeros
                assert row["memory"]["used"] == 0 and row["memory"]["capacity"] == 0

            code, out, err = await _nodes_command(cluster.url(0))
            assert code == 3, out + err  # nodes that do not answer: exit 3
            lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
            mine = lines[cluster.node_id(0)]
            assert "/" in mine, out  # used/capacity of the node asked
            for i in (1, 2, 3):
                peer = lines[cluster.node_id(i)]
                assert "0B/0B" not in peer.replace(" ", "") and " - " in f" {peer} ", out

            for i in (1, 2, 3):
                await cluster.start_node(i)
            await cluster.wait_converged()

            async def all_reported() -> bool:
                nodes = (await _doc(http, cluster.url(0)))["nodes"]
                return all(n["usage_reported"] and n["memory"]["capacity"] > 0 for n in nodes)

            await wait_until("every peer's heartbeat reached node 0", all_reported)
            code, out, err = await _nodes_command(cluster.url(0), "--json")
            assert code == 0, out + err
            doc = json.loads(out)
            assert all(n["memory"]["capacity"] for n in doc["nodes"]), doc
    finally:
        await cluster.close()
