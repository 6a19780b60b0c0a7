"""Node CPU per GB for chunk GETs from RAM: ``python -m loadtest.nodesend``.

What it measures is the node's side of a restore from RAM alone: a 3-node cluster
(replication 3, so every node holds every chunk in RAM) is given ``--chunks`` random
chunks of ``--chunk-mib`` MiB; then a minimal client (an ``asyncio.BufferedProtocol`` per
connection reading every body into one scratch buffer: next to no client CPU) sends
``GET /v1/chunks/<id>`` to node n0 only, ``--concurrency`` connections at once, each
walking the chunks round-robin, for ``--rounds`` rounds of ``--passes`` passes. The
default of 2 connections is what one node of a 4-node restore with 8 requests in flight
serves.

Two clusters run side by side, one of ``loadtest.harness.response_node`` nodes (``response``,
the old path: ``web.Response(body=...)``) and one of product nodes (``stream``, the view
sent after the head); rounds alternate
between them, the order flipping from round to round. Reported per mode: GB/s and n0's
CPU seconds per GB (``/proc/<pid>/stat``, all threads), min-max (median) over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.harness.cluster import TOKEN, start_cluster
from loadtest.harness.machine import new_loop, proc_cpu_seconds
from loadtest.harness.response_node import RESPONSE_NODE
from storaged.client import Client
from storaged.tools.local_cluster import LocalCluster

GB = 1e9
MODES = ("stream", "response")
#: what each mode's nodes run: the product, or its variant with the old GET path
NODE_MODULES = {"stream": "storaged", "response": RESPONSE_NODE}


class _Get(asyncio.BufferedProtocol):
    """One keep-alive connection: GET, read the head, discard the body into scratch."""

    def __init__(self, token: str) -> None:
        self._auth = f"Authorization: Bearer {token}\r\n".encode()
        self._scratch = memoryview(bytearray(1 << 20))
        self._head = bytearray()
        self._left = -1
        self._done: asyncio.Future[int] | None = None
        self._size = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        got = self._scratch[:nbytes]
        if self._left < 0:
            self._head += got
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._head[:end]).decode("latin-1")
            status = int(head.split(" ", 2)[1])
            if status != 200:
                raise RuntimeError(head)
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.lower() == "content-length":
                    self._size = int(v)
            rest = len(self._head) - end - 4
            self._head.clear()
            self._left = self._size - rest
        else:
            self._left -= nbytes
        if self._left == 0 and self._done is not None:
            self._left = -1
            self._done.set_result(self._size)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc or ConnectionError("closed"))

    async def get(self, cid: str) -> int:
        assert self.transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(
            f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\n".encode() + self._auth + b"\r\n"
        )
        return await self._done


async def _load(cluster: LocalCluster, chunks: int, chunk_mib: int) -> list[str]:
    async with Client(cluster.urls, token=TOKEN) as client:
        ids = []
        for _ in range(chunks):
            ids.append(await client.put_chunk(os.urandom(chunk_mib << 20)))
        # Measure once the background work (nvme copies, erasure coding) is over.
        deadline = time.monotonic() + 300
        for cid in ids:
            while (info := await client.head_chunk(cid)).state != "cold":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cid} still {info.state} after 300 s")
                await asyncio.sleep(0.2)
            if info.tier != "memory":
                raise RuntimeError(f"{cid} left RAM ({info.tier})")
        return ids


async def _round(
    url: str, ids: Sequence[str], pid: int, concurrency: int, passes: int
) -> tuple[float, float, int]:
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        transport, conn = await loop.create_connection(lambda: _Get(TOKEN), host, int(port))
        conn.transport = transport
        conns.append(conn)

    async def walk(c: _Get, start: int) -> int:
        # Each walk counts its own bytes: a shared ``total += await c.get(...)`` reads the
        # total before the await and stores it after, so concurrent walks overwrote each
        # other's counts (about one connection's bytes were counted whatever the
        # concurrency: node CPU per GB was overstated by that factor, 4 x at 8 connections).
        walked = 0
        for j in range(len(ids) * passes):
            walked += await c.get(ids[(start + j) % len(ids)])
        return walked

    cpu0, t0 = proc_cpu_seconds(pid), time.monotonic()
    total = sum(await asyncio.gather(*(walk(c, i * 7) for i, c in enumerate(conns))))
    seconds, cpu = time.monotonic() - t0, proc_cpu_seconds(pid) - cpu0
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    return seconds, cpu, total


async def run(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="storaged-nodesend-"))
    memory = args.chunks * args.chunk_mib * 2 + 256
    clusters: dict[str, LocalCluster] = {}
    try:
        for mode in MODES:
            clusters[mode] = await asyncio.to_thread(
                start_cluster,
                root / mode,
                3,
                memory=f"{memory}MiB",
                max_chunk=args.chunk_mib << 20,
                settings={"replication": 3},
                node_module=NODE_MODULES[mode],
            )
        ids = {m: await _load(c, args.chunks, args.chunk_mib) for m, c in clusters.items()}
        for m, c in clusters.items():  # warm-up: connections, first touches
            await _round(c.urls[0], ids[m], c.procs[0].pid, args.concurrency, 1)
        if args.pause:
            print("pids:", {m: c.procs[0].pid for m, c in clusters.items()}, flush=True)
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        per_round = args.concurrency * args.passes * args.chunks * (args.chunk_mib << 20)
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                c = clusters[m]
                sec, cpu, n = await _round(
                    c.urls[0], ids[m], c.procs[0].pid, args.concurrency, args.passes
                )
                if n != per_round:
                    raise RuntimeError(f"a round moved {n} bytes, not the {per_round} it sends")
                results[m].append((n / GB / sec, cpu / (n / GB)))
        print(
            f"{args.chunks} chunks of {args.chunk_mib} MiB from n0's RAM, {args.concurrency} "
            f"connections, {args.rounds} rounds of {args.passes} passes "
            f"({args.chunks * args.chunk_mib * args.passes * args.concurrency / 1024:.1f} GiB;"
            f" {per_round} bytes counted in every round)"
        )
        for m in MODES:
            gbs = [x for x, _ in results[m]]
            cpu_per_gb = [y for _, y in results[m]]
            print(f"{m:<8} GB/s {_range(gbs)}   node CPU s/GB {_range(cpu_per_gb)}")
    finally:
        for c in clusters.values():
            await asyncio.to_thread(c.stop)
        shutil.rmtree(root, ignore_errors=True)


def _range(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.nodesend", description=__doc__)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument(
        "--concurrency", type=int, default=2, help="connections to n0 (a restore: about 2)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--pause", action="store_true", help="print n0's pids (to profile)")
    args = parser.parse_args(argv)
    loop = new_loop()
    try:
        loop.run_until_complete(run(args))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
