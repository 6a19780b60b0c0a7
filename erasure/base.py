"""The codec interface: whole bytes in, ``n`` self-describing fragments out, any ``k`` back.

Callers never split or pad: ``encode`` takes the chunk and returns ``n`` ``Fragment`` objects
(a small packed header plus a view of the payload, see ``erasure.fragment``); ``decode``
takes whole fragments (header + payload) and returns exactly the chunk's bytes, checked
against the chunk id (BLAKE3-256), or raises. A codec never returns wrong bytes.

Implementations supply only the arithmetic (``_encode_payloads``, ``_decode_payloads``);
the checks (headers, CRC-32C, codec/k/n/chunk identity, the BLAKE3 verdict and the retry
over other subsets of good fragments) live here once, for every codec.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import ClassVar

from erasure.content import chunk_id_of, is_chunk_id
from erasure.errors import (
    BytesLike,
    CorruptFragment,
    DecodeMismatch,
    ErasureError,
    InvalidParameters,
    NotEnoughFragments,
    check_parameters,
)
from erasure.fragment import Fragment, build_fragment, parse_fragment

__all__ = [
    "DEFAULT_MAX_DECODE_ATTEMPTS",
    "BytesLike",
    "Codec",
    "CorruptFragment",
    "DecodeMismatch",
    "ErasureError",
    "FragmentInput",
    "FragmentsArg",
    "InvalidParameters",
    "NotEnoughFragments",
    "check_parameters",
]

#: How many ``k``-subsets of CRC-good fragments ``decode`` tries before giving up with
#: ``DecodeMismatch``. A second attempt only happens when a fragment passes its CRC-32C yet
#: carries wrong bytes (a forged or mislabelled fragment, or a codec bug): rare enough that
#: a small bound costs nothing, and each attempt is a full decode plus a BLAKE3 pass.
DEFAULT_MAX_DECODE_ATTEMPTS = 32


def _check_chunk_id(chunk_id: str) -> None:
    if not is_chunk_id(chunk_id):
        raise InvalidParameters(f"chunk id must be 64 lowercase hex digits, got {chunk_id!r}")


#: What ``decode`` accepts: whole fragments (header + payload) as bytes-like objects or
#: ``Fragment`` objects, either as a mapping index -> fragment or as any iterable of them
#: (each header says its index).
FragmentInput = BytesLike | Fragment
FragmentsArg = Mapping[int, FragmentInput] | Iterable[FragmentInput]


def _summary(reasons: Sequence[str], limit: int = 6) -> str:
    if len(reasons) <= limit:
        return "; ".join(reasons)
    return "; ".join(reasons[:limit]) + f"; and {len(reasons) - limit} more"


def _neighbour_subsets(first: Sequence[int], spares: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every other k-subset of ``first + spares``, closest to ``first`` first.

    One spare in place of each member of ``first`` in turn finds a single bad fragment
    within ``k`` tries (given a good spare); then two at a time, and so on until all subsets
    have been produced.
    """
    for r in range(1, min(len(first), len(spares)) + 1):
        for into in itertools.combinations(spares, r):
            for out in itertools.combinations(first, r):
                kept = [i for i in first if i not in out]
                yield tuple(sorted(kept + list(into)))


class Codec(abc.ABC):
    """A Reed-Solomon code with fixed (k, n): ``erasure.zfec_codec``, ``erasure.isal``.

    Instances are immutable and safe to share between threads.
    """

    #: short stable name recorded in every fragment header ("zfec", "isal")
    name: ClassVar[str]
    k: int
    n: int

    def __init__(
        self, k: int, n: int, *, max_decode_attempts: int = DEFAULT_MAX_DECODE_ATTEMPTS
    ) -> None:
        check_parameters(k, n)
        if type(max_decode_attempts) is not int or max_decode_attempts < 1:
            raise InvalidParameters(
                f"max_decode_attempts must be a positive int, got {max_decode_attempts!r}"
            )
        self.k = k
        self.n = n
        self.max_decode_attempts = max_decode_attempts
        self._open_coder()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k}, n={self.n})"

    # -- what an implementation provides -------------------------------------------------

    @abc.abstractmethod
    def _open_coder(self) -> None:
        """Build what coding uses for ``self.k`` of ``self.n`` (both checked by then); called
        once, at the end of ``__init__``."""

    @abc.abstractmethod
    def _encode_payloads(self, data: memoryview) -> Sequence[BytesLike]:
        """The ``n`` payloads for ``data`` (a flat byte view), payload ``i`` at position ``i``."""

    @abc.abstractmethod
    def _decode_payloads(self, fragments: Sequence[Fragment], length: int) -> bytes:
        """The original ``length`` bytes from exactly ``k`` CRC-checked fragments of this codec,
        sorted by index and agreeing on length and payload size. May raise anything on bad
        input: the caller treats an exception like a hash mismatch."""

    def _decode_payloads_into(
        self, fragments: Sequence[Fragment], length: int, out: memoryview
    ) -> None:
        """``_decode_payloads`` written into ``out`` (exactly ``length`` bytes). This default
        copies the joined result; a codec that can write its blocks in place overrides it."""
        out[:] = self._decode_payloads(fragments, length)

    def _decode_payloads_hashed_into(
        self, fragments: Sequence[Fragment], length: int, out: memoryview
    ) -> str:
        """``_decode_payloads_into``, and the chunk id of the bytes it left in ``out`` (the
        BLAKE3 of all of them). This default hashes ``out`` once written; a codec that writes
        block by block overrides it to hash each block as soon as it is written, while its
        bytes are still in cache."""
        self._decode_payloads_into(fragments, length, out)
        return chunk_id_of(out)

    def _expected_payload_size(self, length: int) -> int | None:
        """The payload size this codec makes for a chunk of ``length`` bytes, if known."""
        return None

    # -- encoding -------------------------------------------------------------------------

    def encode(self, chunk_id: str, data: BytesLike, *, verify_id: bool = False) -> list[Fragment]:
        """``n`` fragments of ``data``, fragment ``i`` at position ``i``. CPU-bound.

        Payloads may be views of ``data`` (no copy): keep ``data`` unchanged while the
        fragments are in use. ``chunk_id`` is recorded in every header and must be the
        BLAKE3-256 of ``data``; the caller normally knows it already, so it is only checked
        when ``verify_id`` is true (a wrong id would make every later decode fail with
        ``DecodeMismatch``, never return wrong bytes). Raises ``InvalidParameters`` for a bad
        chunk id, data that is not a contiguous buffer, or (``verify_id``) a wrong id.
        """
        _check_chunk_id(chunk_id)
        try:
            view = memoryview(data).cast("B")
        except TypeError as exc:  # not a buffer, or a strided (non-contiguous) one
            raise InvalidParameters(f"data must be contiguous bytes-like, not {exc}") from exc
        if verify_id and chunk_id_of(view) != chunk_id:
            raise InvalidParameters(f"data does not hash to chunk id {chunk_id}")
        payloads, crcs = self._encode_with_crcs(view)
        return [
            build_fragment(
                codec=self.name,
                k=self.k,
                n=self.n,
                index=i,
                length=view.nbytes,
                chunk_id=chunk_id,
                payload=payload,
                payload_crc=crc,
            )
            for i, (payload, crc) in enumerate(zip(payloads, crcs, strict=True))
        ]

    def _encode_with_crcs(
        self, data: memoryview
    ) -> tuple[Sequence[BytesLike], Sequence[int | None]]:
        """Payloads and, where already known, their CRC-32C (None: computed when built)."""
        payloads = self._encode_payloads(data)
        return payloads, [None] * len(payloads)

    async def encode_async(
        self, chunk_id: str, data: BytesLike, *, verify_id: bool = False
    ) -> list[Fragment]:
        """``encode`` in a worker thread (the event loop never runs the coding)."""
        return await asyncio.to_thread(self.encode, chunk_id, data, verify_id=verify_id)

    # -- decoding -------------------------------------------------------------------------

    def decode(self, chunk_id: str, fragments: FragmentsArg) -> bytes:
        """Rebuild the chunk from any ``k`` good fragments. CPU-bound.

        ``fragments``: whole fragments (header + payload: bytes, bytearray, memoryview, or
        ``Fragment``), as a mapping index -> fragment or an iterable (each header says its
        index). A fragment is skipped, with its reason kept for the error message, when its
        header or payload checksum fails, when it was made by another codec, k, n or for
        another chunk, when a mapping key disagrees with its header, or when it repeats an
        index already good. The result always hashes to ``chunk_id``: if the first ``k``
        good fragments decode to other bytes, other subsets are tried (at most
        ``max_decode_attempts`` decodes in all).

        Raises ``NotEnoughFragments`` (fewer than ``k`` good ones; says how many),
        ``DecodeMismatch`` (enough good ones, but no subset tried hashes to ``chunk_id``),
        ``InvalidParameters`` (bad chunk id or argument type).
        """
        result = self._decode(chunk_id, fragments, None)
        assert isinstance(result, bytes)
        return result

    def _decode(
        self, chunk_id: str, fragments: FragmentsArg, out: memoryview | None
    ) -> bytes | memoryview:
        _check_chunk_id(chunk_id)
        if out is not None and (out.readonly or out.ndim != 1 or out.itemsize != 1):
            raise InvalidParameters("out must be a flat, writable byte view")
        reasons: list[str] = []
        groups = self._collect(chunk_id, fragments, reasons)
        if not groups:
            raise NotEnoughFragments(0, self.k, _summary(reasons) or "no fragments given")
        best_available = 0
        mismatch: DecodeMismatch | None = None
        # Fragments that pass their checksums yet disagree on the chunk's length are forged or
        # mislabelled; each consistent group gets its own chance, biggest first.
        for (length, _size), by_index in sorted(
            groups.items(), key=lambda item: len(item[1]), reverse=True
        ):
            if out is not None and out.nbytes < length:
                raise InvalidParameters(f"out holds {out.nbytes} bytes, the chunk has {length}")
            try:
                return self._decode_group(chunk_id, length, by_index, reasons, out)
            except NotEnoughFragments as exc:
                best_available = max(best_available, exc.available)
            except DecodeMismatch as exc:
                mismatch = exc
        if mismatch is not None:
            raise mismatch
        raise NotEnoughFragments(best_available, self.k, _summary(reasons))

    async def decode_async(self, chunk_id: str, fragments: FragmentsArg) -> bytes:
        """``decode`` in a worker thread (the event loop never runs the coding or hashing)."""
        return await asyncio.to_thread(self.decode, chunk_id, fragments)

    def decode_into(self, chunk_id: str, fragments: FragmentsArg, out: memoryview) -> memoryview:
        """``decode``, the chunk written into the start of ``out`` (a flat writable byte
        view) instead of a new buffer: returns ``out[:length]``. Same checks and errors as
        ``decode``, plus ``InvalidParameters`` when ``out`` is shorter than the chunk (the
        fragments say how long it is). On an error ``out`` may hold anything."""
        result = self._decode(chunk_id, fragments, out)
        assert isinstance(result, memoryview)
        return result

    async def decode_into_async(
        self, chunk_id: str, fragments: FragmentsArg, out: memoryview
    ) -> memoryview:
        """``decode_into`` in a worker thread."""
        return await asyncio.to_thread(self.decode_into, chunk_id, fragments, out)

    def _collect(
        self, chunk_id: str, fragments: FragmentsArg, reasons: list[str]
    ) -> dict[tuple[int, int], dict[int, list[Fragment]]]:
        """Header-checked fragments of this chunk and codec: (length, payload size) -> index ->
        candidates in the order given. Payload checksums are not read yet."""
        if isinstance(fragments, bytes | bytearray | memoryview | str):
            raise InvalidParameters(
                "fragments must be a mapping index -> fragment or a list of fragments,"
                f" not a single {type(fragments).__name__}"
            )
        items: Iterable[tuple[object, object]]
        if isinstance(fragments, Mapping):
            items = fragments.items()
        else:
            items = ((None, f) for f in fragments)
        groups: dict[tuple[int, int], dict[int, list[Fragment]]] = {}
        for position, (key, item) in enumerate(items):
            where = f"fragment at {key!r}" if key is not None else f"fragment #{position}"
            if isinstance(item, Fragment):
                frag = item
            elif isinstance(item, bytes | bytearray | memoryview):
                try:
                    frag = parse_fragment(item, verify_payload=False)
                except CorruptFragment as exc:
                    reasons.append(f"{where}: {exc.reason}")
                    continue
                except (TypeError, ValueError) as exc:  # e.g. a non-contiguous memoryview
                    reasons.append(f"{where}: unreadable buffer ({exc})")
                    continue
            else:
                reasons.append(f"{where}: not a fragment ({type(item).__name__})")
                continue
            problem = self._foreign(frag, chunk_id, key)
            if problem:
                reasons.append(f"{where}: {problem}")
                continue
            size = frag.payload.nbytes
            groups.setdefault((frag.length, size), {}).setdefault(frag.index, []).append(frag)
        return groups

    def _foreign(self, frag: Fragment, chunk_id: str, key: object) -> str:
        """Why ``frag`` cannot be used with this codec for ``chunk_id`` ("" if it can)."""
        if frag.codec != self.name or frag.k != self.k or frag.n != self.n:
            return (
                f"made by {frag.codec} k={frag.k} n={frag.n}, this codec is"
                f" {self.name} k={self.k} n={self.n}"
            )
        if frag.chunk_id != chunk_id:
            return f"belongs to chunk {frag.chunk_id}"
        if key is not None and key != frag.index:
            return f"header says index {frag.index}"
        expected = self._expected_payload_size(frag.length)
        if expected is not None and frag.payload.nbytes != expected:
            return (
                f"payload of {frag.payload.nbytes} bytes, expected {expected} for a chunk of"
                f" {frag.length} bytes"
            )
        return ""

    def _decode_group(
        self,
        chunk_id: str,
        length: int,
        by_index: dict[int, list[Fragment]],
        reasons: list[str],
        out: memoryview | None,
    ) -> bytes | memoryview:
        good: dict[int, Fragment] = {}
        pending = iter(sorted(by_index))

        def verify_next() -> bool:
            """Move the next index with a CRC-good candidate into ``good``; False when none."""
            for index in pending:
                for frag in by_index[index]:
                    try:
                        frag.verify()
                    except CorruptFragment as exc:
                        reasons.append(exc.reason)
                        continue
                    good[index] = frag
                    return True
            return False

        # Checksums are read lazily: given all n fragments, only the k used are CRC'd.
        while len(good) < self.k and verify_next():
            pass
        if len(good) < self.k:
            raise NotEnoughFragments(len(good), self.k, _summary(reasons))
        attempts = 0
        failures: list[str] = []

        def attempt(subset: tuple[int, ...]) -> bytes | memoryview | None:
            nonlocal attempts
            attempts += 1
            data: bytes | memoryview
            try:
                if out is None:
                    data = self._decode_payloads([good[i] for i in subset], length)
                    digest = chunk_id_of(data) if len(data) == length else None
                else:
                    data = out[:length]
                    fragments = [good[i] for i in subset]
                    # the hash of what ``out`` holds, taken as it was written
                    digest = self._decode_payloads_hashed_into(fragments, length, data)
            except Exception as exc:  # the codec's own complaint: treat like a wrong hash
                failures.append(f"fragments {list(subset)}: {type(exc).__name__}: {exc}")
                return None
            if digest == chunk_id:
                return data
            failures.append(f"fragments {list(subset)}: decoded bytes do not hash to the id")
            return None

        first = tuple(sorted(good))
        result = attempt(first)
        if result is not None:
            return result
        # Some fragment passed its CRC-32C yet is wrong: bring in every other good fragment and
        # try the subsets closest to the first one.
        while verify_next():
            pass
        spares = [i for i in sorted(good) if i not in first]
        for subset in _neighbour_subsets(first, spares):
            if attempts >= self.max_decode_attempts:
                break
            result = attempt(subset)
            if result is not None:
                return result
        raise DecodeMismatch(
            f"{len(good)} good fragment(s) of chunk {chunk_id}, {attempts} decode(s) tried, none"
            f" hashes to the chunk id: {_summary(failures)}"
        )
