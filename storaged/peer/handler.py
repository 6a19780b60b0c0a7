"""What a ``PeerServer`` calls: the ``PeerHandler`` interface, implemented by the node
(memory tier, index) and by the tests' handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from storaged.peer.wire import PeerError
from storaged.wire import BytesLike

__all__ = ["PeerHandler"]


class PeerHandler(ABC):
    """What a ``PeerServer`` calls; implemented by the node (memory tier, index).

    Buffer ownership: the buffer returned by ``receive_chunk`` is handed back (the very
    memoryview object returned, so a handler may know it by identity) through exactly
    one of ``chunk_received`` (the whole body arrived; the
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
