"""Chunk GETs read straight into the caller's buffer (``storaged.client.direct``).

Against real nodes, in-process (``tests/service/inproc.py``): round trips into caller
buffers and keep-alive reuse, a node killed mid-body (``kill``, as SIGKILL). Against a
tiny asyncio server on 127.0.0.1 that speaks bad HTTP on purpose: responses longer or
shorter than announced, error mapping, Retry-After, a connection left half-read, the
fallback to aiohttp for what the direct path does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from storaged.client import ByteRange, Client, Holder
from storaged.client.direct import DirectGets, parse_head
from storaged.client.errors import (
    ChunkNotFound,
    ConnectionFailed,
    MemoryFull,
    ProtocolError,
)
from storaged.client.retry import NO_RETRY, RetryPolicy
from storaged.ids import chunk_id_of
from tests.client.helpers import client_for
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster, InprocFactory

pytestmark = pytest.mark.timeout(120)


def pool(client: Client) -> DirectGets:
    assert client.direct is not None, "direct reads are off"
    return client.direct


# --------------------------------------------------------------------------- real nodes


async def test_round_trips_into_the_callers_buffers(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    data = np.random.default_rng(40).bytes(3_000_000)
    async with Client(
        cluster.urls, token=TOKEN, shm=False
    ) as client:  # the HTTP path is the subject
        cid = await client.put_chunk(data)
        direct = pool(client)
        before = direct.stats.requests
        out = bytearray(len(data) + 7)
        view = await client.get_chunk(cid, out)
        assert view.obj is out and bytes(view) == data
        floats = np.zeros(len(data) // 4, np.float32)
        view = await client.get_chunk(cid, floats)
        assert isinstance(view.obj, np.ndarray) and view.obj is floats
        assert floats.tobytes() == data
        view = await client.get_chunk(cid, out, ByteRange(1000, 2_500_000))
        assert view.obj is out and bytes(out[: len(view)]) == data[1000:2_500_000]
        assert bytes(await client.get_chunk(cid, None, ByteRange(2_999_000))) == data[2_999_000:]
        assert bytes(await client.get_chunk(cid)) == data
        assert bytes(await client.get_chunk(cid, None, ByteRange(0, 10))) == data[:10]
        with pytest.raises(ChunkNotFound):
            await client.get_chunk(chunk_id_of(b"never stored"))
        with pytest.raises(ValueError, match="output buffer"):
            await client.get_chunk(cid, bytearray(100))
        # Every GET above went the direct way (not found: once per node).
        assert direct.stats.requests - before == 6 + 4 + 1
        assert client.stats.failovers == 0


async def test_keep_alive_connections_are_reused(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    data = np.random.default_rng(41).bytes(200_000)
    async with Client(
        cluster.urls, token=TOKEN, shm=False
    ) as client:  # the HTTP path is the subject
        cid = await client.put_chunk(data)
        holder = client.placement(cid)[0]
        direct = pool(client)
        out = bytearray(len(data))
        for _ in range(10):  # one at a time, from one holder
            await client.get_chunk(cid, out, holders=[holder])
            assert bytes(out) == data
        addr = client.cluster.node(holder).url.removeprefix("http://")
        assert direct.stats.by_addr[addr] == 10
        assert direct.stats.connections == 1 and direct.stats.reused == 9
        # Concurrent GETs open a connection each, and those are kept for the next ones.
        direct.stats.connections = direct.stats.reused = 0
        for _ in range(3):
            outs = [bytearray(len(data)) for _ in range(4)]
            await asyncio.gather(*(client.get_chunk(cid, o, holders=[holder]) for o in outs))
            assert all(bytes(o) == data for o in outs)
        assert direct.stats.connections <= 4 and direct.stats.reused >= 8


async def test_direct_reads_can_be_switched_off(inproc: InprocFactory) -> None:
    cluster = await inproc.start(4)
    data = b"switched off" * 1000
    async with Client(cluster.urls, token=TOKEN, direct_reads=False) as client:
        assert client.direct is None
        cid = await client.put_chunk(data)
        assert bytes(await client.get_chunk(cid, bytearray(len(data)))) == data


class Relay:
    """A TCP relay in front of a node that forwards a response's first ``limit`` bytes,
    then holds the rest until ``cut`` drops the client's connection."""

    def __init__(self, upstream: tuple[str, int], limit: int) -> None:
        self.upstream = upstream
        self.limit = limit
        self.holding = asyncio.Event()
        self._cut = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def cut(self) -> None:
        self._cut.set()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def forward_request() -> None:
            with contextlib.suppress(ConnectionError):
                while piece := await reader.read(65536):
                    up_writer.write(piece)

        task = asyncio.ensure_future(forward_request())
        sent = 0
        try:
            while sent < self.limit:
                piece = await up_reader.read(min(65536, self.limit - sent))
                if not piece:
                    break
                writer.write(piece)
                sent += len(piece)
            self.holding.set()
            await self._cut.wait()  # the client's connection stays open until then
        finally:
            task.cancel()
            up_writer.close()


async def test_node_killed_mid_body_fails_over_to_another_holder(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    data = np.random.default_rng(42).bytes(8 << 20)
    # The HTTP path is the subject: co-located, the chunk would come from the local node's
    # copy through shared memory.
    async with client_for(cluster, shm=False) as client:
        cid = await client.put_chunk(data)
        first = client.placement(cid)[0]
        index = int(first.removeprefix("n"))
        host, port = client.cluster.node(first).url.removeprefix("http://").split(":")
        async with Relay((host, int(port)), limit=1 << 20) as relay:
            out = np.zeros(len(data), np.uint8)
            # The relay stands for the first holder: the read starts there.
            get = asyncio.ensure_future(
                client.get_chunk(cid, out, holders=[Holder("relay", relay.url, "memory")])
            )
            await asyncio.wait_for(relay.holding.wait(), 30)
            assert not get.done()  # the head and 1 MiB of the body are in, the rest is not
            # as SIGKILL: kill cuts the GET in flight, whose body the relay no longer reads
            # (a node process killed with SIGKILL waits for nothing)
            await cluster.kill(index)
            relay.cut()  # the node's side of the connection is gone: so is the client's
            view = await asyncio.wait_for(get, 60)
        assert isinstance(view.obj, np.ndarray) and view.obj is out
        assert out.tobytes() == data
        # The relay's connection was lost (then the dead node refused, if still tried).
        assert client.stats.failovers >= 1
        assert pool(client).stats.by_addr[relay.url.removeprefix("http://")] == 1


# --------------------------------------------------------------------------- bad HTTP


Respond = Callable[[int, bytes, asyncio.StreamWriter], Awaitable[bool]]


class BadServer:
    """One node's HTTP API, spoken by hand: ``/v1/cluster`` answers properly (the client
    learns a one-node cluster), every other request is answered by ``respond(n, head,
    writer)`` (n counts them from 0), which returns whether to keep the connection."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> BadServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._writers:
            writer.transport.abort()
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        counted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /v1/cluster "):
                    doc = {
                        "nodes": [{"id": "bad", "url": self.url, "alive": True}],
                        "replication": 1,
                        "max_chunk_size": 1 << 20,
                    }
                    writer.write(response(200, msgpack.packb(doc), "application/msgpack"))
                    continue
                self.requests.append(head)
                if not counted:  # connections that carried chunk requests
                    self.connections += 1
                    counted = True
                if not await self.respond(len(self.requests) - 1, head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.transport.abort()


def response(
    status: int,
    body: bytes,
    content_type: str = "application/octet-stream",
    *,
    length: int | None = None,
    extra: str = "",
) -> bytes:
    length = len(body) if length is None else length
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    )
    return head.encode() + body


DATA = bytes(range(256)) * 40  # 10240 bytes
CID = chunk_id_of(DATA)


def ranged(head: bytes) -> tuple[int, int] | None:
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("range: bytes="):
            first, last = line.split("=", 1)[1].split("-")
            return int(first), int(last) + 1 if last else len(DATA)
    return None


async def serve_data(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
    """A correct answer: 200, or 206 for a Range."""
    span = ranged(head)
    if span is None:
        writer.write(response(200, DATA))
    else:
        a, b = span
        extra = f"Content-Range: bytes {a}-{b - 1}/{len(DATA)}\r\n"
        writer.write(response(206, DATA[a:b], extra=extra))
    return True


@contextlib.asynccontextmanager
async def bad_client(
    respond: Respond, *, direct: bool = True, **kwargs: Any
) -> AsyncIterator[tuple[BadServer, Client]]:
    async with BadServer(respond) as server:
        kwargs.setdefault("retry", NO_RETRY)
        async with Client(server.url, direct_reads=direct, **kwargs) as client:
            client.stats.reset()  # count from here, not the membership request of open()
            yield server, client


async def test_the_head_is_parsed_strictly() -> None:
    status, headers, keep = parse_head(b"HTTP/1.1 206 Partial\r\nContent-Length: 5\r\nA:b")
    assert (status, headers, keep) == (206, {"content-length": "5", "a": "b"}, True)
    assert not parse_head(b"HTTP/1.1 200 OK\r\nConnection: close")[2]
    assert not parse_head(b"HTTP/1.0 200 OK")[2]
    for bad in (b"HTP/1.1 200 OK", b"HTTP/1.1 2x0 OK", b"HTTP/1.1 200 OK\r\nno colon",
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2"):  # fmt: skip
        with pytest.raises(ProtocolError):
            parse_head(bad)


async def test_reads_and_keep_alive_against_a_hand_written_server() -> None:
    async with bad_client(serve_data) as (server, client):
        out = bytearray(len(DATA))
        for _ in range(3):
            assert bytes(await client.get_chunk(CID, out, holders=["bad"])) == DATA
        view = await client.get_chunk(CID, out, ByteRange(100, 300), holders=["bad"])
        assert bytes(view) == DATA[100:300]
        assert server.connections == 1 and len(server.requests) == 4
        assert pool(client).stats.reused == 3


@pytest.mark.parametrize("direct", [True, False])
async def test_a_range_answered_longer_or_shorter_is_a_protocol_error(direct: bool) -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        # Asked for 10 bytes: answer 20, then 5 (each with a consistent Content-Range).
        size = 20 if n == 0 else 5
        extra = f"Content-Range: bytes 100-{100 + size - 1}/{len(DATA)}\r\n"
        writer.write(response(206, DATA[100 : 100 + size], extra=extra))
        return True

    async with bad_client(respond, direct=direct) as (_, client):
        for _ in range(2):
            with pytest.raises(ProtocolError):
                await client.get_chunk(CID, bytearray(10), ByteRange(100, 110), holders=["bad"])
        assert client.stats.requests == 2


async def test_bytes_past_the_content_length_are_caught() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 0:  # the surplus comes in the same read as the head
            writer.write(response(200, DATA[:100] + b"surplus", length=100))
        elif n == 1:  # the surplus comes after the whole body
            writer.write(response(200, DATA + b"surplus", length=len(DATA)))
        else:
            await serve_data(n, head, writer)
        return True

    async with bad_client(respond) as (server, client):
        with pytest.raises(ProtocolError, match="longer"):
            await client.get_chunk(CID, bytearray(len(DATA)), holders=["bad"])
        # Read past the head: the body is what was announced, but the connection that
        # carried the surplus is not used again.
        assert bytes(await client.get_chunk(CID, holders=["bad"])) == DATA
        assert bytes(await client.get_chunk(CID, holders=["bad"])) == DATA
        assert server.connections == 3


@pytest.mark.parametrize("direct", [True, False])
async def test_a_body_cut_short_is_a_lost_connection(direct: bool) -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, DATA[:5000], length=len(DATA)))
        await writer.drain()
        return False  # and close

    async with bad_client(respond, direct=direct) as (_, client):
        out = bytearray(len(DATA))
        with pytest.raises(ConnectionFailed):
            await client.get_chunk(CID, out, holders=["bad"])


@pytest.mark.parametrize("direct", [True, False])
async def test_error_answers_map_to_the_same_types(direct: bool) -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 0:
            body = msgpack.packb({"error": "chunk_not_found", "message": "not here"})
            writer.write(response(404, body, "application/msgpack"))
        elif n in (1, 2, 4):
            body = msgpack.packb({"error": "memory_full", "message": "wait"})
            writer.write(response(503, body, "application/msgpack", extra="Retry-After: 0\r\n"))
        else:
            await serve_data(n, head, writer)
        return True

    policy = RetryPolicy(max_attempts=2, max_retry_after=0.1)
    async with bad_client(respond, direct=direct, retry=policy) as (server, client):
        with pytest.raises(ChunkNotFound) as missing:
            await client.get_chunk(CID, holders=["bad"])
        assert missing.value.status == 404 and missing.value.message == "not here"
        # 503 twice: retried once after Retry-After, then raised with its code.
        with pytest.raises(MemoryFull) as full:
            await client.get_chunk(CID, holders=["bad"])
        assert full.value.status == 503 and full.value.retry_after == 0.0
        assert client.stats.retries == 1
        assert bytes(await client.get_chunk(CID, holders=["bad"])) == DATA
        # 503, then the data: the retry succeeds.
        assert bytes(await client.get_chunk(CID, bytearray(len(DATA)), holders=["bad"])) == DATA
        assert client.stats.retries == 2 and client.stats.requests == 6
        assert len(server.requests) == 6
        if direct:  # the error answers were read to their end: one connection for all
            assert server.connections == 1


async def test_a_half_read_connection_is_never_reused() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 0:  # half the body, then silence
            writer.write(response(200, DATA[:5000], length=len(DATA)))
            return True
        return await serve_data(n, head, writer)

    async with bad_client(respond, read_timeout=0.5) as (server, client):
        out = bytearray(len(DATA))
        with pytest.raises(ConnectionFailed) as stalled:
            await client.get_chunk(CID, out, holders=["bad"])
        assert isinstance(stalled.value.__cause__, TimeoutError)
        assert bytes(await client.get_chunk(CID, out, holders=["bad"])) == DATA
        assert server.connections == 2


async def test_a_cancelled_read_closes_its_connection() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 0:
            writer.write(response(200, DATA[:5000], length=len(DATA)))
            return True
        return await serve_data(n, head, writer)

    async with bad_client(respond) as (server, client):
        out = bytearray(len(DATA))
        get = asyncio.ensure_future(client.get_chunk(CID, out, holders=["bad"]))
        for _ in range(200):
            if bytes(out[:5000]) == DATA[:5000]:
                break
            await asyncio.sleep(0.01)
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        assert pool(client).open_connections == 0
        fresh = bytearray(len(DATA))
        assert bytes(await client.get_chunk(CID, fresh, holders=["bad"])) == DATA
        assert server.connections == 2
        assert bytes(out[5000:]) == bytes(len(DATA) - 5000)  # nothing more was written


async def test_a_server_that_ignores_range_is_skipped_through() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, DATA))  # whatever was asked
        return True

    async with bad_client(respond) as (server, client):
        view = await client.get_chunk(CID, bytearray(100), ByteRange(9000, 9100), holders=["bad"])
        assert bytes(view) == DATA[9000:9100]
        # Bytes past the range were dropped by closing: the next GET needs a new connection.
        view = await client.get_chunk(CID, None, ByteRange(10_000), holders=["bad"])
        assert bytes(view) == DATA[10_000:]
        assert server.connections == 2
        # That one read to the end: its connection is kept.
        assert bytes(await client.get_chunk(CID, holders=["bad"])) == DATA
        assert server.connections == 2


async def test_what_the_direct_path_does_not_read_goes_through_aiohttp() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(DATA)
            + DATA
            + b"\r\n0\r\n\r\n"
        )
        return True

    async with bad_client(respond) as (server, client):
        out = bytearray(len(DATA))
        assert bytes(await client.get_chunk(CID, out, holders=["bad"])) == DATA
        # Asked twice (direct, then aiohttp), counted as one attempt.
        assert len(server.requests) == 2 and client.stats.requests == 1
        assert client.stats.failovers == 0 and client.stats.retries == 0


async def test_a_malformed_head_is_a_protocol_error() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 OK 200\r\n\r\n")
        return True

    async with bad_client(respond) as (_, client):
        with pytest.raises(ProtocolError, match="malformed"):
            await client.get_chunk(CID, holders=["bad"])


async def test_connection_close_is_honoured() -> None:
    async def respond(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        # Asks to close, but leaves the socket open (and would answer more on it).
        writer.write(response(200, DATA, extra="Connection: close\r\n"))
        return True

    async with bad_client(respond) as (server, client):
        for _ in range(2):
            assert bytes(await client.get_chunk(CID, holders=["bad"])) == DATA
        assert server.connections == 2 and pool(client).stats.reused == 0


def test_only_plain_http_nodes_are_read_directly() -> None:
    client = Client(["http://h0:7400", "https://h1:7401", "http://u@h2:7402", "http://h3/api/"])
    requests = client._requests
    requests.base_headers = {"Accept": "application/msgpack"}
    assert requests.direct_target("http://h0:7400") == (
        ("h0", 7400),
        "",
        "Host: h0:7400\r\nAccept: application/msgpack\r\n",
    )
    assert requests.direct_target("https://h1:7401") is None
    assert requests.direct_target("http://u@h2:7402") is None
    target = requests.direct_target("http://h3/api")
    assert target is not None and target[:2] == (("h3", 80), "/api")
