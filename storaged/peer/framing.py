"""Frames on a ``storaged.transport.BodyProtocol``: what both ends of a peer connection
share. A header frame is parsed out of scratch; a body goes straight into the buffer its
user names (a put's body into the memory tier's preallocated buffer), so only the body
bytes that arrived in the same read as their header (at most 4 KiB) are copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from storaged.peer.wire import MIN_HEADER_READ, PREFIX, Header, decode_header, encode_frame
from storaged.transport import HEAD, BodyProtocol

__all__ = ["FramedProtocol"]


class FramedProtocol(BodyProtocol):
    """Frame reader and writer; a subclass handles each header in ``_on_header``."""

    def __init__(self, max_header: int) -> None:
        super().__init__(PREFIX.size + max_header + MIN_HEADER_READ, MIN_HEADER_READ)
        self._max_header = max_header
        self._parsing = False

    def _head_want(self, avail: int) -> int:
        want = MIN_HEADER_READ
        if avail >= PREFIX.size:
            # The rest of a large header comes in one read.
            (hlen,) = PREFIX.unpack_from(self._scratch, self._sbeg)
            want = max(want, min(hlen + PREFIX.size - avail, len(self._scratch)))
        return want

    def _on_head_bytes(self) -> None:
        self._parse()

    def _parse(self) -> None:
        """Handle every complete frame in scratch while the mode stays ``HEAD``.

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
        while self._mode == HEAD and not self._closed and self._accepting():
            avail = self._send - self._sbeg
            if avail < PREFIX.size:
                break
            (hlen,) = PREFIX.unpack_from(self._scratch, self._sbeg)
            if hlen == 0 or hlen > self._max_header:
                self._protocol_error(f"header length {hlen} (max {self._max_header})")
                return
            if avail < PREFIX.size + hlen:
                break
            start = self._sbeg + PREFIX.size
            try:
                header = decode_header(self._smv[start : start + hlen])
            except Exception as exc:  # msgpack raises several unrelated types
                self._protocol_error(f"malformed header: {exc!r}")
                return
            self._sbeg = start + hlen
            self._on_header(header)

    def _set_max_header(self, max_header: int) -> None:
        """Accept headers up to ``max_header`` bytes from now on (grows the scratch buffer)."""
        self._max_header = max_header
        self._grow_scratch(PREFIX.size + max_header + MIN_HEADER_READ)

    def _on_header(self, header: Header) -> None:
        raise NotImplementedError

    def _protocol_error(self, reason: str) -> None:
        raise NotImplementedError

    def _send_frame(self, header: Mapping[str, Any]) -> None:
        frame = encode_frame(header)
        if self._transport is not None and not self._closed:
            self._transport.write(frame)
