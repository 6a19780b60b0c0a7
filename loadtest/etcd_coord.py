"""The etcd catalogue's costs: commits per second, and ``references()`` over many checkpoints.

    python -m loadtest.etcd_coord [--etcd etcd://host:port,...] [--checkpoints 10000]

Without ``--etcd`` it starts a 3-member etcd on loopback (the tests' rig). Prints one JSON
document: commit rates at a few concurrencies, and the time and bytes of one
``references()`` over ``--checkpoints`` records of ``--chunks`` ids each, beside what the
embedded catalogue's gather moves for the same records (computed from its wire format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from storaged.coord.etcd import EtcdSession
from storaged.coord.etcd_catalogue import EtcdCatalogue
from storaged.coord.manifest_store import CatalogRecord


def _record(name: str, chunks: int, manifest_bytes: int) -> CatalogRecord:
    ids = [os.urandom(32).hex() for _ in range(chunks)]
    return CatalogRecord(
        name=name,
        digest=os.urandom(32).hex(),
        created=time.time(),
        committed=time.time(),
        total_bytes=chunks * 8 * 2**20,
        chunks=ids,
        manifest=os.urandom(manifest_bytes),
    )


async def _commits(cat: EtcdCatalogue, prefix: str, count: int, workers: int, chunks: int,
                   manifest_bytes: int) -> float:  # fmt: skip
    """Commits per second of ``count`` fresh records by ``workers`` concurrent committers."""
    records = [_record(f"{prefix}/c{i:06d}", chunks, manifest_bytes) for i in range(count)]
    queue = list(reversed(records))

    async def worker() -> None:
        while queue:
            assert await cat.commit(queue.pop())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return count / (time.perf_counter() - started)


def _embedded_gather_bytes(records: int, chunks: int, replication: int) -> int:
    """Bytes the embedded catalogue's ``references()`` receives: every live node dumps the
    records it holds (each is on ``replication`` nodes), chunk ids as hex, no manifests;
    so the sum does not depend on the number of nodes."""
    one = _record("job00/step-000000", chunks, 0).to_wire()
    one["manifest"] = None
    return len(msgpack.packb(one, use_bin_type=True)) * records * replication


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"checkpoints": args.checkpoints, "chunks_per_checkpoint": args.chunks}
    session = EtcdSession(args.etcd + f"/bench{time.monotonic_ns()}", request_timeout=60.0)
    cat = EtcdCatalogue(None, session)
    try:
        rates = {}
        for chunks, manifest in ((10, 2048), (1000, 64 * 1024)):
            for workers in (1, 16, 64):
                rate = await _commits(cat, f"rate{chunks}-{workers}", args.commits, workers,
                                      chunks, manifest)  # fmt: skip
                rates[f"{chunks} ids, {manifest // 1024} KiB manifest, {workers} committers"] = (
                    round(rate, 1)
                )
        out["commits_per_s"] = rates
        # The references read below covers only these records: a key root of their own.
        await session.close()
        session = EtcdSession(args.etcd + f"/refs{time.monotonic_ns()}", request_timeout=60.0)
        cat = EtcdCatalogue(None, session)
        # The many-checkpoints catalogue: 100 jobs, as many steps each.
        started = time.perf_counter()
        per_job = max(1, args.checkpoints // 100)
        queue = [(j, s) for j in range(100) for s in range(per_job)][: args.checkpoints]

        async def fill() -> None:
            while queue:
                j, s = queue.pop()
                assert await cat.commit(_record(f"job{j:02d}/step-{s:06d}", args.chunks, 1024))

        await asyncio.gather(*(fill() for _ in range(32)))
        out["fill_s"] = round(time.perf_counter() - started, 1)
        moved = 0
        real_pages = cat._pages

        async def counting(prefix: str, revision: int = 0, *, keys_only: bool = False) -> Any:
            nonlocal moved
            async for item, rev in real_pages(prefix, revision, keys_only=keys_only):
                moved += len(item.key) + len(item.value)
                yield item, rev

        cat._pages = counting  # type: ignore[method-assign]
        times = []
        for _ in range(3):
            moved = 0
            started = time.perf_counter()
            refs = await cat.references()
            times.append(time.perf_counter() - started)
        cat._pages = real_pages  # type: ignore[method-assign]
        live = [r for r in refs.live if r.name.startswith("job")]
        assert len(live) == args.checkpoints and all(len(r.chunks) == args.chunks for r in live)
        out["references"] = {
            "seconds": [round(t, 2) for t in times],
            "bytes": moved,
            "distinct_chunks": len(refs.chunks),
        }
        out["embedded_gather_bytes"] = _embedded_gather_bytes(args.checkpoints, args.chunks, 3)
    finally:
        await session.close()
    return out


async def main_async(args: argparse.Namespace) -> None:
    if args.etcd:
        print(json.dumps(await run(args), indent=1))
        return
    from tests.etcd import EtcdCluster

    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdCluster(Path(tmp))
        await etcd.start()
        try:
            args.etcd = etcd.url
            print(json.dumps(await run(args), indent=1))
        finally:
            await etcd.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--etcd", default="", help="etcd://host:port,... (default: start one)")
    p.add_argument("--checkpoints", type=int, default=10_000)
    p.add_argument("--chunks", type=int, default=1000)
    p.add_argument("--commits", type=int, default=300, help="commits per rate measurement")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
