"""Degraded reads: a cold chunk decoded by the client from fragments it fetches itself.

When a restore plan (``Client.plan``, extension E8) lists no hot copy of a chunk, only
holders of its erasure fragments, the client asks ``k`` of those holders in parallel for
one fragment each (``GET /v1/chunks/{id}/fragments/{i}``, extension E12) and decodes in a
thread. Each fragment byte then crosses one socket (holder -> client), where the node-side
rebuild costs two (holders -> the decoding node -> the client) and puts every decode of a
restore on the few nodes the client happens to ask.

Checks: ``Codec.decode`` reads each fragment's header and payload CRC-32C before using it
(zfec decodes a corrupted block into wrong bytes without a word) and hashes the result with
BLAKE3 against the chunk id; a fragment that fails is dropped and another index fetched in
its place. Primary fragments (index < k) are asked for first: zfec is systematic, so a
decode from the ``k`` primaries is a copy, and each parity fragment used instead costs one
block of coding.

Fragment buffers (``FragmentBuffers``): each fragment is received into a buffer taken from a
small pool and given back once its chunk is decoded, not into fresh memory; a fresh buffer
per fragment cost its zero fill and its page faults on every receive (measured:
docs/BENCHMARKS.md, "Degraded restores at codec speed").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from erasure import Codec, CorruptFragment, ErasureError, InvalidParameters, parse_fragment
from storaged.client.errors import NotEnoughFragments, StoragedError

#: Fetches fragment ``index`` (header + payload) from one of its holders.
FetchFragment = Callable[[int], Awaitable[memoryview]]


@dataclass(frozen=True, slots=True)
class Decoded:
    """A chunk rebuilt from fragments, and what it took."""

    #: the chunk: new bytes, or the start of the caller's ``out``
    data: bytes | memoryview
    #: fragments downloaded (the good ones and those dropped)
    fetched: int
    #: fragments not used: refused or unreachable holders, failed checks
    skipped: int


class _FragmentBuffer(bytearray):
    """A receive buffer ``FragmentBuffers`` made: only these are taken back."""

    __slots__ = ()


class FragmentBuffers:
    """Receive buffers for fragments, kept for reuse up to ``limit`` bytes, by exact size.

    ``take(size)`` hands out a buffer nobody else holds; ``give_back`` takes back buffers
    whose every reader is done (a decode that returned, never one still running in a
    thread). A buffer not given back (a hedge that lost, a cancelled decode) is dropped
    with its last reference. Used from one event loop: not thread-safe.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[_FragmentBuffer]] = {}
        #: ids of the buffers in ``_free``: one given back twice is kept once
        self._kept_ids: set[int] = set()
        self._kept = 0
        #: buffers made so far (the rest of the takes reused one)
        self.made = 0

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes (contents: whatever it held last)."""
        free = self._free.get(size)
        if free:
            buffer = free.pop()
            self._kept_ids.discard(id(buffer))
            self._kept -= size
        else:
            buffer = _FragmentBuffer(size)
            self.made += 1
        return memoryview(buffer)

    def give_back(self, views: Iterable[memoryview]) -> None:
        """Keep the buffers under ``views`` for the next ``take`` (within ``limit``); views of
        other buffers are ignored."""
        for view in views:
            buffer = view.obj
            if type(buffer) is not _FragmentBuffer or id(buffer) in self._kept_ids:
                continue
            size = len(buffer)
            if self._kept + size <= self.limit:
                self._free.setdefault(size, []).append(buffer)
                self._kept_ids.add(id(buffer))
                self._kept += size

    def clear(self) -> None:
        self._free.clear()
        self._kept_ids.clear()
        self._kept = 0


def fetch_order(sources: Mapping[int, Sequence[str]], k: int) -> list[int]:
    """The fragment indexes to ask for, primaries (index < k) first, then parity."""
    return sorted(sources, key=lambda index: (index >= k, index))


def _bad_fragments(
    codec: Codec, chunk_id: str, fragments: Mapping[int, memoryview]
) -> dict[int, str]:
    """Indexes among ``fragments`` that fail their checks on their own, with the reason.

    Only called after a decode failed: on the normal path ``Codec.decode`` checks each
    fragment once, and this second pass would only repeat it."""
    bad: dict[int, str] = {}
    for index, raw in fragments.items():
        try:
            frag = parse_fragment(raw)
        except CorruptFragment as exc:
            bad[index] = exc.reason
            continue
        if (frag.codec, frag.k, frag.n) != (codec.name, codec.k, codec.n):
            bad[index] = f"made by {frag.codec} k={frag.k} n={frag.n}"
        elif frag.chunk_id != chunk_id or frag.index != index:
            bad[index] = f"is fragment {frag.index} of {frag.chunk_id}"
    return bad


async def decode_cold(
    chunk_id: str,
    codec: Codec,
    sources: Mapping[int, Sequence[str]],
    fetch: FetchFragment,
    decode_slots: asyncio.Semaphore,
    out: memoryview | None = None,
    buffers: FragmentBuffers | None = None,
) -> Decoded:
    """Fetch ``k`` good fragments of ``chunk_id`` (more if some fail) and decode them.

    ``sources``: fragment index -> nodes holding it (from the plan). ``fetch`` raises a
    ``StoragedError`` for a fragment it cannot get; that index is skipped. ``out``: decode
    into it (``Codec.decode_into``; ``InvalidParameters``, a ``ValueError``, when the chunk
    does not fit). Raises ``NotEnoughFragments`` when the indexes run out before a decode
    succeeds. ``buffers``: the pool ``fetch`` takes its receive buffers from; the fragments
    fetched go back to it once the decode has returned (not when it is cancelled: its
    thread may still read them).
    """
    k = codec.k
    pending = fetch_order(sources, k)
    got: dict[int, memoryview] = {}
    reasons: list[str] = []
    fetched = skipped = 0
    # How many fragments to hold before decoding: k, plus one for each decode that failed
    # though every fragment passed its own checks (a forged or mislabelled one: only a
    # larger set lets the codec try other subsets).
    want = k
    # Each round fetches at least one index or ends: bounded by the indexes there are.
    for _ in range(2 * len(pending) + 2):
        batch, pending = pending[: want - len(got)], pending[want - len(got) :]
        results = await asyncio.gather(*(fetch(index) for index in batch), return_exceptions=True)
        for index, result in zip(batch, results, strict=True):
            if isinstance(result, StoragedError):
                reasons.append(f"fragment {index}: {result}")
                skipped += 1
            elif isinstance(result, BaseException):
                raise result
            else:
                got[index] = result
                fetched += 1
        if len(got) < want:
            if pending:
                continue
            break
        async with decode_slots:
            data: bytes | memoryview
            try:
                if out is None:
                    data = await codec.decode_async(chunk_id, dict(got))
                else:
                    data = await codec.decode_into_async(chunk_id, dict(got), out)
            except InvalidParameters:
                raise  # the caller's buffer or id, not the fragments
            except ErasureError as exc:
                bad = await asyncio.to_thread(_bad_fragments, codec, chunk_id, got)
                for index, reason in bad.items():
                    del got[index]
                    reasons.append(f"fragment {index}: {reason}")
                skipped += len(bad)
                if not bad:
                    reasons.append(str(exc))
                    want += 1
                if not pending:
                    break
                continue
        if buffers is not None:
            buffers.give_back(got.values())
        return Decoded(data, fetched, skipped)
    if buffers is not None:
        buffers.give_back(got.values())  # every decode of them has returned
    # With k or more left, each passed its own checks yet no k of them decode to the id.
    raise NotEnoughFragments(
        f"chunk {chunk_id}: {len(got)} fragment(s) passed their checks, {k} good ones needed;"
        f" the plan names {len(sources)} index(es): " + "; ".join(reasons[-8:]),
        available=len(got),
        needed=k,
    )
