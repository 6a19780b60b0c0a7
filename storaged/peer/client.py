"""The peer protocol's client: ``PeerClient`` (authenticated connections pooled per peer,
small calls) and ``PutStream`` (one chunk on its way to a peer). The format is in
``storaged.peer.wire``.

Copies and flow control: the client hands each piece of a body to the transport as a
memoryview and waits whenever more than ``write_buffer`` bytes are queued there; uvloop
sends from the caller's memory, plain asyncio (Python 3.11) copies the part the socket
did not take at once. A reply body is read straight into a buffer of its size.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Any

from storaged.peer.framing import FramedProtocol
from storaged.peer.wire import (
    CLIENT_LABEL,
    MAX_BODY,
    MAX_HEADER,
    NONCE_LEN,
    PROTOCOL_VERSION,
    SERVER_LABEL,
    Addr,
    Header,
    PeerEnd,
    PeerError,
    PeerUnavailable,
    Reply,
    byte_view,
    encode_frame,
    error_from_reply,
    fmt,
    handshake_proof,
    length_field,
)
from storaged.transport import HEAD, IdlePool
from storaged.wire import BytesLike

__all__ = ["PeerClient", "PutStream"]

# One logger for the protocol, as when it was one module.
log = logging.getLogger("storaged.peer")


class _ClientConn(FramedProtocol):
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
        self._fail(PeerUnavailable("connection_lost", f"peer {fmt(self.addr)} closed: {exc!r}"))
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
        log.warning("peer %s sent a bad frame: %s", fmt(self.addr), reason)
        self.abort()
        self._fail(PeerUnavailable("protocol_error", f"peer {fmt(self.addr)}: {reason}"))

    @property
    def transport(self) -> asyncio.Transport:
        if self._transport is None or self._closed:
            raise PeerUnavailable("connection_lost", f"peer {fmt(self.addr)}: connection closed")
        return self._transport

    def clean(self) -> bool:
        """Idle and in step: may go back to the pool."""
        return (
            not self._closed
            and self._mode == HEAD
            and self._send == self._sbeg
            and (self._waiter is None or self._waiter.done())
        )

    def expect_reply(self) -> asyncio.Future[Reply]:
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _drain_over(self) -> bool:
        # The reply came (a refusal): the writer stops waiting for room to send.
        return self._waiter is not None and self._waiter.done()

    def send(self, header: Mapping[str, Any]) -> None:
        self.transport.write(encode_frame(header))

    def _on_header(self, header: Header) -> None:
        if self._waiter is None or self._waiter.done():
            self._protocol_error("unexpected frame")
            return
        size = length_field(header, "body")
        if size is None or size > self._max_reply_body:
            self._protocol_error(f"reply with a bad body length {header.get('body')!r}")
            return
        self._reply_header = header
        if size:
            self._begin_body(memoryview(bytearray(size)))
        else:
            self._deliver(None)

    def _body_complete(self, body: memoryview) -> None:
        self._mode = HEAD
        self._deliver(body)

    def _discard_done(self) -> None:  # the client never discards
        pass

    def _deliver(self, body: memoryview | None) -> None:
        waiter = self._waiter
        assert waiter is not None
        if not waiter.done():
            waiter.set_result((self._reply_header, body))
        self._wake_drain()


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
                    else error_from_reply(header)
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
        mv = byte_view(piece)
        n = mv.nbytes
        if n > self._left:
            raise ValueError(f"piece of {n} bytes past the chunk's size ({self._left} left)")
        if not n:
            return
        conn = self._conn
        transport = conn._transport
        if transport is None or conn._closed:
            self._check()  # connection_lost has failed the verdict, or
            lost = PeerUnavailable("connection_lost", f"peer {fmt(conn.addr)}: closed")
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
                    "timeout", f"peer {fmt(conn.addr)} read nothing for {self._io_timeout} s"
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
                "timeout", f"peer {fmt(self._conn.addr)}: no verdict in {self._io_timeout} s"
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
            refusal = error_from_reply(header)
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


@dataclass(eq=False, repr=False)
class PeerClient(PeerEnd):
    """Connections to peers, pooled per address (at most ``pool_size`` idle ones each).

    Every connection is authenticated before use. An idle pooled connection is
    retired after ``pool_idle_timeout`` seconds, below the server's idle timeout,
    so a request rarely meets a connection the peer is just closing.
    """

    _: KW_ONLY
    connect_timeout: float = 5
    pool_size: int = 8
    pool_idle_timeout: float = 20
    write_buffer: int = 1 << 20
    max_reply_body: int = 1 << 30
    _idle: IdlePool[_ClientConn] = field(default_factory=IdlePool, init=False)
    _conns: set[_ClientConn] = field(default_factory=set, init=False)
    _closed: bool = field(default=False, init=False)

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
        view = byte_view(body) if body is not None else None
        header: Header = {"op": "call", "method": method, "args": dict(args or {})}
        if view is not None and view.nbytes:
            header["body"] = view.nbytes
        else:
            view = None
        frame = encode_frame(header)  # before taking a connection: may raise too_large
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
                "timeout", f"peer {fmt(addr)}: no reply to {method!r} in {limit} s"
            ) from None
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        if reply.get("ok") is not True:
            raise error_from_reply(reply)
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
        now = asyncio.get_running_loop().time()
        while (conn := self._idle.take(addr)) is not None:
            fresh = now - conn.idle_since < self.pool_idle_timeout
            if fresh and conn.clean() and not conn.readable():
                return conn
            self._discard(conn)
        return await self._connect(addr)

    def _release(self, conn: _ClientConn) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        if self._closed or not conn.clean() or not self._idle.keep(conn, self.pool_size):
            self._discard(conn)

    def _discard(self, conn: _ClientConn) -> None:
        conn.abort()
        self._forget(conn)

    def _forget(self, conn: _ClientConn) -> None:
        self._conns.discard(conn)
        self._idle.forget(conn)

    async def _connect(self, addr: Addr) -> _ClientConn:
        loop = asyncio.get_running_loop()
        host, port = addr
        conn: _ClientConn | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConn(addr, self.write_buffer, self.max_reply_body),
                    host,
                    port,
                    ssl=self.ssl,
                    server_hostname=host if self.ssl is not None else None,
                )
                conn.on_lost = self._forget
                self._conns.add(conn)
                await self._handshake(conn)
        except TimeoutError:
            if conn is not None:
                self._discard(conn)
            raise PeerUnavailable(
                "timeout", f"peer {fmt(addr)}: no connection in {self.connect_timeout} s"
            ) from None
        except OSError as exc:
            if conn is not None:
                self._discard(conn)
            raise PeerUnavailable("unreachable", f"peer {fmt(addr)}: {exc}") from exc
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
            raise error_from_reply(challenge)
        sn, server, proof = challenge.get("nonce"), challenge.get("node"), challenge.get("proof")
        if not (isinstance(sn, bytes) and isinstance(server, str) and isinstance(proof, bytes)):
            raise PeerUnavailable("protocol_error", f"peer {fmt(conn.addr)}: bad challenge")
        expected = handshake_proof(self.secret, SERVER_LABEL, cn, sn, self.node_id, server)
        if not hmac.compare_digest(proof, expected):
            raise PeerError(
                "forbidden", f"peer {fmt(conn.addr)} ({server!r}) failed to prove the secret"
            )
        waiter = conn.expect_reply()
        mine = handshake_proof(self.secret, CLIENT_LABEL, cn, sn, self.node_id, server)
        conn.send({"op": "auth", "proof": mine})
        verdict, _ = await waiter
        if verdict.get("ok") is not True:
            raise error_from_reply(verdict)
        conn.peer_node = server
