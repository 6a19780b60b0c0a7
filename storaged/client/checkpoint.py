"""Sharded checkpoints of numpy state: save each rank's shard, commit once, restore any layout.

A *state dict* maps string keys to:

- ``Shard(array, global_shape, offsets)``: this rank's box of a global array;
- a plain ``np.ndarray`` (or numpy scalar): the whole array;
- anything else msgpack can encode (ints, floats, strings, lists, dicts, bytes):
  a small non-array value, stored as an item of dtype ``"msgpack"`` with
  ``global_shape``, ``offsets`` and ``shape`` all ``[]``.

Saving is two steps so that ranks may live in different processes: each rank
packs its shard into one byte stream (``stage_shard``), uploads its chunks and
gets back its *shard entry*, a msgpack-able dict (``upload_shard`` /
``save_shard``); the coordinator gathers every rank's entry and commits them as
one manifest (``commit_checkpoint``). A rank that fails never hands over an
entry, so the checkpoint is never committed. ``save_checkpoint`` does all of it
for several ranks in one process; ``AsyncSaver`` returns as soon as the state is
copied to reusable host staging buffers and uploads in the background, or, lazily,
before the copy, which then runs in threads while an optimizer step waits for it
(``hold_optimizer``); with a staging budget it stages a larger state in waves.

``restore_checkpoint`` fills caller-supplied arrays of any sharding: every
requested box is intersected with the saved ones and only the byte ranges it
needs are fetched, in parallel, straight into the destination's memory where it
is contiguous. A value the PyTorch DCP writer saved (dtype ``"dcp-bytes"``) comes back
as the bytes ``torch.save`` made of it: unpickling is the caller's decision
(``storaged restore`` uses ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgpack
import numpy as np

from storaged.client.client import (
    CheckpointStatus,
    CommitResult,
    Holder,
    RestorePlanDoc,
    WritableBuffer,
    run_all,
)
from storaged.client.errors import MissingChunks
from storaged.client.layout import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_COALESCE_GAP,
    DEFAULT_MAX_TILE,
    MSGPACK_DTYPE,
    VALUE_DTYPES,
    Box,
    DtypeMismatch,
    Fetch,
    Item,
    KeyNotSaved,
    Manifest,
    Request,
    RestorePlan,
    ShardEntry,
    StagedCopy,
    build_manifest,
    check_layout,
    numpy_dtype,
    pack_stream,
    plan_restore,
)
from storaged.client.shm import http_only, in_thread, usable
from storaged.ids import chunk_id_of
from storaged.wire import ByteRange, BytesLike

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Below this many bytes a copy runs on the loop: a thread hop would cost more.
_INLINE_COPY_BYTES = 1 << 20
#: Staging buffers restore may hold at once.
DEFAULT_RESTORE_BUDGET = 256 << 20
#: Chunks below this size are hashed on the loop (as ``chunk_id_of_async`` does).
_INLINE_HASH_BYTES = 64 << 10
#: Chunks the saver hashes before it hands them to ``put_chunks``: the next group hashes
#: while this one uploads (the client's own ``missing`` batch, so nothing is lost).
_HASH_GROUP = 512


class CheckpointStore(Protocol):
    """What saving and restoring need from a client (``Client`` provides it)."""

    @property
    def max_chunk_size(self) -> int: ...

    async def put_chunks(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None = None
    ) -> list[str]: ...

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str: ...

    async def get_chunk(
        self,
        chunk_id: str,
        out: WritableBuffer | None = None,
        byte_range: ByteRange | None = None,
        *,
        holders: Sequence[Holder | str] | None = None,
    ) -> memoryview: ...

    async def commit(self, name: str, manifest: Mapping[str, Any]) -> CommitResult: ...

    async def get_manifest(self, name: str) -> dict[str, Any]: ...

    async def plan(self, name: str) -> RestorePlanDoc: ...

    async def wait(
        self,
        name: str,
        state: str = "memory",
        timeout: float = 60.0,
    ) -> CheckpointStatus: ...


# --------------------------------------------------------------------------- state dicts


@dataclass(frozen=True, slots=True)
class Shard:
    """``array`` is the box at ``offsets`` of a global array of ``global_shape``.

    ``dtype`` names the element type in the manifest when numpy's own name will not
    do (e.g. ``"bfloat16"`` for bytes held in a ``uint16`` array); on restore it must
    match what was saved.
    """

    array: np.ndarray[Any, Any]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dtype: str | None = None

    def __post_init__(self) -> None:
        global_shape = tuple(int(g) for g in self.global_shape)
        offsets = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "offsets", offsets)
        if not (len(global_shape) == len(offsets) == self.array.ndim):
            raise ValueError(
                f"shard of shape {self.array.shape} with global_shape {global_shape} "
                f"and offsets {offsets}: ranks differ"
            )
        box = Box(offsets, tuple(self.array.shape))
        if not box.within(global_shape):
            raise ValueError(f"shard {box} lies outside global shape {global_shape}")


StateDict = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _SaveItem:
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    #: The array to copy, or the msgpack encoding of a value.
    source: np.ndarray[Any, Any] | bytes
    nbytes: int


def _array_item(
    key: str,
    array: np.ndarray[Any, Any],
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    name: str | None,
) -> _SaveItem:
    if array.dtype.kind not in "biufc" or array.dtype.fields is not None:
        raise TypeError(f"{key}: cannot save arrays of dtype {array.dtype}")
    return _SaveItem(
        key, name or array.dtype.name, global_shape, offsets, array, array.size * array.itemsize
    )


def describe_state(state: StateDict) -> list[_SaveItem]:
    """The items of a state dict, checked; ``TypeError`` for what cannot be saved."""
    items: list[_SaveItem] = []
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state dict keys must be non-empty strings, got {key!r}")
        if isinstance(value, Shard):
            items.append(
                _array_item(key, value.array, value.global_shape, value.offsets, value.dtype)
            )
        elif isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
            zeros = (0,) * array.ndim
            items.append(_array_item(key, array, tuple(array.shape), zeros, None))
        else:
            encoded = packed_value(key, value)
            items.append(_SaveItem(key, MSGPACK_DTYPE, (), (), encoded, len(encoded)))
    return items


def packed_value(
    key: str, value: object, *, instead: str = "an array", error: type[Exception] = TypeError
) -> bytes:
    """``value`` as the msgpack bytes a non-array item holds; ``error`` naming ``key`` when
    msgpack cannot pack it (``instead``: what else the value could have been)."""
    try:
        encoded: bytes = msgpack.packb(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise error(
            f"{key}: {type(value).__name__} is neither {instead} nor msgpack-able: {exc}"
        ) from exc
    return encoded


# --------------------------------------------------------------------------- staging


#: staging buffers are touched one byte per page of this size to fault them in
_PAGE = 4096


class StagingBuffer:
    """Host memory a rank's stream is packed into, kept from one save to the next.

    It grows (never shrinks) when a stream does not fit; reusing it spares the page
    faults of fresh memory on every save.
    """

    def __init__(self) -> None:
        self._buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else len(self._buffer)

    def reserve(self, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A view of ``size`` bytes of the buffer (its content is whatever was left there)."""
        if self._buffer is None or len(self._buffer) < size:
            self._buffer = np.empty(size, dtype=np.uint8)
        return self._buffer[:size]

    def prefault(self, size: int) -> None:
        """Make the buffer at least ``size`` bytes and touch each of its pages, so that the
        first copy into it finds its memory there (CPU bound: run in a thread)."""
        fresh = self._buffer is None or len(self._buffer) < size
        buffer = self.reserve(size)
        if fresh:
            buffer[::_PAGE] = 0


def staged_size(state: StateDict, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """The bytes ``stage_shard`` packs ``state`` into (its staging buffer's size)."""
    return pack_stream([item.nbytes for item in describe_state(state)], chunk_size).size


@dataclass(frozen=True, slots=True)
class StagedShard:
    """A rank's stream laid out and cut into chunks, ready to upload."""

    rank: int
    items: tuple[Item, ...]
    #: The bytes of each chunk, in stream order.
    chunks: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def entry(self, chunk_ids: Sequence[str]) -> dict[str, Any]:
        """The shard entry (API.md ``shards[]`` element) once the chunks have these ids."""
        if len(chunk_ids) != len(self.chunks):
            raise ValueError("one id per chunk")
        sized = tuple((cid, len(c)) for cid, c in zip(chunk_ids, self.chunks, strict=True))
        return ShardEntry(self.rank, sized, self.items).to_wire()


def _copy_item(item: _SaveItem, into: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    if isinstance(item.source, bytes):
        into[:] = np.frombuffer(item.source, dtype=np.uint8)
        return
    array = item.source
    native = array.dtype.newbyteorder("=")
    # casting="equiv" lets a big-endian source land in native order, nothing more.
    np.copyto(into.view(native).reshape(array.shape), array, casting="equiv")


def _flat_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    return array.reshape(-1).view(np.uint8).data


@dataclass(frozen=True, slots=True)
class _RankLayout:
    """A rank's state described and laid out, nothing copied yet: which bytes go where."""

    rank: int
    described: tuple[_SaveItem, ...]
    items: tuple[Item, ...]
    #: (offset, size) of each chunk of the stream; together they cover it.
    chunks: tuple[tuple[int, int], ...]
    size: int


def _lay_out(rank: int, state: StateDict, chunk_size: int) -> _RankLayout:
    if rank < 0:
        raise ValueError("rank must be >= 0")
    described = describe_state(state)
    layout = pack_stream([item.nbytes for item in described], chunk_size)
    items = tuple(
        Item(
            d.key,
            d.dtype,
            d.global_shape,
            d.offsets,
            () if isinstance(d.source, bytes) else tuple(d.source.shape),
            start,
            d.nbytes,
        )
        for d, start in zip(described, layout.starts, strict=True)
    )
    return _RankLayout(rank, tuple(described), items, layout.chunks, layout.size)


def stage_shard(
    rank: int,
    state: StateDict,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    staging: StagingBuffer | None = None,
) -> StagedShard:
    """Pack a rank's state into one stream and cut it into chunks (CPU bound: run in a thread).

    With ``staging`` every byte is copied there, so the state may change as soon as
    this returns. Without it large C-contiguous native arrays are referenced, not
    copied: they must not change until the upload is done.
    """
    return _stage_laid_out(_lay_out(rank, state, chunk_size), chunk_size, staging)


def _stage_laid_out(
    layout: _RankLayout, chunk_size: int, staging: StagingBuffer | None
) -> StagedShard:
    described = layout.described
    # Segments of the stream: (offset, bytes); no chunk straddles two of them, because
    # large items start and end chunks of their own (pack_stream).
    segments: list[tuple[int, memoryview]] = []
    if staging is not None:
        buffer = staging.reserve(layout.size)
        for d, item in zip(described, layout.items, strict=True):
            _copy_item(d, buffer[item.start : item.end])
        segments.append((0, buffer.data))
    else:
        small = sum(d.nbytes for d in described if d.nbytes < chunk_size)
        packed = np.empty(small, dtype=np.uint8)
        segments.append((0, packed.data))
        for d, item in zip(described, layout.items, strict=True):
            start = item.start
            if d.nbytes < chunk_size:
                _copy_item(d, packed[start : start + d.nbytes])
                continue
            source = d.source
            if isinstance(source, bytes):  # a large msgpack value: its encoding is ours
                segments.append((start, memoryview(source)))
            elif source.flags.c_contiguous and source.dtype.isnative:
                segments.append((start, _flat_bytes(source)))
            else:
                # Strided or foreign byte order: one deliberate copy to get stream bytes.
                copy = np.empty(d.nbytes, dtype=np.uint8)
                _copy_item(d, copy)
                segments.append((start, copy.data))
    return StagedShard(layout.rank, layout.items, cut_segments(segments, layout.chunks))


def cut_segments(
    segments: Sequence[tuple[int, memoryview]], cuts: Iterable[tuple[int, int]]
) -> tuple[memoryview, ...]:
    """The chunks ``cuts`` (offset, size in the stream) as views of ``segments`` (offset,
    bytes; in stream order), none of them straddling two (``pack_stream`` lays out so)."""
    starts = [offset for offset, _ in segments]
    chunks = []
    for offset, size in cuts:
        seg_start, seg = segments[bisect.bisect_right(starts, offset) - 1]
        chunks.append(seg[offset - seg_start : offset - seg_start + size])
    return tuple(chunks)


def _copy_range(item: _SaveItem, lo: int, hi: int, into: np.ndarray[Any, Any]) -> None:
    """Bytes ``[lo, hi)`` of ``item``'s stream bytes into ``into`` (a wave's part of it)."""
    if lo == 0 and hi == item.nbytes:
        _copy_item(item, into)
        return
    source = item.source
    if isinstance(source, bytes):
        into[:] = np.frombuffer(source, dtype=np.uint8, count=hi - lo, offset=lo)
    elif source.flags.c_contiguous and source.dtype.isnative:
        into[:] = source.reshape(-1).view(np.uint8)[lo:hi]
    else:
        # Strided or foreign byte order: the elements covering the range, copied once
        # more on purpose (at most the range and two elements, never the whole array).
        size = source.itemsize
        first, last = lo // size, -(-hi // size)
        elements = np.empty(last - first, dtype=source.dtype.newbyteorder("="))
        np.copyto(elements, source.flat[first:last], casting="equiv")
        skip = lo - first * size
        into[:] = elements.view(np.uint8)[skip : skip + hi - lo]


#: A wave's part of one rank: (index of the rank's layout, first chunk, end chunk).
_WavePart = tuple[int, int, int]


def _plan_waves(layouts: Sequence[_RankLayout], limit: int) -> list[list[_WavePart]]:
    """Cut the ranks' streams, in order, into waves of whole chunks of at most ``limit``
    bytes each (a chunk larger than ``limit`` is a wave of its own)."""
    waves: list[list[_WavePart]] = []
    current: list[_WavePart] = []
    used = 0
    for index, layout in enumerate(layouts):
        first = 0
        for c, (_, size) in enumerate(layout.chunks):
            if used and used + size > limit:
                if c > first:
                    current.append((index, first, c))
                waves.append(current)
                current, used, first = [], 0, c
            used += size
        if len(layout.chunks) > first:
            current.append((index, first, len(layout.chunks)))
    if current:
        waves.append(current)
    return waves


def _stage_wave(
    layouts: Sequence[_RankLayout], wave: Sequence[_WavePart], staging: StagingBuffer
) -> list[tuple[_WavePart, tuple[memoryview, ...]]]:
    """Copy a wave's bytes into ``staging``; each part's chunks (CPU bound: run in a thread)."""
    spans = []
    for index, lo, hi in wave:
        cuts = layouts[index].chunks
        spans.append((cuts[lo][0], cuts[hi - 1][0] + cuts[hi - 1][1]))
    buffer = staging.reserve(sum(end - begin for begin, end in spans))
    staged = []
    pos = 0
    for part, (begin, end) in zip(wave, spans, strict=True):
        layout = layouts[part[0]]
        segment = buffer[pos : pos + end - begin]
        for d, item in zip(layout.described, layout.items, strict=True):
            lo, hi = max(begin, item.start), min(end, item.end)
            if lo < hi:
                _copy_range(d, lo - item.start, hi - item.start, segment[lo - begin : hi - begin])
        data = segment.data
        chunks = tuple(
            data[offset - begin : offset - begin + size]
            for offset, size in layout.chunks[part[1] : part[2]]
        )
        staged.append((part, chunks))
        pos += end - begin
    return staged


def _chunk_size_for(store: CheckpointStore, chunk_size: int | None) -> int:
    wanted = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    return min(wanted, store.max_chunk_size)


# --------------------------------------------------------------------------- saving


async def upload_shard(store: CheckpointStore, staged: StagedShard) -> dict[str, Any]:
    """Upload a staged rank's chunks (those the cluster lacks); return its shard entry."""
    ids = await store.put_chunks(staged.chunks)
    return staged.entry(ids)


async def save_shard(
    store: CheckpointStore,
    rank: int,
    state: StateDict,
    *,
    chunk_size: int | None = None,
    staging: StagingBuffer | None = None,
) -> dict[str, Any]:
    """Stage and upload one rank's shard; return its shard entry for the coordinator.

    The entry is a msgpack-able dict; hand every rank's entry to
    ``commit_checkpoint`` on one process. Nothing becomes visible before that.
    """
    staged = await asyncio.to_thread(
        stage_shard, rank, state, _chunk_size_for(store, chunk_size), staging
    )
    return await upload_shard(store, staged)


async def commit_checkpoint(
    store: CheckpointStore,
    name: str,
    shards: Sequence[Mapping[str, Any]],
    *,
    meta: Mapping[str, Any] | None = None,
    created: float | None = None,
) -> CommitResult:
    """Commit the gathered shard entries of every rank as checkpoint ``name``.

    Raises ``InvalidManifest`` (before any request) when the entries do not form a
    valid manifest, and the ``Client.commit`` errors (``MissingChunks``, ``Exists``...).
    """
    manifest = build_manifest(
        shards, created=time.time() if created is None else created, meta=meta
    )
    return await store.commit(name, manifest)


async def _commit_staged(
    store: CheckpointStore,
    name: str,
    staged: Sequence[StagedShard],
    entries: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any] | None,
) -> CommitResult:
    """Commit; if the cluster lost chunks since they were acked (or skipped as held), send
    them again from the staged bytes and commit once more."""
    manifest = build_manifest(entries, created=time.time(), meta=meta)
    try:
        return await store.commit(name, manifest)
    except MissingChunks as exc:
        wanted = set(exc.missing)
        log.info("commit of %s: %d chunks missing, uploading them again", name, len(wanted))
        resend: dict[str, memoryview] = {}
        for shard, entry in zip(staged, entries, strict=True):
            for (chunk, _), view in zip(entry["chunks"], shard.chunks, strict=True):
                if chunk in wanted:
                    resend.setdefault(chunk, view)
        if set(resend) != wanted:
            raise
        await run_all([store.put_chunk(view, chunk) for chunk, view in resend.items()])
        return await store.commit(name, manifest)


async def save_checkpoint(
    store: CheckpointStore,
    name: str,
    states: Mapping[int, StateDict],
    *,
    meta: Mapping[str, Any] | None = None,
    chunk_size: int | None = None,
) -> CommitResult:
    """Save every rank's state (``{rank: state dict}``) and commit them as one checkpoint.

    Large contiguous arrays are uploaded from their own memory: do not change the
    state until this returns. Either the checkpoint is committed, or this raises and
    nothing is visible under ``name``. Ranks whose boxes of a key leave a gap or overlap
    are refused before any upload (``ShardGap``, ``ShardOverlap``).
    """
    size = _chunk_size_for(store, chunk_size)
    staged = await run_all(
        [asyncio.to_thread(stage_shard, rank, state, size, None) for rank, state in states.items()]
    )
    check_layout({shard.rank: shard.items for shard in staged})
    entries = await run_all([upload_shard(store, shard) for shard in staged])
    return await _commit_staged(store, name, staged, entries, meta)


def _stage_part(
    gate: _StagingGate, layout: _RankLayout, chunk_size: int, staging: StagingBuffer
) -> StagedShard:
    """A lazy save's copy of one rank (in a thread); the gate learns its end from here."""
    try:
        staged = _stage_laid_out(layout, chunk_size, staging)
    except BaseException as exc:
        gate.part_done(exc)
        raise
    gate.part_done()
    return staged


class _StepHooks(Protocol):
    """What ``AsyncSaver.hold_optimizer`` needs of an optimizer (``torch.optim`` has it)."""

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any: ...


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What an acknowledged save produced."""

    name: str
    #: Shard entry of every rank saved, by rank.
    shards: dict[int, dict[str, Any]]
    #: None when the save was not asked to commit (multi-process ranks).
    commit: CommitResult | None


class _StagingGate:
    """Opens once every byte of a lazy save is in its staging buffers, or its copy failed.

    Waited on from the loop (``wait``) and, blocking, from any thread (``wait_blocking``:
    an optimizer's step hook). ``parts`` copies each call ``part_done`` once, from any
    thread: the gate opens with the last, in that thread, so a hook blocking the loop's
    own thread still sees it open when the copies need no loop (``needs_loop`` False).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, parts: int, *, needs_loop: bool) -> None:
        self.needs_loop = needs_loop
        self._loop = loop
        self._left = parts
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._opened: asyncio.Future[None] = loop.create_future()
        # The failure is the handle's to report (acked); staged() raises it to who asks.
        self._opened.add_done_callback(lambda f: f.cancelled() or f.exception())
        if parts == 0:
            self._event.set()
            self._opened.set_result(None)

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            if self._left:
                return
        self._event.set()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits there
            self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        if self._opened.done():
            return
        if self._error is None:
            self._opened.set_result(None)
        else:
            self._opened.set_exception(self._error)

    def is_open(self) -> bool:
        return self._event.is_set()

    def wait_blocking(self) -> BaseException | None:
        """Block this thread until the gate opens; the copy's failure, if any."""
        self._event.wait()
        return self._error

    async def wait(self) -> None:
        """Until the gate opens (raises the copy's failure); a cancel leaves it as it is."""
        await asyncio.shield(self._opened)

    async def ended(self) -> None:
        """Until the gate opens, even when cancelled meanwhile (the copies' threads touch
        their staging buffers until then, bounded by their own work); raises nothing of
        the copy's, and ``CancelledError`` after if it was cancelled."""
        cancelled = False
        while not self._opened.done():
            try:
                await asyncio.wait([self._opened])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


@dataclass(eq=False, repr=False)
class SaveHandle:
    """A save in progress, returned by ``AsyncSaver.save`` once the state is staged (or,
    with ``lazy=True``, once its copy has begun: ``staged`` says when it is done)."""

    _store: CheckpointStore
    name: str
    #: Bytes copied (or, lazily, to be copied) into staging buffers.
    staged_bytes: int
    #: Seconds ``save`` took (waiting for a free staging buffer included).
    stall_seconds: float
    _commit: bool
    _gate: _StagingGate | None = None
    _result: asyncio.Future[SaveResult] = field(init=False)

    def __post_init__(self) -> None:
        self._result = asyncio.get_running_loop().create_future()
        self._result.add_done_callback(self._log_unseen_failure)

    def _log_unseen_failure(self, future: asyncio.Future[SaveResult]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("checkpoint save %s failed: %s", self.name, future.exception())

    def done(self) -> bool:
        return self._result.done()

    async def staged(self) -> None:
        """Wait until every byte of the state is copied into staging memory: from then on
        the caller may change it. Raises the copy's failure (then ``acked`` raises it too).
        Returns at once for a save that was not lazy. Cancelling the caller does not
        cancel the copy."""
        if self._gate is not None:
            await self._gate.wait()

    async def acked(self) -> SaveResult:
        """Wait until every chunk is acknowledged and, if committing, the manifest committed.

        Raises the failure of the save; in that case nothing is visible under the name.
        Cancelling the caller does not cancel the save.
        """
        return await asyncio.shield(self._result)

    async def durable(
        self,
        state: str = "nvme",
        timeout: float = 300.0,
    ) -> CheckpointStatus:
        """Wait for ``acked``, then until the checkpoint reaches ``state`` (``WaitTimeout``)."""
        if not self._commit:
            raise RuntimeError("this save does not commit; wait on the committed checkpoint")
        await self.acked()
        return await self._store.wait(self.name, state, timeout)

    def _settle(self, result: SaveResult | BaseException) -> None:
        if self._result.done():
            return
        if isinstance(result, BaseException):
            self._result.set_exception(result)
        else:
            self._result.set_result(result)

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """The save's upload runs in this: its failure is the handle's to report (``acked``
        raises it) and ends there, but for a cancellation or an exit, which propagate too."""
        try:
            yield
        except BaseException as exc:
            self._settle(exc)
            if not isinstance(exc, Exception):
                raise

    async def _conclude(
        self,
        ranks: Iterable[int],
        entries: list[dict[str, Any]],
        commit: Callable[[], Awaitable[CommitResult]],
    ) -> None:
        """Settle with the save's result: the ranks' shard entries (``entries``, in the
        order of ``ranks``) and, when the save commits, what ``commit()`` returns."""
        result = await commit() if self._commit else None
        self._settle(SaveResult(self.name, dict(zip(ranks, entries, strict=True)), result))


class AsyncSaver:
    """Saves that stall the caller only for the copy into host staging buffers.

    ``buffers`` sets of staging buffers (one per rank) are reused from save to save;
    while every set is still uploading, ``save`` waits for one (backpressure).
    Use as ``async with AsyncSaver(client) as saver`` or call ``aclose``.

    ``shm``: with ``None`` (the default), when the client has a shared-memory path to
    the node on this host (``Client(shm=...)``), staged chunks are handed to that node
    as they are, unhashed: the node hashes them (and finds those the cluster holds
    already). ``False``: this saver's uploads take the HTTP way, hashed here, with the
    chunks the cluster holds skipped, whatever the client could do.

    ``staging_budget``: the bytes of host staging memory the saver may hold, all saves
    together. A state larger than half of it is staged in waves of whole chunks, at most
    half the budget each (a chunk larger than that is a wave of its own: give the budget
    two chunks at least): one wave is copied while the one before uploads, and a wave's
    buffer is reused once that wave is acknowledged (``buffers`` is then unused). A save
    that is not lazy returns once its last wave is copied. Its bytes are gone once
    uploaded: a commit refused for chunks the cluster lost meanwhile (``MissingChunks``)
    fails the save instead of sending them again.

    Lazy saves (``save(..., lazy=True)``) return before copying; ``hold_optimizer`` makes
    a torch optimizer's ``step`` wait for their copies, ``staged`` does the same for callers
    without one.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        chunk_size: int | None = None,
        buffers: int = 1,
        shm: bool | None = None,
        staging_budget: int | None = None,
    ) -> None:
        if buffers < 1:
            raise ValueError("buffers must be >= 1")
        if staging_budget is not None and staging_budget < 2:
            raise ValueError("staging_budget must be at least 2 bytes (two waves)")
        self._store = store
        self._shm = shm
        self._chunk_size = chunk_size
        self._free: asyncio.Queue[dict[int, StagingBuffer]] = asyncio.Queue()
        for _ in range(buffers):
            self._free.put_nowait({})
        self._tasks: set[asyncio.Task[Any]] = set()
        # At most one hashing thread per core, as the client's own hashing.
        self._hash_slots = asyncio.Semaphore(max(1, os.cpu_count() or 1))
        #: Two wave buffers of half the budget each, with a budget.
        self._wave_limit = 0 if staging_budget is None else staging_budget // 2
        self._waves: asyncio.Queue[StagingBuffer] | None = None
        if staging_budget is not None:
            self._waves = asyncio.Queue()
            for _ in range(2):
                self._waves.put_nowait(StagingBuffer())
        #: Gates of the lazy saves whose copy may still run (replaced, never changed in
        #: place: a step hook reads it from the training thread).
        self._copying: tuple[_StagingGate, ...] = ()
        self._loop_thread: int | None = None

    async def __aenter__(self) -> AsyncSaver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def prepare(self, states: Mapping[int, StateDict]) -> int:
        """Lay out staging buffers for ``{rank: state dict}`` in every buffer set not in use
        and fault their pages in (in threads), so that the first ``save`` of states of
        this shape stalls no longer than later ones: call it once at start-up, after the
        model and optimizer exist. The bytes prepared; optional (``save`` grows buffers
        as it needs them)."""
        size = _chunk_size_for(self._store, self._chunk_size)
        sizes = await asyncio.to_thread(
            lambda: {rank: staged_size(state, size) for rank, state in states.items()}
        )
        if self._waves is not None:
            return await self._prepare_waves(sum(sizes.values()))
        taken: list[dict[int, StagingBuffer]] = []
        while not self._free.empty():
            taken.append(self._free.get_nowait())
        try:
            faults = [
                in_thread(buffers.setdefault(rank, StagingBuffer()).prefault, n)
                for buffers in taken
                for rank, n in sizes.items()
            ]
            await run_all(faults)
        finally:
            for buffers in taken:
                self._free.put_nowait(buffers)
        return sum(sizes.values()) * len(taken)

    async def _prepare_waves(self, total: int) -> int:
        assert self._waves is not None
        size = min(total, self._wave_limit)
        taken = [self._waves.get_nowait() for _ in range(self._waves.qsize())]
        try:
            await run_all([in_thread(buffer.prefault, size) for buffer in taken])
        finally:
            for buffer in taken:
                self._waves.put_nowait(buffer)
        return size * len(taken)

    async def save(
        self,
        name: str,
        states: Mapping[int, StateDict],
        *,
        meta: Mapping[str, Any] | None = None,
        commit: bool = True,
        lazy: bool = False,
    ) -> SaveHandle:
        """Copy ``{rank: state dict}`` into staging buffers, start the upload, return a handle.

        When this returns the state may be changed freely. With ``commit=False`` the
        ranks' shard entries are the result (``SaveResult.shards``), for a coordinator
        to commit; ``name`` is then only a label. With ``commit``, ranks whose boxes of
        a key leave a gap or overlap are refused here (``ShardGap``, ``ShardOverlap``).

        ``lazy=True``: return as soon as the copy has started in threads (after waiting
        for free staging buffers, as any save); the state must not change until
        ``handle.staged()`` returns, or until a step ``hold_optimizer`` holds. What the
        state's form gets wrong (``TypeError``, ``ShardGap``...) is still raised here; a
        failed copy is raised by ``staged`` and ``acked``.
        """
        if lazy or self._waves is not None:
            return await self._save_laid_out(name, states, meta, commit, lazy)
        began = time.perf_counter()
        size = _chunk_size_for(self._store, self._chunk_size)
        buffers = await self._free.get()
        loop = asyncio.get_running_loop()
        copies = [
            loop.create_task(
                in_thread(stage_shard, rank, state, size, buffers.setdefault(rank, StagingBuffer()))
            )
            for rank, state in states.items()
        ]
        try:
            staged = await run_all(copies)
            if commit:  # the ranks saved here are all of them: refuse a bad layout now
                check_layout({shard.rank: shard.items for shard in staged})
        except BaseException:
            # A rank failed or the caller was cancelled while other ranks' threads may still
            # be copying into their buffers: the set goes back only once they are done.
            self._give_back_after(buffers, copies)
            raise
        handle = SaveHandle(
            self._store,
            name,
            sum(s.nbytes for s in staged),
            time.perf_counter() - began,
            commit,
        )
        # The upload task copies this context: http_only() holds for all it does.
        with http_only() if self._shm is False else contextlib.nullcontext():
            task = asyncio.get_running_loop().create_task(
                self._upload(handle, staged, buffers, meta)
            )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def _save_laid_out(
        self,
        name: str,
        states: Mapping[int, StateDict],
        meta: Mapping[str, Any] | None,
        commit: bool,
        lazy: bool,
    ) -> SaveHandle:
        """``save`` when lazy or in waves: laid out here (no bytes move: cheap), copied
        behind the caller."""
        began = time.perf_counter()
        size = _chunk_size_for(self._store, self._chunk_size)
        layouts = [_lay_out(rank, state, size) for rank, state in states.items()]
        if commit:  # the ranks saved here are all of them: refuse a bad layout now
            check_layout({layout.rank: layout.items for layout in layouts})
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        total = sum(layout.size for layout in layouts)
        work: Callable[[SaveHandle], Coroutine[Any, Any, None]]
        if self._waves is None:
            buffers = await self._free.get()
            gate = _StagingGate(loop, len(layouts), needs_loop=False)
            # Submitted now, not when the loop next runs: the copy proceeds while the
            # caller computes, even on the loop's own thread.
            copies = [
                loop.run_in_executor(
                    None,
                    _stage_part,
                    gate,
                    layout,
                    size,
                    buffers.setdefault(layout.rank, StagingBuffer()),
                )
                for layout in layouts
            ]

            def work(handle: SaveHandle) -> Coroutine[Any, Any, None]:
                return self._upload_lazy(handle, gate, copies, buffers, meta)
        else:
            # One part: the save's own task opens the gate after the last wave's copy.
            gate = _StagingGate(loop, 1, needs_loop=True)

            def work(handle: SaveHandle) -> Coroutine[Any, Any, None]:
                return self._upload_in_waves(handle, gate, layouts, meta)

        handle = SaveHandle(self._store, name, total, 0.0, commit, gate)
        with http_only() if self._shm is False else contextlib.nullcontext():
            task = loop.create_task(work(handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if lazy:
            self._copying = (*(g for g in self._copying if not g.is_open()), gate)
        else:
            try:
                await handle.staged()  # in waves: the state may change once all are copied
            except asyncio.CancelledError:
                task.cancel()  # the caller will change the state: this save cannot stand
                raise
        handle.stall_seconds = time.perf_counter() - began
        return handle

    async def _upload_lazy(
        self,
        handle: SaveHandle,
        gate: _StagingGate,
        copies: Sequence[asyncio.Future[StagedShard]],
        buffers: dict[int, StagingBuffer],
        meta: Mapping[str, Any] | None,
    ) -> None:
        try:
            await gate.ended()  # every copy's thread is past the buffers once it is open
            outcomes = await asyncio.gather(*copies, return_exceptions=True)
        except BaseException as exc:
            self._free.put_nowait(buffers)
            handle._settle(exc)
            raise
        staged = [o for o in outcomes if not isinstance(o, BaseException)]
        if len(staged) < len(outcomes):
            self._free.put_nowait(buffers)
            handle._settle(next(o for o in outcomes if isinstance(o, BaseException)))
            return
        await self._upload(handle, staged, buffers, meta)

    async def _upload_in_waves(
        self,
        handle: SaveHandle,
        gate: _StagingGate,
        layouts: Sequence[_RankLayout],
        meta: Mapping[str, Any] | None,
    ) -> None:
        assert self._waves is not None
        ids = [[""] * len(layout.chunks) for layout in layouts]
        uploads: list[asyncio.Task[None]] = []
        try:
            with handle._reporting():
                await self._stage_and_upload_waves(gate, layouts, ids, uploads)
                entries = [
                    ShardEntry(
                        layout.rank,
                        tuple(zip(chunk_ids, (n for _, n in layout.chunks), strict=True)),
                        layout.items,
                    ).to_wire()
                    for layout, chunk_ids in zip(layouts, ids, strict=True)
                ]
                await handle._conclude(
                    (layout.rank for layout in layouts),
                    entries,
                    lambda: commit_checkpoint(self._store, handle.name, entries, meta=meta),
                )
        finally:
            # Each wave's buffer goes back only once its upload (and hashing) has ended.
            for upload in uploads:
                upload.cancel()
            if uploads:
                await asyncio.wait(uploads)
            for upload in uploads:  # the first failure is the save's; the rest its echo
                if not upload.cancelled():
                    upload.exception()

    async def _stage_and_upload_waves(
        self,
        gate: _StagingGate,
        layouts: Sequence[_RankLayout],
        ids: list[list[str]],
        uploads: list[asyncio.Task[None]],
    ) -> None:
        """Copy the waves in turn, each uploaded (into ``ids``) while the next is copied;
        every upload started is in ``uploads``. Returns once all are done."""
        assert self._waves is not None
        try:
            for wave in _plan_waves(layouts, self._wave_limit):
                staging = await self._waves.get()
                try:
                    for upload in uploads:  # a failed wave fails the save: stop copying
                        if upload.done():
                            upload.result()
                    parts = await in_thread(_stage_wave, layouts, wave, staging)
                except BaseException:
                    self._waves.put_nowait(staging)
                    raise
                uploads.append(asyncio.create_task(self._upload_wave(parts, ids, staging)))
        except BaseException as exc:
            gate.part_done(exc)
            raise
        gate.part_done()
        await run_all(uploads)

    async def _upload_wave(
        self,
        parts: Sequence[tuple[_WavePart, tuple[memoryview, ...]]],
        ids: list[list[str]],
        staging: StagingBuffer,
    ) -> None:
        assert self._waves is not None
        try:
            got = await run_all([self._put(chunks) for _, chunks in parts])
            for ((index, lo, hi), _), chunk_ids in zip(parts, got, strict=True):
                ids[index][lo:hi] = chunk_ids
        finally:
            self._waves.put_nowait(staging)

    async def staged(self) -> None:
        """Wait until the copy of every lazy save in progress is done: from then on the
        states they were given may change. Raises the error of the first of them whose
        copy fails meanwhile; a copy that had failed before is its handle's to report
        (as for ``hold_optimizer``)."""
        self._copying = tuple(gate for gate in self._copying if not gate.is_open())
        for gate in self._copying:
            await gate.wait()

    def hold_optimizer(self, optimizer: _StepHooks) -> Any:
        """Make every ``optimizer.step()`` first wait for the copy of each lazy save in
        progress (``register_step_pre_hook``; the handle it returns ``remove()``s it).

        The wait blocks the step's thread. It works on any thread, the event loop's own
        included, for saves without a staging budget (their copies need no loop). A save
        in waves needs the loop to upload the waves before the last: if one is still
        copying when the loop's own thread steps, the hook raises ``RuntimeError`` instead
        of deadlocking; ``await saver.staged()`` before the step there. A failed copy does
        not stop the step: its handle reports it."""

        def hold(*_: Any) -> None:
            self.wait_staged_blocking()

        return optimizer.register_step_pre_hook(hold)

    def wait_staged_blocking(self) -> None:
        """``staged`` for a synchronous caller: block this thread until the copy of every
        lazy save in progress is done (see ``hold_optimizer`` for the loop's own thread)."""
        on_loop = threading.get_ident() == self._loop_thread
        for gate in self._copying:
            if gate.is_open():
                continue
            if on_loop and gate.needs_loop:
                raise RuntimeError(
                    "a lazy save in waves is still copying and its waves need the event loop "
                    "this thread runs: await saver.staged() before the optimizer step"
                )
            gate.wait_blocking()

    async def _upload(
        self,
        handle: SaveHandle,
        staged: Sequence[StagedShard],
        buffers: dict[int, StagingBuffer],
        meta: Mapping[str, Any] | None,
    ) -> None:
        try:
            with handle._reporting():
                entries = await run_all([self._upload_shard(shard) for shard in staged])
                await handle._conclude(
                    (shard.rank for shard in staged),
                    entries,
                    lambda: _commit_staged(self._store, handle.name, staged, entries, meta),
                )
        finally:
            # run_all has waited for every rank's upload, and each of those for its hashing
            # threads: nothing reads the staged bytes any more.
            self._free.put_nowait(buffers)

    async def _upload_shard(self, staged: StagedShard) -> dict[str, Any]:
        """``upload_shard`` whose hashing threads are the saver's own, so that a failed or
        cancelled upload ends only once none of them reads the staging buffer any more
        (the client's hashing threads would go on after a cancel)."""
        return staged.entry(await self._put(staged.chunks))

    async def _put(self, chunks: Sequence[memoryview]) -> list[str]:
        """Upload staged chunks; their ids, in order (see ``_upload_shard``)."""
        if usable(getattr(self._store, "shm", None)) is not None:
            # The node hashes what it is handed (and dedups): hashing here would be a pass
            # over the bytes for nothing. Each copy into shared memory ends with its thread.
            return await run_all([self._store.put_chunk(chunk) for chunk in chunks])

        async def group(lo: int) -> list[str]:
            part = chunks[lo : lo + _HASH_GROUP]
            ids = await run_all([self._chunk_id(chunk) for chunk in part])
            return await self._store.put_chunks(part, ids)

        groups = await run_all([group(lo) for lo in range(0, len(chunks), _HASH_GROUP)])
        return [chunk for ids in groups for chunk in ids]

    async def _chunk_id(self, chunk: memoryview) -> str:
        if len(chunk) <= _INLINE_HASH_BYTES:
            return chunk_id_of(chunk)
        async with self._hash_slots:
            return await in_thread(chunk_id_of, chunk)

    def _give_back_after(
        self, buffers: dict[int, StagingBuffer], tasks: Sequence[asyncio.Task[Any]]
    ) -> None:
        """Return ``buffers`` to the pool once every one of ``tasks`` (each ending with its
        thread) is done; ``aclose`` waits for that too."""
        pending = {task for task in tasks if not task.done()}

        def done(task: asyncio.Task[Any]) -> None:
            pending.discard(task)
            if not task.cancelled():
                task.exception()  # save raised the first failure; the others are its echo
            if not pending:
                self._free.put_nowait(buffers)

        for task in tasks:
            if task.done():
                if not task.cancelled():
                    task.exception()
                continue
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(done)
        if not pending:
            self._free.put_nowait(buffers)

    async def aclose(self) -> None:
        """Wait for the saves in flight to finish (their outcome stays on their handles),
        and for the staging threads of failed saves."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


# --------------------------------------------------------------------------- restoring


class _ByteBudget:
    """At most ``limit`` bytes held at once (a single larger request is let through alone)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, size: int) -> None:
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._used == 0 or self._used + size <= self._limit
            )
            self._used += size

    async def release(self, size: int) -> None:
        async with self._changed:
            self._used -= size
            self._changed.notify_all()


Target = np.ndarray[Any, Any] | Shard | None


def _requests(
    manifest: Manifest,
    targets: Mapping[str, Target],
    dtype_map: Mapping[str, Any] | None,
) -> tuple[list[Request], list[np.ndarray[Any, Any] | None], dict[str, np.ndarray[Any, Any]]]:
    requests: list[Request] = []
    arrays: list[np.ndarray[Any, Any] | None] = []
    allocated: dict[str, np.ndarray[Any, Any]] = {}
    for key, target in targets.items():
        saved = manifest.items_of(key)[0][1]
        if target is None:
            if saved.dtype in VALUE_DTYPES:
                requests.append(Request(key, (), Box((), ()), None))
                arrays.append(None)
                continue
            dtype = numpy_dtype(saved.dtype, dtype_map)
            assert dtype is not None
            array: np.ndarray[Any, Any] = np.empty(saved.global_shape, dtype=dtype)
            allocated[key] = array
            target = array
        if isinstance(target, Shard):
            if target.dtype is not None and target.dtype != saved.dtype:
                raise DtypeMismatch(f"{key}: saved as {saved.dtype}, requested {target.dtype}")
            array, global_shape, offsets = target.array, target.global_shape, target.offsets
        elif isinstance(target, np.ndarray):
            array, global_shape, offsets = target, target.shape, (0,) * target.ndim
        else:
            raise TypeError(f"{key}: restore target must be an ndarray, a Shard or None")
        if not array.flags.writeable:
            raise ValueError(f"{key}: destination array is read-only")
        requests.append(
            Request(
                key,
                tuple(global_shape),
                Box(tuple(offsets), tuple(array.shape)),
                array.dtype,
                bool(array.flags.c_contiguous),
            )
        )
        arrays.append(array)
    return requests, arrays, allocated


async def restore_checkpoint(
    store: CheckpointStore,
    checkpoint: str | Manifest | Mapping[str, Any],
    targets: Mapping[str, Target] | None = None,
    *,
    dtype_map: Mapping[str, Any] | None = None,
    holders: RestorePlanDoc | None = None,
    coalesce_gap: int = DEFAULT_COALESCE_GAP,
    max_tile: int = DEFAULT_MAX_TILE,
    staging_budget: int = DEFAULT_RESTORE_BUDGET,
) -> dict[str, Any]:
    """Fill ``targets`` from a checkpoint (a name, or its manifest); return what was not given.

    ``targets`` maps keys to an ndarray (the whole global array), a ``Shard`` (a box
    of it) or None (allocate the whole array, or decode a msgpack value); every such
    None key is in the returned dict. ``targets=None`` restores every key that way.
    Arrays are written in place. ``dtype_map`` maps saved dtype names to numpy
    dtypes (e.g. ``{"bfloat16": np.uint16}``). ``holders`` (from ``Client.plan``) is
    fetched when a name is given.

    Raises ``KeyNotSaved``, ``ShapeMismatch``, ``DtypeMismatch``, ``RegionNotCovered``
    before any chunk is read; client errors (``ChunkNotFound``...) while reading.
    """
    if isinstance(checkpoint, str):
        if holders is None:
            doc, holders = await asyncio.gather(
                store.get_manifest(checkpoint), store.plan(checkpoint)
            )
        else:
            doc = await store.get_manifest(checkpoint)
        # in a thread, as the plan: at 405B on 1,024 ranks the check takes 40-60 ms of CPU
        manifest = await asyncio.to_thread(Manifest.from_wire, doc, chunks_on_read=True)
    elif isinstance(checkpoint, Manifest):
        manifest = checkpoint
    else:
        manifest = await asyncio.to_thread(Manifest.from_wire, checkpoint, chunks_on_read=True)
    wanted: Mapping[str, Target] = dict.fromkeys(manifest.keys()) if targets is None else targets
    requests, arrays, allocated = _requests(manifest, wanted, dtype_map)
    plan = await asyncio.to_thread(
        plan_restore,
        manifest,
        requests,
        dtype_map=dtype_map,
        coalesce_gap=coalesce_gap,
        max_tile=max_tile,
    )
    values = await execute_restore(
        store, manifest, plan, arrays, holders=holders, staging_budget=staging_budget
    )
    result: dict[str, Any] = dict(allocated)
    for request, value in values.items():
        result[plan.requests[request].key] = value
    missing = [key for key in wanted if wanted[key] is None and key not in result]
    if missing:  # cannot happen unless the plan lost a request
        raise KeyNotSaved(f"not restored: {missing}")
    return result


def _copy_letting_go(pair: list[np.ndarray[Any, Any]]) -> None:
    """``np.copyto(dest, source)`` of ``pair``, emptied first. An executor's work item keeps
    its arguments until its thread takes the next one: a staging buffer passed directly
    outlived its release of the restore's budget, and the next tile was allocated beside
    it (one tile over the budget, measured: tests/client/test_restore_budget_rss.py)."""
    dest, source = pair
    pair.clear()
    np.copyto(dest, source)


def _chunk_sizes(manifest: Manifest, plan: RestorePlan) -> Mapping[str, int]:
    """The sizes of the chunks of the shards the plan reads (a plan made elsewhere may not
    say: then every shard's)."""
    if plan.chunk_sizes is not None:
        return plan.chunk_sizes
    return {chunk: size for shard in manifest.shards for chunk, size in shard.chunks}


async def execute_restore(
    store: CheckpointStore,
    manifest: Manifest,
    plan: RestorePlan,
    arrays: Sequence[np.ndarray[Any, Any] | None],
    *,
    holders: RestorePlanDoc | None = None,
    staging_budget: int = DEFAULT_RESTORE_BUDGET,
) -> dict[int, Any]:
    """Run a ``RestorePlan``: fetch in parallel, write into ``arrays`` (one per request).

    Returns the decoded msgpack values by request index.
    """
    sizes = _chunk_sizes(manifest, plan)
    targets: list[memoryview | None] = [
        _flat_bytes(a) if a is not None and a.flags.c_contiguous else None for a in arrays
    ]
    value_buffers = [bytearray(v.length) for v in plan.values]
    budget = _ByteBudget(staging_budget)

    def destination(kind: str, index: int, staging: memoryview | None) -> memoryview:
        if kind == "target":
            view = targets[index]
            assert view is not None, "direct write planned into a non-contiguous array"
            return view
        if kind == "value":
            return memoryview(value_buffers[index])
        assert staging is not None
        return staging

    async def fetch(item: Fetch, staging: memoryview | None = None) -> None:
        full = item.start == 0 and item.end == sizes.get(item.chunk)
        byte_range = None if full else ByteRange(item.start, item.end)
        known = holders.get(item.chunk) if holders is not None else None
        if item.direct:
            part = item.parts[0]
            into = destination(part.kind, part.index, staging)
            await store.get_chunk(
                item.chunk,
                into[part.offset : part.offset + part.length],
                byte_range,
                holders=known,
            )
            return
        # Several small pieces share one request: one bounce copy each, on purpose.
        data = await store.get_chunk(item.chunk, None, byte_range, holders=known)
        for part in item.parts:
            into = destination(part.kind, part.index, staging)
            into[part.offset : part.offset + part.length] = data[part.src : part.src + part.length]

    async def staged(copy: StagedCopy) -> None:
        await budget.acquire(copy.size)
        try:
            buffer = np.empty(copy.size, dtype=np.uint8)
            view = buffer.data
            await run_all([fetch(f, view) for f in copy.fetches])
            array = arrays[copy.target]
            assert array is not None
            source: np.ndarray[Any, Any] = np.ndarray(
                copy.shape, dtype=array.dtype, buffer=buffer, offset=0, strides=copy.strides
            )
            dest = (array.reshape(1) if array.ndim == 0 else array)[copy.dest.slices()]
            if copy.size > _INLINE_COPY_BYTES:
                await asyncio.to_thread(_copy_letting_go, [dest, source])
            else:
                np.copyto(dest, source)
        finally:
            await budget.release(copy.size)

    await run_all([*(fetch(f) for f in plan.fetches), *(staged(s) for s in plan.staged)])
    # msgpack values decoded; a DCP-saved value stays the bytes torch.save made of it
    # (decoding them means unpickling: the caller decides, see storaged.client.formats)
    return {
        read.request: msgpack.unpackb(bytes(buffer), raw=False)
        if read.dtype == MSGPACK_DTYPE
        else bytes(buffer)
        for read, buffer in zip(plan.values, value_buffers, strict=True)
    }
