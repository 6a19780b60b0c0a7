"""The peer protocol over real sockets on 127.0.0.1.

Raw-socket tests speak the wire format documented in ``storaged.peer.wire`` themselves,
so they check the documented format as well as the server's defences. The protocol's
contract over TCP and TLS is ``tests/peer/``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import mmap
import os
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import crc32c
import msgpack
import pytest

from storaged.peer import (
    Addr,
    LentBuffer,
    PeerClient,
    PeerError,
    PeerHandler,
    PeerServer,
    PeerUnavailable,
    PutStream,
)
from storaged.wire import BytesLike
from tests.peer.conftest import RawPeer as _ContractRawPeer

SECRET = b"cluster-secret-for-the-peer-tests"
CLIENT_TOKEN = b"a-client-token-is-not-the-cluster-secret"
MiB = 1 << 20
pytestmark = pytest.mark.timeout(60)


# Random bytes made once: os.urandom of megabytes inside a test would hold its event loop.
_RANDOM = os.urandom(24 * MiB)
_next_offset = itertools.count(0, 4099)


def blob(size: int) -> bytes:
    """``size`` random bytes, different from every other blob (up to 16 MiB)."""
    start = next(_next_offset) % (len(_RANDOM) - size)
    return _RANDOM[start : start + size]


def chunk_id(data: BytesLike) -> str:
    return blake3.blake3(data).hexdigest()


class StoreHandler(PeerHandler[LentBuffer]):
    """A memory tier in miniature: a pool of reusable slots and a dict of stored chunks.

    Slots are anonymous memory (faulted in as the body is written, not zeroed up front):
    zeroing megabytes inside receive_chunk would hold the event loop.
    """

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.aborted: list[str] = []
        self.free: list[mmap.mmap] = []
        self.lent = 0  # buffers handed out and not yet given back
        self.receiving = 0  # receive_chunk calls that returned a buffer
        self.refuse: PeerError | None = None
        self.refuse_after = 0.0
        self.hold: asyncio.Event | None = None
        self.bad_buffer = False

    async def receive_chunk(self, chunk_id: str, size: int) -> LentBuffer:
        if self.hold is not None:
            await self.hold.wait()
        if self.refuse is not None:
            await asyncio.sleep(self.refuse_after)
            raise self.refuse
        if self.bad_buffer:
            return LentBuffer(memoryview(bytes(size + 1)))  # read-only and one byte too long
        self.lent += 1
        self.receiving += 1
        fitting = [slot for slot in self.free if len(slot) >= size]
        if fitting:
            slot = min(fitting, key=len)
            self.free.remove(slot)
        else:
            slot = mmap.mmap(-1, max(size, 1))
        return LentBuffer(memoryview(slot)[:size])

    def _give_back(self, buf: LentBuffer) -> None:
        self.lent -= 1
        assert isinstance(buf.view.obj, mmap.mmap)
        self.free.append(buf.view.obj)

    async def chunk_received(self, chunk_id: str, buf: LentBuffer) -> dict[str, Any]:
        def check_and_copy() -> tuple[str, bytes]:
            # Deliberate copy: the test keeps the bytes, the slot goes back to the pool.
            return blake3.blake3(buf.view).hexdigest(), bytes(buf.view)

        try:
            digest, data = await asyncio.to_thread(check_and_copy)
            if digest != chunk_id:
                raise PeerError("checksum_mismatch", f"body hashes to {digest}")
            self.stored[chunk_id] = data
            return {"chunk": chunk_id, "size": len(buf.view)}
        finally:
            self._give_back(buf)

    def chunk_aborted(self, chunk_id: str, buf: LentBuffer) -> None:
        self.aborted.append(chunk_id)
        if not buf.view.readonly:
            self._give_back(buf)

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], BytesLike | None]:
        if method == "echo":
            return dict(args), body
        if method == "has":
            return {"has": args.get("id") in self.stored}, None
        if method == "get":
            data = self.stored.get(str(args.get("id")))
            if data is None:
                raise PeerError("chunk_not_found", f"no chunk {args.get('id')}")
            return {"size": len(data)}, data
        if method == "fail":
            raise PeerError("nope", "refused on purpose")
        if method == "crash":
            raise RuntimeError("a handler bug")
        if method == "sleep":
            await asyncio.sleep(float(args["seconds"]))
            return {}, None
        if method == "unpackable":
            return {"value": object()}, None
        return await super().call(method, args, body)


@dataclass
class Node:
    handler: StoreHandler
    server: PeerServer
    client: PeerClient
    addr: Addr


async def start_node(**server_kw: Any) -> Node:
    handler = StoreHandler()
    kw: dict[str, Any] = {"io_timeout": 10, "auth_timeout": 10} | server_kw
    server = PeerServer("server", SECRET, handler, **kw)
    await server.start("127.0.0.1", 0)
    client = PeerClient("client", SECRET, io_timeout=5, connect_timeout=5)
    return Node(handler, server, client, ("127.0.0.1", server.port))


async def stop_node(node: Node) -> None:
    await node.client.close()
    await node.server.close()


#: Tests of the stall timers use a server with short ones (``impatient``); the others a
#: patient one, so that a loaded machine cannot make them drop a connection.
SHORT = 0.5


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    n = await start_node()
    yield n
    await stop_node(n)


@pytest.fixture
async def impatient() -> AsyncIterator[Node]:
    n = await start_node(io_timeout=SHORT, auth_timeout=SHORT)
    yield n
    await stop_node(n)


async def wait_until(predicate: Callable[[], bool], within: float = 5) -> None:
    async with asyncio.timeout(within):
        # Polling: the conditions live in the handler and server, which have no events.
        while not predicate():
            await asyncio.sleep(0.01)


async def send_body(stream: PutStream, data: BytesLike, piece: int) -> None:
    view = memoryview(data)
    for start in range(0, len(view), piece):
        await stream.write(view[start : start + piece])


async def put(
    client: PeerClient, addr: Addr, data: bytes, piece: int = 256 << 10
) -> dict[str, Any]:
    stream = await client.open_put(addr, chunk_id(data), len(data))
    await send_body(stream, data, piece)
    return await stream.finish()


# -- a raw peer speaking the documented wire format ---------------------------------------------


def frame(header: Any) -> bytes:
    payload: bytes = msgpack.packb(header)
    return struct.pack("!I", len(payload)) + payload


class RawPeer(_ContractRawPeer):
    """The contract suite's raw peer (``tests/peer/conftest.py``), dialled by port only:
    this module's server speaks plain TCP on 127.0.0.1."""

    @classmethod
    async def connect(cls, port: int) -> RawPeer:  # type: ignore[override]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def authenticate(self, secret: bytes = SECRET, node: str = "raw") -> dict[str, Any]:
        cn = os.urandom(32)
        await self.send(frame({"op": "hello", "v": 1, "node": node, "nonce": cn}))
        challenge, _ = await self.recv()
        assert challenge["ok"] is True
        sn, server = challenge["nonce"], challenge["node"]
        expected = hmac.new(
            SECRET,
            msgpack.packb(["storaged-peer/1 server", cn, sn, node, server]),
            hashlib.sha256,
        ).digest()
        assert hmac.compare_digest(challenge["proof"], expected)
        proof = hmac.new(
            secret,
            msgpack.packb(["storaged-peer/1 client", cn, sn, node, server]),
            hashlib.sha256,
        ).digest()
        await self.send(frame({"op": "auth", "proof": proof}))
        verdict, _ = await self.recv()
        return verdict

    def close(self) -> None:
        self.writer.transport.abort()


@pytest.fixture
async def raw(node: Node) -> AsyncIterator[RawPeer]:
    peer = await RawPeer.connect(node.server.port)
    assert (await peer.authenticate())["ok"] is True
    yield peer
    peer.close()


# -- chunks --------------------------------------------------------------------------------------


SIZES = [0, 1, 7, 4095, 4096, 65537, 1_000_003, 8 * MiB, 8 * MiB + 13]


async def check_round_trip(node: Node) -> None:
    for size, piece in zip(
        SIZES, [1, 1, 3, 4096, 1000, 65536, 99_991, MiB, 256 << 10], strict=True
    ):
        data = blob(size)
        result = await put(node.client, node.addr, data, piece=max(piece, 1))
        assert result == {"chunk": chunk_id(data), "size": size}
        assert node.handler.stored[chunk_id(data)] == data
    assert node.handler.lent == 0
    assert node.server.connections == 1  # one pooled connection served them all


async def test_round_trip_of_many_sizes(node: Node) -> None:
    await check_round_trip(node)


def test_round_trip_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        n = await start_node()
        try:
            await check_round_trip(n)
            await check_refusal_mid_body(n)
        finally:
            await stop_node(n)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_many_concurrent_streams_and_calls(node: Node) -> None:
    blobs = [blob(MiB + 4099 * i) for i in range(24)]
    results = await asyncio.gather(
        *(put(node.client, node.addr, b, piece=100_000 + i) for i, b in enumerate(blobs)),
        *(node.client.call(node.addr, "echo", {"i": i}, blob(i * 1000)) for i in range(16)),
    )
    for data, result in zip(blobs, results, strict=False):
        assert result == {"chunk": chunk_id(data), "size": len(data)}
        assert node.handler.stored[chunk_id(data)] == data
    for i, (result, _) in enumerate(results[len(blobs) :]):
        assert result == {"i": i}
    assert node.handler.lent == 0
    assert node.server.connections <= len(results)


async def check_refusal_mid_body(node: Node) -> None:
    """memory_full arrives while the body streams: the client learns it, the next put works."""
    node.handler.refuse = PeerError("memory_full", "no room in RAM")
    node.handler.refuse_after = 0.05
    data = blob(8 * MiB)
    stream = await node.client.open_put(node.addr, chunk_id(data), len(data))
    with pytest.raises(PeerError) as info:
        await send_body(stream, data, 64 << 10)
        await stream.finish()
    assert info.value.code == "memory_full"
    assert not isinstance(info.value, PeerUnavailable)
    with pytest.raises(PeerError, match="memory_full"):
        await stream.finish()  # the verdict stays
    node.handler.refuse = None
    again = blob(3 * MiB)
    assert (await put(node.client, node.addr, again))["size"] == len(again)
    assert chunk_id(data) not in node.handler.stored
    assert node.handler.lent == 0


async def test_refusal_while_the_body_streams(node: Node) -> None:
    await check_refusal_mid_body(node)


async def test_refusal_of_a_fully_sent_body_keeps_the_connection(node: Node) -> None:
    node.handler.refuse = PeerError("memory_full", "no room in RAM")
    node.handler.refuse_after = 0.05
    data = blob(1000)
    with pytest.raises(PeerError) as info:
        await put(node.client, node.addr, data)
    assert info.value.code == "memory_full"
    node.handler.refuse = None
    await put(node.client, node.addr, data)
    assert node.server.connections == 1


async def test_checksum_mismatch_is_refused_and_nothing_stored(node: Node) -> None:
    data = bytearray(blob(2 * MiB))
    cid = chunk_id(data)
    data[12345] ^= 1
    stream = await node.client.open_put(node.addr, cid, len(data))
    await send_body(stream, data, MiB)
    with pytest.raises(PeerError) as info:
        await stream.finish()
    assert info.value.code == "checksum_mismatch"
    assert node.handler.stored == {}
    assert node.handler.lent == 0
    await put(node.client, node.addr, bytes(data))  # same connection, still in step
    assert node.server.connections == 1


async def test_a_crc_sent_along_does_not_weaken_a_handler_that_ignores_it(node: Node) -> None:
    """A handler without ``chunk_received_crc`` gets the full check: a body that matches the
    CRC sent with it but not the id is refused all the same."""
    data = bytearray(blob(MiB))
    cid = chunk_id(data)
    data[777] ^= 1
    stream = await node.client.open_put(node.addr, cid, len(data), crc32c.crc32c(data))
    await send_body(stream, data, MiB)
    with pytest.raises(PeerError) as info:
        await stream.finish()
    assert info.value.code == "checksum_mismatch" and node.handler.stored == {}
    data[777] ^= 1
    stream = await node.client.open_put(node.addr, cid, len(data), crc32c.crc32c(data))
    await send_body(stream, data, MiB)
    assert await stream.finish() == {"chunk": cid, "size": MiB}


async def test_client_abort_mid_body_returns_the_buffer(node: Node) -> None:
    data = blob(8 * MiB)
    stream = await node.client.open_put(node.addr, chunk_id(data), len(data))
    await stream.write(memoryview(data)[:MiB])
    await wait_until(lambda: node.handler.lent == 1)
    stream.abort()
    stream.abort()  # idempotent
    await wait_until(lambda: node.handler.aborted == [chunk_id(data)])
    assert node.handler.lent == 0
    assert node.handler.stored == {}
    with pytest.raises(PeerError):
        await stream.write(b"more")
    await put(node.client, node.addr, data)
    assert node.handler.stored[chunk_id(data)] == data


async def test_finish_before_the_whole_body_is_truncated(node: Node) -> None:
    data = blob(5000)
    stream = await node.client.open_put(node.addr, chunk_id(data), len(data))
    await stream.write(data[:4000])
    with pytest.raises(ValueError):
        await stream.write(data)  # past the stated size
    with pytest.raises(PeerError) as info:
        await stream.finish()
    assert info.value.code == "truncated"
    await wait_until(lambda: node.handler.aborted == [chunk_id(data)])
    assert node.handler.lent == 0


async def test_context_manager_aborts_on_error(node: Node) -> None:
    data = blob(MiB)
    with pytest.raises(RuntimeError):
        async with await node.client.open_put(node.addr, chunk_id(data), len(data)) as stream:
            await stream.write(data[:1000])
            await wait_until(lambda: node.handler.lent == 1)
            raise RuntimeError("the coordinator's client went away")
    await wait_until(lambda: node.handler.aborted == [chunk_id(data)])
    assert node.handler.lent == 0


async def test_handler_giving_a_bad_buffer_is_an_internal_error(node: Node) -> None:
    node.handler.bad_buffer = True
    with pytest.raises(PeerError) as info:
        await put(node.client, node.addr, b"x" * 100)
    assert info.value.code == "internal"
    node.handler.bad_buffer = False
    await put(node.client, node.addr, b"y" * 100)


async def test_writes_wait_for_a_peer_that_does_not_read() -> None:
    """Flow control: bounded bytes in the transport, and a stall becomes PeerUnavailable."""
    n = await start_node(io_timeout=30)
    n.handler.hold = asyncio.Event()  # receive_chunk waits: the server does not read
    client = PeerClient("client", SECRET, io_timeout=0.5, write_buffer=256 << 10)
    piece = blob(MiB)
    size = 256 * MiB  # far more than the socket buffers hold
    try:
        stream = await client.open_put(n.addr, "x" * 64, size)
        with pytest.raises(PeerUnavailable) as info:
            for _ in range(size // MiB):
                await stream.write(piece)
                assert stream.pending_bytes <= (256 << 10) + MiB
        assert info.value.code == "timeout"
        assert stream.written < size
        n.handler.hold.set()  # the server reads again, finds the connection gone
        await wait_until(lambda: n.handler.aborted == ["x" * 64])
        assert n.handler.lent == 0
    finally:
        await client.close()
        await stop_node(n)


async def test_server_close_aborts_bodies_in_flight(node: Node) -> None:
    data = blob(8 * MiB)
    stream = await node.client.open_put(node.addr, chunk_id(data), len(data))
    await stream.write(data[: 2 * MiB])
    await wait_until(lambda: node.handler.lent == 1)
    await node.server.close()
    assert node.handler.aborted == [chunk_id(data)]
    assert node.handler.lent == 0
    with pytest.raises(PeerUnavailable):
        await send_body(stream, memoryview(data)[2 * MiB :], MiB)
        await stream.finish()


async def test_peer_dying_mid_stream_is_unavailable() -> None:
    n = await start_node()
    data = blob(8 * MiB)
    stream = await n.client.open_put(n.addr, chunk_id(data), len(data))
    await stream.write(data[:MiB])
    await wait_until(lambda: n.handler.lent == 1)
    await n.server.close()
    with pytest.raises(PeerUnavailable):
        await send_body(stream, memoryview(data)[MiB:], MiB)
        await stream.finish()
    with pytest.raises(PeerUnavailable) as info:
        await n.client.call(n.addr, "echo")
    assert info.value.code == "unreachable"
    await n.client.close()


# -- stalls and timeouts ---------------------------------------------------------------------------


async def test_half_a_header_then_silence_is_dropped(impatient: Node) -> None:
    raw = await RawPeer.connect(impatient.server.port)
    assert (await raw.authenticate())["ok"] is True
    whole = frame({"op": "call", "method": "echo", "args": {"pad": "x" * 100}})
    await raw.send(whole[:50])
    assert await raw.closed_by_server()
    raw.close()


async def test_half_a_body_then_silence_is_dropped_and_aborted(impatient: Node) -> None:
    node = impatient
    raw = await RawPeer.connect(node.server.port)
    assert (await raw.authenticate())["ok"] is True
    data = blob(MiB)
    await raw.send(frame({"op": "put", "id": chunk_id(data), "size": len(data)}) + data[:1000])
    assert await raw.closed_by_server()
    raw.close()
    await wait_until(lambda: node.handler.aborted == [chunk_id(data)])
    assert node.handler.lent == 0
    await put(node.client, node.addr, data)  # the server still serves


async def test_unauthenticated_connection_is_dropped_after_the_auth_timeout(
    impatient: Node,
) -> None:
    node = impatient
    silent = await RawPeer.connect(node.server.port)
    slow = await RawPeer.connect(node.server.port)
    await slow.send(frame({"op": "hello", "v": 1, "node": "slow", "nonce": os.urandom(32)})[:9])
    assert await silent.closed_by_server()
    assert await slow.closed_by_server()
    silent.close()
    slow.close()


async def test_a_flood_of_unauthenticated_connections_stays_bounded() -> None:
    # A patient auth timeout: without the cap, every one of them would stay open for it.
    node = await start_node(auth_timeout=60, max_handshakes=16)
    flood: list[RawPeer] = []
    try:
        for _ in range(200):
            flood.append(await RawPeer.connect(node.server.port))
            assert node.server.handshaking <= 16
        await wait_until(lambda: node.server.connections <= 16)
        # The oldest were dropped to make room: the server closed them, at once.
        closed = await asyncio.gather(*(raw.closed_by_server(within=5) for raw in flood[:-16]))
        assert all(closed)
        # A peer that authenticates is served, and no longer counts as handshaking.
        data = blob(MiB)
        assert await put(node.client, node.addr, data) == {"chunk": chunk_id(data), "size": MiB}
        assert node.server.handshaking <= 16
        assert node.server.connections <= 17
    finally:
        for raw in flood:
            raw.close()
        await stop_node(node)


async def test_connections_over_the_total_cap_are_refused_at_once() -> None:
    node = await start_node(max_connections=4)
    peers: list[RawPeer] = []
    try:
        for i in range(4):
            peers.append(await RawPeer.connect(node.server.port))
            assert (await peers[-1].authenticate(node=f"raw{i}"))["ok"] is True
        extra = await RawPeer.connect(node.server.port)
        header, _ = await extra.recv()
        assert header["ok"] is False and header["error"] == "busy"
        assert await extra.closed_by_server()
        extra.close()
        assert node.server.connections == 4
        peers.pop().close()  # room again: a new connection is served
        await wait_until(lambda: node.server.connections == 3)
        data = blob(1000)
        assert await put(node.client, node.addr, data) == {"chunk": chunk_id(data), "size": 1000}
    finally:
        for raw in peers:
            raw.close()
        await stop_node(node)


async def test_idle_connections_are_closed_and_the_pool_reconnects() -> None:
    n = await start_node(idle_timeout=SHORT)
    try:
        client = PeerClient("client", SECRET, pool_idle_timeout=60)
        await client.call(n.addr, "echo", {"a": 1})
        await wait_until(lambda: n.server.connections == 0)
        result, _ = await client.call(n.addr, "echo", {"a": 2})
        assert result == {"a": 2}
        await client.close()
    finally:
        await stop_node(n)


async def test_call_timeout_is_unavailable(node: Node) -> None:
    with pytest.raises(PeerUnavailable) as info:
        await node.client.call(node.addr, "sleep", {"seconds": 30}, timeout=0.2)
    assert info.value.code == "timeout"
    assert (await node.client.call(node.addr, "echo", {"b": 1}))[0] == {"b": 1}


async def test_dead_peer_is_unavailable_at_once() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = PeerClient("client", SECRET, connect_timeout=30)
    try:
        # "unreachable", not "timeout": refused connects fail at once, not after 30 s.
        with pytest.raises(PeerUnavailable) as info:
            await client.call(("127.0.0.1", port), "echo")
        assert info.value.code == "unreachable"
        with pytest.raises(PeerUnavailable):
            await client.open_put(("127.0.0.1", port), "x" * 64, 10)
    finally:
        await client.close()


async def test_closed_client_refuses_requests(node: Node) -> None:
    await node.client.close()
    with pytest.raises(PeerUnavailable) as info:
        await node.client.call(node.addr, "echo")
    assert info.value.code == "closed"


# -- authentication --------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [b"some-other-cluster", CLIENT_TOKEN])
async def test_wrong_secret_is_refused(node: Node, secret: bytes) -> None:
    intruder = PeerClient("intruder", secret)
    with pytest.raises(PeerError) as info:
        await intruder.call(node.addr, "echo")
    assert info.value.code == "forbidden"
    assert not isinstance(info.value, PeerUnavailable)
    await intruder.close()
    # The server's own refusal of a bad proof: a clear error, then the connection closes.
    peer = await RawPeer.connect(node.server.port)
    verdict = await peer.authenticate(secret=secret)
    assert verdict["ok"] is False and verdict["error"] == "forbidden"
    assert await peer.closed_by_server()
    peer.close()
    assert (await node.client.call(node.addr, "echo", {"ok": 1}))[0] == {"ok": 1}
    assert node.handler.stored == {}


async def test_server_with_another_secret_is_not_trusted() -> None:
    handler = StoreHandler()
    impostor = PeerServer("impostor", b"not-the-secret", handler)
    await impostor.start("127.0.0.1", 0)
    client = PeerClient("client", SECRET)
    try:
        with pytest.raises(PeerError) as info:
            await put(client, ("127.0.0.1", impostor.port), b"secret bytes")
        assert info.value.code == "forbidden"
        assert handler.receiving == 0
    finally:
        await client.close()
        await impostor.close()


async def test_client_sends_nothing_to_a_peer_that_cannot_prove_the_secret() -> None:
    """A fake peer answers hello with a bogus proof and would accept anything after."""
    seen: list[Any] = []

    async def fake_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = struct.unpack("!I", await reader.readexactly(4))
                header = msgpack.unpackb(await reader.readexactly(length))
                seen.append(header.get("op"))
                if header.get("op") == "hello":
                    reply = {"ok": True, "v": 1, "node": "fake", "nonce": os.urandom(32)}
                    writer.write(frame(reply | {"proof": os.urandom(32)}))
                else:
                    await reader.readexactly(header.get("size", header.get("body", 0)))
                    writer.write(frame({"ok": True, "result": {}}))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    fake = await asyncio.start_server(fake_peer, "127.0.0.1", 0)
    client = PeerClient("client", SECRET)
    try:
        port = fake.sockets[0].getsockname()[1]
        with pytest.raises(PeerError) as info:
            await put(client, ("127.0.0.1", port), b"secret bytes")
        assert info.value.code == "forbidden"
        await asyncio.sleep(0.05)
        assert seen == ["hello"]
    finally:
        await client.close()
        fake.close()


async def test_nothing_is_served_before_authentication(node: Node) -> None:
    peer = await RawPeer.connect(node.server.port)
    await peer.send(frame({"op": "put", "id": "a" * 64, "size": 3}) + b"abc")
    reply, _ = await peer.recv()
    assert reply["error"] == "forbidden"
    assert await peer.closed_by_server()
    peer.close()
    peer = await RawPeer.connect(node.server.port)
    await peer.send(frame({"op": "hello", "v": 99, "node": "future", "nonce": os.urandom(32)}))
    reply, _ = await peer.recv()
    assert reply["error"] == "unsupported_version"
    assert await peer.closed_by_server()
    peer.close()
    peer = await RawPeer.connect(node.server.port)
    await peer.send(struct.pack("!I", 5000) + b"\0" * 5000)  # over the pre-auth header cap
    reply, _ = await peer.recv()
    assert reply["error"] == "bad_request"
    peer.close()
    assert node.handler.receiving == 0


# -- garbage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack("!I", 1 << 20) + b"x" * 100,  # oversized header
        struct.pack("!I", 0),  # empty header
        struct.pack("!I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
        frame([1, 2, 3]),  # not a map
        frame({1: "int key"}),
        struct.pack("!I", 40001) + b"\x91" * 40000 + b"\xc0",  # nested too deep
        frame({"op": "put", "id": "a" * 64, "size": -1}),
        frame({"op": "put", "id": "a" * 64}),
        frame({"op": "call", "method": "echo", "body": "ten"}),
        frame({"op": "teleport", "body": -5}),
    ],
)
async def test_garbage_after_auth_is_refused_and_the_server_lives(
    node: Node, raw: RawPeer, garbage: bytes
) -> None:
    await raw.send(garbage)
    reply, _ = await raw.recv()
    assert reply["ok"] is False and reply["error"] == "bad_request"
    assert await raw.closed_by_server()
    await put(node.client, node.addr, b"still serving")


async def test_http_request_to_the_peer_port_is_refused(node: Node) -> None:
    peer = await RawPeer.connect(node.server.port)
    await peer.send(b"GET /v1/cluster HTTP/1.1\r\nHost: x\r\n\r\n")
    reply, _ = await peer.recv()
    assert reply["error"] == "bad_request"
    assert await peer.closed_by_server()
    peer.close()
    await put(node.client, node.addr, b"still serving")


async def test_refused_requests_keep_the_connection_in_step(node: Node, raw: RawPeer) -> None:
    await raw.send(frame({"op": "teleport", "body": 5}) + b"12345")
    assert (await raw.recv())[0]["error"] == "unknown_op"
    await raw.send(frame({"op": "put", "id": 42, "size": 3}) + b"abc")
    assert (await raw.recv())[0]["error"] == "bad_chunk_id"
    await raw.send(frame({"op": "call", "method": ["not", "a", "name"], "body": 2}) + b"zz")
    assert (await raw.recv())[0]["error"] == "bad_request"
    await raw.send(frame({"op": "call", "method": "echo", "args": {"x": 1}, "body": 3}) + b"abc")
    assert await raw.recv() == ({"ok": True, "result": {"x": 1}, "body": 3}, b"abc")


async def test_thousands_of_pipelined_refusals_in_one_read(node: Node, raw: RawPeer) -> None:
    count = 3000
    await raw.send(frame({"op": "nope"}) * count)
    for _ in range(count):
        assert (await raw.recv())[0]["error"] == "unknown_op"
    await raw.send(frame({"op": "call", "method": "echo", "args": {"y": 2}}))
    assert (await raw.recv())[0] == {"ok": True, "result": {"y": 2}}


# -- rpc ------------------------------------------------------------------------------------------


async def test_rpc_with_and_without_bodies(node: Node) -> None:
    c, addr = node.client, node.addr
    assert await c.call(addr, "echo", {"a": [1, "b"]}) == ({"a": [1, "b"]}, None)
    assert await c.call(addr, "echo", None, b"") == ({}, None)
    big_args = {"pad": "x" * (60 << 10)}  # near the 64 KiB header cap
    assert await c.call(addr, "echo", big_args) == (big_args, None)
    body = blob(3 * MiB + 1)
    result, reply_body = await c.call(addr, "echo", {"n": 1}, memoryview(body))
    assert result == {"n": 1}
    assert reply_body is not None and bytes(reply_body) == body
    data = blob(70_000)
    await put(c, addr, data)
    assert (await c.call(addr, "has", {"id": chunk_id(data)}))[0] == {"has": True}
    result, fetched = await c.call(addr, "get", {"id": chunk_id(data)})
    assert result == {"size": len(data)} and fetched is not None
    assert bytes(fetched) == data
    assert node.server.connections == 1


@pytest.mark.parametrize(
    ("method", "code"),
    [
        ("fail", "nope"),
        ("crash", "internal"),
        ("unpackable", "internal"),
        ("no-such-method", "unknown_method"),
        ("get", "chunk_not_found"),
    ],
)
async def test_rpc_errors_are_peer_errors(node: Node, method: str, code: str) -> None:
    with pytest.raises(PeerError) as info:
        await node.client.call(node.addr, method, {"id": "0" * 64}, b"body")
    assert info.value.code == code
    assert not isinstance(info.value, PeerUnavailable)
    assert (await node.client.call(node.addr, "echo", {"after": 1}))[0] == {"after": 1}
    assert node.server.connections == 1


async def test_rpc_body_over_the_cap_is_refused_and_skipped() -> None:
    n = await start_node(max_call_body=64 << 10)
    try:
        with pytest.raises(PeerError) as info:
            await n.client.call(n.addr, "echo", {}, blob(MiB))
        assert info.value.code == "too_large"
        body = blob(60 << 10)
        echoed = (await n.client.call(n.addr, "echo", {}, body))[1]
        assert echoed is not None and bytes(echoed) == body
        assert n.server.connections == 1
    finally:
        await stop_node(n)


async def test_reply_body_over_the_client_cap_drops_the_connection(node: Node) -> None:
    client = PeerClient("client", SECRET, max_reply_body=1000)
    try:
        echoed = (await client.call(node.addr, "echo", {}, b"x" * 1000))[1]
        assert echoed is not None and bytes(echoed) == b"x" * 1000
        with pytest.raises(PeerUnavailable) as info:
            await client.call(node.addr, "echo", {}, b"x" * 1001)
        assert info.value.code == "protocol_error"
        assert (await client.call(node.addr, "echo", {"z": 1}))[0] == {"z": 1}
    finally:
        await client.close()


async def test_oversized_request_header_is_refused_locally(node: Node) -> None:
    with pytest.raises(PeerError) as info:
        await node.client.call(node.addr, "echo", {"pad": "x" * (70 << 10)})
    assert info.value.code == "too_large"


# -- tls -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder: Path = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=storaged-test"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    return server_ctx, client_ctx


async def test_round_trip_over_tls(tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_ctx, client_ctx = tls_contexts
    handler = StoreHandler()
    server = PeerServer("server", SECRET, handler, ssl=server_ctx)
    await server.start("127.0.0.1", 0)
    client = PeerClient("client", SECRET, ssl=client_ctx)
    addr = ("127.0.0.1", server.port)
    try:
        for size in (0, 5, 3 * MiB + 7):
            data = blob(size)
            await put(client, addr, data, piece=100_000)
            assert handler.stored[chunk_id(data)] == data
        body = blob(MiB)
        echoed = (await client.call(addr, "echo", {}, body))[1]
        assert echoed is not None and bytes(echoed) == body
        plain = PeerClient("client", SECRET, connect_timeout=1)
        with pytest.raises(PeerError):
            await plain.call(addr, "echo")
        await plain.close()
    finally:
        await client.close()
        await server.close()


# -- the benchmark still runs ----------------------------------------------------------------


def test_loadtest_peer_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.peer import main

    assert main(["--gib", "0.03", "--chunk-mib", "1", "--repeat", "2", "--verify"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[2:]] == ["raw", "peer", "aiohttp"]
    assert rows[2].split("|")[3].strip() == "1.00"  # raw against itself
