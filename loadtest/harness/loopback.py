"""Servers and senders on 127.0.0.1 that the baselines measure against.

- ``spawn_server``/``stop_server``: a server in a spawned process (``serve_aiohttp``,
  ``serve_baseline``: the one-copy aiohttp receiver), stopped with SIGTERM, then SIGKILL.
- ``upload_all``: PUT ``Upload``s with the client's slicing, as ``storaged.client`` sends.
- ``serve``/``Clients``/``run_round``: one round of raw loopback, peer protocol or aiohttp
  transfers between this process and a server process (the peer benchmark's modes).
"""

from __future__ import annotations

import asyncio
import collections
import math
import multiprocessing
import signal
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import aiohttp
import blake3
from aiohttp import web

from loadtest.harness.cluster import HOST
from loadtest.harness.machine import new_loop, prefaulted
from storaged.peer import LentBuffer, PeerClient, PeerError, PeerHandler, PeerServer


def serve_aiohttp(app: web.Application, loop_name: str, control: Connection) -> None:
    """Serve ``app`` on an ephemeral port of ``HOST`` (on a fresh ``loop_name`` loop) and send
    the port on ``control``; returns once SIGTERM stops the loop. For baseline servers run
    with ``spawn_server``."""

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, 0, backlog=1024).start()
        return runner

    loop = new_loop(loop_name)
    asyncio.set_event_loop(loop)
    runner = loop.run_until_complete(start())
    control.send(runner.addresses[0][1])
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.run_forever()


#: what storaged.client sends per write
SEND_SLICE = 1 << 20


#: bytes at the head of each chunk that make it distinct: (round tag, chunk index)
STAMP = struct.Struct("!QQ")


@dataclass(frozen=True)
class Upload:
    chunk_id: str
    stamp: bytes
    view: memoryview

    @property
    def size(self) -> int:
        return len(self.view)

    async def body(self) -> AsyncIterator[bytes | memoryview]:
        # The slices storaged.client sends, with the stamp in front of the first one.
        yield self.stamp
        yield self.view[STAMP.size : SEND_SLICE]
        for offset in range(SEND_SLICE, len(self.view), SEND_SLICE):
            yield self.view[offset : offset + SEND_SLICE]


def serve_baseline(chunk: int, slots: int, loop_name: str, control: Connection) -> None:
    """The one-copy baseline receiver (run it with ``spawn_server``): ``PUT /v1/chunks/<id>``
    of at most ``chunk`` bytes, copied once into one of ``slots`` reused buffers, 201."""
    from aiohttp import web

    pool = [prefaulted(chunk) for _ in range(slots)]

    async def put_chunk(request: web.Request) -> web.Response:
        size = request.content_length
        if size is None or size > chunk:
            return web.Response(status=413)
        buf = pool.pop()
        try:
            pos = 0
            while pos < size:
                data, _ = await request.content.readchunk()
                if not data:
                    return web.Response(status=400, text="truncated")
                buf[pos : pos + len(data)] = data  # the one copy a store has to make
                pos += len(data)
        finally:
            pool.append(buf)
        return web.Response(status=201, body=b"\x80")  # an empty msgpack map, like a node's

    app = web.Application()
    app.router.add_put("/v1/chunks/{id}", put_chunk)
    serve_aiohttp(app, loop_name, control)


def spawn_server(target: Callable[..., None], *args: Any) -> tuple[BaseProcess, int]:
    """``target(*args, control)`` in a spawned daemon process, once it has sent its port on
    ``control`` (60 s at most, else killed and RuntimeError): (process, port).
    Stop it with ``stop_server``."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    if not mine.poll(60):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    port: int = mine.recv()
    return proc, port


def stop_server(proc: BaseProcess) -> None:
    """SIGTERM, then SIGKILL if it is still alive after 10 s; joined."""
    if proc.is_alive():
        proc.terminate()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


class UploadError(RuntimeError):
    pass


#: how often one PUT is retried after a 503 (with its Retry-After, at most 2 s each)
RETRIES_503 = 5


async def upload_all(
    session: aiohttp.ClientSession,
    uploads: Sequence[Upload],
    url_of: Callable[[Upload], str],
    concurrency: int,
    max_seconds: float = math.inf,
) -> tuple[float, list[float]]:
    """PUT the uploads with ``concurrency`` in flight; (wall seconds, ack latencies).

    No new PUT starts after ``max_seconds``: there is one latency per acked upload.
    """
    latencies: list[float] = []
    retries: list[str] = []
    todo = iter(uploads)
    deadline = time.perf_counter() + max_seconds

    async def worker() -> None:
        for up in todo:
            if time.perf_counter() > deadline:
                return  # bounded run time on a slow or busy machine: stop sending new chunks
            t0 = time.perf_counter()
            headers = {"Content-Length": str(up.size), "Content-Type": "application/octet-stream"}
            for attempt in range(RETRIES_503 + 1):
                async with session.put(url_of(up), data=up.body(), headers=headers) as resp:
                    text = (await resp.read())[:200]
                    if resp.status == 201:
                        break
                    if resp.status != 503 or attempt == RETRIES_503:
                        raise UploadError(f"PUT {up.chunk_id[:12]} gave {resp.status}: {text!r}")
                    # As a client would: a busy node (heartbeats late, RAM full) asks to retry.
                    retries.append(up.chunk_id)
                    await asyncio.sleep(min(2.0, float(resp.headers.get("Retry-After", "0.5"))))
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if retries:
        print(f"# {len(retries)} PUT(s) answered 503 and were retried", flush=True)
    return time.perf_counter() - t0, latencies


SECRET = b"loadtest-cluster-secret"


ROUND_TIMEOUT = 600  # seconds: a round that takes longer has hung


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


class _PoolHandler(PeerHandler[LentBuffer]):
    """Lends pre-faulted chunk buffers, stores nothing."""

    def __init__(self, chunk: int, slots: int, verify: bool) -> None:
        self._free = [prefaulted(chunk) for _ in range(slots)]
        self._verify = verify

    async def receive_chunk(self, chunk_id: str, size: int) -> LentBuffer:
        if not self._free:
            raise PeerError("memory_full", "no free slot")
        return LentBuffer(memoryview(self._free.pop())[:size])

    async def chunk_received(self, chunk_id: str, buf: LentBuffer) -> dict[str, Any]:
        try:
            if self._verify:
                digest = await asyncio.to_thread(lambda: blake3.blake3(buf.view).hexdigest())
                if digest != chunk_id:
                    raise PeerError("checksum_mismatch", "digest differs")
            return {"size": len(buf.view)}
        finally:
            self.chunk_aborted(chunk_id, buf)

    def chunk_aborted(self, chunk_id: str, buf: LentBuffer) -> None:
        assert isinstance(buf.view.obj, bytearray)
        self._free.append(buf.view.obj)


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


class FlowControl(asyncio.Protocol):
    """A sending protocol's flow control as ``storaged.peer``'s connections have it:
    ``pause_writing`` past the transport's high-water mark, ``drain`` until
    ``resume_writing``; ``drain`` raises ``ConnectionError`` once ``lost`` is set."""

    def __init__(self) -> None:
        self.paused = False
        self.lost = False
        self._resumed: asyncio.Future[None] | None = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)

    async def drain(self) -> None:
        while self.paused:
            if self.lost:
                raise ConnectionError("receiver went away")
            self._resumed = asyncio.get_running_loop().create_future()
            await self._resumed


class _RawSource(FlowControl):
    def __init__(self) -> None:
        super().__init__()
        self.ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()

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
