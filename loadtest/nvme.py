"""The nvme tier next to plain file I/O on the same disk, in one run: ``python -m loadtest.nvme``.

Writes, per round, ``--count`` chunks of ``--size`` bytes (8 MiB by default):

- ``raw``: the plain durable-write loop any careful program runs: open a temp file, write,
  fsync, close, rename, fsync the directory; one chunk after the other.
- ``tier``: ``await NvmeTier.put(key, data, verified=True)``, one after the other: the same
  discipline plus the file header, fan-out directories, the index and a thread hop.
- ``tier+check``: the same with the BLAKE3 check of the data (``verified=False``).
- ``raw x4`` and ``tier x4``: four writes in flight (threads / concurrent puts).

Then reads the files of the last round, from the page cache (``warm``) and after dropping
each file's pages with ``posix_fadvise(DONTNEED)`` (``cold``):

- ``raw``: open, ``preadv`` into a preallocated buffer, close; no check.
- ``raw+blake3``: the same and a BLAKE3 of the bytes: what any checked read costs.
- ``tier read_into``: ``NvmeTier.read_into(key, preallocated)``: header and BLAKE3 checked.
- ``tier get``: ``NvmeTier.get(key)``: the same into a new buffer the caller keeps.

This machine is shared, disk included, so the sequential modes are timed chunk by chunk,
interleaved (chunk 1 raw, chunk 1 tier, chunk 1 tier+check, chunk 2 ..., the order rotating
from round to round): a neighbour's burst slows them alike. The x4 modes alternate round by
round. GB/s is chunk bytes (10^9) per second from the best and the median round; ``ratio``
is to the raw mode of the same kind from the best rounds, ``median ratio`` the median of the
round-by-round ratios. Rounds stop at ``--rounds`` or after ``--budget`` seconds (at least
two), so a run stays well under a minute.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.harness.baselines import raw_write_one
from storaged.ids import chunk_id_of
from tiers._durable import preadv_all
from tiers.nvme import NvmeTier

MiB = 1 << 20


@dataclass
class Mode:
    name: str
    baseline: str | None
    #: seconds per round (all chunks)
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
    started = time.perf_counter()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="storaged-nvme-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    raw_dir = base / "raw"
    raw_dir.mkdir(exist_ok=True)
    chunks = make_chunks(args.count, args.size)
    total = args.count * args.size
    tier = await NvmeTier.open(base / "tier", 1 << 50)
    checked = await NvmeTier.open(base / "tier-checked", 1 << 50)
    pool = ThreadPoolExecutor(max_workers=4)
    loop = asyncio.get_running_loop()

    def more_rounds(done: int) -> bool:
        if done < 2:
            return True
        rounds_left: bool = done < args.rounds
        return rounds_left and time.perf_counter() - started < args.budget

    # --- writes: the sequential modes are timed chunk by chunk, interleaved, so that the
    # disk's neighbours (this machine is shared) slow each mode alike.
    async def write_one(mode: str, key: str, data: bytearray) -> None:
        if mode == "raw":
            raw_write_one(str(raw_dir), key, data)
        elif mode == "tier":
            await tier.put(key, data, verified=True)
        else:
            await checked.put(key, data)

    async def write_many(mode: str) -> None:
        if mode == "raw x4":
            await asyncio.gather(
                *(loop.run_in_executor(pool, raw_write_one, str(raw_dir), k, d) for k, d in chunks)
            )
        else:
            sem = asyncio.Semaphore(4)

            async def one(key: str, data: bytearray) -> None:
                async with sem:
                    await tier.put(key, data, verified=True)

            await asyncio.gather(*(one(k, d) for k, d in chunks))

    async def clean() -> None:
        for key, _ in chunks:
            await tier.delete(key)
            await checked.delete(key)
            (raw_dir / key).unlink(missing_ok=True)

    seq = {m.name: m for m in (Mode("raw", None), Mode("tier", "raw"), Mode("tier+check", "raw"))}
    par = {m.name: m for m in (Mode("raw x4", None), Mode("tier x4", "raw x4"))}
    await clean()
    for key, data in chunks[:2]:  # warm-up: directories, threads, allocator
        for name in seq:
            await write_one(name, key, data)
    rounds = 0
    while more_rounds(rounds):
        await clean()
        order = list(seq)[rounds % 3 :] + list(seq)[: rounds % 3]
        spent = dict.fromkeys(seq, 0.0)
        for key, data in chunks:
            for name in order:
                t0 = time.perf_counter()
                await write_one(name, key, data)
                spent[name] += time.perf_counter() - t0
        for name, seconds in spent.items():
            seq[name].times.append(seconds)
        for name in list(par) if rounds % 2 == 0 else list(par)[::-1]:
            for key, _ in chunks:  # each mode rewrites its own files
                if name == "tier x4":
                    await tier.delete(key)
                else:
                    (raw_dir / key).unlink(missing_ok=True)
            t0 = time.perf_counter()
            await write_many(name)
            par[name].times.append(time.perf_counter() - t0)
        rounds += 1
    write_rounds = rounds

    # --- reads of what the last round wrote, chunk by chunk, interleaved likewise.
    out = memoryview(bytearray(args.size))
    raw_paths = {k: str(raw_dir / k) for k, _ in chunks}
    tier_paths = {k: str(tier.root / k[:2] / k[2:4] / k) for k, _ in chunks}

    async def read_one(mode: str, key: str) -> None:
        if mode == "raw":
            raw_read_one(raw_paths[key], out)
        elif mode == "raw+blake3":
            raw_read_one(raw_paths[key], out)
            if chunk_id_of(out) != key:
                raise AssertionError("raw read returned other bytes")
        elif mode == "tier read_into":
            await tier.read_into(key, out)
        else:
            await tier.get(key)

    results: dict[str, Any] = {"writes": {}, "reads": {}}
    for cache in ("warm", "cold"):
        modes = {
            m.name: m
            for m in (
                Mode("raw", None),
                Mode("raw+blake3", "raw"),
                Mode("tier read_into", "raw"),
                Mode("tier get", "raw"),
            )
        }
        started = time.perf_counter()
        rounds = 0
        while more_rounds(rounds):
            order = list(modes)[rounds % 4 :] + list(modes)[: rounds % 4]
            spent = dict.fromkeys(modes, 0.0)
            for key, _ in chunks:
                for name in order:
                    path = tier_paths[key] if name.startswith("tier") else raw_paths[key]
                    if cache == "cold":
                        drop_cache([path])
                    else:
                        await read_one(name, key)  # make sure its pages are in
                    t0 = time.perf_counter()
                    await read_one(name, key)
                    spent[name] += time.perf_counter() - t0
            for name, seconds in spent.items():
                modes[name].times.append(seconds)
            rounds += 1
        results["reads"][cache] = summarize(list(modes.values()), total)
        results["reads"][cache]["rounds"] = rounds
    results["writes"] = summarize([*seq.values(), *par.values()], total)
    await tier.close()
    await checked.close()
    pool.shutdown()
    if not args.dir:
        shutil.rmtree(base)
    results["config"] = {
        "count": args.count,
        "size": args.size,
        "write_rounds": write_rounds,
        "dir": str(base),
        "python": sys.version.split()[0],
        "load_average": os.getloadavg()[0],
    }
    return results


def summarize(modes: Sequence[Mode], total: int) -> dict[str, Any]:
    """GB/s from the best and the median round; ratios to the baseline from the best
    rounds and (``ratio_median``) the median of the round-by-round ratios."""
    by_name = {m.name: m for m in modes}
    rows: dict[str, Any] = {}
    for m in modes:
        row = {
            "best_gbps": round(total / min(m.times) / 1e9, 3),
            "median_gbps": round(total / statistics.median(m.times) / 1e9, 3),
        }
        if m.baseline is not None:
            b = by_name[m.baseline]
            row["ratio_best"] = round(min(b.times) / min(m.times), 3)
            paired = [bt / mt for bt, mt in zip(b.times, m.times, strict=True)]
            row["ratio_median"] = round(statistics.median(paired), 3)
        rows[m.name] = row
    return rows


def print_table(title: str, rows: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"  {'mode':<16} {'best GB/s':>10} {'median GB/s':>12} {'ratio':>7} {'median ratio':>13}")
    for name, row in rows.items():
        if not isinstance(row, dict):
            continue
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
    parser.add_argument("--rounds", type=int, default=5, help="at most this many (default 5)")
    parser.add_argument(
        "--budget",
        type=float,
        default=15.0,
        help="no new round after this many seconds of writes, or of each read kind"
        " (at least 2 rounds; default 15)",
    )
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
        f" {cfg['write_rounds']} write rounds, in {cfg['dir']}; load average at the end"
        f" {cfg['load_average']:.1f}"
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
