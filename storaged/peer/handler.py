"""What a ``PeerServer`` calls: the ``PeerHandler`` interface, implemented by the node
(memory tier, index) and by the tests' handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from storaged.peer.wire import PeerError
from storaged.wire import BytesLike

__all__ = ["BodyBuffer", "LentBuffer", "PeerHandler"]


class BodyBuffer(Protocol):
    """A buffer a handler lends for a put's body: the server reads into ``view``."""

    @property
    def view(self) -> memoryview: ...


@dataclass(frozen=True, eq=False, slots=True)
class LentBuffer:
    """The plainest ``BodyBuffer``: a view and nothing else to track it by (for handlers
    that lend memory of their own, such as the tests' and the load tests')."""

    view: memoryview


B = TypeVar("B", bound=BodyBuffer)


class PeerHandler(ABC, Generic[B]):
    """What a ``PeerServer`` calls; implemented by the node (memory tier, index).

    Buffer ownership: the handle returned by ``receive_chunk`` (a ``BodyBuffer``: the
    node's is the memory tier's ``Allocation``) is handed back, the very object returned,
    through exactly one of ``chunk_received`` (the whole body arrived in its ``view``; the
    handler owns the buffer from then on, whatever that call does or raises,
    even if it is cancelled by ``PeerServer.close``) or ``chunk_aborted`` (the
    connection dropped, stalled or the server closed first).
    """

    @abstractmethod
    async def receive_chunk(self, chunk_id: str, size: int) -> B:
        """Return the handle of a buffer for the body: its ``view`` a writable, contiguous
        memoryview of exactly ``size`` bytes.

        Raise ``PeerError`` to refuse (``memory_full``, ``too_large``,
        ``bad_chunk_id``, ...): the client is told at once and the body is skipped.
        It may wait (memory backpressure); the connection's reading is paused meanwhile.
        """

    @abstractmethod
    async def chunk_received(self, chunk_id: str, buf: B) -> dict[str, Any]:
        """The whole body is in ``buf.view``: verify and store it; the dict is the client's
        result.

        Raise ``PeerError`` (``checksum_mismatch``, ...) to refuse; the client gets the code.
        """

    async def chunk_received_crc(self, chunk_id: str, buf: B, crc32c: int) -> dict[str, Any]:
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
    def chunk_aborted(self, chunk_id: str, buf: B) -> None:
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
