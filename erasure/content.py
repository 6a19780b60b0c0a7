"""The content address the storage leaves check: a chunk id is the lowercase hex
BLAKE3-256 of the chunk's bytes (API.md).

Owned here, at the bottom of the import graph, so that ``erasure`` and ``tiers`` verify
ids without importing ``storaged``. ``storaged.ids`` states the same form for the server
and the client (which must start without loading the codecs); ``tests/erasure`` checks
that the two agree.
"""

from __future__ import annotations

import re

import blake3

from erasure.errors import BytesLike

CHUNK_ID_RE = re.compile(r"^[0-9a-f]{64}$")


def is_chunk_id(value: object) -> bool:
    return isinstance(value, str) and CHUNK_ID_RE.fullmatch(value) is not None


def chunk_hasher() -> blake3.blake3:
    """A BLAKE3 hasher whose ``hexdigest()`` is the chunk id of what it was given, fed in
    pieces (``update`` releases the GIL for large inputs)."""
    return blake3.blake3(max_threads=1)


def chunk_id_of(data: BytesLike) -> str:
    """Lowercase hex BLAKE3-256 of ``data``. Releases the GIL for large inputs."""
    hasher = chunk_hasher()
    hasher.update(data)
    return hasher.hexdigest()
