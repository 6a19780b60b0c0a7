"""The peer protocol's bytes on the wire, against golden values taken from the code before
the protocol became a package (``storaged/peer.py`` at d6d7484): nodes of the old and the
new code must understand each other, so every byte must stay as it was.

The frames are checked one by one (``encode_frame``, the proofs), and whole sessions
byte for byte: what a ``PeerClient`` sends (to a recording server) and what a
``PeerServer`` answers (to a scripted client), nonces made deterministic.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from typing import Any

import msgpack
import pytest

from storaged.peer import LentBuffer, PeerClient, PeerError, PeerHandler, PeerServer
from storaged.peer.wire import (
    CLIENT_LABEL,
    SERVER_LABEL,
    encode_frame,
    error_header,
    handshake_proof,
)
from storaged.wire import BytesLike

pytestmark = pytest.mark.timeout(30)

SECRET = b"golden-secret"
CN = bytes(range(32))  # the client's nonce
SN = bytes(range(100, 132))  # the server's nonce
CHUNK_ID = "ab" * 32

#: header -> its frame, as the old code encoded it
FRAMES: list[tuple[dict[str, Any], str]] = [
    (
        {"op": "hello", "v": 1, "node": "n1", "nonce": CN},
        "0000003d84a26f70a568656c6c6fa17601a46e6f6465a26e31a56e6f6e6365c420000102030405060708"
        "090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
    ),
    (
        {"ok": True, "v": 1, "node": "n2", "nonce": SN, "proof": b"\xaa" * 32},
        "0000006085a26f6bc3a17601a46e6f6465a26e32a56e6f6e6365c4206465666768696a6b6c6d6e6f7071"
        "72737475767778797a7b7c7d7e7f80818283a570726f6f66c420aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ),
    (
        {"op": "auth", "proof": b"\xbb" * 32},
        "0000003182a26f70a461757468a570726f6f66c420bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
        "bbbbbbbbbbbbbbbbbbbbbb",
    ),
    (
        {"ok": True},
        "0000000581a26f6bc3",
    ),
    (
        {"op": "put", "id": CHUNK_ID, "size": 1 << 20, "crc32c": 0xDEADBEEF, "ack": True},
        "0000006885a26f70a3707574a26964d94061626162616261626162616261626162616261626162616261"
        "626162616261626162616261626162616261626162616261626162616261626162616261626162a47369"
        "7a65ce00100000a6637263333263cedeadbeefa361636bc3",
    ),
    (
        {"op": "call", "method": "has", "args": {"id": "cd" * 32, "n": 7}, "body": 5},
        "0000006884a26f70a463616c6ca66d6574686f64a3686173a46172677382a26964d94063646364636463"
        "646364636463646364636463646364636463646364636463646364636463646364636463646364636463"
        "646364636463646364636463646364a16e07a4626f647905",
    ),
    (
        {"ok": True, "result": {"has": True, "size": 123456789}, "body": 300},
        "0000002483a26f6bc3a6726573756c7482a3686173c3a473697a65ce075bcd15a4626f6479cd012c",
    ),
    (
        error_header("memory_full", "no room in RAM"),
        "0000002e83a26f6bc2a56572726f72ab6d656d6f72795f66756c6ca76d657373616765ae6e6f20726f6f"
        "6d20696e2052414d",
    ),
]

PROOF_SERVER = "6e7e7f91e2fc0675894924afd031970a5fee5b9ea29861477213e53e71067f03"
PROOF_CLIENT = "50234be40ddf18354f5c469d145850ad674c8caf323de2eed52345a5191e0970"


@pytest.mark.parametrize(
    ("header", "golden"), FRAMES, ids=[h.get("op", "reply") for h, _ in FRAMES]
)
def test_a_frame_is_encoded_as_before(header: dict[str, Any], golden: str) -> None:
    assert encode_frame(header).hex() == golden


def test_the_proofs_are_computed_as_before() -> None:
    assert handshake_proof(SECRET, SERVER_LABEL, CN, SN, "n1", "n2").hex() == PROOF_SERVER
    assert handshake_proof(SECRET, CLIENT_LABEL, CN, SN, "n1", "n2").hex() == PROOF_CLIENT


# -- whole sessions -----------------------------------------------------------------------------


def _frame(header: dict[str, Any]) -> bytes:
    """The documented format, written out here rather than taken from the code under test."""
    payload: bytes = msgpack.packb(header)
    return struct.pack("!I", len(payload)) + payload


def _hmac(label: str, client: str, server: str) -> bytes:
    transcript = msgpack.packb([label, CN, SN, client, server])
    return hmac.new(SECRET, transcript, hashlib.sha256).digest()


def _nonces(monkeypatch: pytest.MonkeyPatch, nonce: bytes) -> None:
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: nonce if n == len(nonce) else real(n))


#: what a PeerClient sent for: hello, auth, call("echo", {"x": 1}, b"hello"),
#: put(CHUNK_ID, 5 bytes, crc32c=7, ack=True) + "abcde"
CLIENT_SESSION = (
    "0000003d84a26f70a568656c6c6fa17601a46e6f6465a26e31a56e6f6e6365c420000102030405060708090a"
    "0b0c0d0e0f101112131415161718191a1b1c1d1e1f0000003182a26f70a461757468a570726f6f66c4205023"
    "4be40ddf18354f5c469d145850ad674c8caf323de2eed52345a5191e09700000002484a26f70a463616c6ca6"
    "6d6574686f64a46563686fa46172677381a17801a4626f64790568656c6c6f0000006085a26f70a3707574a2"
    "6964d94061626162616261626162616261626162616261626162616261626162616261626162616261626162"
    "616261626162616261626162616261626162616261626162a473697a6505a663726333326307a361636bc361"
    "62636465"
)


async def test_a_client_session_is_sent_byte_for_byte_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _nonces(monkeypatch, CN)
    sent = bytearray()

    async def recording_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def frame_in() -> dict[str, Any]:
            prefix = await reader.readexactly(4)
            payload = await reader.readexactly(struct.unpack("!I", prefix)[0])
            sent.extend(prefix + payload)
            header = msgpack.unpackb(payload)
            assert isinstance(header, dict)
            body = await reader.readexactly(header.get("size") or header.get("body") or 0)
            sent.extend(body)
            return header

        await frame_in()  # hello
        challenge = {"ok": True, "v": 1, "node": "n2", "nonce": SN}
        writer.write(_frame(challenge | {"proof": _hmac(SERVER_LABEL, "n1", "n2")}))
        await frame_in()  # auth
        writer.write(_frame({"ok": True}))
        call = await frame_in()
        writer.write(_frame({"ok": True, "result": call["args"]}))
        await frame_in()  # put
        writer.write(_frame({"ok": True, "result": {"stored": True}}))
        await writer.drain()

    server = await asyncio.start_server(recording_peer, "127.0.0.1", 0)
    client = PeerClient("n1", SECRET)
    try:
        addr = ("127.0.0.1", server.sockets[0].getsockname()[1])
        assert await client.call(addr, "echo", {"x": 1}, b"hello") == ({"x": 1}, None)
        stream = await client.open_put(addr, CHUNK_ID, 5, 7, ack=True)
        await stream.write(b"abcde")
        assert await stream.finish() == {"stored": True}
    finally:
        await client.close()
        server.close()
    assert bytes(sent).hex() == CLIENT_SESSION


class _FixedHandler(PeerHandler[LentBuffer]):
    async def receive_chunk(self, chunk_id: str, size: int) -> LentBuffer:
        if size > 100:
            raise PeerError("memory_full", "no room in RAM")
        return LentBuffer(memoryview(bytearray(size)))

    async def chunk_received(self, chunk_id: str, buf: LentBuffer) -> dict[str, Any]:
        return {"chunk": chunk_id, "size": len(buf.view), "first": bytes(buf.view[:1])}

    def chunk_aborted(self, chunk_id: str, buf: LentBuffer) -> None:
        pass

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], BytesLike | None]:
        if method == "echo":
            return dict(args), body
        return await super().call(method, args, body)


#: what a PeerServer answered to: hello, auth, call echo {"x": 1} + "hello",
#: put 5 bytes + "abcde", put of 1000 bytes (refused, body skipped), call "nope"
SERVER_SESSION = (
    "0000006085a26f6bc3a17601a46e6f6465a26e32a56e6f6e6365c4206465666768696a6b6c6d6e6f70717273"
    "7475767778797a7b7c7d7e7f80818283a570726f6f66c4206e7e7f91e2fc0675894924afd031970a5fee5b9e"
    "a29861477213e53e71067f030000000581a26f6bc30000001683a26f6bc3a6726573756c7481a17801a4626f"
    "64790568656c6c6f0000006482a26f6bc3a6726573756c7483a56368756e6bd9406162616261626162616261"
    "6261626162616261626162616261626162616261626162616261626162616261626162616261626162616261"
    "626162616261626162a473697a6505a56669727374c401610000002e83a26f6bc2a56572726f72ab6d656d6f"
    "72795f66756c6ca76d657373616765ae6e6f20726f6f6d20696e2052414d0000003e83a26f6bc2a56572726f"
    "72ae756e6b6e6f776e5f6d6574686f64a76d657373616765bb6e6f20737563682070656572206d6574686f64"
    "3a20276e6f706527"
)


async def test_a_server_session_is_answered_byte_for_byte_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _nonces(monkeypatch, SN)
    server = PeerServer("n2", SECRET, _FixedHandler())
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    received = bytearray()

    async def exchange(request: bytes) -> None:
        writer.write(request)
        prefix = await reader.readexactly(4)
        payload = await reader.readexactly(struct.unpack("!I", prefix)[0])
        header = msgpack.unpackb(payload)
        received.extend(prefix + payload + await reader.readexactly(header.get("body", 0)))

    try:
        async with asyncio.timeout(10):
            await exchange(_frame({"op": "hello", "v": 1, "node": "n1", "nonce": CN}))
            await exchange(_frame({"op": "auth", "proof": _hmac(CLIENT_LABEL, "n1", "n2")}))
            call = {"op": "call", "method": "echo", "args": {"x": 1}, "body": 5}
            await exchange(_frame(call) + b"hello")
            await exchange(_frame({"op": "put", "id": CHUNK_ID, "size": 5}) + b"abcde")
            await exchange(_frame({"op": "put", "id": CHUNK_ID, "size": 1000}) + b"z" * 1000)
            await exchange(_frame({"op": "call", "method": "nope", "args": {}}))
    finally:
        writer.transport.abort()
        await server.close()
    assert bytes(received).hex() == SERVER_SESSION
