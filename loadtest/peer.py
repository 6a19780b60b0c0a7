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
import collections
import multiprocessing
import os
import statistics
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import blake3

from loadtest.common import new_loop, prefaulted
from storaged.peer import PeerClient, PeerError, PeerHandler, PeerServer

MiB = 1 << 20
GB = 1e9
MODES = ("raw", "peer", "aiohttp")
SECRET = b"loadtest-cluster-secret"
HOST = "127.0.0.1"
ROUND_TIMEOUT = 600  # seconds: a round that takes longer has hung


# -- servers (in the child process) -----------------------------------------------------------


class _RawSink(asyncio.BufferedProtocol):
    """8-byte big-endian length, then that many bytes into pooled buffers, then b"k".

    Each chunk's worth of bytes lands in the next buffer of a pool shared with the
    other connections, as in the peer handler: the same memory, the same cache misses.
    """

    def __init__(self, pool: collections.deque[bytearray]) -> None:
        self._pool = pool
        self._slot = pool.popleft()
        self._buf = memoryview(self._slot)
        self._head = bytearray(8)
        self._hpos = 0
        self._left = 0
        self._pos = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.append(self._slot)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._hpos < 8:
            return memoryview(self._head)[self._hpos :]
        if self._pos == len(self._buf):
            self._pool.append(self._slot)
            self._slot = self._pool.popleft()
            self._buf = memoryview(self._slot)
            self._pos = 0
        end = min(len(self._buf), self._pos + self._left)
        return self._buf[self._pos : end]

    def buffer_updated(self, nbytes: int) -> None:
        if self._hpos < 8:
            self._hpos += nbytes
            if self._hpos == 8:
                (self._left,) = struct.unpack("!Q", self._head)
            return
        self._pos += nbytes
        self._left -= nbytes
        if self._left == 0:
            self._hpos = 0
            assert self._transport is not None
            self._transport.write(b"k")


class _PoolHandler(PeerHandler):
    """Lends pre-faulted chunk buffers, stores nothing."""

    def __init__(self, chunk: int, slots: int, verify: bool) -> None:
        self._free = [prefaulted(chunk) for _ in range(slots)]
        self._verify = verify

    async def receive_chunk(self, chunk_id: str, size: int) -> memoryview:
        if not self._free:
            raise PeerError("memory_full", "no free slot")
        return memoryview(self._free.pop())[:size]

    async def chunk_received(self, chunk_id: str, buf: memoryview) -> dict[str, Any]:
        try:
            if self._verify:
                digest = await asyncio.to_thread(lambda: blake3.blake3(buf).hexdigest())
                if digest != chunk_id:
                    raise PeerError("checksum_mismatch", "digest differs")
            return {"size": len(buf)}
        finally:
            self.chunk_aborted(chunk_id, buf)

    def chunk_aborted(self, chunk_id: str, buf: memoryview) -> None:
        assert isinstance(buf.obj, bytearray)
        self._free.append(buf.obj)


async def _start_server(mode: str, chunk: int, slots: int, verify: bool) -> int:
    loop = asyncio.get_running_loop()
    if mode == "raw":
        sink_buffers = collections.deque(prefaulted(chunk) for _ in range(slots))
        server = await loop.create_server(lambda: _RawSink(sink_buffers), HOST, 0)
        port: int = server.sockets[0].getsockname()[1]
        return port
    if mode == "peer":
        peer = PeerServer("bench-server", SECRET, _PoolHandler(chunk, slots, verify))
        await peer.start(HOST, 0)
        return peer.port
    from aiohttp import web

    pool = [prefaulted(chunk) for _ in range(slots)]

    async def put_chunk(request: web.Request) -> web.Response:
        buf = pool.pop()
        try:
            pos = 0
            while piece := await request.content.readany():
                buf[pos : pos + len(piece)] = piece  # the one copy a node makes
                pos += len(piece)
        finally:
            pool.append(buf)
        return web.Response(status=201)

    app = web.Application()
    app.router.add_put("/chunk", put_chunk)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]
    return port


def serve(
    mode: str, loop_name: str, chunk: int, slots: int, verify: bool, control: Connection
) -> None:
    """A sink for ``mode`` (raw, peer or aiohttp) in this process: sends its port on ``control``,
    then answers each ``"cpu"`` with its process CPU seconds; any other message stops it."""
    loop = new_loop(loop_name)
    asyncio.set_event_loop(loop)
    port = loop.run_until_complete(_start_server(mode, chunk, slots, verify))

    def answer() -> None:
        # Blocked in recv, this thread costs nothing: process_time counts the loop's work.
        try:
            while control.recv() == "cpu":
                control.send(time.process_time())
        except (EOFError, OSError):
            pass  # the parent is gone
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=answer, daemon=True).start()
    control.send(port)
    loop.run_forever()


# -- clients (in this process) ------------------------------------------------------------------


class _RawSource(asyncio.Protocol):
    def __init__(self) -> None:
        self.ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.paused = False
        self._resumed: asyncio.Future[None] | None = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)

    async def drain(self) -> None:
        while self.paused:
            self._resumed = asyncio.get_running_loop().create_future()
            await self._resumed

    def data_received(self, data: bytes) -> None:
        if not self.ack.done():
            self.ack.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ack.done():
            self.ack.set_exception(ConnectionError(f"raw sink closed: {exc!r}"))
        self.resume_writing()


@dataclass(frozen=True)
class Plan:
    chunk: int
    piece: int
    chunks_per_stream: int
    streams: int
    write_buffer: int

    @property
    def nbytes(self) -> int:
        return self.chunk * self.chunks_per_stream * self.streams


Sender = Callable[[int], Awaitable[None]]


class Clients:
    """One client per mode, kept across rounds (connections stay open, as in a node).

    ``ports``: mode -> port of its ``serve`` sink; ``close`` when done."""

    def __init__(self, plan: Plan, ports: dict[str, int], source: bytes) -> None:
        self.plan = plan
        self.ports = ports
        self.source = memoryview(source)
        self.chunk_id = blake3.blake3(source).hexdigest()
        self.peer = PeerClient("bench-client", SECRET, write_buffer=plan.write_buffer)
        self._session: Any = None

    async def close(self) -> None:
        await self.peer.close()
        if self._session is not None:
            await self._session.close()

    def _pieces(self) -> list[memoryview]:
        step = self.plan.piece
        return [self.source[i : i + step] for i in range(0, len(self.source), step)]

    async def raw(self, chunks: int) -> None:
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_connection(_RawSource, HOST, self.ports["raw"])
        transport.set_write_buffer_limits(high=self.plan.write_buffer)
        pieces = self._pieces()
        transport.write(struct.pack("!Q", chunks * self.plan.chunk))
        for _ in range(chunks):
            for piece in pieces:
                transport.write(piece)
                if proto.paused:
                    await proto.drain()
        await proto.ack
        transport.close()

    async def peer_puts(self, chunks: int) -> None:
        addr = (HOST, self.ports["peer"])
        pieces = self._pieces()
        for _ in range(chunks):
            stream = await self.peer.open_put(addr, self.chunk_id, self.plan.chunk)
            for piece in pieces:
                await stream.write(piece)
            await stream.finish()

    async def aiohttp_puts(self, chunks: int) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"http://{HOST}:{self.ports['aiohttp']}/chunk"
        for _ in range(chunks):
            async with self._session.put(url, data=self.source) as response:
                if response.status != 201:
                    raise RuntimeError(f"aiohttp PUT gave {response.status}")

    def sender(self, mode: str) -> Sender:
        return {"raw": self.raw, "peer": self.peer_puts, "aiohttp": self.aiohttp_puts}[mode]


@dataclass
class Round:
    seconds: float
    client_cpu: float
    server_cpu: float


async def run_round(clients: Clients, mode: str, control: Connection, chunks: int) -> Round:
    """``chunks`` chunks on each of the plan's streams to the ``mode`` sink (its ``control``
    pipe gives the sink's CPU): wall seconds and CPU seconds of both ends."""
    send = clients.sender(mode)
    control.send("cpu")
    server0 = control.recv()
    cpu0, t0 = time.process_time(), time.perf_counter()
    async with asyncio.timeout(ROUND_TIMEOUT):
        await asyncio.gather(*(send(chunks) for _ in range(clients.plan.streams)))
    seconds, cpu1 = time.perf_counter() - t0, time.process_time()
    control.send("cpu")
    server1 = control.recv()
    return Round(seconds, cpu1 - cpu0, server1 - server0)


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
