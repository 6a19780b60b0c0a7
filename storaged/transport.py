"""The one receive and send core of storaged's raw transports over asyncio.

Both the peer protocol (``storaged.peer``: length-prefixed msgpack frames between nodes)
and the client's direct chunk GETs (``storaged.client.direct``: HTTP/1.1 responses) are a
``BodyProtocol``: what differs between them is only how a message's head is parsed and
what a finished body means, the subclass's hooks.

Receiving: a message's head is read into a small scratch buffer; its body is read with
``get_buffer`` handing out the destination's memoryview itself, so a body costs one copy,
kernel to destination. Only the body bytes that arrived in the same read as their head
(a few KiB) are copied out of scratch. A body may be preceded by bytes to drop, and a
body nobody wants is read over the start of scratch and dropped. One read takes at most
``MAX_READ`` bytes: it bounds how long a callback holds the loop while other connections
wait.

Sending: the transport's ``pause_writing`` and ``resume_writing`` are tracked, and
``drain`` waits while the transport holds more than its high-water mark (uvloop sends from
the caller's memory; plain asyncio copies what the socket did not take at once).

Keep-alive: ``IdlePool``, the idle connections of a client by address (the peer client's
and the direct GETs'; each decides itself when one is too old to reuse).

A leaf: it imports nothing of the project, so the client can use it without loading the
peer protocol, and the peer protocol without loading the client.
"""

from __future__ import annotations

import asyncio
import select
from typing import Final, Generic, Protocol, TypeVar, cast

__all__ = ["BODY", "DISCARD", "HEAD", "HOLD", "MAX_READ", "BodyProtocol", "IdlePool"]

#: One read copies at most this much out of the kernel.
MAX_READ: Final = 1 << 20

# Receive modes.
#: Bytes go to scratch and ``_on_head_bytes`` parses what it can.
HEAD: Final = 0
#: Bytes go straight into the destination buffer ``_begin_body`` was given.
BODY: Final = 1
#: Bytes are read over the start of scratch and dropped.
DISCARD: Final = 2
#: Nothing is parsed: bytes go to scratch and ``_on_held_bytes`` is told (a server while
#: its handler runs, reading paused; a client with no request outstanding).
HOLD: Final = 3


class BodyProtocol(asyncio.BufferedProtocol):
    """A connection that reads heads into scratch and bodies into the caller's buffers.

    Unparsed head bytes are ``scratch[_sbeg:_send]``: a subclass's ``_on_head_bytes``
    consumes a head by moving ``_sbeg`` past it, then either starts a body
    (``_begin_body``, ``_begin_discard``) or leaves the mode at ``HEAD``.
    """

    def __init__(self, scratch_size: int, head_read: int, mode: int = HEAD) -> None:
        self._scratch = bytearray(scratch_size)
        self._smv = memoryview(self._scratch)
        self._sbeg = 0
        self._send = 0
        self._head_read = head_read
        self._mode = mode
        self._body: memoryview | None = None
        self._pos = 0
        self._discard_left = 0
        self._rx = 0  # bytes received so far: progress for the stall timers
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        mode = self._mode
        if mode == BODY:
            assert self._body is not None
            return self._body[self._pos : self._pos + MAX_READ]
        if mode == DISCARD:
            return self._smv[: min(self._discard_left, len(self._scratch))]
        avail = self._send - self._sbeg
        capacity = len(self._scratch)
        want = self._head_want(avail)
        if capacity - self._send < want and self._sbeg:
            # Move the partial head to the front: at most one head's worth of bytes.
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
        if mode == BODY:
            self._pos += nbytes
            assert self._body is not None
            if self._pos == len(self._body):
                self._finish_body()
        elif mode == DISCARD:
            self._discard_left -= nbytes
            if self._discard_left == 0:
                self._finish_discard()
        else:
            self._send += nbytes
            if mode == HEAD:
                self._on_head_bytes()
            else:
                self._on_held_bytes()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wake_drain()

    # -- hooks ---------------------------------------------------------------------------------

    def _head_want(self, avail: int) -> int:
        """How many bytes a head read asks for, ``avail`` unparsed ones in scratch."""
        return self._head_read

    def _on_head_bytes(self) -> None:
        """Bytes were added to scratch in ``HEAD`` mode: parse what is complete."""
        raise NotImplementedError

    def _on_held_bytes(self) -> None:
        """Bytes were added to scratch in ``HOLD`` mode; by default they wait there."""
        return None

    def _body_complete(self, body: memoryview) -> None:
        """The whole body is in ``body``; the mode is ``HOLD`` until this sets another."""
        raise NotImplementedError

    def _discard_done(self) -> None:
        """A ``_begin_discard`` ended; the mode is ``HEAD`` again."""
        raise NotImplementedError

    # -- receiving -----------------------------------------------------------------------------

    def _begin_body(self, dest: memoryview, skip: int = 0) -> None:
        """Drop the next ``skip`` bytes, receive the ``len(dest)`` after them into ``dest``,
        then call ``_body_complete(dest)``. Unparsed bytes in scratch come first."""
        avail = self._send - self._sbeg
        dropped = min(avail, skip)
        self._sbeg += dropped
        take = min(avail - dropped, len(dest))
        if take:
            # Deliberate copy: the body bytes that arrived in the head's read.
            dest[:take] = self._smv[self._sbeg : self._sbeg + take]
            self._sbeg += take
        self._body = dest
        self._pos = take
        if dropped < skip:
            # Scratch is empty now: dropped bytes are read over its start.
            self._sbeg = self._send = 0
            self._discard_left = skip - dropped
            self._mode = DISCARD
        elif take < len(dest):
            self._mode = BODY
        else:
            self._finish_body()

    def _begin_discard(self, size: int) -> None:
        """Skip the next ``size`` bytes, then call ``_discard_done``."""
        self._body = None
        take = min(self._send - self._sbeg, size)
        self._sbeg += take
        if take == size:
            self._mode = HEAD
            self._discard_done()
            return
        # Scratch is empty now: discarded bytes are read over its start.
        self._sbeg = self._send = 0
        self._discard_left = size - take
        self._mode = DISCARD

    def _finish_body(self) -> None:
        body, self._body = self._body, None
        assert body is not None
        self._mode = HOLD
        self._body_complete(body)

    def _finish_discard(self) -> None:
        if self._body is not None:  # the bytes in front of a body
            if self._pos < len(self._body):
                self._mode = BODY
            else:
                self._finish_body()
            return
        self._mode = HEAD
        self._discard_done()

    def _grow_scratch(self, size: int) -> None:
        """Make scratch hold at least ``size`` bytes, keeping the unparsed ones."""
        if size > len(self._scratch):
            avail = self._send - self._sbeg
            scratch = bytearray(size)
            scratch[:avail] = self._smv[self._sbeg : self._send]
            self._scratch, self._smv = scratch, memoryview(scratch)
            self._sbeg, self._send = 0, avail

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = False
            self._transport.resume_reading()

    # -- sending -------------------------------------------------------------------------------

    def _drain_over(self) -> bool:
        """Whether ``drain`` may stop waiting before the transport empties; by default never."""
        return False

    async def drain(self) -> None:
        """Wait until the transport is below its low-water mark or closed (or the subclass's
        ``_drain_over``)."""
        while self._write_paused and not self._closed:
            if self._drain_over():
                return
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiter = waiter
            await waiter

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the connection ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def readable(self) -> bool:
        """Whether bytes or an EOF wait unread: on an idle connection, the other end closed it.

        The loop learns of a close one iteration late; this asks the kernel, so a pooled
        connection the other end just closed is not handed out.
        """
        if self._transport is None or not hasattr(select, "poll"):
            return False
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def abort(self) -> None:
        """Drop the connection at once (unsent bytes are lost)."""
        if self._transport is not None:
            self._transport.abort()
        self._closed = True


class _Pooled(Protocol):
    @property
    def addr(self) -> tuple[str, int]: ...


_C = TypeVar("_C", bound=_Pooled)


class IdlePool(Generic[_C]):
    """A client's idle keep-alive connections, by the address each is connected to.

    ``take`` hands out the most recently used one (the likeliest to be alive), ``keep``
    refuses a connection beyond ``limit`` idle ones for its address, ``forget`` removes
    one wherever it is (closed meanwhile). It only holds them: whether one is still fit to
    reuse, and closing them, are the client's."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_C]] = {}

    def take(self, addr: tuple[str, int]) -> _C | None:
        idle = self._idle.get(addr)
        return idle.pop() if idle else None

    def keep(self, conn: _C, limit: int) -> bool:
        """Hold ``conn`` idle; False (not held) when its address has ``limit`` already."""
        idle = self._idle.setdefault(conn.addr, [])
        if len(idle) >= limit:
            return False
        idle.append(conn)
        return True

    def forget(self, conn: _C) -> None:
        idle = self._idle.get(conn.addr)
        if idle and conn in idle:
            idle.remove(conn)

    def clear(self) -> None:
        self._idle.clear()
