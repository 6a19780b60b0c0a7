"""Draining a node of a running embedded cluster (real processes) while a save and a
restore run: ``storaged drain NODE --wait`` returns once the node can leave, it is killed
with SIGKILL, and every acked checkpoint restores byte-exact with nothing under-replicated.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import aiohttp

from tests.conftest import TOKEN, ClusterFactory
from tests.service.drain_workload import (
    DrainWorkload,
    assert_the_workload_came_through,
    drain_under_the_workload,
    storaged_cli,
)
from tests.service.http import Api
from tests.service.inproc import wait_until

#: generous bounds: a loaded 2-core machine
SLOW = 120.0


async def test_a_node_drained_under_a_save_and_a_restore_leaves_with_nothing_lost(
    cluster_factory: ClusterFactory, http: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(5, drain_defer=0.0, encode_defer=0.0)
    urls = cluster.urls
    api = Api(http, urls[0], TOKEN)
    work = DrainWorkload(api, urls[:4], "embedded")
    for i in range(3):
        await work.save(1000 + i)
    assert len(work.acked) == 3, work.failed_saves
    # some of it cold, so the drained node holds fragments as well as copies
    await api.wait_state(sorted(work.acked)[0], "cold", SLOW)

    tasks = [asyncio.create_task(work.saver()), asyncio.create_task(work.restorer())]
    try:
        await wait_until("saves go on", lambda: len(work.acked) >= 6, SLOW)
        await drain_under_the_workload(work, urls[1], "n4", SLOW)
    finally:
        work.stop.set()
        await asyncio.gather(*tasks)
    assert_the_workload_came_through(work)

    await asyncio.to_thread(cluster.kill, 4, signal.SIGKILL)

    async def n4_down_everywhere() -> bool:
        for url in urls[:4]:
            r = await api.request("GET", "/v1/cluster", url=url)
            n4: dict[str, Any] = next(n for n in r.doc["nodes"] if n["id"] == "n4")
            if n4["alive"] or n4["state"] != "draining":
                return False
        return True

    await wait_until("n4 down (and draining) everywhere", n4_down_everywhere, SLOW)
    await work.check_after(urls[2])
    # storaged nodes shows it: down and draining (exit 3: a node is down)
    status, out, err = await storaged_cli("nodes", "--json", "--url", urls[0])
    assert status == 3, (out, err)
    rows = {row["id"]: row for row in json.loads(out)["nodes"]}
    assert rows["n4"]["state"] == "draining" and not rows["n4"]["alive"]
    assert all(rows[f"n{i}"]["state"] == "active" for i in range(4))
