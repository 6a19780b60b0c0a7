"""The peer protocol as a contract (``storaged.peer.wire`` documents it): each test runs
against a real server on 127.0.0.1 over plain TCP and over TLS (``conftest.peer``)."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from storaged.peer import MAX_HEADER, PeerClient, PeerError, PeerUnavailable
from tests.peer.conftest import IO_TIMEOUT, SECRET, Peer, RawPeer, frame, wait_until

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
CHUNK = "c" * 64


# -- authentication ---------------------------------------------------------------------------


async def test_the_handshake_with_the_secret_authenticates_both_ends(peer: Peer) -> None:
    raw = await RawPeer.connect(peer)
    try:
        assert await raw.authenticate() == {"ok": True}  # the raw side checked the server too
        assert peer.server.handshaking == 0
        await raw.send(frame({"op": "call", "method": "echo", "args": {"a": 1}}))
        assert await raw.recv() == ({"ok": True, "result": {"a": 1}}, b"")
    finally:
        raw.close()


async def test_a_wrong_secret_is_refused_by_the_server_and_by_the_client(peer: Peer) -> None:
    raw = await RawPeer.connect(peer)
    verdict = await raw.authenticate(secret=b"not-the-secret")
    assert verdict["ok"] is False and verdict["error"] == "forbidden"
    assert await raw.closed_by_server()
    raw.close()
    intruder = PeerClient("intruder", b"not-the-secret", ssl=peer.client_ssl)
    try:
        with pytest.raises(PeerError) as info:
            await intruder.call(peer.addr, "echo")
        assert info.value.code == "forbidden" and not isinstance(info.value, PeerUnavailable)
    finally:
        await intruder.close()
    assert peer.handler.received == []


async def test_nothing_but_the_handshake_is_served_before_it(peer: Peer) -> None:
    raw = await RawPeer.connect(peer)
    await raw.send(frame({"op": "call", "method": "echo", "args": {}}))
    reply, _ = await raw.recv()
    assert reply["ok"] is False and reply["error"] == "forbidden"
    assert await raw.closed_by_server()
    raw.close()


# -- calls ------------------------------------------------------------------------------------


async def test_a_call_returns_its_result_and_reply_body(peer: Peer) -> None:
    body = os.urandom(300_001)
    result, echoed = await peer.client.call(peer.addr, "echo", {"n": [1, "two"]}, body)
    assert result == {"n": [1, "two"]}
    assert echoed is not None and bytes(echoed) == body
    assert await peer.client.call(peer.addr, "echo", {"empty": True}) == ({"empty": True}, None)


async def test_an_error_reply_is_a_peer_error_and_the_connection_stays(peer: Peer) -> None:
    for method, code in (("refuse", "nope"), ("no-such-method", "unknown_method")):
        with pytest.raises(PeerError) as info:
            await peer.client.call(peer.addr, method, {}, b"a body to skip")
        assert info.value.code == code and not isinstance(info.value, PeerUnavailable)
        assert info.value.message
    assert (await peer.client.call(peer.addr, "echo", {"after": 1}))[0] == {"after": 1}
    assert peer.server.connections == 1


# -- bodies -----------------------------------------------------------------------------------


async def test_a_put_body_lands_in_the_buffer_the_handler_lent(peer: Peer) -> None:
    data = os.urandom(3 * MiB + 5)
    stream = await peer.client.open_put(peer.addr, CHUNK, len(data))
    view = memoryview(data)
    for start in range(0, len(data), 256 << 10):
        await stream.write(view[start : start + (256 << 10)])
    assert await stream.finish() == {"chunk": CHUNK, "size": len(data)}
    [(chunk_id, buf)] = peer.handler.received
    assert chunk_id == CHUNK and bytes(buf) == data
    assert isinstance(buf.obj, bytearray)  # the lent buffer itself (the handler checked)


async def test_a_refused_body_is_refused_early_and_discarded_in_step(peer: Peer) -> None:
    peer.handler.refuse = PeerError("memory_full", "no room in RAM")
    raw = await RawPeer.connect(peer)
    try:
        assert (await raw.authenticate())["ok"] is True
        # The refusal comes before the body is sent.
        await raw.send(frame({"op": "put", "id": CHUNK, "size": 2 * MiB}))
        reply, _ = await raw.recv()
        assert reply == {"ok": False, "error": "memory_full", "message": "no room in RAM"}
        # The body that follows is read and dropped: the next request is answered.
        await raw.send(os.urandom(2 * MiB) + frame({"op": "call", "method": "echo", "args": {}}))
        assert await raw.recv() == ({"ok": True, "result": {}}, b"")
    finally:
        raw.close()
    with pytest.raises(PeerError) as info:
        stream = await peer.client.open_put(peer.addr, CHUNK, MiB)
        await stream.write(os.urandom(MiB))
        await stream.finish()
    assert info.value.code == "memory_full"
    assert peer.handler.received == [] and peer.handler.aborted == []


async def test_a_client_dying_mid_body_gives_the_buffer_back(peer: Peer) -> None:
    raw = await RawPeer.connect(peer)
    assert (await raw.authenticate())["ok"] is True
    await raw.send(frame({"op": "put", "id": CHUNK, "size": MiB}) + os.urandom(MiB // 2))
    await wait_until(lambda: len(peer.handler.lent) == 1)
    raw.close()
    await wait_until(lambda: len(peer.handler.aborted) == 1)
    assert peer.handler.aborted[0][0] == CHUNK and peer.handler.received == []


async def test_a_server_dying_mid_body_is_unavailable_to_the_client(peer: Peer) -> None:
    stream = await peer.client.open_put(peer.addr, CHUNK, 8 * MiB)
    await stream.write(os.urandom(MiB))
    await wait_until(lambda: len(peer.handler.lent) == 1)
    await peer.server.close()
    assert [chunk for chunk, _ in peer.handler.aborted] == [CHUNK]
    with pytest.raises(PeerUnavailable):
        for _ in range(7):
            await stream.write(os.urandom(MiB))
        await stream.finish()


# -- oversize frames --------------------------------------------------------------------------


async def test_an_oversize_header_is_refused_and_the_connection_closed(peer: Peer) -> None:
    raw = await RawPeer.connect(peer)
    await raw.send(struct.pack("!I", 4097) + b"\0" * 4097)  # over the pre-auth cap
    assert (await raw.recv())[0]["error"] == "bad_request"
    assert await raw.closed_by_server()
    raw.close()
    raw = await RawPeer.connect(peer)
    assert (await raw.authenticate())["ok"] is True
    await raw.send(struct.pack("!I", MAX_HEADER + 1) + b"\0" * 100)
    assert (await raw.recv())[0]["error"] == "bad_request"
    assert await raw.closed_by_server()
    raw.close()


async def test_a_header_over_the_cap_is_refused_before_it_is_sent(peer: Peer) -> None:
    with pytest.raises(PeerError) as info:
        await peer.client.call(peer.addr, "echo", {"pad": "x" * MAX_HEADER})
    assert info.value.code == "too_large" and not isinstance(info.value, PeerUnavailable)
    assert peer.server.connections == 0  # no connection was even taken


async def test_a_header_at_the_cap_is_served(peer: Peer) -> None:
    args = {"pad": "x" * (MAX_HEADER - 100)}
    assert (await peer.client.call(peer.addr, "echo", args))[0] == args


# -- slow ends --------------------------------------------------------------------------------


async def test_a_slow_reader_gets_every_byte(peer: Peer) -> None:
    """A client that reads its reply a little at a time: flow control loses nothing."""
    raw = await RawPeer.connect(peer, limit=4096)
    try:
        assert (await raw.authenticate())["ok"] is True
        body = os.urandom(4 * MiB)
        await raw.send(frame({"op": "call", "method": "echo", "args": {}, "body": len(body)}))
        await raw.send(body)
        (length,) = struct.unpack("!I", await raw.reader.readexactly(4))
        await raw.reader.readexactly(length)
        got = bytearray()
        while len(got) < len(body):
            got += await raw.reader.readexactly(min(64 << 10, len(body) - len(got)))
            await asyncio.sleep(0.002)
        assert got == body
    finally:
        raw.close()


async def test_a_reader_that_stops_is_dropped_after_the_io_timeout(peer: Peer) -> None:
    if peer.client_ssl is not None:
        # Seen with storaged/peer.py before the split too (d6d7484): over asyncio's TLS
        # transport the server keeps such a connection open (15 s and more). Not fixed
        # here: this change keeps the protocol's behaviour as it was.
        pytest.xfail("a reader that stops is not dropped over TLS")
    raw = await RawPeer.connect(peer, limit=4096)
    assert (await raw.authenticate())["ok"] is True
    # Far more reply than the socket buffers hold, and the client never reads it.
    await raw.send(frame({"op": "call", "method": "blob", "args": {"size": 64 * MiB}}))
    await wait_until(lambda: peer.server.connections == 0, within=IO_TIMEOUT * 2 + 10)
    raw.close()


async def test_a_server_that_stops_reading_makes_writes_wait_then_time_out(peer: Peer) -> None:
    peer.handler.hold = asyncio.Event()  # receive_chunk waits: the server does not read
    client = PeerClient("client", SECRET, ssl=peer.client_ssl, io_timeout=0.5,
                        write_buffer=256 << 10)  # fmt: skip
    piece = os.urandom(MiB)
    try:
        stream = await client.open_put(peer.addr, CHUNK, 256 * MiB)
        with pytest.raises(PeerUnavailable) as info:
            for _ in range(256):
                await stream.write(piece)
                assert stream.pending_bytes <= (256 << 10) + MiB
        assert info.value.code == "timeout" and stream.written < 256 * MiB
    finally:
        await client.close()
        peer.handler.hold.set()
    await wait_until(lambda: [chunk for chunk, _ in peer.handler.aborted] == [CHUNK])
