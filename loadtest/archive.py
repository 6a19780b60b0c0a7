"""The archive tier next to its object store's own PUT and GET, in one run:
``python -m loadtest.archive [--quick]``.

Per round, ``--count`` chunks of ``--size`` bytes (8 MiB by default), fresh bytes every
round (chunks are content-addressed: the same bytes twice would be a no-op for the tier),
``--concurrency`` requests in flight, through four modes:

- ``raw put``: the library's (obstore) single PUT of each chunk's bytes under a plain name:
  what any program pays to store those bytes in that store.
- ``tier put``: ``ArchiveTier.put(id, bytes)``: the BLAKE3 check of the bytes against their
  id (in a thread), a HEAD (is it archived already?), the same single PUT.
- ``raw get``: the library's GET of each raw object into its buffer, unchecked.
- ``tier get``: ``ArchiveTier.get(id)``: the same GET and the BLAKE3 check.

Then, through a real cluster (``--no-cluster`` skips it): a checkpoint of the same bytes
(``--count`` chunks of ``--size``) saved to 4 node processes pointed at the archive,
``archive`` (``POST ?archive`` until ``?status`` says archived: every chunk read from the
nodes' RAM and put, then the manifest), the cluster stopped, and a fresh cluster of 4 with
empty data directories pointed at the same archive: ``restore from archive`` (the client's
``restore_checkpoint``; the nodes read every chunk through the archive) and ``restore
again`` (from the nodes' read-through cache in RAM). Each as GB/s of checkpoint bytes, and
as a ratio to the store's own best raw put (archive) or raw get (the restores) of the
same run.

The store is a Swift with s3api started for the run on 127.0.0.1 (the tests' server,
``tests/s3server.py``), or ``--endpoint``/``--bucket``/``--access-key``/``--secret-key``
of yours, or a directory (``--file DIR``: the ``file://`` form, raw = the library's
local store on the same directory). The modes' order rotates from round to round (the
machine is shared: a neighbour's burst slows them alike). GB/s is chunk bytes (10^9) per
second of the best and the median round; ``ratio`` is the tier's best round over the raw
mode's best, ``median ratio`` the median of the round-by-round ratios. Every object is
deleted after its round; the scratch directory (and the Swift) are gone at the end.
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
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import obstore
from obstore.store import LocalStore, S3Store

from erasure.content import chunk_id_of
from loadtest.harness.cluster import TOKEN, start_cluster
from loadtest.harness.report import RESULTS, markdown_table, ratio, write_json
from storaged.client import Client
from storaged.client.checkpoint import restore_checkpoint, save_checkpoint
from storaged.tools.local_cluster import LocalCluster
from tiers.archive import ArchiveTier, S3Options

if TYPE_CHECKING:
    from obstore.store import ObjectStore, S3Config

    from tests.s3server import SwiftS3Server

MiB = 1 << 20
MODES = ("raw put", "tier put", "raw get", "tier get")
BASELINE = {"tier put": "raw put", "tier get": "raw get"}


def fresh_chunks(count: int, size: int, round_no: int) -> list[tuple[str, bytearray]]:
    """``count`` chunks no earlier round made: one random block, a different prefix each."""
    block = os.urandom(size)
    chunks = []
    for i in range(count):
        data = bytearray(block)
        data[:24] = round_no.to_bytes(8, "little") + i.to_bytes(16, "little")
        chunks.append((chunk_id_of(data), data))
    return chunks


async def bounded(calls: Sequence[Callable[[], Awaitable[Any]]], concurrency: int) -> float:
    """Seconds to run ``calls`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with sem:
            await call()

    started = time.perf_counter()
    await asyncio.gather(*(one(call) for call in calls))
    return time.perf_counter() - started


async def measure(
    raw: ObjectStore, tier: ArchiveTier, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds per round of each mode."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_no in range(args.rounds):
        chunks = fresh_chunks(args.count, args.size, round_no)
        names = [f"raw/{key}" for key, _ in chunks]

        async def raw_get(name: str, size: int) -> None:
            got = await (await obstore.get_async(raw, name)).bytes_async()
            if len(got) != size:
                raise AssertionError(f"{name}: {len(got)} bytes, not {size}")

        async def tier_get(key: str) -> None:
            if (await tier.get(key)).nbytes != args.size:
                raise AssertionError(f"{key}: wrong size")

        calls: dict[str, list[Callable[[], Awaitable[Any]]]] = {
            "raw put": [
                partial(obstore.put_async, raw, n, d, use_multipart=False)
                for n, (_, d) in zip(names, chunks, strict=True)
            ],
            "tier put": [partial(tier.put, k, d) for k, d in chunks],
            "raw get": [partial(raw_get, n, args.size) for n in names],
            "tier get": [partial(tier_get, k) for k, _ in chunks],
        }
        # Puts before gets (a get reads what its put wrote); within each pair the order
        # rotates from round to round.
        for pair in (MODES[:2], MODES[2:]):
            for mode in pair if round_no % 2 == 0 else pair[::-1]:
                times[mode].append(await bounded(calls[mode], args.concurrency))
        await obstore.delete_async(raw, names)
        for key, _ in chunks:
            await tier.delete(key)
    return times


#: the cluster step's node settings: small RAM, nothing pre-faulted (two clusters run)
CLUSTER_SETTINGS = {"prefault_fraction": 0.0, "log_level": "WARNING"}
#: seconds between status polls while a checkpoint is archived
_POLL = 0.02


async def through_cluster(
    args: argparse.Namespace, archive: dict[str, str], scratch: Path
) -> dict[str, float]:
    """Seconds to archive a checkpoint of ``count`` chunks of ``size`` bytes from a cluster,
    to restore it on a fresh cluster that shares only the archive, and to restore it again
    (``archive``: the cluster file's ``[archive]`` table)."""
    total = args.count * args.size
    data = np.frombuffer(os.urandom(total), dtype=np.uint8)
    name = f"bench/archive-{time.time_ns()}"
    make = partial(LocalCluster, archive=archive)
    first = await asyncio.to_thread(
        start_cluster, scratch / "first", memory="1GiB", settings=CLUSTER_SETTINGS, make=make
    )
    try:
        async with Client(first.urls, token=TOKEN) as client:
            await save_checkpoint(client, name, {0: {"bytes": data}}, chunk_size=args.size)
            started = time.perf_counter()
            await client.archive(name)
            while not (await client.status(name)).archived:
                await asyncio.sleep(_POLL)
            seconds = {"archive": time.perf_counter() - started}
    finally:
        await asyncio.to_thread(first.stop)
        shutil.rmtree(scratch / "first", ignore_errors=True)
    second = await asyncio.to_thread(
        start_cluster, scratch / "second", memory="1GiB", settings=CLUSTER_SETTINGS, make=make
    )
    try:
        async with Client(second.urls, token=TOKEN) as client:
            for step in ("restore from archive", "restore again"):
                out = np.empty(total, dtype=np.uint8)
                started = time.perf_counter()
                await restore_checkpoint(client, name, {"bytes": out})
                seconds[step] = time.perf_counter() - started
                if not np.array_equal(out, data):
                    raise AssertionError(f"{step}: the restored bytes differ")
    finally:
        await asyncio.to_thread(second.stop)
        shutil.rmtree(scratch / "second", ignore_errors=True)
    return seconds


def summarize_cluster(
    seconds: dict[str, float], total: int, modes: dict[str, Any]
) -> dict[str, Any]:
    """GB/s of each cluster step, and its ratio to the store's raw mode of the same kind
    (best rounds: the raw modes' best GB/s)."""
    rows: dict[str, Any] = {}
    for step, took in seconds.items():
        gbps = total / took / 1e9
        base = "raw put" if step == "archive" else "raw get"
        rows[step] = {
            "seconds": round(took, 6),
            "gbps": round(gbps, 6),
            "baseline": base,
            "ratio": ratio(gbps, modes[base]["best_gbps"]),
        }
    return rows


def summarize(times: dict[str, list[float]], total: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for mode, seconds in times.items():
        row: dict[str, Any] = {
            "seconds": [round(s, 6) for s in seconds],
            "best_gbps": round(total / min(seconds) / 1e9, 6),
            "median_gbps": round(total / statistics.median(seconds) / 1e9, 6),
        }
        base = BASELINE.get(mode)
        if base is not None:
            row["ratio_best"] = ratio(min(times[base]), min(seconds))
            paired = [b / s for b, s in zip(times[base], seconds, strict=True)]
            row["ratio_median"] = round(statistics.median(paired), 3)
        rows[mode] = row
    return rows


async def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    doc: dict[str, Any] = {"count": args.count, "size": args.size, "rounds": args.rounds}
    doc["concurrency"] = args.concurrency
    server = None
    if args.file:
        root = Path(args.file) / f"bench-{time.time_ns()}"  # absolute: main() made it
        raw: ObjectStore = LocalStore(root, mkdir=True)
        tier = await ArchiveTier.open(root.as_uri(), 1 << 50)
        doc["store"] = f"file:// {root}"
        archive = {"url": (root / "cluster").as_uri()}
    else:
        if not args.endpoint:
            server = await asyncio.to_thread(start_swift, scratch)
            args.endpoint, args.bucket = server.endpoint, server.bucket
            args.access_key, args.secret_key = server.access_key, server.secret_key
            doc["swift_start_s"] = round(server.start_seconds, 2)
        prefix = f"bench-{time.time_ns()}"
        keys: S3Config = {}  # none given: from the environment, as the tier's
        if args.access_key:
            keys = {"access_key_id": args.access_key, "secret_access_key": args.secret_key}
        raw = S3Store(
            args.bucket,
            prefix=prefix,
            config=keys,
            endpoint=args.endpoint,
            region=args.region,
            client_options={"allow_http": args.endpoint.startswith("http://")},
        )
        options = S3Options(
            endpoint=args.endpoint,
            region=args.region,
            access_key_id=args.access_key or None,  # None: from the environment
            secret_access_key=args.secret_key or None,
        )
        tier = await ArchiveTier.open(f"s3://{args.bucket}/{prefix}", 1 << 50, s3=options)
        doc["store"] = "swift s3api" if server else f"s3 {args.endpoint}"
        archive = {
            "url": f"s3://{args.bucket}/{prefix}-cluster",
            "endpoint": args.endpoint,
            "region": args.region,
        }
        if args.access_key:  # the nodes take them from their environment only
            os.environ["AWS_ACCESS_KEY_ID"] = args.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = args.secret_key
    try:
        times = await measure(raw, tier, args)
        doc["modes"] = summarize(times, args.count * args.size)
        if args.cluster:
            seconds = await through_cluster(args, archive, scratch)
            doc["cluster"] = summarize_cluster(seconds, args.count * args.size, doc["modes"])
    finally:
        await tier.close()
        if server is not None:
            await asyncio.to_thread(server.close_blocking)
        if args.file:
            shutil.rmtree(root, ignore_errors=True)
    doc["load_average"] = round(os.getloadavg()[0], 1)
    return doc


def start_swift(scratch: Path) -> SwiftS3Server:
    # The tests' server: a benchmark may start it as loadtest.etcd_coord starts etcd
    from tests.s3server import SwiftS3Server, swift_missing

    why = swift_missing()
    if why is not None:
        raise SystemExit(f"loadtest.archive: {why}; or give --endpoint, or --file DIR")
    server = SwiftS3Server(scratch / "swift")
    server.start_blocking(timeout=180)
    return server


def report(doc: dict[str, Any]) -> str:
    head = ["mode", "best GB/s", "median GB/s", "ratio", "median ratio"]
    rows = []
    for mode, row in doc["modes"].items():
        rows.append(
            [
                mode,
                f"{row['best_gbps']:.3f}",
                f"{row['median_gbps']:.3f}",
                f"{row['ratio_best']:.2f}" if "ratio_best" in row else "-",
                f"{row['ratio_median']:.2f}" if "ratio_median" in row else "-",
            ]
        )
    for step, row in doc.get("cluster", {}).items():
        rows.append([f"cluster: {step}", f"{row['gbps']:.3f}", "-", f"{row['ratio']:.2f}", "-"])
    started = f", started in {doc['swift_start_s']} s" if "swift_start_s" in doc else ""
    title = (
        f"archive tier on {doc['store']}{started}: {doc['count']} chunks of {doc['size']} "
        f"bytes per round, {doc['rounds']} rounds, {doc['concurrency']} in flight; load "
        f"average at the end {doc['load_average']} (ratio: tier / raw of the same kind; "
        "cluster: archive / raw put, restores / raw get, best rounds)"
    )
    return title + "\n\n" + markdown_table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.archive", description=__doc__)
    p.add_argument("--count", type=int, default=16, help="chunks per round (default 16)")
    p.add_argument("--size", type=int, default=8 * MiB, help="chunk bytes (default 8 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--concurrency", type=int, default=4, help="in flight (default 4)")
    p.add_argument("--quick", action="store_true", help="4 chunks, 2 rounds")
    p.add_argument("--endpoint", default="", help="an S3 server of yours (default: a Swift)")
    p.add_argument("--bucket", default="", help="its bucket (with --endpoint)")
    p.add_argument("--access-key", default="", help="with --endpoint")
    p.add_argument("--secret-key", default="", help="with --endpoint")
    p.add_argument("--region", default="us-east-1", help="with --endpoint")
    p.add_argument("--file", default="", help="the file:// form, in a new directory in DIR")
    p.add_argument(
        "--no-cluster",
        dest="cluster",
        action="store_false",
        help="skip the archive and restore of a checkpoint through node processes",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="where archive.json goes")
    args = p.parse_args(argv)
    if args.quick:
        args.count, args.rounds = 4, 2
    if args.endpoint and not args.bucket:
        p.error("--endpoint needs --bucket")
    if args.file:
        args.file = str(Path(args.file).resolve())
    scratch = Path(tempfile.mkdtemp(prefix="storaged-archive-bench-"))
    try:
        doc = asyncio.run(run(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(doc))
    write_json(args.out / "archive.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
