"""The nvme tier next to plain file I/O on the same disk, in one run: ``python -m loadtest.nvme``.

Writes, per round, ``--count`` chunks of ``--size`` bytes (8 MiB by default):

- ``raw``: the plain durable-write loop any careful program runs: open a temp file, write,
  fsync, close, rename, fsync the directory; one chunk after the other.
- ``tier``: ``await NvmeTier.put(key, data, verified=True)``, one after the other: the same
  discipline plus the file header, fan-out directories, the index and a thread hop.
- ``tier+check``: the same with the BLAKE3 check of the data (``verified=False``).
- ``raw x4`` and ``tier x4``: four writes in flight (threads / concurrent puts).

Then reads every file of the last round, from the page cache (``warm``) and after dropping
the files' pages with ``posix_fadvise(DONTNEED)`` (``cold``):

- ``raw``: open, ``readv`` into a preallocated buffer, close; no check.
- ``raw+blake3``: the same and a BLAKE3 of the bytes: what any checked read costs.
- ``tier read_into``: ``NvmeTier.read_into(key, preallocated)``: header and BLAKE3 checked.
- ``tier get``: ``NvmeTier.get(key)``: the same into a fresh buffer the caller keeps.

Modes run interleaved, round after round, so that drift on a shared, noisy machine hits
all of them alike. GB/s is chunk bytes (10^9) per second; ``best`` is from the fastest
round, ``median`` from the median round; ratios are to the raw mode of the same kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storaged.ids import chunk_id_of
from tiers._durable import fsync_dir, preadv_all
from tiers.nvme import NvmeTier

MiB = 1 << 20


@dataclass
class Mode:
    name: str
    baseline: str | None
    times: list[float] = field(default_factory=list)


def make_chunks(count: int, size: int) -> list[tuple[str, bytearray]]:
    """Distinct chunks: one random block with a different prefix each (fast to make)."""
    block = os.urandom(size)
    chunks = []
    for i in range(count):
        data = bytearray(block)
        data[:16] = i.to_bytes(16, "little")
        chunks.append((chunk_id_of(data), data))
    return chunks


def raw_write_one(directory: str, name: str, data: bytearray) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def raw_read_one(path: str, out: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if preadv_all(fd, [out], 0) != out.nbytes:
            raise OSError(f"short read of {path}")
    finally:
        os.close(fd)


def drop_cache(paths: Sequence[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="storaged-nvme-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    raw_dir = base / "raw"
    raw_dir.mkdir(exist_ok=True)
    chunks = make_chunks(args.count, args.size)
    total = args.count * args.size
    tier = await NvmeTier.open(base / "tier", 1 << 50)
    pool = ThreadPoolExecutor(max_workers=4)
    loop = asyncio.get_running_loop()

    async def tier_write(verified: bool, inflight: int) -> None:
        sem = asyncio.Semaphore(inflight)

        async def one(key: str, data: bytearray) -> None:
            async with sem:
                await tier.put(key, data, verified=verified)

        await asyncio.gather(*(one(k, d) for k, d in chunks))

    async def raw_write(inflight: int) -> None:
        if inflight == 1:
            for key, data in chunks:
                raw_write_one(str(raw_dir), key, data)
        else:
            await asyncio.gather(
                *(loop.run_in_executor(pool, raw_write_one, str(raw_dir), k, d) for k, d in chunks)
            )

    async def clean() -> None:
        for key, _ in chunks:
            await tier.delete(key)
            (raw_dir / key).unlink(missing_ok=True)

    writes: list[tuple[Mode, Callable[[], Any]]] = [
        (Mode("raw", None), lambda: raw_write(1)),
        (Mode("tier", "raw"), lambda: tier_write(True, 1)),
        (Mode("tier+check", "raw"), lambda: tier_write(False, 1)),
        (Mode("raw x4", None), lambda: raw_write(4)),
        (Mode("tier x4", "raw x4"), lambda: tier_write(True, 4)),
    ]
    for round_ in range(args.rounds):
        for mode, write in writes:
            await clean()
            if round_ == 0 and mode.name == "raw":
                await write()  # warm-up: directories, page cache, allocator
                await clean()
            start = time.perf_counter()
            await write()
            mode.times.append(time.perf_counter() - start)
    if not all(tier.has(k) and (raw_dir / k).exists() for k, _ in chunks):
        await tier_write(True, 4)
        await raw_write(4)

    out = memoryview(bytearray(args.size))
    bufs = [memoryview(bytearray(args.size)) for _ in range(1)]
    raw_paths = [str(raw_dir / k) for k, _ in chunks]
    tier_paths = [str(tier.root / k[:2] / k[2:4] / k) for k, _ in chunks]

    async def raw_read(check: bool) -> None:
        for (key, _), path in zip(chunks, raw_paths, strict=True):
            raw_read_one(path, out)
            if check and chunk_id_of(out) != key:
                raise AssertionError("raw read returned other bytes")

    async def tier_read_into() -> None:
        for key, _ in chunks:
            await tier.read_into(key, bufs[0])

    async def tier_get() -> None:
        for key, _ in chunks:
            await tier.get(key)

    results: dict[str, Any] = {"writes": {}, "reads": {}}
    for cache in ("warm", "cold"):
        reads: list[tuple[Mode, Callable[[], Any], list[str]]] = [
            (Mode("raw", None), lambda: raw_read(False), raw_paths),
            (Mode("raw+blake3", None), lambda: raw_read(True), raw_paths),
            (Mode("tier read_into", "raw"), tier_read_into, tier_paths),
            (Mode("tier get", "raw"), tier_get, tier_paths),
        ]
        for _ in range(args.rounds):
            for mode, read, paths in reads:
                if cache == "cold":
                    drop_cache(paths)
                else:
                    await read()  # make sure the pages are in
                start = time.perf_counter()
                await read()
                mode.times.append(time.perf_counter() - start)
        results["reads"][cache] = summarize([m for m, _, _ in reads], total)
    results["writes"] = summarize([m for m, _ in writes], total)
    await tier.close()
    pool.shutdown()
    if not args.dir:
        shutil.rmtree(base)
    results["config"] = {
        "count": args.count,
        "size": args.size,
        "rounds": args.rounds,
        "dir": str(base),
        "python": sys.version.split()[0],
    }
    return results


def summarize(modes: Sequence[Mode], total: int) -> dict[str, dict[str, float]]:
    by_name = {m.name: m for m in modes}
    rows: dict[str, dict[str, float]] = {}
    for m in modes:
        best = total / min(m.times) / 1e9
        median = total / statistics.median(m.times) / 1e9
        row = {"best_gbps": round(best, 3), "median_gbps": round(median, 3)}
        if m.baseline is not None:
            b = by_name[m.baseline]
            row["ratio_best"] = round(min(b.times) / min(m.times), 3)
            row["ratio_median"] = round(statistics.median(b.times) / statistics.median(m.times), 3)
        rows[m.name] = row
    return rows


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'mode':<16} {'best GB/s':>10} {'median GB/s':>12} {'ratio':>7} {'median ratio':>13}")
    for name, row in rows.items():
        ratio = f"{row['ratio_best']:.2f}" if "ratio_best" in row else "-"
        mratio = f"{row['ratio_median']:.2f}" if "ratio_median" in row else "-"
        print(
            f"  {name:<16} {row['best_gbps']:>10.2f} {row['median_gbps']:>12.2f}"
            f" {ratio:>7} {mratio:>13}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.nvme", description=__doc__)
    parser.add_argument("--dir", help="where to write (default: a temp dir, removed after)")
    parser.add_argument("--count", type=int, default=16, help="chunks per round (default 16)")
    parser.add_argument("--size", type=int, default=8 * MiB, help="chunk bytes (default 8 MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode (default 5)")
    parser.add_argument("--quick", action="store_true", help="6 chunks, 2 rounds")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.count, args.rounds = 6, 2
    started = time.perf_counter()
    results = asyncio.run(run(args))
    cfg = results["config"]
    print(
        f"nvme tier: {cfg['count']} chunks of {cfg['size']} bytes per round,"
        f" {cfg['rounds']} rounds, in {cfg['dir']}"
    )
    print_table("writes (ratio: to raw at the same concurrency)", results["writes"])
    for cache, rows in results["reads"].items():
        print_table(f"reads, {cache} page cache (ratio: to raw, unchecked)", rows)
    print(f"\n{time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
