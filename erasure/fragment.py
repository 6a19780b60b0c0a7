"""The fragment format: a versioned, self-describing, checksummed header, then the payload.

Layout, version 1 (little-endian, ``HEADER_SIZE`` = 80 bytes, then ``payload_size`` bytes)::

    offset size field
         0    4 magic          b"SDFR" (storaged fragment)
         4    1 version        1
         5    1 flags          0 (reserved: readers reject anything else)
         6    2 header_size    80 (lets a later version grow the header)
         8    8 codec          ASCII name, NUL-padded ("zfec", "isal")
        16    2 k              fragments needed to rebuild
        18    2 n              fragments made
        20    2 index          0 <= index < n
        22    2 reserved       0
        24    8 length         the original chunk's length in bytes
        32    8 payload_size   bytes of payload after the header
        40   32 chunk_id       raw BLAKE3-256 digest of the original chunk
        72    4 payload_crc    CRC-32C of the payload
        76    4 header_crc     CRC-32C of bytes 0..75

The header is packed with ``struct`` (never pickle) and checked as a whole: a flipped
bit anywhere in a fragment (header or payload) makes ``parse_fragment`` raise
``CorruptFragment`` with the reason.

Copies: ``build_fragment`` keeps a *view* of the payload it is given, and a ``Fragment``
is a small header plus that view. ``Fragment.parts()`` hands both to ``os.writev``
without joining them; ``Fragment.to_bytes()`` joins them (one copy) for callers that
truly need one buffer. ``parse_fragment`` slices the buffer it is given without copying.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field, fields

import crc32c

from erasure.errors import BytesLike, CorruptFragment, InvalidParameters, check_parameters

MAGIC = b"SDFR"
VERSION = 1
HEADER_SIZE = 80

# Everything before the header checksum, then the header checksum itself.
_BODY = struct.Struct("<4sBBH8sHHHHQQ32sI")
_HEADER_CRC = struct.Struct("<I")
assert _BODY.size + _HEADER_CRC.size == HEADER_SIZE

_CODEC_NAME_RE = re.compile(r"^[a-z0-9_]{1,8}$")
_CHUNK_ID_RE = re.compile(r"^[0-9a-f]{64}$")


def _crc(data: BytesLike) -> int:
    return int(crc32c.crc32c(data))


def payload_crc(data: BytesLike) -> int:
    """The CRC-32C a fragment header records for ``data`` (releases the GIL on large data)."""
    return _crc(data)


@dataclass(frozen=True, slots=True)
class _FragmentFields:
    """The fields a fragment and its header share: the code it was made by, its place in
    it, and the chunk it is of."""

    codec: str
    k: int
    n: int
    index: int
    #: length of the original chunk in bytes (decoders strip padding to this)
    length: int
    #: lowercase hex BLAKE3-256 of the original chunk
    chunk_id: str


_SHARED = tuple(f.name for f in fields(_FragmentFields))


@dataclass(frozen=True, slots=True)
class FragmentHeader(_FragmentFields):
    """What a fragment's header says, already checked (magic, version, header checksum)."""

    payload_size: int
    payload_crc: int
    version: int

    def pack(self) -> bytes:
        """The ``HEADER_SIZE`` header bytes, header checksum included."""
        body = _BODY.pack(
            MAGIC,
            self.version,
            0,
            HEADER_SIZE,
            self.codec.encode("ascii"),
            self.k,
            self.n,
            self.index,
            0,
            self.length,
            self.payload_size,
            bytes.fromhex(self.chunk_id),
            self.payload_crc,
        )
        return body + _HEADER_CRC.pack(_crc(body))

    def fragment(self, payload: memoryview, header: bytes) -> Fragment:
        """The fragment this header describes: ``header`` its packed bytes, ``payload`` a
        view of the bytes after them (kept, not copied)."""
        shared = {name: getattr(self, name) for name in _SHARED}
        return Fragment(
            **shared,
            payload=payload,
            payload_crc=self.payload_crc,
            version=self.version,
            header=header,
        )


@dataclass(frozen=True)
class Fragment(_FragmentFields):
    """One fragment: its header fields, the packed header, and a view of its payload.

    ``payload`` is a ``memoryview`` of the buffer the fragment was built or parsed from:
    that buffer must stay unchanged while the fragment is in use.
    """

    payload: memoryview
    payload_crc: int
    version: int
    #: the packed header (``HEADER_SIZE`` bytes) that precedes the payload on disk or wire
    header: bytes = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Size of the serialized fragment (header + payload)."""
        return len(self.header) + self.payload.nbytes

    def __len__(self) -> int:
        return self.nbytes

    def parts(self) -> tuple[bytes, memoryview]:
        """``(header, payload)``, ready for ``os.writev`` or a scatter write: no copy."""
        return self.header, self.payload

    def to_bytes(self) -> bytes:
        """Header and payload joined into one ``bytes`` (a deliberate copy of the payload)."""
        return b"".join((self.header, self.payload))

    def verify(self) -> None:
        """Re-check the payload against its CRC-32C; raises ``CorruptFragment``."""
        if _crc(self.payload) != self.payload_crc:
            raise CorruptFragment(f"fragment {self.index}: payload checksum mismatch", self.index)


def build_fragment(
    *,
    codec: str,
    k: int,
    n: int,
    index: int,
    length: int,
    chunk_id: str,
    payload: BytesLike,
    payload_crc: int | None = None,
) -> Fragment:
    """A fragment for ``payload`` (kept as a view, not copied), its header and checksums computed.

    ``payload_crc`` skips computing the payload's CRC-32C when the caller already has it.
    Raises ``InvalidParameters`` for a bad codec name, k/n/index, length or chunk id.
    Tests use this to make valid (or deliberately inconsistent) fragments.
    """
    if not isinstance(codec, str) or not _CODEC_NAME_RE.fullmatch(codec):
        raise InvalidParameters(f"codec name must match [a-z0-9_]{{1,8}}, got {codec!r}")
    check_parameters(k, n)
    if not (isinstance(index, int) and 0 <= index < n):
        raise InvalidParameters(f"fragment index must satisfy 0 <= index < n={n}, got {index}")
    if not (isinstance(length, int) and 0 <= length < 2**64):
        raise InvalidParameters(f"chunk length must be a non-negative 64-bit integer, got {length}")
    if not isinstance(chunk_id, str) or not _CHUNK_ID_RE.fullmatch(chunk_id):
        raise InvalidParameters(f"chunk id must be 64 lowercase hex digits, got {chunk_id!r}")
    view = memoryview(payload).cast("B")
    info = FragmentHeader(
        codec=codec,
        k=k,
        n=n,
        index=index,
        length=length,
        chunk_id=chunk_id,
        payload_size=view.nbytes,
        payload_crc=_crc(view) if payload_crc is None else payload_crc,
        version=VERSION,
    )
    return info.fragment(view, info.pack())


def parse_header(buf: BytesLike) -> FragmentHeader:
    """Check and decode the header at the start of ``buf`` (the payload is not read).

    Raises ``CorruptFragment`` (truncated header, bad magic, unsupported version, header
    checksum mismatch, or fields out of range).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptFragment(f"truncated header: {view.nbytes} bytes, need {HEADER_SIZE}")
    head = view[:HEADER_SIZE]
    if head[:4] != MAGIC:
        raise CorruptFragment(f"bad magic {bytes(head[:4])!r}, expected {MAGIC!r}")
    (stored_crc,) = _HEADER_CRC.unpack_from(head, _BODY.size)
    if _crc(head[: _BODY.size]) != stored_crc:
        raise CorruptFragment("header checksum mismatch")
    (
        _magic,
        version,
        flags,
        header_size,
        raw_codec,
        k,
        n,
        index,
        reserved,
        length,
        payload_size,
        raw_id,
        payload_crc,
    ) = _BODY.unpack_from(head)
    # The checksum passed, so anything odd below was written that way: a newer or foreign writer.
    if version != VERSION:
        raise CorruptFragment(f"unsupported fragment version {version} (this reader: {VERSION})")
    if header_size != HEADER_SIZE or flags != 0 or reserved != 0:
        raise CorruptFragment(
            f"unsupported header layout (size {header_size}, flags {flags}, reserved {reserved})"
        )
    codec_bytes = raw_codec.rstrip(b"\0")
    try:
        codec = codec_bytes.decode("ascii")
    except UnicodeDecodeError:
        codec = ""
    if not _CODEC_NAME_RE.fullmatch(codec) or b"\0" in codec_bytes:
        raise CorruptFragment(f"bad codec name {raw_codec!r}")
    if not (1 <= k < n <= 256):
        raise CorruptFragment(f"bad erasure parameters k={k} n={n}")
    if index >= n:
        raise CorruptFragment(f"fragment index {index} out of range for n={n}")
    return FragmentHeader(
        codec=codec,
        k=k,
        n=n,
        index=index,
        length=length,
        chunk_id=raw_id.hex(),
        payload_size=payload_size,
        payload_crc=payload_crc,
        version=version,
    )


def parse_fragment(buf: BytesLike, *, verify_payload: bool = True) -> Fragment:
    """Check and split a whole fragment (header + payload) without copying the payload.

    Raises ``CorruptFragment`` with the reason: any header problem (see ``parse_header``),
    a payload shorter or longer than the header says, or (unless ``verify_payload`` is
    false) a payload checksum mismatch. ``Fragment.payload`` is a view into ``buf``.
    """
    info = parse_header(buf)
    view = memoryview(buf).cast("B")
    actual = view.nbytes - HEADER_SIZE
    if actual != info.payload_size:
        what = "truncated" if actual < info.payload_size else "trailing bytes after"
        raise CorruptFragment(
            f"fragment {info.index}: {what} payload ({actual} bytes, header says"
            f" {info.payload_size})",
            info.index,
        )
    payload = view[HEADER_SIZE:]
    if verify_payload and _crc(payload) != info.payload_crc:
        raise CorruptFragment(f"fragment {info.index}: payload checksum mismatch", info.index)
    # 80 bytes: a copy keeps the header hashable/immutable
    return info.fragment(payload, bytes(view[:HEADER_SIZE]))
