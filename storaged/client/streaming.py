"""Saving and restoring with memory bounded by a few chunks, whatever the checkpoint's size.

``upload_stream`` cuts a byte stream into chunks as it is read: a fixed pool of
chunk buffers circulates between one reader thread and the uploads, so at most
``window`` chunks are held at once and reading overlaps uploading. ``upload_source``
lays a ``Source``'s items out as ``stage_shard`` does (``pack_stream``: small items
packed first, large ones on chunk boundaries of their own, so that they dedup)
and returns the rank's shard entry; the manifest is the one API.md describes.

``restore_blocks`` restores a checkpoint's items in manifest order as blocks of
rows of at most about ``budget`` bytes, through the resharding restore
(``restore_checkpoint`` with ``Shard`` targets), one window fetching while the
previous one is written: a writer sees every item's bytes in order and never
holds more than two windows.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storaged.client.checkpoint import Shard, restore_checkpoint
from storaged.client.client import Client, RestorePlanDoc
from storaged.client.formats import (
    FILE_PREFIX,
    HEADER_PREFIX,
    STORAGE_DTYPES,
    OutputItem,
    Source,
)
from storaged.client.layout import VALUE_DTYPES, Item, Manifest, ShardEntry, pack_stream

#: Chunks in flight (read, hashed or uploading) during a streamed save.
DEFAULT_WINDOW = 6
#: Bytes of one restore window; two are held at once.
DEFAULT_RESTORE_WINDOW = 32 << 20


@dataclass
class Counters:
    """Bytes read from the input (save) or written to the output (restore), for progress."""

    read: int = 0
    written: int = 0


async def upload_stream(
    client: Client,
    fill: Callable[[memoryview], int],
    chunk_size: int,
    *,
    window: int = DEFAULT_WINDOW,
    counters: Counters | None = None,
) -> list[tuple[str, int]]:
    """Upload the chunks ``fill`` produces; ``[(chunk id, size), ...]`` in stream order.

    ``fill(buffer)`` runs in a thread, writes the next chunk into ``buffer`` (at most
    ``chunk_size`` bytes) and returns its length, 0 at the end. Each chunk is hashed,
    checked against what the cluster holds and sent if missing; the first failure
    cancels the rest and is raised.
    """
    if window < 1 or chunk_size < 1:
        raise ValueError("window and chunk_size must be >= 1")
    free: asyncio.Queue[np.ndarray[Any, np.dtype[np.uint8]]] = asyncio.Queue()
    for _ in range(window):
        free.put_nowait(np.empty(chunk_size, dtype=np.uint8))
    results: list[tuple[str, int]] = []
    tasks: list[asyncio.Task[None]] = []

    async def upload(index: int, buffer: np.ndarray[Any, np.dtype[np.uint8]], size: int) -> None:
        try:
            (chunk,) = await client.put_chunks([buffer.data[:size]])
            results[index] = (chunk, size)
        finally:
            free.put_nowait(buffer)

    try:
        while True:
            buffer = await free.get()
            for task in tasks:  # a failed upload stops the reading at once
                if task.done() and task.exception() is not None:
                    await task
            size = await asyncio.to_thread(fill, buffer.data)
            if size == 0:
                break
            if counters is not None:
                counters.read += size
            results.append(("", size))
            tasks.append(asyncio.create_task(upload(len(results) - 1, buffer, size)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def _stream_reader(
    source: Source, chunk_size: int
) -> tuple[Callable[[memoryview], int], tuple[int, ...]]:
    """``fill`` for ``upload_stream`` over the source's stream, and each item's start."""
    layout = pack_stream([item.nbytes for item in source.items], chunk_size)
    order = sorted(range(len(source.items)), key=lambda i: layout.starts[i])
    starts = [layout.starts[i] for i in order]
    chunks = iter(layout.chunks)

    def fill(into: memoryview) -> int:
        try:
            offset, size = next(chunks)
        except StopIteration:
            return 0
        end = offset + size
        # The last item starting at or before the chunk (the first of those starting there:
        # an empty item shares its start with the next one, and the one that straddles
        # into the chunk may be sorted before it); then every item up to the chunk's end.
        position = max(0, bisect.bisect_right(starts, offset) - 1)
        while position > 0 and starts[position - 1] == starts[position]:
            position -= 1
        while position < len(order) and starts[position] < end:
            item = source.items[order[position]]
            lo, hi = max(offset, starts[position]), min(end, starts[position] + item.nbytes)
            if hi > lo:
                item.read(lo - starts[position], into[lo - offset : hi - offset])
            position += 1
        return size

    return fill, layout.starts


async def upload_source(
    client: Client,
    source: Source,
    chunk_size: int,
    *,
    window: int = DEFAULT_WINDOW,
    counters: Counters | None = None,
    rank: int = 0,
) -> dict[str, Any]:
    """Upload a source's items as one rank's stream; return its shard entry (API.md)."""
    fill, starts = _stream_reader(source, chunk_size)
    chunks = await upload_stream(client, fill, chunk_size, window=window, counters=counters)
    items = []
    for item, start in zip(source.items, starts, strict=True):
        shape = item.shape
        zeros = (0,) * len(shape)
        items.append(Item(item.key, item.dtype, shape, zeros, shape, start, item.nbytes))
    return ShardEntry(rank, tuple(chunks), tuple(items)).to_wire()


async def upload_sequential(
    client: Client,
    read: Callable[[memoryview], int],
    chunk_size: int,
    *,
    key: str = "data",
    window: int = DEFAULT_WINDOW,
    counters: Counters | None = None,
) -> dict[str, Any]:
    """Upload a stream of unknown length (e.g. stdin) as one ``uint8`` item ``key``.

    ``read(buffer)`` is ``readinto``: it may return less than asked; 0 is the end.
    """

    def fill(into: memoryview) -> int:
        done = 0
        while done < len(into):
            n = read(into[done:])
            if not n:
                break
            done += n
        return done

    chunks = await upload_stream(client, fill, chunk_size, window=window, counters=counters)
    size = sum(n for _, n in chunks)
    item = Item(key, "uint8", (size,), (0,), (size,), 0, size)
    return ShardEntry(0, tuple(chunks), (item,)).to_wire()


# --------------------------------------------------------------------------- restore


def is_side_item(manifest: Manifest, key: str) -> bool:
    """Whether ``key`` is a shard directory's header or side file (``config.json``...),
    not a tensor: only a directory restore writes those."""
    return "safetensors_shards" in manifest.meta and key.startswith((HEADER_PREFIX, FILE_PREFIX))


def output_items(manifest: Manifest, *, side_files: bool = False) -> list[OutputItem]:
    """Each key of a checkpoint once, in manifest order, with its global shape; a shard
    directory's headers and side files only with ``side_files``."""
    out = []
    for key in manifest.keys():  # noqa: SIM118 - Manifest.keys is a method, not a mapping
        if not side_files and is_side_item(manifest, key):
            continue
        saved = manifest.items_of(key)[0][1]
        out.append(OutputItem(key, saved.dtype, tuple(saved.global_shape)))
    return out


@dataclass(frozen=True, slots=True)
class Block:
    """Rows ``[row, row + len(array))`` of an item (all of it when ``first and last``)."""

    item: OutputItem
    first: bool
    last: bool
    array: np.ndarray[Any, Any] | None
    #: The decoded value of a non-tensor item.
    value: Any = None


def _blocks(item: OutputItem, budget: int) -> list[tuple[int, int]]:
    """Row ranges of ``item`` of at most ``budget`` bytes (at least one row each)."""
    if not item.shape or item.shape[0] == 0 or item.nbytes <= budget:
        return [(0, item.shape[0] if item.shape else 1)]
    row = item.nbytes // item.shape[0]
    rows = max(1, budget // max(row, 1))
    return [(lo, min(lo + rows, item.shape[0])) for lo in range(0, item.shape[0], rows)]


async def restore_blocks(
    client: Client,
    manifest: Manifest,
    holders: RestorePlanDoc | None,
    *,
    budget: int = DEFAULT_RESTORE_WINDOW,
    side_files: bool = False,
    values: bool = True,
) -> AsyncIterator[Block]:
    """Every item of ``manifest`` in order (``output_items``), as row blocks, fetched a
    window ahead; non-tensor values only with ``values``."""
    # (item, first row, end row, first block?, last block?), grouped into windows
    windows: list[list[tuple[OutputItem, int, int, bool, bool]]] = [[]]
    used = 0
    for item in output_items(manifest, side_files=side_files):
        if not values and item.dtype in VALUE_DTYPES:
            continue
        ranges = _blocks(item, budget) if item.dtype not in VALUE_DTYPES else [(0, 1)]
        rows = max(1, item.shape[0]) if item.shape else 1
        for index, (lo, hi) in enumerate(ranges):
            size = item.nbytes * (hi - lo) // rows
            if windows[-1] and used + size > budget:
                windows.append([])
                used = 0
            windows[-1].append((item, lo, hi, index == 0, index == len(ranges) - 1))
            used += size
    plan = [w for w in windows if w]

    async def fetch(window: Sequence[tuple[OutputItem, int, int, bool, bool]]) -> list[Block]:
        targets: dict[str, Any] = {}
        for item, lo, hi, _, _ in window:
            if item.dtype in VALUE_DTYPES:
                targets[item.key] = None
                continue
            dtype = np.dtype(STORAGE_DTYPES.get(item.dtype, item.dtype))
            shape = (hi - lo, *item.shape[1:]) if item.shape else ()
            array = np.empty(shape, dtype=dtype)
            offsets = (lo,) + (0,) * (len(item.shape) - 1) if item.shape else ()
            targets[item.key] = Shard(array, item.shape, offsets, item.dtype)
        values = await restore_checkpoint(
            client, manifest, targets, dtype_map=STORAGE_DTYPES, holders=holders
        )
        blocks = []
        for item, _, _, first, last in window:
            target = targets[item.key]
            if target is None:
                blocks.append(Block(item, True, True, None, values[item.key]))
            else:
                blocks.append(Block(item, first, last, target.array))
        return blocks

    pending: asyncio.Task[list[Block]] | None = (
        asyncio.create_task(fetch(plan[0])) if plan else None
    )
    following: asyncio.Task[list[Block]] | None = None
    try:
        for position in range(len(plan)):
            assert pending is not None
            blocks = await pending
            following = None
            for index, block in enumerate(blocks):
                yield block
                if index == 0 and position + 1 < len(plan):
                    # Only now: the caller has let go of the previous window's last block,
                    # so two windows are held at most, this one and the one fetching.
                    following = asyncio.create_task(fetch(plan[position + 1]))
            del blocks
            pending, following = following, None
    finally:
        for task in (pending, following):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def nbytes_of(manifest: Manifest, *, side_files: bool = False) -> int:
    """The bytes of every item's global array (what a restored file holds, headers aside)."""
    return sum(item.nbytes for item in output_items(manifest, side_files=side_files))
