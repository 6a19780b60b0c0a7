"""Peer protocol throughput next to raw loopback and aiohttp: ``python -m loadtest.peer``.

One client process (this one) sends ``--gib`` GiB as ``--chunk-mib`` MiB chunks, over
``--streams`` concurrent connections, to a server process on 127.0.0.1, three ways:

- ``raw``: the floor. A plain ``asyncio.BufferedProtocol`` sink that receives into a
  preallocated buffer; the client writes the same pieces with the same flow control; no
  framing, no auth, one byte of ack per stream at the end.
- ``peer``: ``storaged.peer``: one authenticated ``put`` per chunk (``open_put``, ``write``
  of each piece, ``finish``), received into pooled, pre-faulted buffers by a handler that
  stores nothing (``--verify`` adds the BLAKE3 check in a thread, as the node does).
- ``aiohttp``: one HTTP ``PUT`` per chunk to an aiohttp server that reads the body with
  ``readany()`` and copies it into a pooled, pre-faulted buffer, as a node would.

The modes run interleaved, round after round, each against its own server process started
up front, so drift on this shared machine hits all of them alike; each figure is the median
round. Reported: GB/s (10^9 body bytes per second of wall time) and CPU seconds per GB in
each process (``time.process_time``, all threads of the process), and each as a ratio to
``raw``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
from multiprocessing.connection import Connection
from typing import Any

from loadtest.harness.loopback import Clients, Plan, Round, run_round, serve
from loadtest.harness.machine import new_loop

MiB = 1 << 20
GB = 1e9
MODES = ("raw", "peer", "aiohttp")


# -- clients (in this process) ------------------------------------------------------------------


async def _run_all(
    plan: Plan, ports: dict[str, int], controls: dict[str, Connection], repeat: int
) -> dict[str, list[Round]]:
    source = os.urandom(plan.chunk)
    clients = Clients(plan, ports, source)
    rounds: dict[str, list[Round]] = {mode: [] for mode in ports}
    try:
        for mode in ports:  # warm-up: connections, pools, first-touch
            await run_round(clients, mode, controls[mode], 1)
        for _ in range(repeat):
            for mode in ports:
                rounds[mode].append(
                    await run_round(clients, mode, controls[mode], plan.chunks_per_stream)
                )
    finally:
        await clients.close()
    return rounds


def _median_round(rounds: list[Round]) -> Round:
    ordered = sorted(rounds, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.peer", description=__doc__)
    parser.add_argument("--gib", type=float, help="bytes per round in GiB (default 1)")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--piece-kib", type=int, default=256, help="size of each write")
    parser.add_argument("--streams", type=int, default=2, help="concurrent connections")
    parser.add_argument("--write-buffer-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, help="rounds, the median is reported (default 3)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--verify", action="store_true", help="peer handler checks BLAKE3")
    parser.add_argument("--quick", action="store_true", help="defaults to 256 MiB, one round")
    args = parser.parse_args(argv)
    if args.gib is None:
        args.gib = 0.25 if args.quick else 1.0
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a subset of {','.join(MODES)}")
    chunk = args.chunk_mib * MiB
    chunks_per_stream = max(1, round(args.gib * (1 << 30) / chunk / args.streams))
    plan = Plan(chunk, args.piece_kib << 10, chunks_per_stream, args.streams,
                args.write_buffer_kib << 10)  # fmt: skip

    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    controls: dict[str, Connection] = {}
    ports: dict[str, int] = {}
    try:
        for mode in modes:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(mode, args.loop, chunk, args.streams + 2, args.verify, theirs),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            if not mine.poll(60):
                raise RuntimeError(f"{mode} server did not start")
            ports[mode] = mine.recv()
            controls[mode] = mine
        with asyncio.Runner(loop_factory=lambda: new_loop(args.loop)) as runner:
            rounds = runner.run(_run_all(plan, ports, controls, args.repeat))
    finally:
        for control in controls.values():
            control.send("stop")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    print(f"# python -m loadtest.peer {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(
        f"# {plan.nbytes / (1 << 30):.2f} GiB per round as {args.chunk_mib} MiB chunks, "
        f"{args.piece_kib} KiB writes, {args.streams} streams, {args.loop}, "
        f"median of {args.repeat}, {os.cpu_count()} CPUs"
    )
    base = _median_round(rounds["raw"]) if "raw" in rounds else None
    header = ("mode", "GB/s", "x raw", "client CPU s/GB", "x raw", "server CPU s/GB", "x raw")
    print("| " + " | ".join(header) + " |")
    print("| --- |" + " ---: |" * (len(header) - 1))
    gb = plan.nbytes / GB
    for mode, mode_rounds in rounds.items():
        r = _median_round(mode_rounds)
        rate, ccpu, scpu = gb / r.seconds, r.client_cpu / gb, r.server_cpu / gb
        if base is not None:
            ratios = (
                f"{rate / (gb / base.seconds):.2f}",
                f"{ccpu / (base.client_cpu / gb):.2f}",
                f"{scpu / (base.server_cpu / gb):.2f}",
            )
        else:
            ratios = ("-", "-", "-")
        print(
            f"| {mode} | {rate:.2f} | {ratios[0]} | {ccpu:.3f} | {ratios[1]} "
            f"| {scpu:.3f} | {ratios[2]} |"
        )
    spread = {mode: statistics.pstdev([gb / r.seconds for r in rs]) for mode, rs in rounds.items()}
    if args.repeat > 1:
        print("# GB/s spread (stdev): " + ", ".join(f"{m} {s:.2f}" for m, s in spread.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
