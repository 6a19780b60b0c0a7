"""Where a save's staging copy should land: ``python -m loadtest.staging``.

Issue 10 expected the first save's stall to vanish if the trainer staged straight into
memory leased from its node (pre-allocated there, so no page faults). This measures the
one copy a stall is made of, ``--size`` bytes in ``--chunk-mib`` MiB pieces, into:

- **reused buffers**: numpy arrays written before (the baseline: a steady-state save);
- **fresh buffers**: new numpy arrays each round (a first save without
  ``AsyncSaver.prepare``; numpy asks for transparent huge pages on large arrays);
- **leased node memory**: per piece, a lease from a real node over its shared-memory
  socket (a memfd the node created and ``fallocate``d: its pages exist), mapped writable
  here, filled, unmapped, given back: what staging into leases costs per save, since a
  sealed lease becomes the node's RAM copy and cannot be reused;
- **memfd here**: the same without the node (memfd_create + fallocate + map + copy +
  unmap in this process), the kernel's part alone.

Each mode reports the median seconds per GB over ``--rounds`` rounds (the order of the
modes rotating every round) and its ratio to the reused buffers, plus this process's CPU
seconds per GB (and the node's for the lease mode). A cluster of three nodes (the
smallest that erasure-codes) of which n0 leases.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np

from loadtest.harness.cluster import TOKEN, start_cluster
from loadtest.harness.machine import new_loop, proc_cpu_seconds
from storaged.client.shm import ShmPath, _stage
from storaged.front.shm import socket_path

GB = 1e9
MiB = 1 << 20
MODES = ("reused", "fresh", "leased", "memfd")


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("staging-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


async def _leased(path: ShmPath, pieces: list[memoryview]) -> None:
    for piece in pieces:
        reply, fd = await path._ask({"op": "lease", "size": piece.nbytes})
        if fd is None:
            raise RuntimeError(f"lease refused: {reply}")
        await asyncio.to_thread(_stage, fd, piece.nbytes, piece)
        await path._ask({"op": "release", "lease": reply["lease"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="MiB per round (512)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="piece size, MiB (8)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    size, piece = args.size * MiB, args.chunk_mib * MiB
    source = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    src = [source.data[i : i + piece] for i in range(0, size, piece)]
    reused = [np.ones(piece, np.uint8) for _ in src]
    root = Path(tempfile.mkdtemp(prefix="storaged-staging-"))
    cluster = start_cluster(root / "cluster", 3, memory=f"{2 * args.size}MiB")
    loop = new_loop()
    try:
        node_pid = cluster.procs[0].pid
        sock = socket_path(cluster.data / cluster.node_id(0))
        path = loop.run_until_complete(
            ShmPath.connect(cluster.node_id(0), str(sock), TOKEN, limit=8)
        )

        def copy_reused() -> None:
            for dst, s in zip(reused, src, strict=True):
                np.copyto(dst, np.frombuffer(s, np.uint8))

        def copy_fresh() -> None:
            fresh = [np.empty(piece, np.uint8) for _ in src]
            for dst, s in zip(fresh, src, strict=True):
                np.copyto(dst, np.frombuffer(s, np.uint8))

        def copy_memfd() -> None:
            for s in src:
                _stage(_memfd(piece), piece, s)

        def copy_leased() -> None:
            loop.run_until_complete(_leased(path, src))

        runs: dict[str, Callable[[], None]] = {
            "reused": copy_reused,
            "fresh": copy_fresh,
            "leased": copy_leased,
            "memfd": copy_memfd,
        }
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        node_cpu: list[float] = []
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                c0, n0, t0 = time.process_time(), proc_cpu_seconds(node_pid), time.perf_counter()
                runs[mode]()
                dt = time.perf_counter() - t0
                seconds[mode].append(dt / (size / GB))
                cpu[mode].append((time.process_time() - c0) / (size / GB))
                if mode == "leased":
                    node_cpu.append((proc_cpu_seconds(node_pid) - n0) / (size / GB))
        loop.run_until_complete(path.close())
    finally:
        loop.close()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(seconds["reused"])
    print(f"# staging copy of {args.size} MiB in {args.chunk_mib} MiB pieces, "
          f"{args.rounds} rounds; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| into | s/GB median (min-max) | x reused | this process CPU s/GB | node CPU s/GB |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        med = statistics.median(seconds[mode])
        span = f"{min(seconds[mode]):.3f}-{max(seconds[mode]):.3f}"
        node = f"{statistics.median(node_cpu):.3f}" if mode == "leased" else "-"
        print(f"| {mode} | {med:.3f} ({span}) | {med / base:.2f} | "
              f"{statistics.median(cpu[mode]):.3f} | {node} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
