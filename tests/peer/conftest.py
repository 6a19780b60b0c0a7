"""The peer protocol's conformance suite: its behaviour as a contract, against a real
``PeerServer`` on 127.0.0.1, over each link it runs on (plain TCP and TLS) and on each
event loop the nodes run (asyncio's, and uvloop's where it is installed).

A test takes ``peer`` (a server, a client and the handler behind the server, on one
link) and, to speak the documented format itself, ``RawPeer``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.util
import os
import shutil
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from storaged.peer import Addr, LentBuffer, PeerClient, PeerError, PeerHandler, PeerServer
from storaged.wire import BytesLike
from tests.conftest import _guarded_loop, _LoopWatchdog

SECRET = b"the-conformance-suite's-cluster-secret"
#: stall timers of the suite's server: short enough for the stall tests, long enough for
#: a loaded machine not to trip them elsewhere
IO_TIMEOUT = 1.0


def _guarded_uvloop() -> asyncio.AbstractEventLoop:
    import uvloop

    loop = uvloop.new_event_loop()
    _LoopWatchdog(loop)
    return loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every test here runs on asyncio's loop and on uvloop's (nodes run on uvloop: its
    transports are not asyncio's, and the protocol must not notice)."""
    factories = {"guarded": _guarded_loop}
    if importlib.util.find_spec("uvloop") is not None:
        factories["uvloop"] = _guarded_uvloop
    return factories


class LendingHandler(PeerHandler[LentBuffer]):
    """Lends a fresh buffer per put and records every buffer it gets back: the contract
    says each comes back, the very handle lent, through exactly one of ``chunk_received``
    and ``chunk_aborted``."""

    def __init__(self) -> None:
        self.lent: set[LentBuffer] = set()
        self.received: list[tuple[str, memoryview]] = []
        self.aborted: list[tuple[str, memoryview]] = []
        self.refuse: PeerError | None = None
        self.hold: asyncio.Event | None = None

    async def receive_chunk(self, chunk_id: str, size: int) -> LentBuffer:
        if self.hold is not None:
            await self.hold.wait()
        if self.refuse is not None:
            raise self.refuse
        lent = LentBuffer(memoryview(bytearray(size)))
        self.lent.add(lent)
        return lent

    def _take_back(self, buf: LentBuffer) -> None:
        assert buf in self.lent, "a buffer came back twice, or not the handle that was lent"
        self.lent.remove(buf)

    async def chunk_received(self, chunk_id: str, buf: LentBuffer) -> dict[str, Any]:
        self._take_back(buf)
        self.received.append((chunk_id, buf.view))
        return {"chunk": chunk_id, "size": len(buf.view)}

    def chunk_aborted(self, chunk_id: str, buf: LentBuffer) -> None:
        self._take_back(buf)
        self.aborted.append((chunk_id, buf.view))

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], BytesLike | None]:
        if method == "echo":
            return dict(args), body
        if method == "blob":
            return {}, os.urandom(int(args["size"]))
        if method == "refuse":
            raise PeerError("nope", "refused on purpose")
        return await super().call(method, args, body)


@dataclass
class Peer:
    handler: LendingHandler
    server: PeerServer
    client: PeerClient
    addr: Addr
    #: the client side of the link (None: plain TCP)
    client_ssl: ssl.SSLContext | None


@pytest.fixture(scope="session")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder: Path = tmp_path_factory.mktemp("peer-tls")
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
    return server_ctx, ssl.create_default_context(cafile=str(cert))


@pytest.fixture(params=["tcp", "tls"])
async def peer(request: pytest.FixtureRequest) -> AsyncIterator[Peer]:
    server_ssl = client_ssl = None
    if request.param == "tls":
        server_ssl, client_ssl = request.getfixturevalue("tls_pair")
    handler = LendingHandler()
    server = PeerServer(
        "server", SECRET, handler, ssl=server_ssl, io_timeout=IO_TIMEOUT, auth_timeout=5
    )
    await server.start("127.0.0.1", 0)
    client = PeerClient("client", SECRET, ssl=client_ssl, io_timeout=5)
    try:
        yield Peer(handler, server, client, ("127.0.0.1", server.port), client_ssl)
    finally:
        await client.close()
        await server.close()
    assert not handler.lent, "a lent buffer never came back"


def frame(header: Any) -> bytes:
    """The documented frame, written out here rather than taken from the code under test."""
    payload: bytes = msgpack.packb(header)
    return struct.pack("!I", len(payload)) + payload


class RawPeer:
    """A client that speaks the documented wire format by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, peer: Peer, *, limit: int = 1 << 16) -> RawPeer:
        host, port = peer.addr
        reader, writer = await asyncio.open_connection(host, port, ssl=peer.client_ssl, limit=limit)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> tuple[dict[str, Any], bytes]:
        async with asyncio.timeout(5):
            (length,) = struct.unpack("!I", await self.reader.readexactly(4))
            header = msgpack.unpackb(await self.reader.readexactly(length))
            assert isinstance(header, dict)
            body = await self.reader.readexactly(header.get("body", 0))
        return header, body

    async def closed_by_server(self, within: float = 5) -> bool:
        """Read until EOF; True when the server closed the connection in time."""
        try:
            async with asyncio.timeout(within):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except (ConnectionError, ssl.SSLError):
            pass
        return True

    async def authenticate(self, secret: bytes = SECRET, node: str = "raw") -> dict[str, Any]:
        """The handshake; returns the server's verdict on our proof."""
        cn = os.urandom(32)
        await self.send(frame({"op": "hello", "v": 1, "node": node, "nonce": cn}))
        challenge, _ = await self.recv()
        assert challenge["ok"] is True and challenge["v"] == 1
        sn, server = challenge["nonce"], challenge["node"]
        assert hmac.compare_digest(
            challenge["proof"], _proof(SECRET, "server", cn, sn, node, server)
        )
        await self.send(
            frame({"op": "auth", "proof": _proof(secret, "client", cn, sn, node, server)})
        )
        verdict, _ = await self.recv()
        return verdict

    def close(self) -> None:
        self.writer.transport.abort()


def _proof(secret: bytes, role: str, cn: bytes, sn: bytes, client: str, server: str) -> bytes:
    transcript = msgpack.packb([f"storaged-peer/1 {role}", cn, sn, client, server])
    return hmac.new(secret, transcript, hashlib.sha256).digest()


async def wait_until(predicate: Any, within: float = 5) -> None:
    async with asyncio.timeout(within):
        # Polling: the conditions live in the handler and server, which have no events.
        while not predicate():
            await asyncio.sleep(0.01)
