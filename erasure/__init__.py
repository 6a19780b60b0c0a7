"""Erasure coding of chunks into self-describing fragments (see ``erasure.base``)."""

from __future__ import annotations

from erasure.base import (
    BytesLike,
    Codec,
    CorruptFragment,
    DecodeMismatch,
    ErasureError,
    InvalidParameters,
    NotEnoughFragments,
    check_parameters,
)
from erasure.fragment import (
    HEADER_SIZE,
    Fragment,
    FragmentHeader,
    build_fragment,
    parse_fragment,
    parse_header,
)

__all__ = [
    "HEADER_SIZE",
    "BytesLike",
    "Codec",
    "CorruptFragment",
    "DecodeMismatch",
    "ErasureError",
    "Fragment",
    "FragmentHeader",
    "InvalidParameters",
    "NotEnoughFragments",
    "build_fragment",
    "check_parameters",
    "fragment_key",
    "parse_fragment",
    "parse_fragment_key",
    "parse_header",
]


def fragment_key(chunk_id: str, index: int) -> str:
    """The storage key of fragment ``index`` of a chunk: ``f"{chunk_id}.{index}"``."""
    return f"{chunk_id}.{index}"


def parse_fragment_key(key: str) -> tuple[str, int]:
    """Inverse of ``fragment_key``; raises ``ValueError`` for anything else."""
    chunk_id, sep, index = key.rpartition(".")
    if (
        not sep
        or len(chunk_id) != 64
        or any(c not in "0123456789abcdef" for c in chunk_id)
        or not index.isascii()
        or not index.isdigit()
        or (len(index) > 1 and index[0] == "0")
        or int(index) > 255
    ):
        raise ValueError(f"not a fragment key: {key!r}")
    return chunk_id, int(index)
