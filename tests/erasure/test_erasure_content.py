"""``erasure.content`` (the leaves' chunk-id form and digest) agrees with ``storaged.ids``
(the server's and client's), so a chunk the client names is one the tiers and codecs accept."""

from __future__ import annotations

import os

import pytest

from erasure import content
from storaged import ids


def test_the_same_form_on_both_sides() -> None:
    assert content.CHUNK_ID_RE.pattern == ids.CHUNK_ID_RE.pattern
    good = "ab" * 32
    for value in (good, good.upper(), good[:-1], good + "0", "g" * 64, 64, None, ""):
        assert content.is_chunk_id(value) == ids.is_chunk_id(value), value


@pytest.mark.parametrize("size", [0, 1, 64 * 1024 + 1, 1 << 20])
def test_the_same_digest_on_both_sides(size: int) -> None:
    data = os.urandom(size)
    assert content.chunk_id_of(data) == ids.chunk_id_of(data)
    assert content.chunk_id_of(memoryview(data)) == ids.chunk_id_of(bytearray(data))
    assert content.is_chunk_id(content.chunk_id_of(data))
