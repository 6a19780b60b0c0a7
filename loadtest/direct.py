"""Restore from RAM with direct reads on and off, same run: ``python -m loadtest.direct``.

One checkpoint (``loadtest.vs_dcp``'s state layout: float32 tensors, a few large, many
medium, some small; ``--size``, default 2 GiB) is saved to a fresh 4-node
``LocalCluster`` and left to go cold (the RAM copies stay: the RAM tier holds three
copies plus a margin), then restored from the RAM tier into the same pre-faulted
arrays by two ``Client``s of this one process: one with ``direct_reads=True`` (chunk
bodies read straight into the arrays, ``storaged.client.direct``), one with
``direct_reads=False`` (aiohttp, each piece copied into the arrays). Each client does
one untimed restore first (connections, node-side leases); then ``--rounds`` rounds,
each timing one restore per client, the order alternating from round to round.

Reported per mode: GB/s (10^9 bytes per wall second), the client's CPU seconds per GB
(``time.process_time``, all its threads) and the nodes' (``/proc/<pid>/stat``); per
round the ratios direct / aiohttp, and their range and median over the rounds. Every
restore is checked against the saved bytes (BLAKE3 of all arrays, untimed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.harness.cluster import TOKEN
from loadtest.harness.machine import GB
from loadtest.harness.report import RESULTS
from loadtest.harness.state_dict import (
    Array,
    digest_arrays,
    memory_per_node,
    node_pids,
    prefaulted_arrays,
    ram_tier_check,
    start_sized_cluster,
    state_layout,
)
from loadtest.harness.stopwatch import Stopwatch, Window
from storaged.client import Client, restore_checkpoint, save_checkpoint

MODES = ("direct", "aiohttp")


def random_state(shapes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {key: rng.random(shape, dtype=np.float32) for key, shape in shapes.items()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    total = int(args.size * (1 << 30)) // 4 * 4
    specs = state_layout(total)
    shapes = {s.key: s.shape for s in specs}
    state = await asyncio.to_thread(random_state, shapes)
    nbytes = sum(a.nbytes for a in state.values())
    expected = await asyncio.to_thread(digest_arrays, [state[k] for k in shapes])
    root = Path(tempfile.mkdtemp(prefix="storaged-direct-", dir=args.tmp))
    cluster = await asyncio.to_thread(start_sized_cluster, root, 4, memory_per_node(nbytes, 4))
    try:
        pids = node_pids(cluster)
        name = "bench/direct"
        async with Client(cluster.urls, token=TOKEN) as writer:
            await save_checkpoint(writer, name, {0: state})
            await writer.wait(name, "cold", timeout=600)
            ram = await ram_tier_check(writer, name)
        del state
        dst = await asyncio.to_thread(prefaulted_arrays, specs)
        clients = {
            # HTTP both ways (the subject): co-located, every chunk would come from the
            # local node's copy through shared memory.
            mode: Client(
                cluster.urls,
                token=TOKEN,
                max_concurrency=args.concurrency,
                direct_reads=mode == "direct",
                shm=False,
            )
            for mode in MODES
        }
        windows: dict[str, list[Window]] = {mode: [] for mode in MODES}
        verified = True
        try:
            for client in clients.values():
                await client.open()
            for mode in MODES:
                await restore_checkpoint(clients[mode], name, dst)  # untimed
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    for array in dst.values():
                        array.fill(0)
                    watch = Stopwatch(pids)
                    await restore_checkpoint(clients[mode], name, dst)
                    windows[mode].append(watch.lap())
                    got = await asyncio.to_thread(digest_arrays, [dst[k] for k in shapes])
                    verified = verified and got == expected
            direct = clients["direct"].direct
            pool = (
                {
                    "connections": direct.stats.connections,
                    "requests": direct.stats.requests,
                    "reused": direct.stats.reused,
                    "stale_retries": direct.stats.stale_retries,
                }
                if direct is not None
                else {}
            )
        finally:
            for client in clients.values():
                await client.close()
    finally:
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(root, ignore_errors=True)
    return report(windows, nbytes, ram, verified, pool, args)


def _range(values: Sequence[float], digits: int = 2) -> str:
    return (
        f"{min(values):.{digits}f}-{max(values):.{digits}f} "
        f"(median {statistics.median(values):.{digits}f})"
    )


def report(
    windows: Mapping[str, Sequence[Window]],
    nbytes: int,
    ram: Mapping[str, int],
    verified: bool,
    pool: Mapping[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    per_mode: dict[str, dict[str, list[float]]] = {}
    for mode in MODES:
        ws = windows[mode]
        per_mode[mode] = {
            "gb_s": [nbytes / GB / w.seconds for w in ws],
            "client_cpu_s_per_gb": [w.client_cpu / (nbytes / GB) for w in ws],
            "node_cpu_s_per_gb": [sum(w.node_cpu) / (nbytes / GB) for w in ws],
            "machine_busy": [w.machine_busy for w in ws],
        }
    d, a = per_mode["direct"], per_mode["aiohttp"]
    ratios = {
        "gb_s": [x / y for x, y in zip(d["gb_s"], a["gb_s"], strict=True)],
        "client_cpu_s_per_gb": [
            x / y for x, y in zip(d["client_cpu_s_per_gb"], a["client_cpu_s_per_gb"], strict=True)
        ],
    }
    print(
        f"restore from RAM of {nbytes / GB:.3f} GB ({ram['chunks']} chunks, "
        f"{ram['chunks_in_memory']} in RAM), {args.rounds} rounds, "
        f"{args.concurrency} requests in flight"
    )
    print(f"{'mode':<8} {'GB/s':>28} {'client CPU s/GB':>28} {'node CPU s/GB':>28}")
    for mode in MODES:
        m = per_mode[mode]
        print(
            f"{mode:<8} {_range(m['gb_s']):>28} {_range(m['client_cpu_s_per_gb']):>28} "
            f"{_range(m['node_cpu_s_per_gb']):>28}"
        )
    print(
        f"direct / aiohttp per round: GB/s {_range(ratios['gb_s'])}, "
        f"client CPU s/GB {_range(ratios['client_cpu_s_per_gb'])}"
    )
    print(f"direct pool: {dict(pool)}; every restore verified: {verified}")
    return {
        "bytes": nbytes,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "ram": dict(ram),
        "modes": per_mode,
        "ratios": ratios,
        "direct_pool": dict(pool),
        "verified": verified,
        "windows": {mode: [w.to_json() for w in windows[mode]] for mode in MODES},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.direct", description=__doc__)
    parser.add_argument("--size", type=float, default=2.0, help="GiB (default 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8, help="Client max_concurrency")
    parser.add_argument("--quick", action="store_true", help="128 MiB, 2 rounds")
    parser.add_argument("--tmp", default=None, help="directory for the nodes' data")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds = 0.125, 2
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "direct.json").write_text(json.dumps(result, indent=1))
    print(f"results in {args.out / 'direct.json'}")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
