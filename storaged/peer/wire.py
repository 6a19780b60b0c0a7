"""The peer protocol's wire format: frames, the header codec, the proofs of the handshake,
and the errors a peer answers with.

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
"""

from __future__ import annotations

import hashlib
import hmac
import ssl as ssl_module
import struct
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Final

import msgpack

from storaged.wire import BytesLike

__all__ = [
    "CLIENT_LABEL",
    "MAX_BODY",
    "MAX_CHUNK_ID_LEN",
    "MAX_HEADER",
    "MAX_NODE_ID_LEN",
    "MAX_PREAUTH_HEADER",
    "MIN_HEADER_READ",
    "NONCE_LEN",
    "PREFIX",
    "PROTOCOL_VERSION",
    "SERVER_LABEL",
    "Addr",
    "Header",
    "PeerError",
    "PeerUnavailable",
    "Reply",
    "byte_view",
    "decode_header",
    "encode_frame",
    "error_from_reply",
    "error_header",
    "fmt",
    "handshake_proof",
    "length_field",
]

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

#: The frame's length prefix.
PREFIX: Final = struct.Struct("!I")
#: Header reads ask for at least this much: a put header and the first body bytes
#: behind it arrive in one read, and the few body bytes are copied out of scratch.
MIN_HEADER_READ: Final = 4096
SERVER_LABEL: Final = "storaged-peer/1 server"
CLIENT_LABEL: Final = "storaged-peer/1 client"

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


@dataclass(eq=False, repr=False)
class PeerEnd:
    """What either end of the protocol is made with: this node's id, the cluster secret
    both ends prove in the handshake (never empty), TLS, and ``io_timeout``, the seconds a
    frame may stall part-way (sent or received)."""

    node_id: str
    secret: bytes
    _: KW_ONLY
    ssl: ssl_module.SSLContext | None = None
    io_timeout: float = 30

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("the cluster secret must not be empty")


def handshake_proof(
    secret: bytes, label: str, cn: bytes, sn: bytes, client: str, server: str
) -> bytes:
    """One side's proof of the secret over both nonces and both node ids (see above)."""
    transcript = msgpack.packb([label, cn, sn, client, server])
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def encode_frame(header: Mapping[str, Any]) -> bytes:
    """The frame of ``header`` (length prefix and msgpack); ``too_large`` past ``MAX_HEADER``."""
    payload: bytes = msgpack.packb(header)
    if len(payload) > MAX_HEADER:
        raise PeerError("too_large", f"peer header of {len(payload)} bytes (max {MAX_HEADER})")
    return PREFIX.pack(len(payload)) + payload


def decode_header(data: memoryview) -> Header:
    """The header map of a frame's payload; msgpack's errors or ``ValueError`` if it is not one."""
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


def byte_view(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of ``data`` (no copy); non-contiguous data is refused."""
    mv = data if type(data) is memoryview else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def length_field(header: Header, key: str) -> int | None:
    """A body length from the header: 0 when absent, None when invalid."""
    value = header.get(key, 0)
    if type(value) is not int or not 0 <= value <= MAX_BODY:
        return None
    return value


def error_from_reply(header: Header) -> PeerError:
    """The ``PeerError`` a refusal stands for (``internal`` when it names no code)."""
    code = header.get("error")
    message = header.get("message")
    return PeerError(
        code if isinstance(code, str) else "internal",
        message if isinstance(message, str) else "peer refused the request",
    )


def error_header(code: str, message: str) -> Header:
    """The header of a refusal."""
    return {"ok": False, "error": code, "message": message}


def fmt(addr: Addr) -> str:
    """``host:port``, for messages."""
    return f"{addr[0]}:{addr[1]}"
