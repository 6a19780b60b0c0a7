"""The per-chunk fixed costs of the ack's parts, by chunk size: ``python -m loadtest.chunkcost``.

Issue 20 §1 asks for the per-chunk overheads (mapping, ``fallocate``, thread hops) at
8 MiB and at the chunk size that minimises them. End-to-end sweeps drown them in the noise
of a shared machine, so each part runs here alone, in this process, as the node runs it
(its own functions and classes), ``--ops`` bytes' worth of chunks at a time, for each
size of ``--sizes`` MiB:

- ``map``: ``MemoryTier.allocate`` of a fresh buffer (the pool trimmed before each, as a
  node's first checkpoints find it: anonymous ``mmap`` with ``MAP_POPULATE`` in a worker
  thread) and its ``release``, then the unmapping;
- ``pooled``: the same from a warm pool (a free buffer of that class mapped before the
  batch, then reused);
- ``lease``: a co-located chunk's segment leased and given back unsealed:
  ``lease_shared`` (``memfd_create``, ``ftruncate``, ``posix_fallocate``, seals, in a
  thread), ``release_shared`` (the memfd closed, its pages freed);
- ``shared``: a co-located chunk's segment through its whole life on the node:
  ``lease_shared`` as above, ``seal_shared`` (the write seal, a read-only ``MAP_POPULATE``
  mapping, in a thread), ``release`` (unmapped, closed, its pages freed);
- ``populated``, ``lazy``: how a sealed segment is mapped, alone (no tier, no thread):
  a segment as ``lease_shared`` makes it, sealed, mapped read-only with ``MAP_POPULATE``
  (as ``seal_shared`` does) or without it, one byte of every page read (as the first
  reader of the mapping would fault them in), unmapped and closed;
- ``hop``: ``asyncio.to_thread`` of nothing: the thread hop alone;
- ``blake3``, ``crc32c``: ``chunk_id_of_async`` and ``crc32c_of_async`` of a chunk (the
  id check and the replica's check, each a hop and a pass);
- ``peer``: one replica copy through ``storaged.peer`` over loopback, both ends in this
  process (``open_put``, the chunk in 1 MiB slices as ``PutStream.write`` takes them,
  ``finish``; the server receives into a warm pool's buffer of a ``MemoryTier`` and
  releases it).

Each batch's cost is CPU seconds of the whole process (``getrusage``: every thread, so
the worker threads' part of a hop counts), per operation, a garbage collection at its end
included (what the batch dropped in reference cycles is freed within it: objects from
before the first batch are frozen, so it looks at the batch's own). Sizes run in a rotated order
each round, so load drifts hit them alike. For each part, cost per MiB against 1/size is
fitted by least squares, cost/size = b + a/size (so each size's relative error weighs
alike): ``a`` is the fixed cost per chunk, ``b`` the cost per MiB; fitted per round, the
median and min-max over rounds reported, with the size above which ``a`` is under 5 % of
``b x size`` (20 a / b) and ``a``'s share of the cost at 8 MiB.

The results go to ``loadtest/results/chunkcost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import gc
import mmap
import os
import resource
import statistics
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import blake3

from loadtest.harness.machine import new_loop, run_machine
from loadtest.harness.report import finish
from storaged.ids import chunk_id_of_async, crc32c_of_async
from storaged.peer import PeerClient, PeerError, PeerHandler, PeerServer
from tiers.memory import (
    _SEALS,
    PAGE,
    SHARED_POPULATED,
    Allocation,
    MemoryTier,
    _new_memfd,
    size_class,
)

MiB = 1 << 20
HOST = "127.0.0.1"
SECRET = b"loadtest-chunkcost-secret"
RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("map", "pooled", "lease", "shared", "populated", "lazy", "hop", "blake3", "crc32c",
         "peer")  # fmt: skip
#: the size the issue asks about
AT_MIB = 8
#: what a fixed cost may be of the per-byte cost at the size reported
SHARE = 0.05
#: a sealed chunk goes to each replica in slices this big (storaged.node.write)
SEND_SLICE = 1 << 20


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _TierHandler(PeerHandler[Allocation]):
    """Receives each copy into a pooled buffer of a memory tier and gives it back."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    async def receive_chunk(self, chunk_id: str, size: int) -> Allocation:
        try:
            return await self.tier.allocate(size, timeout=5)
        except Exception as exc:
            raise PeerError("memory_full", str(exc)) from exc

    async def chunk_received(self, chunk_id: str, buf: Allocation) -> dict[str, Any]:
        self.tier.release(buf)
        return {"new": True}

    def chunk_aborted(self, chunk_id: str, buf: Allocation) -> None:
        self.tier.release(buf)


class Parts:
    """Each part as one awaitable operation on a chunk of ``size`` bytes."""

    def __init__(self, largest: int) -> None:
        self.fresh = MemoryTier(4 * largest)
        self.pool = MemoryTier(4 * largest)
        self.shared = MemoryTier(4 * largest)
        self.receiving = MemoryTier(4 * largest)
        self.data = memoryview(blake3.blake3(b"chunkcost").digest(largest))
        self.server = PeerServer("receiver", SECRET, _TierHandler(self.receiving))
        self.client = PeerClient("sender", SECRET)
        self.chunk_id = "0" * 64

    async def start(self) -> None:
        await self.server.start(HOST, 0)

    async def close(self) -> None:
        await self.client.close()
        await self.server.close()
        for tier in (self.fresh, self.pool, self.shared, self.receiving):
            await tier.close()

    async def prepare(self, part: str, size: int) -> None:
        """Untimed, before a batch: the warm pools hold a free buffer of the batch's class
        (the receiving one two: a copy may arrive before the last one is released)."""
        if part in ("pooled", "peer"):
            tier = self.pool if part == "pooled" else self.receiving
            tier.trim()
            await tier.prefault(size, 2)

    def op(self, part: str) -> Callable[[int], Awaitable[object]]:
        ops: dict[str, Callable[[int], Awaitable[object]]] = {
            "map": self.map, "pooled": self.pooled, "lease": self.lease,
            "shared": self.share, "populated": self.populated, "lazy": self.lazy,
            "hop": self.hop,
            "blake3": self.blake3, "crc32c": self.crc32c, "peer": self.peer,
        }  # fmt: skip
        return ops[part]

    async def map(self, size: int) -> None:
        self.fresh.trim()  # the buffer unmapped here, as a trim or a class change does
        self.fresh.release(await self.fresh.allocate(size))

    async def pooled(self, size: int) -> None:
        self.pool.release(await self.pool.allocate(size))

    async def lease(self, size: int) -> None:
        self.shared.release_shared(await self.shared.lease_shared(size))

    async def share(self, size: int) -> None:
        seg = await self.shared.lease_shared(size)
        self.shared.release(await self.shared.seal_shared(seg, size))

    async def populated(self, size: int) -> None:
        _map_sealed(size, SHARED_POPULATED)

    async def lazy(self, size: int) -> None:
        _map_sealed(size, mmap.MAP_SHARED)

    async def hop(self, size: int) -> None:
        await asyncio.to_thread(int)

    async def blake3(self, size: int) -> str:
        return await chunk_id_of_async(self.data[:size])

    async def crc32c(self, size: int) -> int:
        return await crc32c_of_async(self.data[:size])

    async def peer(self, size: int) -> None:
        stream = await self.client.open_put((HOST, self.server.port), self.chunk_id, size)
        async with stream:
            for pos in range(0, size, SEND_SLICE):
                await stream.write(self.data[pos : pos + SEND_SLICE])
            await stream.finish()


async def _settle() -> None:
    """Let the batch's last operation finish freeing within the batch: pending callbacks,
    reference cycles, one more thread hop (without it, after 64 MiB shared segments about
    20 ms per batch landed in the next part's batch, whatever that was)."""
    await asyncio.sleep(0)
    gc.collect()
    await asyncio.to_thread(int)


def _map_sealed(size: int, flags: int) -> None:
    fd = _new_memfd(size_class(size))
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ) as mem:
            bytes(memoryview(mem)[::PAGE])  # every page read once
    finally:
        os.close(fd)


def batch_ops(size: int, batch_bytes: int, lo: int = 16, hi: int = 512) -> int:
    """Operations per batch: ``batch_bytes`` worth of chunks, between ``lo`` and ``hi``."""
    return max(lo, min(hi, batch_bytes // size))


async def _measure(
    parts: Parts, names: Sequence[str], sizes: Sequence[int], rounds: int, batch_bytes: int,
    progress: Callable[[str], None],
) -> list[dict[str, dict[str, float]]]:  # fmt: skip
    """Per round, {part: {size in MiB as text: CPU ms per operation}}."""
    await parts.start()
    for name in names:  # warm-up: imports, connections, the pools' first buffers
        for size in sizes:
            await parts.op(name)(size)
    # What exists now is never collected: a collection at the end of each batch (which
    # charges the batch with the frees of what its operations dropped in cycles) then
    # looks at that batch's objects only.
    gc.collect()
    gc.freeze()
    out: list[dict[str, dict[str, float]]] = []
    for rnd in range(rounds):
        k = rnd % len(sizes)
        figures: dict[str, dict[str, float]] = {name: {} for name in names}
        for size in [*sizes[k:], *sizes[:k]]:
            n = batch_ops(size, batch_bytes)
            for name in names:
                op = parts.op(name)
                await parts.prepare(name, size)
                cpu0 = _cpu()
                for _ in range(n):
                    await op(size)
                await _settle()
                figures[name][_label(size)] = round((_cpu() - cpu0) / n * 1e3, 5)
        out.append({name: {_label(s): figures[name][_label(s)] for s in sizes} for name in names})
        progress(f"# round {rnd + 1} of {rounds} done")
    return out


def _label(size: int) -> str:
    return f"{size / MiB:g}"


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of cost = a + b x size by least squares on cost/size = b + a/size, from
    (size in MiB, cost in ms) points: a in ms per chunk, b in ms per MiB."""
    xs = [1 / s for s, _ in points]
    ys = [c / s for s, c in points]
    if len(points) < 2 or len(set(xs)) < 2:
        raise ValueError("a fit needs two sizes or more")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return a, my - a * mx


def summarize(rounds: list[dict[str, dict[str, float]]], names: Sequence[str]) -> dict[str, Any]:
    """Per part: each size's median and min-max cost (ms per chunk, and ms per MiB); the
    fit of every round (a, b), their medians and spreads; the size where the median ``a``
    is ``SHARE`` of ``b x size``, and ``a``'s share of the cost at ``AT_MIB``."""
    out: dict[str, Any] = {}
    for name in names:
        labels = list(rounds[0][name])
        sizes: dict[str, Any] = {}
        for label in labels:
            values = [r[name][label] for r in rounds]
            med = statistics.median(values)
            sizes[label] = {"median_ms": round(med, 5), "min_ms": min(values),
                            "max_ms": max(values),
                            "ms_per_mib": round(med / float(label), 5)}  # fmt: skip
        fits = [fit([(float(lb), r[name][lb]) for lb in labels]) for r in rounds]
        a = statistics.median(f[0] for f in fits)
        b = statistics.median(f[1] for f in fits)
        at = a + b * AT_MIB
        out[name] = {
            "sizes": sizes,
            "fits": [{"a_ms": round(fa, 5), "b_ms_per_mib": round(fb, 5)} for fa, fb in fits],
            "a_ms": {"median": round(a, 5), "min": round(min(f[0] for f in fits), 5),
                     "max": round(max(f[0] for f in fits), 5)},
            "b_ms_per_mib": {"median": round(b, 5), "min": round(min(f[1] for f in fits), 5),
                             "max": round(max(f[1] for f in fits), 5)},
            # None where the fit has no positive fixed or per-byte cost to compare
            "mib_where_a_is_5pct": round(a / (SHARE * b), 2) if a > 0 and b > 0 else None,
            "a_share_at_8mib": round(a / at, 4) if a > 0 and b > 0 else None,
        }  # fmt: skip
    return out


def _table(summary: dict[str, Any], names: Sequence[str]) -> str:
    head = ("part", "a ms/chunk (min-max)", "b ms/MiB (min-max)", "a share at 8 MiB",
            "a < 5 % above")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in names:
        s = summary[name]
        a, b = s["a_ms"], s["b_ms_per_mib"]
        share = "-" if s["a_share_at_8mib"] is None else f"{s['a_share_at_8mib'] * 100:.1f} %"
        where = "-" if s["mib_where_a_is_5pct"] is None else f"{s['mib_where_a_is_5pct']:g} MiB"
        lines.append(
            f"| {name} | {a['median']:.4f} ({a['min']:.4f} to {a['max']:.4f}) "
            f"| {b['median']:.4f} ({b['min']:.4f} to {b['max']:.4f}) | {share} | {where} |"
        )
    return "\n".join(lines)


def _sizes_table(summary: dict[str, Any], names: Sequence[str]) -> str:
    labels = list(summary[names[0]]["sizes"])
    head = ("part", *(f"{lb} MiB" for lb in labels))
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in names:
        sizes = summary[name]["sizes"]
        lines.append(f"| {name} | " + " | ".join(f"{sizes[lb]['ms_per_mib']:.4f}"
                                                  for lb in labels) + " |")  # fmt: skip
    return "\n".join(lines)


def _parse_sizes(text: str) -> list[int]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if len(values) < 2 or any(v <= 0 for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(
            f"want two or more distinct MiB sizes like 1,8, not {text!r}"
        )
    return [int(v * MiB) for v in values]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.chunkcost", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--sizes", type=_parse_sizes, default=_parse_sizes("1,2,4,8,16,32,64"),
                        help="chunk sizes in MiB (default 1,2,4,8,16,32,64)")  # fmt: skip
    parser.add_argument("--ops", type=float, default=128.0,
                        help="MiB of chunks per batch (16 to 512 operations)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--quick", action="store_true", help="sizes 1,2 MiB, 4 MiB batches, 2 rounds"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "chunkcost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.ops, args.rounds = [MiB, 2 * MiB], 4.0, min(args.rounds, 2)
    names = [p for p in args.parts.split(",") if p]
    if not names or any(p not in PARTS for p in names) or len(set(names)) < len(names):
        parser.error(f"--parts takes a subset of {','.join(PARTS)}")
    if args.rounds < 1 or args.ops <= 0:
        parser.error("--rounds and --ops must be positive")
    command = "python -m loadtest.chunkcost " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}".rstrip(), flush=True)
    load_before = os.getloadavg()
    sizes = sorted(args.sizes)

    async def measure() -> list[dict[str, dict[str, float]]]:
        parts = Parts(max(sizes))
        try:
            return await _measure(parts, names, sizes, args.rounds, int(args.ops * MiB),
                                  lambda line: print(line, flush=True))  # fmt: skip
        finally:
            await parts.close()

    with asyncio.Runner(loop_factory=lambda: new_loop(args.loop)) as runner:
        rounds = runner.run(measure())
    summary = summarize(rounds, names)
    print(f"# CPU ms per chunk = a + b x MiB, fitted per round; median (min to max) of "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs, {args.loop}, load "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(_table(summary, names))
    print("# CPU ms per MiB by chunk size (each size's median)")
    print(_sizes_table(summary, names))
    result = {
        "command": command,
        "machine": run_machine(load_before, loop=args.loop),
        "settings": {"sizes": sizes, "batch_bytes": int(args.ops * MiB), "rounds": args.rounds,
                     "parts": names, "at_mib": AT_MIB, "share": SHARE},
        "rounds": rounds,
        "summary": summary,
    }  # fmt: skip
    return finish(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
