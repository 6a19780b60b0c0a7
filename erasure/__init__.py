"""Erasure coding of chunks into self-describing fragments.

``make_codec(name, k, n)`` gives a ``Codec``; ``codec.encode(chunk_id, data)`` returns ``n``
``Fragment`` objects (write each with ``os.writev(fd, fragment.parts())`` or store
``fragment.to_bytes()``), and ``codec.decode(chunk_id, fragments)`` rebuilds the chunk from
any ``k`` of them, whole (header + payload) as read back. ``parse_fragment`` checks one
fragment on its own (the cold tier's scrubber and index rebuild). Fragment ``i`` of a chunk
is stored under ``fragment_key(chunk_id, i)``.
"""

from __future__ import annotations

from erasure import errors
from erasure.base import DEFAULT_MAX_DECODE_ATTEMPTS, Codec, FragmentInput, FragmentsArg
from erasure.errors import *  # noqa: F403 (the codec errors, named in errors.__all__)
from erasure.fragment import (
    HEADER_SIZE,
    Fragment,
    FragmentHeader,
    build_fragment,
    parse_fragment,
    parse_header,
)
from erasure.isal import IsalCodec, isal_available
from erasure.zfec_codec import ZfecCodec

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "DEFAULT_MAX_DECODE_ATTEMPTS",
    "HEADER_SIZE",
    "Codec",
    "Fragment",
    "FragmentHeader",
    "FragmentInput",
    "FragmentsArg",
    "IsalCodec",
    "ZfecCodec",
    "build_fragment",
    "fragment_key",
    "isal_available",
    "make_codec",
    "parse_fragment",
    "parse_fragment_key",
    "parse_header",
]
__all__ += errors.__all__

#: codec name (as recorded in fragment headers) -> implementation
CODECS: dict[str, type[Codec]] = {ZfecCodec.name: ZfecCodec, IsalCodec.name: IsalCodec}
DEFAULT_CODEC = ZfecCodec.name


def make_codec(name: str, k: int, n: int) -> Codec:
    """The codec ``name`` ("zfec", the default, or "isal") for ``k`` of ``n``.

    Raises ``InvalidParameters`` (also a ``ValueError``) for an unknown name, parameters
    outside ``1 <= k < n <= 256``, or "isal" without pyeclib (the message says to install
    the ``isal`` extra).
    """
    codec_class = CODECS.get(name)
    if codec_class is None:
        raise errors.InvalidParameters(
            f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}"
        )
    return codec_class(k, n)


def fragment_key(chunk_id: str, index: int) -> str:
    """The storage key of fragment ``index`` of a chunk: ``f"{chunk_id}.{index}"``."""
    return f"{chunk_id}.{index}"


def parse_fragment_key(key: str) -> tuple[str, int]:
    """Inverse of ``fragment_key``: ``(chunk_id, index)``; raises ``ValueError`` for anything
    that ``fragment_key`` cannot have made (bad id, index outside 0..255, leading zeros)."""
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
