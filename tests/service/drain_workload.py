"""A save and a restore that run while a node drains, and the checks after it left: the
real-process drain tests, embedded (``test_drain_cluster.py``) and etcd
(``tests/coordination/test_etcd_drain.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from storaged.ids import chunk_id_of
from tests.conftest import ADMIN_TOKEN, TOKEN
from tests.service.http import Api, manifest_for
from tests.service.inproc import wait_until

#: chunks per checkpoint, and their size: small, many chunks, so placement spreads them
CHUNKS = 4
CHUNK_SIZE = 48 * 1024
#: bounds of the loops: a test never runs unbounded
MAX_SAVES = 400
MAX_RESTORES = 4000


@dataclass
class DrainWorkload:
    """Saves checkpoints and restores acked ones, through the nodes in ``urls``, until
    ``stop`` is set. ``acked`` holds every checkpoint whose commit was answered 201."""

    api: Api
    urls: list[str]
    prefix: str
    rng: random.Random = field(default_factory=lambda: random.Random(42))
    acked: dict[str, list[bytes]] = field(default_factory=dict)
    restores: int = 0
    failed_saves: list[str] = field(default_factory=list)
    bad_restores: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def save(self, i: int) -> None:
        chunks = [os.urandom(CHUNK_SIZE) for _ in range(CHUNKS)]
        for data in chunks:
            r = await self.api.put_chunk(data, url=self.rng.choice(self.urls))
            if r.status not in (200, 201):
                self.failed_saves.append(f"PUT {r.status} {r.raw[:200]!r}")
                return
        name = f"{self.prefix}/ckpt-{i}"
        r = await self.api.commit(name, manifest_for(chunks), url=self.rng.choice(self.urls))
        if r.status != 201:
            self.failed_saves.append(f"commit {name}: {r.status} {r.raw[:200]!r}")
            return
        self.acked[name] = chunks

    async def saver(self) -> None:
        for i in range(MAX_SAVES):
            if self.stop.is_set():
                return
            await self.save(i)
            await asyncio.sleep(0.05)

    async def restore(self, name: str, url: str | None = None) -> str | None:
        """Restore ``name`` through one node; what was wrong, or None."""
        url = url or self.rng.choice(self.urls)
        r = await self.api.request("GET", f"/v1/checkpoints/{name}", url=url)
        if r.status != 200:
            return f"{name}: manifest {r.status} {r.raw[:200]!r}"
        listed = [cid for cid, _ in r.doc["shards"][0]["chunks"]]
        want = self.acked[name]
        if listed != [chunk_id_of(c) for c in want]:
            return f"{name}: the manifest names other chunks"
        for cid, data in zip(listed, want, strict=True):
            got = await self.api.get_chunk(cid, url=url)
            if got.status != 200 or got.raw != data:
                return f"{name}: chunk {cid[:12]} answered {got.status}, {len(got.raw)} bytes"
        return None

    async def restorer(self) -> None:
        for _ in range(MAX_RESTORES):
            if self.stop.is_set():
                return
            if not self.acked:
                await asyncio.sleep(0.1)
                continue
            name = self.rng.choice(sorted(self.acked))
            wrong = await self.restore(name)
            if wrong is not None:
                self.bad_restores.append(wrong)
            self.restores += 1

    async def check_after(self, url: str) -> None:
        """Every acked checkpoint restores byte-exact through ``url``, and its status says
        nothing is lost or under-replicated."""
        for name in sorted(self.acked):
            wrong = await self.restore(name, url)
            assert wrong is None, wrong
            r = await self.api.request("GET", f"/v1/checkpoints/{name}?status", url=url)
            assert r.status == 200, (name, r.status, r.raw[:200])
            assert r.doc["lost"] == 0 and r.doc["under_replicated"] == 0, (name, r.doc)


async def storaged_cli(*args: str, timeout: float = 600.0) -> tuple[int, str, str]:
    """Run ``storaged ARGS`` (the real CLI, with the test tokens); (status, stdout, stderr)."""
    env = {**os.environ, "STORAGED_TOKEN": TOKEN, "STORAGED_ADMIN_TOKEN": ADMIN_TOKEN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "storaged",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def drain_until_it_can_leave(url: str, node_id: str) -> dict[str, Any]:
    """``storaged drain NODE --wait --json`` through ``url``; its final document."""
    status, out, err = await storaged_cli(
        "drain", node_id, "--wait", "--json", "--url", url, "--interval", "0.5",
        "--timeout", "400",
    )  # fmt: skip
    assert status == 0, (status, out, err)
    doc: dict[str, Any] = json.loads(out)
    assert doc["can_leave"] is True and doc["state"] == "draining", doc
    assert doc["chunks_pending"] == 0 and doc["fragments_pending"] == 0, doc
    return doc


async def drain_under_the_workload(
    work: DrainWorkload, url: str, node_id: str, slow: float
) -> dict[str, Any]:
    """Drain ``node_id`` (through ``url``) while ``work``'s saver and restorer run, until it
    can leave; saves must go on meanwhile. The drain's final document."""
    before = len(work.acked)
    doc = await drain_until_it_can_leave(url, node_id)
    assert doc["node"] == node_id and doc["chunks"] + doc["fragments"] > 0
    await wait_until("saves went on during the drain", lambda: len(work.acked) > before, slow)
    return doc


def assert_the_workload_came_through(work: DrainWorkload) -> None:
    """Every restore the workload made was byte-exact, there were some, no save failed."""
    assert not work.bad_restores, work.bad_restores[:5]
    assert work.restores > 0
    assert not work.failed_saves, work.failed_saves[:5]
