"""Chunk GETs read straight into the caller's buffer: plain HTTP/1.1 over asyncio.

Why not aiohttp for these: its parser copies every received piece into a new
``bytes`` (``readany()`` may join several, another copy) and the client then
copies that into the destination; reading with aiohttp costs about 3x the CPU per
byte of a raw ``asyncio.BufferedProtocol`` here (docs/BENCHMARKS.md, "Peer
protocol"). This path reads a response's status line and headers into a small
scratch buffer and its body with ``get_buffer`` handing out the destination
memoryview itself: one copy, kernel to destination. Only the body bytes that
arrived in the same read as the headers (at most ``_HEAD_READ``) are copied out
of scratch. The receive machine is ``storaged.transport.BodyProtocol``, the one the
peer protocol runs on; what is here is HTTP.

It speaks only what a storaged chunk GET needs: HTTP/1.1 ``GET``, keep-alive, and
a response with a ``Content-Length``. A response it does not read (chunked
transfer encoding, no length, a status other than 200, 206 or >= 400) raises
``NotHandled`` before any body byte is consumed; its connection is closed and the
caller repeats the request through aiohttp. https is never sent here.

Failures: a connection lost or reset before the response ended raises
``ConnectionError`` (an ``OSError``), a connect or read stall past its timeout
``TimeoutError``, a malformed response head, or a body longer than its
``Content-Length`` when the extra bytes come with the head, ``ProtocolError``.
A connection is pooled again only when its response was read to its end and
neither side asked to close it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from storaged.client.deadlines import Progress, attempt_progress
from storaged.client.errors import ProtocolError
from storaged.transport import HEAD, HOLD, BodyProtocol, IdlePool

__all__ = ["MAX_ERROR_BODY", "MAX_HEAD", "BodyPlan", "DirectGets", "NotHandled", "ResponseHead"]

#: Largest response head (status line and headers) accepted.
MAX_HEAD: Final = 16 * 1024
#: Largest error body (status >= 400) read; error documents are a few hundred bytes.
MAX_ERROR_BODY: Final = 1 << 20
# Head reads ask for this much at a time: the head and the first body bytes behind it
# arrive in one read, and only those few body bytes are copied out of scratch.
_HEAD_READ = 4096

#: (host, port)
Addr = tuple[str, int]


class NotHandled(Exception):
    """This path does not read that response (or that URL): do the request with aiohttp.

    No byte of the body was consumed and nothing was written to the destination.
    """


class _StaleConnection(ConnectionResetError):
    """The connection closed before any byte of the response came back."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    #: Header names in lower case; a repeated header keeps its last value.
    headers: Mapping[str, str]
    content_length: int
    #: False when the server asked to close the connection after this response.
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class BodyPlan:
    """Where a 200/206 body goes: ``skip`` bytes dropped, then ``len(dest)`` bytes into
    ``dest``; body bytes past those are dropped and the connection is not reused."""

    dest: memoryview
    skip: int = 0


#: Called with the head of a 200 or 206 response, before any body byte is read. It may
#: raise (the exception is the request's; the connection is closed).
Planner = Callable[[ResponseHead], BodyPlan]
Result = tuple[ResponseHead, memoryview]


@dataclass(slots=True)
class DirectStats:
    """Counters of one ``DirectGets`` (one event loop, not thread-safe)."""

    #: connections opened
    connections: int = 0
    #: requests sent on a pooled (kept-alive) connection
    reused: int = 0
    requests: int = 0
    #: requests sent again on a new connection after a pooled one turned out closed
    stale_retries: int = 0
    #: requests per "host:port"
    by_addr: dict[str, int] = field(default_factory=dict)


def parse_head(raw: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, lower-cased headers, keep-alive) of a response head without its blank line.

    ``ProtocolError`` for anything that is not an HTTP/1.x response head.
    """
    try:
        text = raw.decode("latin-1")
        status_line, *lines = text.split("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        well_formed = code.isdigit() and rest[3:4] in ("", " ")
        if version not in ("HTTP/1.1", "HTTP/1.0") or not well_formed:
            raise ValueError(f"bad status line {status_line[:80]!r}")
        headers: dict[str, str] = {}
        for line in lines:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip() or " " in name:
                raise ValueError(f"bad header line {line[:80]!r}")
            key = name.lower()
            value = value.strip()
            if key == "content-length" and key in headers and headers[key] != value:
                raise ValueError("conflicting Content-Length headers")
            headers[key] = value
    except ValueError as exc:
        raise ProtocolError(message=f"malformed response head: {exc}") from None
    connection = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
    return int(code), headers, keep_alive


class _GetConnection(BodyProtocol):
    """One HTTP/1.1 connection, one request at a time: a response's head parsed out of the
    core's scratch, its body read into the caller's buffer (``storaged.transport``)."""

    def __init__(self, addr: Addr, read_timeout: float) -> None:
        # No request outstanding (HOLD): any byte that arrives is a protocol violation.
        super().__init__(MAX_HEAD + _HEAD_READ, _HEAD_READ, HOLD)
        self.addr = addr
        self._read_timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self._scanned = 0  # scratch[:_scanned] holds no end of head
        self._reusable = False
        self._waiter: asyncio.Future[Result] | None = None
        self._planner: Planner | None = None
        self._head: ResponseHead | None = None
        self._tail = 0  # body bytes past the destination: dropped by closing
        self._last_rx = 0.0
        self._progress: Progress | None = None  # the attempt's, while a request runs
        self._stall: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.on_lost: Callable[[_GetConnection], None] | None = None

    # -- asyncio callbacks ---------------------------------------------------------------------

    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = self._loop.time()
        if self._progress is not None:
            self._progress.last = time.monotonic()
        super().buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost tells the waiter

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._reusable = False
        self._cancel_stall()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            reason = f": {exc}" if exc is not None else ""
            if self._mode == HEAD and self._rx == 0:
                error: ConnectionError = _StaleConnection(
                    f"{_fmt(self.addr)} closed the connection before answering{reason}"
                )
            else:
                error = ConnectionResetError(
                    f"{_fmt(self.addr)} closed the connection after {self._rx} bytes "
                    f"of the response{reason}"
                )
            self._fail(error)
        self._body = None
        self._mode = HOLD
        if self.on_lost is not None:
            self.on_lost(self)

    def _on_held_bytes(self) -> None:
        # Bytes nobody asked for: the previous response was longer than it said.
        self.abort()

    # -- the request ---------------------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        """The last response was read to its end and the connection may carry another."""
        return self._reusable and not self._closed and self._mode == HOLD

    async def exchange(self, request: bytes, planner: Planner) -> Result:
        """Send ``request``; return the head and the body (the plan's ``dest`` for 200/206,
        a new buffer for status >= 400) once the body is in place."""
        if self._closed or self._transport is None:
            raise _StaleConnection(f"{_fmt(self.addr)}: connection closed")
        waiter: asyncio.Future[Result] = self._loop.create_future()
        self._waiter = waiter
        self._planner = planner
        self._head = None
        self._reusable = False
        self._progress = attempt_progress()
        self._mode = HEAD
        self._sbeg = self._send = self._scanned = self._rx = 0
        self._last_rx = self._loop.time()
        self._stall = self._loop.call_at(self._last_rx + self._read_timeout, self._check_stall)
        try:
            self._transport.write(request)
            return await waiter
        except BaseException:
            # Cancelled or failed: no later read may write into the caller's buffer.
            self.abort()
            raise
        finally:
            self._waiter = None
            self._planner = None
            self._progress = None

    def abort(self) -> None:
        """Drop the connection at once; a pending request fails with ``ConnectionResetError``."""
        self._reusable = False
        self._body = None
        self._mode = HOLD
        self._cancel_stall()
        super().abort()

    # -- parsing -------------------------------------------------------------------------------

    def _on_head_bytes(self) -> None:
        # A response's head starts at the front of scratch (``exchange`` empties it).
        end = self._scratch.find(b"\r\n\r\n", max(0, self._scanned - 3), self._send)
        if end < 0:
            self._scanned = self._send
            if self._send >= MAX_HEAD:
                self._fail(ProtocolError(message=f"response head over {MAX_HEAD} bytes"))
            return
        try:
            status, headers, keep_alive = parse_head(bytes(self._smv[:end]))
            length = self._content_length(headers)
            head = ResponseHead(status, headers, length, keep_alive)
            if status >= 400:
                if length > MAX_ERROR_BODY:
                    raise ProtocolError(message=f"error body of {length} bytes", status=status)
                plan = BodyPlan(memoryview(bytearray(length)))
            elif status in (200, 206):
                assert self._planner is not None
                plan = self._planner(head)
                if plan.skip < 0 or plan.skip + len(plan.dest) > length:
                    raise ProtocolError(message="body plan outside the response", status=status)
            else:
                raise NotHandled(f"status {status}")
        except Exception as exc:  # the planner's errors (ValueError, ...) are the request's
            self._fail(exc)
            return
        self._head = head
        self._sbeg = end + 4
        if self._send - self._sbeg > length:
            self._fail(ProtocolError(message=f"response longer than its Content-Length {length}"))
            return
        self._tail = length - plan.skip - len(plan.dest)
        self._begin_body(plan.dest, plan.skip)

    @staticmethod
    def _content_length(headers: Mapping[str, str]) -> int:
        if "transfer-encoding" in headers:
            raise NotHandled("transfer-encoding")
        value = headers.get("content-length")
        if value is None:
            raise NotHandled("no Content-Length")
        if not value.isdigit():  # also refuses signs and spaces
            raise ProtocolError(message=f"bad Content-Length {value[:40]!r}")
        return int(value)

    def _body_complete(self, body: memoryview) -> None:
        head = self._head
        assert head is not None
        # Body bytes past the destination that came with the head are dropped with the
        # connection (``_tail``): it is not reused.
        self._sbeg = self._send = self._scanned = 0
        self._cancel_stall()
        self._reusable = head.keep_alive and self._tail == 0
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((head, body))

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        self.abort()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _check_stall(self) -> None:
        self._stall = None
        if self._waiter is None or self._waiter.done():
            return
        late = self._last_rx + self._read_timeout
        if self._loop.time() >= late:
            self._fail(
                TimeoutError(f"{_fmt(self.addr)}: no response bytes for {self._read_timeout} s")
            )
        else:
            self._stall = self._loop.call_at(late, self._check_stall)

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None


def _fmt(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


class DirectGets:
    """Keep-alive HTTP/1.1 connections per node address, for chunk GETs.

    At most ``pool_size`` idle connections are kept per address; one idle for
    ``idle_timeout`` seconds is closed. ``connect_timeout`` bounds each connect,
    ``read_timeout`` each wait for response bytes. A pooled connection that the server
    closed before answering is replaced by a new one once, as aiohttp does.
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        pool_size: int = 16,
        idle_timeout: float = 10.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_size = pool_size
        self.idle_timeout = idle_timeout
        self.stats = DirectStats()
        self._idle: IdlePool[_GetConnection] = IdlePool()
        self._conns: set[_GetConnection] = set()
        self._closed = False

    async def get(self, addr: Addr, request: bytes, planner: Planner) -> Result:
        """Send ``request`` (a whole GET head) to ``addr``; see ``_GetConnection.exchange``."""
        if self._closed:
            raise RuntimeError("DirectGets is closed")
        fresh = False
        while True:
            conn, reused = await self._acquire(addr, fresh)
            self.stats.requests += 1
            self.stats.reused += reused
            key = _fmt(addr)
            self.stats.by_addr[key] = self.stats.by_addr.get(key, 0) + 1
            try:
                result = await conn.exchange(request, planner)
            except _StaleConnection:
                self._discard(conn)
                if reused and not fresh:
                    self.stats.stale_retries += 1
                    fresh = True
                    continue
                raise
            except BaseException:
                self._discard(conn)
                raise
            self._release(conn)
            return result

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports deliver connection_lost

    # -- pool ----------------------------------------------------------------------------------

    async def _acquire(self, addr: Addr, fresh: bool) -> tuple[_GetConnection, bool]:
        while not fresh and (conn := self._idle.take(addr)) is not None:
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            if conn.reusable and not conn.readable():
                return conn, True
            self._discard(conn)
        return await self._connect(addr), False

    def _release(self, conn: _GetConnection) -> None:
        if self._closed or not conn.reusable or not self._idle.keep(conn, self.pool_size):
            self._discard(conn)
            return
        conn.idle_timer = asyncio.get_running_loop().call_later(
            self.idle_timeout, self._discard, conn
        )

    def _discard(self, conn: _GetConnection) -> None:
        conn.abort()
        self._forget(conn)

    def _forget(self, conn: _GetConnection) -> None:
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        self._conns.discard(conn)
        self._idle.forget(conn)

    async def _connect(self, addr: Addr) -> _GetConnection:
        loop = asyncio.get_running_loop()
        host, port = addr
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                lambda: _GetConnection(addr, self.read_timeout), host, port
            )
        self.stats.connections += 1
        if self._closed:
            conn.abort()
            raise RuntimeError("DirectGets is closed")
        conn.on_lost = self._forget
        self._conns.add(conn)
        return conn
