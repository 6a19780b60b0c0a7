"""The default codec: zfec (Reed-Solomon over GF(2^8), systematic), any 1 <= k < n <= 256.

The chunk is cut into ``k`` primary blocks of ``ceil(len / k)`` bytes (at least 1), the last
ones zero-padded; fragments ``0..k-1`` carry the primary blocks, ``k..n-1`` the parity
blocks. Primary payloads are views of the caller's data (zfec hands the very objects it
was given back), so encoding copies only the few padded bytes of the tail.

Two zfec 1.6 behaviours are guarded against here:

- ``Decoder.decode`` reorders the sequence of blocks it is given in place (to put primary
  blocks at their own positions; it does so even to a tuple) while leaving the block
  numbers as they were, so a sequence reused for a second call pairs blocks with the wrong
  numbers and decodes garbage. Every call here builds a fresh tuple that nobody else holds.
- zfec decodes a corrupted block into wrong bytes without any error. ``Codec.decode``
  checks each fragment's CRC-32C before use and the result's BLAKE3 after.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import zfec

from erasure.base import BytesLike, Codec, DecodeMismatch
from erasure.content import chunk_hasher
from erasure.fragment import Fragment, payload_crc

#: one helper thread computes the primary payloads' CRCs while zfec codes the parity
_CRC_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="erasure-crc")

__all__ = ["ZfecCodec", "block_size"]


def block_size(length: int, k: int) -> int:
    """Payload size of every fragment of a ``length``-byte chunk: ``ceil(length / k)``, >= 1.

    An empty chunk still gets one (zero) byte per fragment, so that every fragment has a
    payload to check and zfec never sees empty blocks.
    """
    return max(1, -(-length // k))


class ZfecCodec(Codec):
    """zfec behind the ``Codec`` interface; fragments are recorded with codec name "zfec"."""

    name = "zfec"

    def _open_coder(self) -> None:
        # Both hold only the coding matrix, which encode/decode read and never write, and
        # both release the GIL while coding: one of each serves every thread.
        self._encoder = zfec.Encoder(self.k, self.n)
        self._decoder = zfec.Decoder(self.k, self.n)

    def _expected_payload_size(self, length: int) -> int:
        return block_size(length, self.k)

    def _encode_with_crcs(
        self, data: memoryview
    ) -> tuple[Sequence[BytesLike], Sequence[int | None]]:
        # The primary payloads are known before zfec runs: their CRCs are computed on
        # another thread while zfec computes the parity (both release the GIL), so the
        # checksums cost next to nothing on a machine with a free core.
        primaries = self._primaries(data)
        crcs_of_primaries = _CRC_POOL.submit(lambda: [payload_crc(p) for p in primaries])
        parity = self._encoder.encode(tuple(primaries), tuple(range(self.k, self.n)))
        parity_crcs: list[int | None] = [payload_crc(p) for p in parity]
        crcs: list[int | None] = [*crcs_of_primaries.result(), *parity_crcs]
        return [*primaries, *parity], crcs

    def _encode_payloads(self, data: memoryview) -> Sequence[BytesLike]:
        primaries = self._primaries(data)
        # Fresh tuples here too, though encode was not seen to reorder them: cheap insurance.
        parity = self._encoder.encode(tuple(primaries), tuple(range(self.k, self.n)))
        return [*primaries, *parity]

    def _primaries(self, data: memoryview) -> list[BytesLike]:
        length = data.nbytes
        size = block_size(length, self.k)
        primaries: list[BytesLike] = []
        for start in range(0, self.k * size, size):
            if start + size <= length:
                primaries.append(data[start : start + size])
            else:
                # The tail block (and any wholly empty block of a tiny chunk) is padded with
                # zeros: a deliberate copy of fewer than ``size`` bytes.
                padded = bytearray(size)
                tail = data[start:length] if start < length else data[0:0]
                padded[: tail.nbytes] = tail
                primaries.append(bytes(padded))
        return primaries

    def _segments(self, fragments: Sequence[Fragment], length: int) -> list[memoryview]:
        """The primary segments zfec decodes, cut at the original length (the padding never
        reaches the result)."""
        # A fresh tuple on every call: zfec reorders its argument in place (module doc).
        blocks = tuple(f.payload for f in fragments)
        numbers = tuple(f.index for f in fragments)
        segments = self._decoder.decode(blocks, numbers)
        size = block_size(length, self.k)
        if len(segments) != self.k or any(len(s) != size for s in segments):
            raise DecodeMismatch(f"zfec returned {len(segments)} segment(s) of unexpected size")
        views: list[memoryview] = []
        remaining = length
        for segment in segments:
            if remaining <= 0:
                break
            view = memoryview(segment)
            views.append(view[:remaining] if view.nbytes > remaining else view)
            remaining -= view.nbytes
        return views

    def _decode_payloads(self, fragments: Sequence[Fragment], length: int) -> bytes:
        # One copy: the segments joined.
        return b"".join(self._segments(fragments, length))

    def _decode_payloads_into(
        self, fragments: Sequence[Fragment], length: int, out: memoryview
    ) -> None:
        # One copy, straight into the caller's buffer: no joined bytes to allocate.
        pos = 0
        for view in self._segments(fragments, length):
            out[pos : pos + view.nbytes] = view
            pos += view.nbytes

    def _decode_payloads_hashed_into(
        self, fragments: Sequence[Fragment], length: int, out: memoryview
    ) -> str:
        # Each segment hashed right after its copy, from the destination while it is still
        # in cache: one pass over the chunk from memory fewer than copying all, then hashing
        # all (an 8 MiB chunk from 4 fragments, one of them rebuilt: 0.83 -> 0.73 s/GB for
        # the whole decode_into, best of 90, docs/BENCHMARKS.md "Degraded restores").
        hasher = chunk_hasher()
        pos = 0
        for view in self._segments(fragments, length):
            end = pos + view.nbytes
            out[pos:end] = view
            hasher.update(out[pos:end])
            pos = end
        return hasher.hexdigest()
