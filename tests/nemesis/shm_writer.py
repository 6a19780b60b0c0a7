"""A co-located writer in a process of its own, for the nemesis to SIGKILL mid-lease.

``python -m tests.nemesis.shm_writer URL TOKEN SEED NAME OUT`` saves checkpoints
``NAME/step-S`` of fresh chunks (contents from ``tests.nemesis.history.content``, keys
``NAME/sS/cI``) through the shared-memory path of the node at ``URL``: each chunk leased,
staged into the leased memfd and sealed, after a short drawn wait between the stage and
the seal (so that a kill lands before a seal as often as after one), then the manifest
committed over HTTP. Every step is appended to ``OUT`` as a JSON line *before* the next
is tried, so that what the parent reads after the kill is what the writer had been told:

- ``{"lease": key, "size": n}``: about to lease ``key``'s chunk;
- ``{"sealed": id, "status": s}``: the seal's answer (201/200 is an acknowledged PUT);
- ``{"commit": name, "chunks": [[id, size], ...], "step": s}``: the commit is sent;
- ``{"committed": name}``: it was acknowledged (it must then survive like any ack).

A writer that cannot use the path (no socket, a refusal) writes ``{"error": text}`` and
stops; it runs until killed otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from typing import Any

import aiohttp

from storaged.client import Client, StoragedError
from storaged.client.shm import ShmPath, _stage, in_thread
from storaged.ids import chunk_id_of
from tests.nemesis.history import content
from tests.nemesis.workload import manifest_of

SIZES = (48 * 1024, 320 * 1024)


class Record:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, doc: dict[str, Any]) -> None:
        # One write per line, no buffer: a SIGKILL cannot lose or tear what was written.
        os.write(self.fd, (json.dumps(doc) + "\n").encode())


async def socket_of(url: str, token: str) -> tuple[str, str]:
    """(node id, shared-memory socket) of the node at ``url``."""
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"{url}/v1/cluster", headers=headers) as resp,
    ):
        doc = await resp.json()
    for node in doc["nodes"]:
        if node.get("url") == url and node.get("shm"):
            return str(node["id"]), str(node["shm"]["socket"])
    raise RuntimeError(f"{url} lists no shared-memory socket for itself")


async def run(url: str, token: str, seed: int, name: str, record: Record) -> None:
    node_id, sock = await socket_of(url, token)
    path = await ShmPath.connect(node_id, sock, token, limit=4, timeout=30.0)
    client = Client([url], token=token, shm=False, request_timeout=20.0)
    await client.open()
    rng = random.Random(f"{seed}/{name}")
    try:
        step = 0
        while True:
            chunks: list[tuple[str, int]] = []
            for c in range(rng.randint(2, 5)):
                key, size = f"{name}/s{step}/c{c}", rng.randint(*SIZES)
                data = content(seed, key, size)
                cid = chunk_id_of(data)
                record({"lease": key, "size": size})
                # The path's own lease and seal requests, with a pause between them that
                # ShmPath.put does not have: the kill must find leases open.
                reply, fd = await path._ask({"op": "lease", "size": size})
                if fd is None:
                    record({"error": f"lease refused: {reply}"})
                    return
                await in_thread(_stage, fd, size, memoryview(data))
                await asyncio.sleep(rng.uniform(0.0, 0.15))
                reply, _ = await path._ask(
                    {"op": "seal", "lease": reply["lease"], "length": size, "id": cid}
                )
                status = int(reply.get("status", 500))
                record({"sealed": cid, "status": status})
                if status >= 300:
                    record({"error": f"seal answered {status}: {reply}"})
                    return
                chunks.append((cid, size))
            checkpoint = f"{name}/step-{step:05d}"
            record({"commit": checkpoint, "chunks": chunks, "step": step})
            try:
                await client.commit(checkpoint, manifest_of(chunks, {"step": step, "shm": name}))
            except StoragedError as exc:
                record({"error": f"commit failed: {exc}"})
                return
            record({"committed": checkpoint})
            step += 1
    finally:
        await client.close()
        await path.close()


def main(argv: list[str]) -> int:
    url, token, seed, name, out = argv
    record = Record(out)
    try:
        asyncio.run(run(url, token, int(seed), name, record))
    except Exception as exc:  # the parent reads the cause from the record
        record({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
