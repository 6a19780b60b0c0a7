"""The peer protocol's server: ``PeerServer`` accepts authenticated peer connections and
serves each request with a ``PeerHandler`` (``storaged.peer.handler``). The format is in
``storaged.peer.wire``.

Copies and flow control: a put body is received straight into the buffer the handler
lends (``BufferedProtocol.get_buffer``); only the body bytes that arrived in the same read
as the header (at most 4 KiB) are copied out of the header buffer. While the handler
decides (``receive_chunk``, which may wait for memory) and while it checks and stores
(``chunk_received``), the server stops reading, so TCP pushes back on the sender instead
of bytes piling up.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from storaged.peer.framing import FramedProtocol
from storaged.peer.handler import BodyBuffer, PeerHandler
from storaged.peer.wire import (
    CLIENT_LABEL,
    MAX_CHUNK_ID_LEN,
    MAX_HEADER,
    MAX_NODE_ID_LEN,
    MAX_PREAUTH_HEADER,
    NONCE_LEN,
    PROTOCOL_VERSION,
    SERVER_LABEL,
    Header,
    PeerEnd,
    PeerError,
    byte_view,
    encode_frame,
    error_header,
    handshake_proof,
    length_field,
)
from storaged.transport import BODY, DISCARD, HEAD, HOLD

__all__ = ["PeerServer"]

# One logger for the protocol, as when it was one module.
log = logging.getLogger("storaged.peer")


def _failed(exc: Exception, what: str) -> Header:
    """The reply to a handler call ``what`` that raised ``exc``: a ``PeerError`` as its code
    and message, anything else as "internal", logged with its traceback (call it in the
    ``except`` block)."""
    if isinstance(exc, PeerError):
        return error_header(exc.code, exc.message)
    log.exception("peer handler %s failed", what)
    return error_header("internal", repr(exc))


@dataclass(eq=False, repr=False)
class PeerServer(PeerEnd):
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

    handler: PeerHandler[Any]
    _: KW_ONLY
    idle_timeout: float = 60
    auth_timeout: float = 5
    max_call_body: int = 256 << 20
    max_handshakes: int = 64
    max_connections: int = 4096
    _tick: float = field(init=False)
    _server: asyncio.Server | None = field(default=None, init=False)
    _conns: set[_ServerConn] = field(default_factory=set, init=False)
    # Connections not yet authenticated, oldest first (a dict keeps insertion order).
    _handshaking: dict[_ServerConn, None] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Timers tick at a quarter of the shortest timeout: a stall is noticed
        # between 1x and 1.25x its timeout.
        shortest = min(self.idle_timeout, self.io_timeout, self.auth_timeout)
        self._tick = min(max(shortest / 4, 0.02), 5.0)

    async def start(self, host: str, port: int) -> None:
        """Listen on (host, port); port 0 picks a free port, see ``port``."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConn(self), host, port, ssl=self.ssl, reuse_address=True
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


class _ServerConn(FramedProtocol):
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
        self._inflight: tuple[str, BodyBuffer] | None = None  # buffer owed to the handler
        self._method = ""
        self._args: dict[str, Any] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peername = transport.get_extra_info("peername")
        self._peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        if not self._server._admit(self):
            log.warning("refusing peer connection from %s: %d open", self._peer,
                        self._server.max_connections)  # fmt: skip
            self._send_frame(error_header("busy", "too many peer connections"))
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
        if self._mode != HOLD and not self._closed:
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
        elif self._write_paused and self._mode != HOLD:
            if now - self._write_paused_at > server.io_timeout:
                reason = f"reply unread for {server.io_timeout} s"
        elif self._mode in (BODY, DISCARD) or (self._mode == HEAD and self._send > self._sbeg):
            if now - self._mark > server.io_timeout:
                reason = f"request stalled for {server.io_timeout} s"
        elif self._mode == HEAD and now - self._mark > server.idle_timeout:
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
        self._send_frame(error_header(code, message))
        self._mode = HOLD
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
            size = length_field(header, "body")
            if size is None:
                self._protocol_error(f"unknown op {op!r} with a bad body length")
                return
            self._refuse(error_header("unknown_op", f"unknown peer op {op!r}"), size)

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
            proof = handshake_proof(
                server.secret, SERVER_LABEL, nonce, self._server_nonce, node, server.node_id
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
            expected = handshake_proof(
                server.secret,
                CLIENT_LABEL,
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
        chunk_id, size = header.get("id"), length_field(header, "size")
        if size is None or "size" not in header:
            self._protocol_error("put without a valid size")
            return
        if not (isinstance(chunk_id, str) and 0 < len(chunk_id) <= MAX_CHUNK_ID_LEN):
            self._refuse(error_header("bad_chunk_id", "put without a chunk id"), size)
            return
        crc = header.get("crc32c")
        self._kind = "put"
        self._put_id = chunk_id
        self._put_crc = crc if type(crc) is int and 0 <= crc < 2**32 else None
        self._put_ack = header.get("ack") is True
        if self._put_ack:
            self._server.handler.ack_copy(chunk_id)
        self._mode = HOLD
        self._pause_reading()
        self.task = self._loop.create_task(self._start_put(chunk_id, size))

    async def _start_put(self, chunk_id: str, size: int) -> None:
        handler = self._server.handler
        try:
            raw = await handler.receive_chunk(chunk_id, size)
        except Exception as exc:
            self._early_refusal(_failed(exc, f"receive_chunk({chunk_id})"), size)
            return
        if self._closed:
            self._inflight = (chunk_id, raw)
            self._abort_inflight()
            return
        try:
            # The body goes into the handle's view; the handle itself is what goes back.
            buf = raw.view
            ok = isinstance(buf, memoryview) and not buf.readonly and buf.nbytes == size
            ok = ok and buf.format == "B" and buf.ndim == 1
        except AttributeError:  # not a BodyBuffer
            ok = False
        if not ok:
            log.error("peer handler receive_chunk(%s) gave an unusable buffer", chunk_id)
            self._inflight = (chunk_id, raw)
            self._abort_inflight()
            self._early_refusal(error_header("internal", "no usable buffer"), size)
            return
        self._inflight = (chunk_id, raw)
        self._mark = self._loop.time()
        self._begin_body(buf)
        if self._mode == BODY:
            self._resume_reading()

    def _early_refusal(self, reply: Header, size: int) -> None:
        if self._closed:
            return
        self._resume_reading()
        self._mark = self._loop.time()
        self._refuse(reply, size)

    def _on_call(self, header: Header) -> None:
        size = length_field(header, "body")
        if size is None:
            self._protocol_error("call with a bad body length")
            return
        method, args = header.get("method"), header.get("args", {})
        if not isinstance(method, str) or not isinstance(args, dict):
            self._refuse(error_header("bad_request", "call needs a method and args map"), size)
            return
        if size > self._server.max_call_body:
            self._refuse(
                error_header(
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
            self._dispatch(None)

    def _body_complete(self, body: memoryview) -> None:
        self._dispatch(body)

    def _dispatch(self, body: memoryview | None) -> None:
        """The request is whole: run the handler, reading paused meanwhile."""
        self._mode = HOLD
        self._pause_reading()
        if self._kind == "put":
            assert body is not None and self._inflight is not None
            _, lent = self._inflight
            self._inflight = None  # the handler owns the buffer from here on
            self.task = self._loop.create_task(self._finish_put(self._put_id, lent, self._put_crc))
        else:
            self.task = self._loop.create_task(self._run_call(self._method, self._args, body))

    async def _finish_put(self, chunk_id: str, buf: BodyBuffer, crc: int | None) -> None:
        handler = self._server.handler
        if self._put_ack:
            handler.ack_copy(chunk_id)
        try:
            if crc is None:
                result = await handler.chunk_received(chunk_id, buf)
            else:
                result = await handler.chunk_received_crc(chunk_id, buf, crc)
            reply: Header = {"ok": True, "result": result}
        except Exception as exc:
            reply = _failed(exc, f"chunk_received({chunk_id})")
        self._reply(reply, None)

    async def _run_call(self, method: str, args: dict[str, Any], body: memoryview | None) -> None:
        out: memoryview | None = None
        try:
            result, out_body = await self._server.handler.call(method, args, body)
            if not isinstance(result, dict):
                raise TypeError(f"call({method!r}) returned a {type(result).__name__}, not a dict")
            reply: Header = {"ok": True, "result": result}
            if out_body is not None:
                out = byte_view(out_body)
                if out.nbytes:
                    reply["body"] = out.nbytes
                else:
                    out = None
        except Exception as exc:
            reply = _failed(exc, f"call({method!r})")
        self._reply(reply, out)

    def _reply(self, reply: Header, body: memoryview | None) -> None:
        if self._closed:
            return
        try:
            frame = encode_frame(reply)
        except Exception as exc:  # the handler's result does not pack, or is too big
            log.error("peer reply does not encode: %r", exc)
            frame, body = encode_frame(error_header("internal", f"bad reply: {exc!r}")), None
        assert self._transport is not None
        self._transport.write(frame)
        if body is not None:
            self._transport.write(body)
        self._request_done()

    def _request_done(self) -> None:
        self.task = None
        self._mode = HEAD
        self._mark = self._loop.time()
        if not self._write_paused:
            self._continue()

    def _continue(self) -> None:
        """Serve what is already buffered, then read more."""
        self._parse()
        if self._mode != HOLD and not self._write_paused:
            self._resume_reading()
