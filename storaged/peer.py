"""The peer protocol: node-to-node chunk replication and small RPCs over raw TCP.

Why not HTTP: replication is the hot path of the ack (every PUT crosses two peer
hops). A raw ``asyncio.BufferedProtocol`` receives each chunk body straight into
the memory tier's preallocated buffer and costs about a third of aiohttp's CPU
per byte here. The client side of the HTTP API stays aiohttp.

Wire format (version 1)
-----------------------

Every message is a *frame*::

    u32 big-endian L | L bytes: msgpack map (the header) | optional raw body

``L`` is at most 64 KiB (4 KiB before authentication); a larger or zero ``L``,
or a header that is not a msgpack map with string keys, is a protocol error
(the server replies ``bad_request`` and closes). The length of the raw body is
stated by the header: ``size`` for a ``put`` request, ``body`` for every other
frame (absent or 0: no body).

Authentication (mutual HMAC-SHA256 challenge-response over the cluster secret;
nothing else is accepted before it completes, and it must complete within
``auth_timeout`` seconds of the connect)::

    C->S {"op": "hello", "v": 1, "node": client_id, "nonce": cn}           # cn: 32 random bytes
    S->C {"ok": true, "v": 1, "node": server_id, "nonce": sn, "proof": Ps}
    C->S {"op": "auth", "proof": Pc}
    S->C {"ok": true}   or   {"ok": false, "error": "forbidden", ...} and close

    Ps = HMAC-SHA256(secret, msgpack(["storaged-peer/1 server", cn, sn, client_id, server_id]))
    Pc = HMAC-SHA256(secret, msgpack(["storaged-peer/1 client", cn, sn, client_id, server_id]))

Both proofs cover both nonces, so neither can be replayed, and the role label
keeps a proof from being reflected. The client checks ``Ps`` before it proves
anything itself or sends any data. The secret authenticates the connection, not
each frame: run with ``ssl`` on a network where TCP can be hijacked. (Chunk
bodies are still checked end to end against their BLAKE3 id by the handler, or,
when the sender, which checked the id itself, gives the body's CRC-32C, against
that: see ``PeerHandler.chunk_received_crc``.)

Requests, one at a time per connection (concurrency comes from the pool)::

    {"op": "put", "id": chunk_id, "size": n, "crc32c": c?} + n body bytes
    {"op": "call", "method": str, "args": {...}, "body": n} + n body bytes

Replies::

    {"ok": true, "result": {...}, "body": n} + n body bytes    (body only for calls)
    {"ok": false, "error": code, "message": str}

A request has exactly one reply. A refused ``put`` (for instance
``memory_full``) is replied to *at once*, before its body has arrived: the
server then reads and discards the rest of the body, so the connection stays in
step, while the client, which learns of the refusal early, may stop sending and
close the connection instead. An unknown ``op`` with a valid ``body`` length is
refused with ``unknown_op`` and its body skipped; a request whose length fields
cannot be trusted closes the connection.

Copies and flow control
-----------------------

A put body is received straight into the buffer the handler lends
(``BufferedProtocol.get_buffer``); only the body bytes that arrived in the same
read as the header (at most 4 KiB) are copied out of the header buffer. While
the handler decides (``receive_chunk``, which may wait for memory) and while it
checks and stores (``chunk_received``), the server stops reading, so TCP pushes
back on the sender instead of bytes piling up. The client hands each piece to
the transport as a memoryview and waits whenever more than ``write_buffer``
bytes are queued there; uvloop sends from the caller's memory, plain asyncio
(Python 3.11) copies the part the socket did not take at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import select
import ssl as ssl_module
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Final, cast

import msgpack

from tiers.base import BytesLike

__all__ = [
    "MAX_HEADER",
    "PROTOCOL_VERSION",
    "Addr",
    "PeerClient",
    "PeerError",
    "PeerHandler",
    "PeerServer",
    "PeerUnavailable",
    "PutStream",
]

log = logging.getLogger(__name__)

PROTOCOL_VERSION: Final = 1
#: Largest header frame accepted after authentication.
MAX_HEADER: Final = 64 * 1024
#: Largest header frame accepted before: hello and auth are a few dozen bytes.
MAX_PREAUTH_HEADER: Final = 4096
#: Largest body length a header may state at all (1 TiB): anything beyond is malformed.
MAX_BODY: Final = 1 << 40
NONCE_LEN: Final = 32
MAX_NODE_ID_LEN: Final = 256
MAX_CHUNK_ID_LEN: Final = 256

_PREFIX = struct.Struct("!I")
# Header reads ask for at least this much: a put header and the first body bytes
# behind it arrive in one read, and the few body bytes are copied out of scratch.
_MIN_HEADER_READ = 4096
# One read copies at most this much out of the kernel: it bounds how long a
# single callback holds the loop while other connections wait.
_MAX_READ = 1 << 20
_SERVER_LABEL = "storaged-peer/1 server"
_CLIENT_LABEL = "storaged-peer/1 client"

#: A peer's address: (host, port).
Addr = tuple[str, int]
Header = dict[str, Any]
Reply = tuple[Header, memoryview | None]


class PeerError(Exception):
    """A peer refused a request, or the protocol failed.

    ``code`` is a stable string like the HTTP API's error codes (``memory_full``,
    ``checksum_mismatch``, ``forbidden``, ``bad_request``, ...); ``message`` is
    for humans.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PeerUnavailable(PeerError):
    """The peer could not be reached or the connection failed mid-request.

    Codes: ``unreachable`` (connect failed), ``timeout`` (connect, stall or
    reply), ``connection_lost``, ``protocol_error`` (the peer sent nonsense),
    ``closed`` (this client was closed). The request's outcome on the peer is
    unknown, except that a put is never stored from a partial body.
    """


class PeerHandler(ABC):
    """What a ``PeerServer`` calls; implemented by the node (memory tier, index).

    Buffer ownership: the buffer returned by ``receive_chunk`` is handed back
    through exactly one of ``chunk_received`` (the whole body arrived; the
    handler owns the buffer from then on, whatever that call does or raises,
    even if it is cancelled by ``PeerServer.close``) or ``chunk_aborted`` (the
    connection dropped, stalled or the server closed first).
    """

    @abstractmethod
    async def receive_chunk(self, chunk_id: str, size: int) -> memoryview:
        """Return a writable, contiguous memoryview of exactly ``size`` bytes for the body.

        Raise ``PeerError`` to refuse (``memory_full``, ``too_large``,
        ``bad_chunk_id``, ...): the client is told at once and the body is skipped.
        It may wait (memory backpressure); the connection's reading is paused meanwhile.
        """

    @abstractmethod
    async def chunk_received(self, chunk_id: str, buf: memoryview) -> dict[str, Any]:
        """The whole body is in ``buf``: verify and store it; the dict is the client's result.

        Raise ``PeerError`` (``checksum_mismatch``, ...) to refuse; the client gets the code.
        """

    async def chunk_received_crc(
        self, chunk_id: str, buf: memoryview, crc32c: int
    ) -> dict[str, Any]:
        """``chunk_received`` of a body whose sender checked it against the id and sent its
        CRC-32C along: a handler may check that instead of hashing again (the link is
        authenticated; the CRC catches damage on the way). By default, the full check."""
        return await self.chunk_received(chunk_id, buf)

    def ack_copy(self, chunk_id: str) -> None:
        """A put that a client's PUT waits for (sent with ``ack``) began or finished
        arriving: called at both. A handler may hold background work back meanwhile;
        by default nothing."""
        return None

    @abstractmethod
    def chunk_aborted(self, chunk_id: str, buf: memoryview) -> None:
        """The body will never complete: take ``buf`` back; nothing is to be stored."""

    async def call(
        self, method: str, args: dict[str, Any], body: memoryview | None
    ) -> tuple[dict[str, Any], BytesLike | None]:
        """Serve a small RPC; return (result, optional reply body).

        ``body`` is a fresh buffer the handler may keep. A returned reply body is
        sent without a copy, so it must not change until the next request on the
        connection. Raise ``PeerError`` to refuse.
        """
        raise PeerError("unknown_method", f"no such peer method: {method!r}")


def _proof(secret: bytes, label: str, cn: bytes, sn: bytes, client: str, server: str) -> bytes:
    transcript = msgpack.packb([label, cn, sn, client, server])
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def _encode_frame(header: Mapping[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(header)
    if len(payload) > MAX_HEADER:
        raise PeerError("too_large", f"peer header of {len(payload)} bytes (max {MAX_HEADER})")
    return _PREFIX.pack(len(payload)) + payload


def _decode_header(data: memoryview) -> Header:
    obj = msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_HEADER,
        max_bin_len=MAX_HEADER,
        max_array_len=MAX_HEADER,
        max_map_len=MAX_HEADER,
        max_ext_len=0,
    )
    if not isinstance(obj, dict):
        raise ValueError(f"header is a {type(obj).__name__}, not a map")
    return obj


def _byte_view(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of ``data`` (no copy); non-contiguous data is refused."""
    mv = data if type(data) is memoryview else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _length_field(header: Header, key: str) -> int | None:
    """A body length from the header: 0 when absent, None when invalid."""
    value = header.get(key, 0)
    if type(value) is not int or not 0 <= value <= MAX_BODY:
        return None
    return value


def _error_from_reply(header: Header) -> PeerError:
    code = header.get("error")
    message = header.get("message")
    return PeerError(
        code if isinstance(code, str) else "internal",
        message if isinstance(message, str) else "peer refused the request",
    )


def _error_header(code: str, message: str) -> Header:
    return {"ok": False, "error": code, "message": message}


# Receive modes of a connection.
_HEADER = 0  # reading frames into scratch
_BODY = 1  # reading a body straight into its destination buffer
_DISCARD = 2  # skipping a refused body
_BUSY = 3  # a handler runs (server) or nothing is expected; reading is paused


class _FramedProtocol(asyncio.BufferedProtocol):
    """Frame reader and write flow control shared by both ends.

    Headers are read into a small scratch buffer; a body is read directly into
    the buffer ``_begin_body`` is given, so only the body bytes that arrived in
    the same read as their header are copied.
    """

    def __init__(self, max_header: int) -> None:
        self._scratch = bytearray(_PREFIX.size + max_header + _MIN_HEADER_READ)
        self._smv = memoryview(self._scratch)
        self._sbeg = 0  # unparsed bytes are scratch[_sbeg:_send]
        self._send = 0
        self._max_header = max_header
        self._mode = _HEADER
        self._body: memoryview | None = None
        self._pos = 0
        self._discard_left = 0
        self._rx = 0  # bytes received so far: progress for the stall timers
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._parsing = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        mode = self._mode
        if mode == _BODY:
            assert self._body is not None
            return self._body[self._pos : self._pos + _MAX_READ]
        if mode == _DISCARD:
            return self._smv[: min(self._discard_left, len(self._scratch))]
        avail = self._send - self._sbeg
        capacity = len(self._scratch)
        want = _MIN_HEADER_READ
        if avail >= _PREFIX.size:
            (hlen,) = _PREFIX.unpack_from(self._scratch, self._sbeg)
            want = max(want, min(hlen + _PREFIX.size - avail, capacity))
        if capacity - self._send < want and self._sbeg:
            # Move the partial frame to the front: at most one header's worth of bytes.
            self._scratch[:avail] = self._scratch[self._sbeg : self._send]
            self._sbeg, self._send = 0, avail
        end = min(capacity, self._send + want)
        if end == self._send:
            # Only a peer that pipelines far past a paused reader gets here.
            raise BufferError("peer sent more than the connection buffers")
        return self._smv[self._send : end]

    def buffer_updated(self, nbytes: int) -> None:
        self._rx += nbytes
        mode = self._mode
        if mode == _BODY:
            self._pos += nbytes
            assert self._body is not None
            if self._pos == len(self._body):
                self._body_complete()
        elif mode == _DISCARD:
            self._discard_left -= nbytes
            if self._discard_left == 0:
                self._mode = _HEADER
                self._discard_done()
        else:
            self._send += nbytes
            if mode == _HEADER:
                self._parse()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wake_drain()

    # -- frame parsing -------------------------------------------------------------------------

    def _parse(self) -> None:
        """Handle every complete frame in scratch while the mode stays _HEADER.

        Not re-entrant: a request completed from inside the loop (a refusal whose
        body was already buffered) lets the outer loop carry on, so pipelined
        refusals cannot recurse.
        """
        if self._parsing:
            return
        self._parsing = True
        try:
            self._parse_frames()
        finally:
            self._parsing = False
        if self._sbeg == self._send:
            self._sbeg = self._send = 0

    def _accepting(self) -> bool:
        """Whether to take the next frame now (the server stops while its replies pile up)."""
        return True

    def _parse_frames(self) -> None:
        while self._mode == _HEADER and not self._closed and self._accepting():
            avail = self._send - self._sbeg
            if avail < _PREFIX.size:
                break
            (hlen,) = _PREFIX.unpack_from(self._scratch, self._sbeg)
            if hlen == 0 or hlen > self._max_header:
                self._protocol_error(f"header length {hlen} (max {self._max_header})")
                return
            if avail < _PREFIX.size + hlen:
                break
            start = self._sbeg + _PREFIX.size
            try:
                header = _decode_header(self._smv[start : start + hlen])
            except Exception as exc:  # msgpack raises several unrelated types
                self._protocol_error(f"malformed header: {exc!r}")
                return
            self._sbeg = start + hlen
            self._on_header(header)

    def _set_max_header(self, max_header: int) -> None:
        """Accept headers up to ``max_header`` bytes from now on (grows the scratch buffer)."""
        self._max_header = max_header
        size = _PREFIX.size + max_header + _MIN_HEADER_READ
        if size > len(self._scratch):
            avail = self._send - self._sbeg
            scratch = bytearray(size)
            scratch[:avail] = self._smv[self._sbeg : self._send]
            self._scratch, self._smv = scratch, memoryview(scratch)
            self._sbeg, self._send = 0, avail

    def _begin_body(self, dest: memoryview) -> None:
        """Receive the next ``len(dest)`` bytes into ``dest``, then call ``_body_complete``."""
        take = min(self._send - self._sbeg, len(dest))
        if take:
            # Deliberate copy: the body bytes that arrived in the header's read.
            dest[:take] = self._smv[self._sbeg : self._sbeg + take]
            self._sbeg += take
        self._body = dest
        self._pos = take
        if take == len(dest):
            self._body_complete()
        else:
            self._mode = _BODY

    def _begin_discard(self, size: int) -> None:
        """Skip the next ``size`` bytes, then call ``_discard_done``."""
        take = min(self._send - self._sbeg, size)
        self._sbeg += take
        if take == size:
            self._mode = _HEADER
            self._discard_done()
            return
        # Scratch is empty now: discarded bytes are read over its start.
        self._sbeg = self._send = 0
        self._discard_left = size - take
        self._mode = _DISCARD

    # -- hooks ---------------------------------------------------------------------------------

    def _on_header(self, header: Header) -> None:
        raise NotImplementedError

    def _body_complete(self) -> None:
        raise NotImplementedError

    def _discard_done(self) -> None:
        raise NotImplementedError

    def _protocol_error(self, reason: str) -> None:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------

    def _send_frame(self, header: Mapping[str, Any]) -> None:
        frame = _encode_frame(header)
        if self._transport is not None and not self._closed:
            self._transport.write(frame)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def abort(self) -> None:
        """Drop the connection at once (unsent bytes are lost)."""
        if self._transport is not None:
            self._transport.abort()
        self._closed = True


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


class PeerServer:
    """Accepts authenticated peer connections and serves them with a ``PeerHandler``.

    Timeouts: ``auth_timeout`` from connect to a completed handshake;
    ``io_timeout`` without progress while a header or body is partly received
    (or while the client does not read our reply); ``idle_timeout`` between
    requests. A connection past any of them is dropped (a partial body goes
    back through ``chunk_aborted``). Time spent in the handler never counts.

    Caps: at most ``max_handshakes`` connections are in the handshake at once; a new one
    over it drops the *oldest* unauthenticated connection, so a flood of connections that
    never authenticate cannot lock peers out for ``auth_timeout`` (a peer's handshake
    takes two round trips; the flood would have to displace it within them). At most
    ``max_connections`` in all: one over it is refused (``busy``) and closed at once.
    """

    def __init__(
        self,
        node_id: str,
        secret: bytes,
        handler: PeerHandler,
        *,
        ssl: ssl_module.SSLContext | None = None,
        idle_timeout: float = 60,
        io_timeout: float = 30,
        auth_timeout: float = 5,
        max_call_body: int = 256 << 20,
        max_handshakes: int = 64,
        max_connections: int = 4096,
    ) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self.node_id = node_id
        self._secret = secret
        self.handler = handler
        self._ssl = ssl
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self.auth_timeout = auth_timeout
        self.max_call_body = max_call_body
        self.max_handshakes = max_handshakes
        self.max_connections = max_connections
        # Timers tick at a quarter of the shortest timeout: a stall is noticed
        # between 1x and 1.25x its timeout.
        self._tick = min(max(min(idle_timeout, io_timeout, auth_timeout) / 4, 0.02), 5.0)
        self._server: asyncio.Server | None = None
        self._conns: set[_ServerConn] = set()
        # Connections not yet authenticated, oldest first (a dict keeps insertion order).
        self._handshaking: dict[_ServerConn, None] = {}

    async def start(self, host: str, port: int) -> None:
        """Listen on (host, port); port 0 picks a free port, see ``port``."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConn(self), host, port, ssl=self._ssl, reuse_address=True
        )

    @property
    def port(self) -> int:
        """The port actually listened on."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("server not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def connections(self) -> int:
        """Open connections (authenticated or not)."""
        return len(self._conns)

    @property
    def handshaking(self) -> int:
        """Open connections that have not authenticated yet."""
        return len(self._handshaking)

    def _admit(self, conn: _ServerConn) -> bool:
        """Count a new connection in, making room in the handshake cap; False: refuse it."""
        if len(self._conns) >= self.max_connections:
            return False
        while len(self._handshaking) >= self.max_handshakes:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            log.warning(
                "dropping peer connection from %s: over %d in the handshake",
                oldest._peer,
                self.max_handshakes,
            )
            oldest.abort()
        self._conns.add(conn)
        self._handshaking[conn] = None
        return True

    async def close(self) -> None:
        """Stop listening, drop every connection and cancel handler calls in progress.

        Partial bodies go back through ``chunk_aborted`` before this returns.
        """
        if self._server is not None:
            self._server.close()
        conns = list(self._conns)
        tasks = [c.task for c in conns if c.task is not None and not c.task.done()]
        for conn in conns:
            conn.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        lost = [c.lost for c in conns]
        if lost:
            await asyncio.wait(lost, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _ServerConn(_FramedProtocol):
    def __init__(self, server: PeerServer) -> None:
        super().__init__(MAX_PREAUTH_HEADER)
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self.task: asyncio.Task[None] | None = None
        self._peer = "?"
        self._client_nonce: bytes | None = None
        self._server_nonce = b""
        self._client_node = ""
        self._authed = False
        self._born = self._loop.time()
        self._mark = self._born  # last progress or last change of mode
        self._rx_seen = 0
        self._write_paused_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # The request in progress.
        self._kind = ""
        self._put_id = ""
        self._put_crc: int | None = None
        self._put_ack = False
        self._inflight: tuple[str, memoryview] | None = None  # buffer owed to the handler
        self._method = ""
        self._args: dict[str, Any] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peername = transport.get_extra_info("peername")
        self._peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        if not self._server._admit(self):
            log.warning("refusing peer connection from %s: %d open", self._peer,
                        self._server.max_connections)  # fmt: skip
            self._send_frame(_error_header("busy", "too many peer connections"))
            self._pause_reading()
            self._closed = True
            transport.close()
            return
        self._timer = self._loop.call_later(self._server._tick, self._on_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._server._conns.discard(self)
        self._server._handshaking.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
        self._abort_inflight()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        # The client does not read its replies: stop reading its requests too.
        super().pause_writing()
        self._write_paused_at = self._loop.time()
        self._pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._mode != _BUSY and not self._closed:
            self._continue()

    def _accepting(self) -> bool:
        return not self._write_paused

    def _abort_inflight(self) -> None:
        if self._inflight is not None:
            chunk_id, buf = self._inflight
            self._inflight = None
            try:
                self._server.handler.chunk_aborted(chunk_id, buf)
            except Exception:
                log.exception("peer handler chunk_aborted(%s) failed", chunk_id)

    def _on_tick(self) -> None:
        if self._closed:
            return
        server = self._server
        now = self._loop.time()
        if self._rx != self._rx_seen:
            self._rx_seen = self._rx
            self._mark = now
        reason = ""
        if not self._authed:
            if now - self._born > server.auth_timeout:
                reason = f"no authentication within {server.auth_timeout} s"
        elif self._write_paused and self._mode != _BUSY:
            if now - self._write_paused_at > server.io_timeout:
                reason = f"reply unread for {server.io_timeout} s"
        elif self._mode in (_BODY, _DISCARD) or (self._mode == _HEADER and self._send > self._sbeg):
            if now - self._mark > server.io_timeout:
                reason = f"request stalled for {server.io_timeout} s"
        elif self._mode == _HEADER and now - self._mark > server.idle_timeout:
            log.debug("peer connection from %s idle, closing", self._peer)
            assert self._transport is not None
            self._transport.close()
            self._closed = True
            return
        if reason:
            log.warning("dropping peer connection from %s: %s", self._peer, reason)
            self.abort()
            return
        self._timer = self._loop.call_later(server._tick, self._on_tick)

    def _protocol_error(self, reason: str) -> None:
        log.warning("peer connection from %s: %s; closing", self._peer, reason)
        self._refuse_and_close("bad_request", reason)

    def _refuse_and_close(self, code: str, message: str) -> None:
        self._send_frame(_error_header(code, message))
        self._mode = _BUSY
        self._pause_reading()
        if self._transport is not None:
            self._transport.close()  # flushes the refusal first...
            # ...unless the peer never reads it.
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_later(self._server.io_timeout, self._transport.abort)
        self._closed = True
        self._abort_inflight()

    # -- requests ------------------------------------------------------------------------------

    def _on_header(self, header: Header) -> None:
        if not self._authed:
            self._on_auth_frame(header)
            return
        op = header.get("op")
        if op == "put":
            self._on_put(header)
        elif op == "call":
            self._on_call(header)
        else:
            size = _length_field(header, "body")
            if size is None:
                self._protocol_error(f"unknown op {op!r} with a bad body length")
                return
            self._refuse(_error_header("unknown_op", f"unknown peer op {op!r}"), size)

    def _refuse(self, reply: Header, body_left: int) -> None:
        """Reply ``reply`` now and skip the ``body_left`` bytes of the request's body."""
        self._send_frame(reply)
        self._begin_discard(body_left)

    def _discard_done(self) -> None:
        self._request_done()

    def _on_auth_frame(self, header: Header) -> None:
        op = header.get("op")
        server = self._server
        if op == "hello" and self._client_nonce is None:
            nonce, node, version = header.get("nonce"), header.get("node"), header.get("v")
            if version != PROTOCOL_VERSION:
                self._refuse_and_close(
                    "unsupported_version", f"peer protocol {version!r}, want {PROTOCOL_VERSION}"
                )
                return
            if not (isinstance(nonce, bytes) and len(nonce) == NONCE_LEN):
                self._protocol_error("hello without a 32-byte nonce")
                return
            if not (isinstance(node, str) and 0 < len(node) <= MAX_NODE_ID_LEN):
                self._protocol_error("hello without a node id")
                return
            self._client_nonce, self._client_node = nonce, node
            self._server_nonce = os.urandom(NONCE_LEN)
            proof = _proof(
                server._secret, _SERVER_LABEL, nonce, self._server_nonce, node, server.node_id
            )
            self._send_frame(
                {
                    "ok": True,
                    "v": PROTOCOL_VERSION,
                    "node": server.node_id,
                    "nonce": self._server_nonce,
                    "proof": proof,
                }
            )
        elif op == "auth" and self._client_nonce is not None:
            given = header.get("proof")
            expected = _proof(
                server._secret,
                _CLIENT_LABEL,
                self._client_nonce,
                self._server_nonce,
                self._client_node,
                server.node_id,
            )
            if not (isinstance(given, bytes) and hmac.compare_digest(given, expected)):
                log.warning(
                    "peer %s (%r) failed authentication", self._peer, self._client_node[:64]
                )
                self._refuse_and_close("forbidden", "peer authentication failed: wrong secret")
                return
            self._authed = True
            server._handshaking.pop(self, None)
            # Unauthenticated connections hold a small buffer; this one may now send more.
            self._set_max_header(MAX_HEADER)
            self._mark = self._loop.time()
            self._send_frame({"ok": True})
        else:
            self._refuse_and_close("forbidden", "authenticate first (hello, then auth)")

    def _on_put(self, header: Header) -> None:
        chunk_id, size = header.get("id"), _length_field(header, "size")
        if size is None or "size" not in header:
            self._protocol_error("put without a valid size")
            return
        if not (isinstance(chunk_id, str) and 0 < len(chunk_id) <= MAX_CHUNK_ID_LEN):
            self._refuse(_error_header("bad_chunk_id", "put without a chunk id"), size)
            return
        crc = header.get("crc32c")
        self._kind = "put"
        self._put_id = chunk_id
        self._put_crc = crc if type(crc) is int and 0 <= crc < 2**32 else None
        self._put_ack = header.get("ack") is True
        if self._put_ack:
            self._server.handler.ack_copy(chunk_id)
        self._mode = _BUSY
        self._pause_reading()
        self.task = self._loop.create_task(self._start_put(chunk_id, size))

    async def _start_put(self, chunk_id: str, size: int) -> None:
        handler = self._server.handler
        try:
            raw = await handler.receive_chunk(chunk_id, size)
        except PeerError as exc:
            self._early_refusal(_error_header(exc.code, exc.message), size)
            return
        except Exception as exc:
            log.exception("peer handler receive_chunk(%s) failed", chunk_id)
            self._early_refusal(_error_header("internal", repr(exc)), size)
            return
        if self._closed:
            self._inflight = (chunk_id, raw)
            self._abort_inflight()
            return
        try:
            buf = memoryview(raw)
            ok = not buf.readonly and buf.nbytes == size and buf.format == "B" and buf.ndim == 1
        except TypeError:
            ok = False
        if not ok:
            log.error("peer handler receive_chunk(%s) gave an unusable buffer", chunk_id)
            self._inflight = (chunk_id, raw)
            self._abort_inflight()
            self._early_refusal(_error_header("internal", "no usable buffer"), size)
            return
        self._inflight = (chunk_id, buf)
        self._mark = self._loop.time()
        self._begin_body(buf)
        if self._mode == _BODY:
            self._resume_reading()

    def _early_refusal(self, reply: Header, size: int) -> None:
        if self._closed:
            return
        self._resume_reading()
        self._mark = self._loop.time()
        self._refuse(reply, size)

    def _on_call(self, header: Header) -> None:
        size = _length_field(header, "body")
        if size is None:
            self._protocol_error("call with a bad body length")
            return
        method, args = header.get("method"), header.get("args", {})
        if not isinstance(method, str) or not isinstance(args, dict):
            self._refuse(_error_header("bad_request", "call needs a method and args map"), size)
            return
        if size > self._server.max_call_body:
            self._refuse(
                _error_header(
                    "too_large",
                    f"call body of {size} bytes (max {self._server.max_call_body})",
                ),
                size,
            )
            return
        self._kind = "call"
        self._method, self._args = method, args
        if size:
            self._begin_body(memoryview(bytearray(size)))
        else:
            self._body = None
            self._body_complete()

    def _body_complete(self) -> None:
        body, self._body = self._body, None
        self._mode = _BUSY
        self._pause_reading()
        if self._kind == "put":
            assert body is not None
            self._inflight = None  # the handler owns the buffer from here on
            self.task = self._loop.create_task(self._finish_put(self._put_id, body, self._put_crc))
        else:
            self.task = self._loop.create_task(self._run_call(self._method, self._args, body))

    async def _finish_put(self, chunk_id: str, buf: memoryview, crc: int | None) -> None:
        handler = self._server.handler
        if self._put_ack:
            handler.ack_copy(chunk_id)
        try:
            if crc is None:
                result = await handler.chunk_received(chunk_id, buf)
            else:
                result = await handler.chunk_received_crc(chunk_id, buf, crc)
            reply: Header = {"ok": True, "result": result}
        except PeerError as exc:
            reply = _error_header(exc.code, exc.message)
        except Exception as exc:
            log.exception("peer handler chunk_received(%s) failed", chunk_id)
            reply = _error_header("internal", repr(exc))
        self._reply(reply, None)

    async def _run_call(self, method: str, args: dict[str, Any], body: memoryview | None) -> None:
        out: memoryview | None = None
        try:
            result, out_body = await self._server.handler.call(method, args, body)
            if not isinstance(result, dict):
                raise TypeError(f"call({method!r}) returned a {type(result).__name__}, not a dict")
            reply: Header = {"ok": True, "result": result}
            if out_body is not None:
                out = _byte_view(out_body)
                if out.nbytes:
                    reply["body"] = out.nbytes
                else:
                    out = None
        except PeerError as exc:
            reply = _error_header(exc.code, exc.message)
        except Exception as exc:
            log.exception("peer handler call(%r) failed", method)
            reply = _error_header("internal", repr(exc))
        self._reply(reply, out)

    def _reply(self, reply: Header, body: memoryview | None) -> None:
        if self._closed:
            return
        try:
            frame = _encode_frame(reply)
        except Exception as exc:  # the handler's result does not pack, or is too big
            log.error("peer reply does not encode: %r", exc)
            frame, body = _encode_frame(_error_header("internal", f"bad reply: {exc!r}")), None
        assert self._transport is not None
        self._transport.write(frame)
        if body is not None:
            self._transport.write(body)
        self._request_done()

    def _request_done(self) -> None:
        self.task = None
        self._mode = _HEADER
        self._mark = self._loop.time()
        if not self._write_paused:
            self._continue()

    def _continue(self) -> None:
        """Serve what is already buffered, then read more."""
        self._parse()
        if self._mode != _BUSY and not self._write_paused:
            self._resume_reading()


# ---------------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------------


class _ClientConn(_FramedProtocol):
    def __init__(self, addr: Addr, write_buffer: int, max_reply_body: int) -> None:
        super().__init__(MAX_HEADER)
        self.addr = addr
        self._write_buffer = write_buffer
        self._max_reply_body = max_reply_body
        self._waiter: asyncio.Future[Reply] | None = None
        self._reply_header: Header = {}
        self.idle_since = 0.0
        self.peer_node = ""
        self.on_lost: Callable[[_ClientConn], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self._transport is not None
        # Bounded bytes in the transport: writers wait in drain() past this.
        self._transport.set_write_buffer_limits(high=self._write_buffer)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._fail(PeerUnavailable("connection_lost", f"peer {_fmt(self.addr)} closed: {exc!r}"))
        if self.on_lost is not None:
            self.on_lost(self)

    def _fail(self, exc: PeerError) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            # Retrieved or not, this must not be logged as "never retrieved".
            waiter.exception()
        self._wake_drain()

    def _protocol_error(self, reason: str) -> None:
        log.warning("peer %s sent a bad frame: %s", _fmt(self.addr), reason)
        self.abort()
        self._fail(PeerUnavailable("protocol_error", f"peer {_fmt(self.addr)}: {reason}"))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def transport(self) -> asyncio.Transport:
        if self._transport is None or self._closed:
            raise PeerUnavailable("connection_lost", f"peer {_fmt(self.addr)}: connection closed")
        return self._transport

    def clean(self) -> bool:
        """Idle and in step: may go back to the pool."""
        return (
            not self._closed
            and self._mode == _HEADER
            and self._send == self._sbeg
            and (self._waiter is None or self._waiter.done())
        )

    def readable(self) -> bool:
        """Whether bytes or an EOF wait unread: on an idle connection, the peer closed it.

        The loop learns of a close one iteration late; this asks the kernel, so a
        pooled connection the peer just closed is not handed out.
        """
        if self._transport is None or not hasattr(select, "poll"):
            return False
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def expect_reply(self) -> asyncio.Future[Reply]:
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def send(self, header: Mapping[str, Any]) -> None:
        self.transport.write(_encode_frame(header))

    async def drain(self) -> None:
        """Wait until the transport is below its low-water mark, the reply came, or it closed."""
        while self._write_paused and not self._closed:
            if self._waiter is not None and self._waiter.done():
                return
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiter = waiter
            await waiter

    def _on_header(self, header: Header) -> None:
        if self._waiter is None or self._waiter.done():
            self._protocol_error("unexpected frame")
            return
        size = _length_field(header, "body")
        if size is None or size > self._max_reply_body:
            self._protocol_error(f"reply with a bad body length {header.get('body')!r}")
            return
        self._reply_header = header
        if size:
            self._begin_body(memoryview(bytearray(size)))
        else:
            self._deliver(None)

    def _body_complete(self) -> None:
        body, self._body = self._body, None
        self._mode = _HEADER
        self._deliver(body)

    def _discard_done(self) -> None:  # the client never discards
        pass

    def _deliver(self, body: memoryview | None) -> None:
        waiter = self._waiter
        assert waiter is not None
        if not waiter.done():
            waiter.set_result((self._reply_header, body))
        self._wake_drain()


def _fmt(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


class PutStream:
    """One chunk on its way to a peer: ``write`` its pieces, then ``finish``.

    Pieces are handed to the transport without a copy, so their bytes must not
    change until ``finish`` returns or the stream is aborted. Usable as an async
    context manager: leaving it with an exception (or without ``finish``) aborts.
    """

    def __init__(
        self, client: PeerClient, conn: _ClientConn, chunk_id: str, size: int, io_timeout: float
    ) -> None:
        self._client = client
        self._conn = conn
        self._verdict = conn.expect_reply()
        self.chunk_id = chunk_id
        self.size = size
        self._left = size
        self._io_timeout = io_timeout
        self._done = False
        self._failure: PeerError | None = None

    @property
    def written(self) -> int:
        """Body bytes handed to the transport so far."""
        return self.size - self._left

    @property
    def pending_bytes(self) -> int:
        """Bytes handed to the transport but not yet to the socket (bounded by flow control)."""
        transport = self._conn._transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._done:
            raise PeerError("bad_request", "put stream already finished")
        verdict = self._verdict
        if verdict.done():
            raised = verdict.exception()
            if isinstance(raised, PeerError):
                exc = raised
            elif raised is not None:
                exc = PeerUnavailable("connection_lost", repr(raised))
            else:
                header, _ = verdict.result()
                exc = (
                    PeerUnavailable("protocol_error", "peer accepted a put before its body")
                    if header.get("ok") is True
                    else _error_from_reply(header)
                )
            # Refused early: the rest of the body is not wanted. A connection
            # mid-body cannot be reused, one whose body is all sent can.
            self._fail(exc, reusable=self._left == 0 and not isinstance(exc, PeerUnavailable))
            raise exc

    def _fail(self, exc: PeerError, *, reusable: bool = False) -> None:
        self._failure = exc
        self._done = True
        if reusable:
            self._client._release(self._conn)
        else:
            self._client._discard(self._conn)

    async def write(self, piece: BytesLike) -> None:
        """Send the next piece of the body, waiting while the transport is full.

        Raises the peer's ``PeerError`` as soon as it refused the chunk,
        ``PeerUnavailable`` on connection loss or a stall of ``io_timeout``.
        """
        if self._done or self._verdict.done():  # the common case skips the call
            self._check()
        mv = _byte_view(piece)
        n = mv.nbytes
        if n > self._left:
            raise ValueError(f"piece of {n} bytes past the chunk's size ({self._left} left)")
        if not n:
            return
        conn = self._conn
        transport = conn._transport
        if transport is None or conn._closed:
            self._check()  # connection_lost has failed the verdict, or
            lost = PeerUnavailable("connection_lost", f"peer {_fmt(conn.addr)}: closed")
            self._fail(lost)
            raise lost
        transport.write(mv)
        self._left -= n
        if conn._write_paused:
            try:
                async with asyncio.timeout(self._io_timeout):
                    await conn.drain()
            except TimeoutError:
                exc = PeerUnavailable(
                    "timeout", f"peer {_fmt(conn.addr)} read nothing for {self._io_timeout} s"
                )
                self._fail(exc)
                raise exc from None
            except BaseException:
                self.abort()
                raise
            if conn.closed or self._verdict.done():
                self._check()

    async def finish(self) -> dict[str, Any]:
        """Wait for the peer's verdict on the whole body; return the handler's result.

        Raises ``PeerError`` with the peer's code on refusal, ``truncated`` if
        fewer than ``size`` bytes were written (the stream is then aborted),
        ``PeerUnavailable`` on connection loss or no verdict within ``io_timeout``.
        """
        if self._failure is not None:
            raise self._failure
        if self._done:
            raise PeerError("bad_request", "put stream already finished")
        if self._left:
            exc = PeerError("truncated", f"finish() after {self.written} of {self.size} bytes")
            self._fail(exc)
            raise exc
        try:
            async with asyncio.timeout(self._io_timeout):
                header, _ = await asyncio.shield(self._verdict)
        except TimeoutError:
            exc = PeerUnavailable(
                "timeout", f"peer {_fmt(self._conn.addr)}: no verdict in {self._io_timeout} s"
            )
            self._fail(exc)
            raise exc from None
        except PeerError as exc:
            self._fail(exc)
            raise
        except BaseException:
            self.abort()
            raise
        if header.get("ok") is not True:
            refusal = _error_from_reply(header)
            self._fail(refusal, reusable=True)
            raise refusal
        self._done = True
        self._client._release(self._conn)
        result = header.get("result", {})
        return result if isinstance(result, dict) else {}

    def abort(self) -> None:
        """Tear the connection down: the peer discards the partial body. Idempotent."""
        if not self._done:
            self._fail(PeerError("aborted", "put stream aborted"))

    async def __aenter__(self) -> PutStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class PeerClient:
    """Connections to peers, pooled per address (at most ``pool_size`` idle ones each).

    Every connection is authenticated before use. An idle pooled connection is
    retired after ``pool_idle_timeout`` seconds, below the server's idle timeout,
    so a request rarely meets a connection the peer is just closing.
    """

    def __init__(
        self,
        node_id: str,
        secret: bytes,
        *,
        ssl: ssl_module.SSLContext | None = None,
        connect_timeout: float = 5,
        io_timeout: float = 30,
        pool_size: int = 8,
        pool_idle_timeout: float = 20,
        write_buffer: int = 1 << 20,
        max_reply_body: int = 1 << 30,
    ) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self.node_id = node_id
        self._secret = secret
        self._ssl = ssl
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.pool_size = pool_size
        self.pool_idle_timeout = pool_idle_timeout
        self._write_buffer = write_buffer
        self._max_reply_body = max_reply_body
        self._idle: dict[Addr, list[_ClientConn]] = {}
        self._conns: set[_ClientConn] = set()
        self._closed = False

    async def open_put(
        self,
        addr: Addr,
        chunk_id: str,
        size: int,
        crc32c: int | None = None,
        *,
        ack: bool = False,
    ) -> PutStream:
        """Start sending a chunk of ``size`` bytes to the peer at ``addr``; ``crc32c``,
        when given, is the body's CRC-32C (see ``PeerHandler.chunk_received_crc``);
        ``ack``: the copy is one a client's PUT waits for (``PeerHandler.ack_copy``)."""
        if type(size) is not int or not 0 <= size <= MAX_BODY:
            raise ValueError(f"bad chunk size {size!r}")
        conn = await self._acquire(addr)
        stream = PutStream(self, conn, chunk_id, size, self.io_timeout)
        header: Header = {"op": "put", "id": chunk_id, "size": size}
        if crc32c is not None:
            header["crc32c"] = crc32c
        if ack:
            header["ack"] = True
        try:
            conn.send(header)
        except BaseException:
            self._discard(conn)
            raise
        return stream

    async def call(
        self,
        addr: Addr,
        method: str,
        args: Mapping[str, Any] | None = None,
        body: BytesLike | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], memoryview | None]:
        """Call ``method`` on the peer; return (result, reply body or None).

        ``body`` is sent without a copy and must not change until this returns.
        Raises the peer's ``PeerError``, or ``PeerUnavailable`` when it cannot
        be reached or does not answer within ``timeout`` (default ``io_timeout``).
        """
        limit = self.io_timeout if timeout is None else timeout
        view = _byte_view(body) if body is not None else None
        header: Header = {"op": "call", "method": method, "args": dict(args or {})}
        if view is not None and view.nbytes:
            header["body"] = view.nbytes
        else:
            view = None
        frame = _encode_frame(header)  # before taking a connection: may raise too_large
        conn = await self._acquire(addr)
        waiter = conn.expect_reply()
        try:
            conn.transport.write(frame)
            if view is not None:
                conn.transport.write(view)
            async with asyncio.timeout(limit):
                reply, reply_body = await asyncio.shield(waiter)
        except TimeoutError:
            self._discard(conn)
            raise PeerUnavailable(
                "timeout", f"peer {_fmt(addr)}: no reply to {method!r} in {limit} s"
            ) from None
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        if reply.get("ok") is not True:
            raise _error_from_reply(reply)
        result = reply.get("result", {})
        return (result if isinstance(result, dict) else {}), reply_body

    async def close(self) -> None:
        """Drop every connection; later requests raise ``PeerUnavailable("closed")``."""
        self._closed = True
        for conn in list(self._conns):
            conn.abort()
            conn._fail(PeerUnavailable("closed", "peer client closed"))
        self._conns.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports deliver connection_lost

    # -- pool ----------------------------------------------------------------------------------

    async def _acquire(self, addr: Addr) -> _ClientConn:
        if self._closed:
            raise PeerUnavailable("closed", "peer client closed")
        idle = self._idle.get(addr)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()  # the most recently used one
                fresh = now - conn.idle_since < self.pool_idle_timeout
                if fresh and conn.clean() and not conn.readable():
                    return conn
                self._discard(conn)
        return await self._connect(addr)

    def _release(self, conn: _ClientConn) -> None:
        if self._closed or not conn.clean():
            self._discard(conn)
            return
        idle = self._idle.setdefault(conn.addr, [])
        if len(idle) >= self.pool_size:
            self._discard(conn)
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def _discard(self, conn: _ClientConn) -> None:
        conn.abort()
        self._forget(conn)

    def _forget(self, conn: _ClientConn) -> None:
        self._conns.discard(conn)
        idle = self._idle.get(conn.addr)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(self, addr: Addr) -> _ClientConn:
        loop = asyncio.get_running_loop()
        host, port = addr
        conn: _ClientConn | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConn(addr, self._write_buffer, self._max_reply_body),
                    host,
                    port,
                    ssl=self._ssl,
                    server_hostname=host if self._ssl is not None else None,
                )
                conn.on_lost = self._forget
                self._conns.add(conn)
                await self._handshake(conn)
        except TimeoutError:
            if conn is not None:
                self._discard(conn)
            raise PeerUnavailable(
                "timeout", f"peer {_fmt(addr)}: no connection in {self.connect_timeout} s"
            ) from None
        except OSError as exc:
            if conn is not None:
                self._discard(conn)
            raise PeerUnavailable("unreachable", f"peer {_fmt(addr)}: {exc}") from exc
        except BaseException:
            if conn is not None:
                self._discard(conn)
            raise
        if self._closed:
            self._discard(conn)
            raise PeerUnavailable("closed", "peer client closed")
        return conn

    async def _handshake(self, conn: _ClientConn) -> None:
        cn = os.urandom(NONCE_LEN)
        waiter = conn.expect_reply()
        conn.send({"op": "hello", "v": PROTOCOL_VERSION, "node": self.node_id, "nonce": cn})
        challenge, _ = await waiter
        if challenge.get("ok") is not True:
            raise _error_from_reply(challenge)
        sn, server, proof = challenge.get("nonce"), challenge.get("node"), challenge.get("proof")
        if not (isinstance(sn, bytes) and isinstance(server, str) and isinstance(proof, bytes)):
            raise PeerUnavailable("protocol_error", f"peer {_fmt(conn.addr)}: bad challenge")
        expected = _proof(self._secret, _SERVER_LABEL, cn, sn, self.node_id, server)
        if not hmac.compare_digest(proof, expected):
            raise PeerError(
                "forbidden", f"peer {_fmt(conn.addr)} ({server!r}) failed to prove the secret"
            )
        waiter = conn.expect_reply()
        mine = _proof(self._secret, _CLIENT_LABEL, cn, sn, self.node_id, server)
        conn.send({"op": "auth", "proof": mine})
        verdict, _ = await waiter
        if verdict.get("ok") is not True:
            raise _error_from_reply(verdict)
        conn.peer_node = server
