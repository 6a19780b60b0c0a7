"""The raw baselines the restore and save load tests share: loopback and erasure codec.

Apart from ``loadtest.common`` (the harness) because they run the peer and codec
benchmarks' own raw modes, and those benchmarks use the harness: here the dependencies
run one way (benchmarks -> baselines -> harness), with no import cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from erasure import make_codec
from loadtest.codec import raw_zfec_ops, wrapper_ops
from loadtest.common import GB, ROW_BYTES, Layout, new_loop
from loadtest.peer import Clients, Plan, run_round, serve


def raw_loopback(nbytes: int, chunk: int, streams: int, loop: str = "uvloop") -> dict[str, Any]:
    """``loadtest.peer``'s raw mode: ``streams`` asyncio connections into a sink process.

    The floor of any transfer over loopback here: no framing, no copies but the kernel's.
    The bytes flow from this process to the sink (the two directions cost the same on
    loopback). Returns gbps, seconds, bytes and CPU seconds per GB of both ends.
    """
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=serve, args=("raw", loop, chunk, streams + 2, False, theirs), daemon=True
    )
    proc.start()
    theirs.close()
    try:
        if not mine.poll(60):
            raise RuntimeError("raw loopback sink did not start")
        port = int(mine.recv())
        plan = Plan(chunk, 256 << 10, max(1, nbytes // chunk // streams), streams, 1 << 20)

        async def measure() -> Any:
            clients = Clients(plan, {"raw": port}, os.urandom(chunk))
            try:
                await run_round(clients, "raw", mine, 1)  # warm-up: connections, first touch
                return await run_round(clients, "raw", mine, plan.chunks_per_stream)
            finally:
                await clients.close()

        with asyncio.Runner(loop_factory=lambda: new_loop(loop)) as runner:
            rnd = runner.run(measure())
    finally:
        with contextlib.suppress(OSError):
            mine.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        mine.close()
    gb = plan.nbytes / GB
    return {
        "concurrency": streams,
        "bytes": plan.nbytes,
        "seconds": round(rnd.seconds, 4),
        "gbps": round(gb / rnd.seconds, 4),
        "client_cpu_s_per_gb": round(rnd.client_cpu / gb, 4),
        "server_cpu_s_per_gb": round(rnd.server_cpu / gb, 4),
    }


def codec_rates(data: bytes, k: int, n: int, rounds: int = 5) -> dict[str, Any]:
    """``loadtest.codec``'s raw zfec and the ``erasure`` wrapper on one chunk, best of rounds.

    GB/s of chunk bytes, one thread: encode, and decode with fragment 0 missing (a real
    reconstruction, what a degraded cold read does).
    """
    raw = raw_zfec_ops(data, k, n)
    wrapped = wrapper_ops(make_codec("zfec", k, n), data)
    out: dict[str, Any] = {"codec": "zfec", "k": k, "n": n, "chunk_bytes": len(data)}
    for label, op in (("encode", "encode"), ("decode", "decode missing #0")):
        for side, fns in (("raw", raw), ("wrapper", wrapped)):
            fn = fns[op]
            fn()  # warm-up: first-touch page faults, lazy tables
            best = math.inf
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[f"{label}_{side}_gbps"] = round(len(data) / best / GB, 4)
    return out


def raw_baselines(
    layout: Layout, chunk: int, levels: Sequence[int], loop: str, k: int, n: int
) -> dict[str, Any]:
    """``raw_loopback`` of the layout's bytes at each of ``levels`` streams, and ``codec_rates``
    (zfec ``k``/``n``) of one chunk of the layout: ``{"raw_loopback": [...], "codec": {...}}``."""
    loopback = [raw_loopback(layout.nbytes, chunk, c, loop) for c in levels]
    sample = np.empty((chunk // ROW_BYTES, ROW_BYTES // 4), dtype=np.float32)
    layout.fill(0, 0, sample)
    return {"raw_loopback": loopback, "codec": codec_rates(sample.tobytes(), k, n)}
