"""The fragment format: round trips, zero-copy views, and every way a fragment can be bad."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from erasure import (
    HEADER_SIZE,
    BytesLike,
    CorruptFragment,
    Fragment,
    InvalidParameters,
    build_fragment,
    fragment_key,
    parse_fragment,
    parse_fragment_key,
    parse_header,
)
from erasure.fragment import MAGIC
from storaged.ids import chunk_id_of

CHUNK = b"the original chunk bytes"
CHUNK_ID = chunk_id_of(CHUNK)


def make(payload: BytesLike = b"payload bytes", **overrides: Any) -> Fragment:
    fields: dict[str, Any] = {
        "codec": "zfec",
        "k": 2,
        "n": 3,
        "index": 1,
        "length": len(CHUNK),
        "chunk_id": CHUNK_ID,
    }
    fields.update(overrides)
    return build_fragment(payload=payload, **fields)


def reheader(buf: bytes, **changes: int | bytes) -> bytes:
    """``buf`` with header fields changed and the header checksum recomputed (a fragment
    a foreign or future writer could have made, with a valid checksum)."""
    layout = struct.Struct("<4sBBH8sHHHHQQ32sI")
    names = [
        "magic",
        "version",
        "flags",
        "header_size",
        "codec",
        "k",
        "n",
        "index",
        "reserved",
        "length",
        "payload_size",
        "chunk_id",
        "payload_crc",
    ]
    values = dict(zip(names, layout.unpack_from(buf), strict=True))
    values.update(changes)
    body = layout.pack(*(values[name] for name in names))
    return body + struct.pack("<I", crc32c.crc32c(body)) + buf[HEADER_SIZE:]


def test_round_trip_keeps_every_field() -> None:
    frag = make(b"\x00\x01payload", index=2, n=5, k=3, codec="isal")
    parsed = parse_fragment(frag.to_bytes())
    assert parsed == frag
    assert (parsed.codec, parsed.k, parsed.n, parsed.index) == ("isal", 3, 5, 2)
    assert (parsed.length, parsed.chunk_id) == (len(CHUNK), CHUNK_ID)
    assert bytes(parsed.payload) == b"\x00\x01payload"
    assert parsed.nbytes == len(parsed) == HEADER_SIZE + 9
    assert parse_header(frag.to_bytes()).payload_size == 9


def test_build_keeps_a_view_and_parse_slices_without_copying() -> None:
    payload = bytearray(b"x" * 1000)
    frag = make(payload)
    assert frag.payload.obj is payload
    buf = frag.to_bytes()
    parsed = parse_fragment(buf)
    assert parsed.payload.obj is buf


def test_parts_suit_writev(tmp_path: Path) -> None:
    frag = make(os.urandom(4096))
    path = tmp_path / fragment_key(CHUNK_ID, frag.index)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        written = os.writev(fd, frag.parts())
    finally:
        os.close(fd)
    assert written == frag.nbytes
    assert parse_fragment(path.read_bytes()) == frag


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.integers(0, 3000))
def test_any_flipped_bit_is_detected(data: st.DataObject, size: int) -> None:
    buf = bytearray(make(os.urandom(size)).to_bytes())
    position = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(CorruptFragment):
        parse_fragment(buf)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:40], "truncated header"),
        (lambda b: b"", "truncated header"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:-1], "truncated payload"),
        (lambda b: b + b"!", "trailing bytes"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "header checksum mismatch"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0x80]), "payload checksum mismatch"),
        (lambda b: reheader(b, version=2), "unsupported fragment version 2"),
        (lambda b: reheader(b, flags=1), "unsupported header layout"),
        (lambda b: reheader(b, header_size=96), "unsupported header layout"),
        (lambda b: reheader(b, reserved=7), "unsupported header layout"),
        (lambda b: reheader(b, codec=b"ZF\xffEC"), "bad codec name"),
        (lambda b: reheader(b, codec=b"\0" * 8), "bad codec name"),
        (lambda b: reheader(b, k=3, n=3), "bad erasure parameters"),
        (lambda b: reheader(b, n=257), "bad erasure parameters"),
        (lambda b: reheader(b, index=3), "index 3 out of range"),
    ],
)
def test_bad_fragments_say_why(mutate: object, reason: str) -> None:
    buf = make(b"some payload").to_bytes()
    assert callable(mutate)
    with pytest.raises(CorruptFragment, match=reason):
        parse_fragment(mutate(buf))


def test_payload_error_carries_the_index_header_error_does_not() -> None:
    buf = bytearray(make(b"abc", index=2).to_bytes())
    buf[-1] ^= 1
    with pytest.raises(CorruptFragment) as payload_error:
        parse_fragment(buf)
    assert payload_error.value.index == 2
    buf[10] ^= 1
    with pytest.raises(CorruptFragment) as header_error:
        parse_fragment(buf)
    assert header_error.value.index is None


def test_verify_payload_false_reads_only_the_header_then_verify_catches_it() -> None:
    buf = bytearray(make(b"abc").to_bytes())
    buf[-1] ^= 1
    frag = parse_fragment(buf, verify_payload=False)
    with pytest.raises(CorruptFragment, match="payload checksum"):
        frag.verify()


def test_header_magic_is_first() -> None:
    assert make().to_bytes()[:4] == MAGIC
    assert len(make().header) == HEADER_SIZE


@pytest.mark.parametrize(
    "overrides",
    [
        {"codec": ""},
        {"codec": "Zfec"},
        {"codec": "muchtoolong"},
        {"k": 0},
        {"k": 3, "n": 3},
        {"n": 257},
        {"index": 3},
        {"index": -1},
        {"length": -1},
        {"length": 2**64},
        {"chunk_id": "ABC"},
        {"chunk_id": CHUNK_ID.upper()},
    ],
)
def test_build_rejects_bad_fields(overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidParameters):
        make(**overrides)


def test_fragment_keys_round_trip_and_reject_others() -> None:
    assert fragment_key(CHUNK_ID, 7) == f"{CHUNK_ID}.7"
    for index in (0, 9, 255):
        assert parse_fragment_key(fragment_key(CHUNK_ID, index)) == (CHUNK_ID, index)
    bad = [
        CHUNK_ID,
        f"{CHUNK_ID}.",
        f"{CHUNK_ID}.07",
        f"{CHUNK_ID}.256",
        f"{CHUNK_ID}.-1",
        f"{CHUNK_ID}.1.2",
        f"{CHUNK_ID[:-1]}.1",
        f"{CHUNK_ID.upper()}.1",
        f"{CHUNK_ID}.١",  # a non-ASCII digit
    ]
    for key in bad:
        with pytest.raises(ValueError):
            parse_fragment_key(key)
