"""The checkpoint the restore and save benchmarks move, and saving it into storaged.

- ``Layout``: a checkpoint of ``keys`` float32 tensors of ``rows`` x 64 KiB rows, sharded by
  rows over ranks. Its bytes are a function of (seed, key, global offset) alone, so any
  process can make or check any box of it without the others (``fill``, ``check``); every
  64 KiB block starts with a distinct stamp, so no two chunks of it are equal (no dedup).
- ``StoragedSave`` (one rank's ``AsyncSaver`` save, a ``WorkerPool`` job),
  ``commit_entries`` and ``save_checkpoint_with`` (all ranks, then the commit).
- ``StoragedRestore`` (one rank's ``restore_checkpoint``, a ``WorkerPool`` job) into
  ``empty_box`` arrays, checked with ``verify_box``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from loadtest.harness.machine import GB
from loadtest.harness.trace import traced_runner
from loadtest.harness.workers import Prepared, WorkerPool, wall_seconds
from storaged.client import AsyncSaver, Client, Shard, commit_checkpoint, restore_checkpoint
from storaged.client.layout import DEFAULT_CHUNK_SIZE

ROW_BYTES = 64 << 10


#: float32 elements per row
COLS = ROW_BYTES // 4


#: rows of the repeated random pattern (1 MiB): stamps make every block distinct
_PATTERN_ROWS = 16


_patterns: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}


def _pattern(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if seed not in _patterns:
        raw = blake3.blake3(b"loadtest.pattern" + seed.to_bytes(8, "big")).digest(
            length=_PATTERN_ROWS * ROW_BYTES
        )
        _patterns[seed] = np.frombuffer(raw, dtype=np.uint8).reshape(_PATTERN_ROWS, ROW_BYTES)
    return _patterns[seed]


@dataclass(frozen=True)
class Layout:
    """``keys`` tensors ``layers.<i>.weight`` of shape (rows, COLS) float32, made from ``seed``."""

    keys: int
    rows: int
    seed: int = 1

    @classmethod
    def of_size(cls, nbytes: int, keys: int, seed: int = 1, multiple: int = 1) -> Layout:
        """About ``nbytes`` in ``keys`` tensors whose row count is a multiple of ``multiple``."""
        rows = nbytes // (keys * ROW_BYTES)
        rows -= rows % multiple
        if keys < 1 or rows < 1:
            raise ValueError(f"{nbytes} bytes do not make {keys} tensors of {multiple}+ rows")
        return cls(keys, rows, seed)

    def with_seed(self, seed: int) -> Layout:
        return Layout(self.keys, self.rows, seed)

    @property
    def key_bytes(self) -> int:
        return self.rows * ROW_BYTES

    @property
    def nbytes(self) -> int:
        return self.keys * self.key_bytes

    @property
    def global_shape(self) -> tuple[int, int]:
        return (self.rows, COLS)

    def key(self, index: int) -> str:
        return f"layers.{index}.weight"

    def box(self, rank: int, ranks: int) -> tuple[int, int]:
        """Rows [start, end) that ``rank`` of ``ranks`` holds of every tensor."""
        return self.rows * rank // ranks, self.rows * (rank + 1) // ranks

    def empty(self, rank: int, ranks: int) -> dict[str, np.ndarray[Any, Any]]:
        """Pre-faulted (written once) destination arrays of ``rank``'s boxes."""
        start, end = self.box(rank, ranks)
        out = {}
        for i in range(self.keys):
            array = np.empty((end - start, COLS), dtype=np.float32)
            array.view(np.uint8).fill(0)  # touch every page now, not inside a timed window
            out[self.key(i)] = array
        return out

    def fill(self, key: int, start_row: int, out: np.ndarray[Any, Any]) -> None:
        """Write the rows of tensor ``key`` from ``start_row`` on into ``out`` (len(out) rows)."""
        rows = out.view(np.uint8).reshape(-1, ROW_BYTES)
        pattern = _pattern(self.seed)
        for phase in range(min(_PATTERN_ROWS, len(rows))):
            rows[phase::_PATTERN_ROWS] = pattern[(start_row + phase) % _PATTERN_ROWS]
        stamps = np.empty((len(rows), 2), dtype=">u8")
        stamps[:, 0] = (self.seed << 32) | key
        stamps[:, 1] = (start_row + np.arange(len(rows), dtype=np.uint64)) * ROW_BYTES
        rows[:, :16] = stamps.view(np.uint8).reshape(-1, 16)

    def make(self, rank: int, ranks: int) -> dict[str, np.ndarray[Any, Any]]:
        """``rank``'s boxes of every tensor, filled."""
        start, _ = self.box(rank, ranks)
        arrays = self.empty(rank, ranks)
        for i in range(self.keys):
            self.fill(i, start, arrays[self.key(i)])
        return arrays

    def check(self, key: int, start_row: int, got: np.ndarray[Any, Any], step: int = 256) -> bool:
        """Whether ``got`` holds exactly the rows of tensor ``key`` from ``start_row`` on."""
        rows = got.view(np.uint8).reshape(-1, ROW_BYTES)
        want = np.empty((min(step, len(rows)), COLS), dtype=np.float32)
        for lo in range(0, len(rows), step):
            part = rows[lo : lo + step]
            expected = want[: len(part)]
            self.fill(key, start_row + lo, expected)
            if not np.array_equal(part, expected.view(np.uint8).reshape(-1, ROW_BYTES)):
                return False
        return True


def chunk_pieces(layout: Layout, arrays: dict[str, np.ndarray[Any, Any]], chunk: int) -> list[
    tuple[int, int, memoryview]
]:  # fmt: skip
    """(key index, first row, bytes) of every chunk-sized piece of a rank's boxes, in order."""
    rows_per_piece = max(1, chunk // ROW_BYTES)
    out = []
    for i in range(layout.keys):
        flat = arrays[layout.key(i)].view(np.uint8).reshape(-1)
        for lo in range(0, len(flat), rows_per_piece * ROW_BYTES):
            out.append((i, lo // ROW_BYTES, flat.data[lo : lo + rows_per_piece * ROW_BYTES]))
    return out


@dataclass(frozen=True)
class StoragedSave:
    """Save rank ``rank`` of ``ranks`` with ``AsyncSaver`` (no commit: the parent commits)."""

    urls: tuple[str, ...]
    token: str | None
    name: str
    layout: Layout
    rank: int
    ranks: int
    client_concurrency: int = 8
    chunk: int = DEFAULT_CHUNK_SIZE
    loop: str = "uvloop"
    warm_stall: bool = True

    def prepare(self) -> Prepared:
        return _StoragedSaver(self)


class _StoragedSaver:
    def __init__(self, job: StoragedSave) -> None:
        self.job = job
        start, _ = job.layout.box(job.rank, job.ranks)
        arrays = job.layout.make(job.rank, job.ranks)
        shape = job.layout.global_shape
        self.state = {key: Shard(a, shape, (start, 0)) for key, a in arrays.items()}
        self.runner, self.client = traced_runner(
            job.urls, job.token, job.client_concurrency, job.loop
        )
        self.saver = AsyncSaver(self.client, chunk_size=job.chunk)

    def run(self) -> dict[str, Any]:
        return self.runner.run(self._run())

    async def _run(self) -> dict[str, Any]:
        handle = await self.saver.save(self.job.name, {self.job.rank: self.state}, commit=False)
        stalled = time.monotonic()
        result = await handle.acked()
        stats = self.client.stats
        return {
            "stall": handle.stall_seconds,
            "stalled_at": stalled,
            "acked_at": time.monotonic(),
            "bytes": handle.staged_bytes,
            "entry": result.shards[self.job.rank],
            "uploaded": stats.bytes_uploaded,
            "skipped": stats.bytes_skipped,
            "retries": stats.retries,
            "put_latencies": list(self.client.log.put_latencies),
        }

    def check(self) -> dict[str, Any]:
        if not self.job.warm_stall:
            return {}

        async def again() -> float:
            # The same state again: staging buffers are warm, every chunk is held already.
            handle = await self.saver.save(
                self.job.name + "-again", {self.job.rank: self.state}, commit=False
            )
            await handle.acked()
            return handle.stall_seconds

        return {"stall_warm": self.runner.run(again())}

    def close(self) -> None:
        try:
            self.runner.run(self.saver.aclose())
            self.runner.run(self.client.close())
        finally:
            self.runner.close()


async def _commit(
    urls: Sequence[str], token: str | None, name: str, entries: Sequence[dict[str, Any]]
) -> float:
    async with Client(list(urls), token=token) as client:
        t0 = time.monotonic()
        await commit_checkpoint(client, name, entries, meta={"loadtest": "save"})
        return time.monotonic() - t0


def commit_entries(
    urls: Sequence[str], token: str | None, name: str, results: Sequence[dict[str, Any]]
) -> float:
    """Commit the ranks' shard entries as ``name``; the seconds the commit took."""
    entries = [r["entry"] for r in results]
    with asyncio.Runner() as runner:
        return runner.run(_commit(urls, token, name, entries))


def save_checkpoint_with(
    pool: WorkerPool,
    urls: Sequence[str],
    token: str | None,
    name: str,
    layout: Layout,
    ranks: int,
    chunk: int = DEFAULT_CHUNK_SIZE,
    client_concurrency: int = 8,
) -> dict[str, Any]:
    """Save ``layout`` from ``ranks`` processes of ``pool`` and commit it as ``name``."""
    jobs = [
        StoragedSave(tuple(urls), token, name, layout, r, ranks, client_concurrency, chunk,
                     warm_stall=False)
        for r in range(ranks)
    ]  # fmt: skip
    results = pool.run(jobs)
    commit_s = commit_entries(urls, token, name, results)
    seconds = wall_seconds(results)
    return {
        "bytes": sum(r["bytes"] for r in results),
        "ack_seconds": round(seconds, 3),
        "ack_gbps": round(sum(r["bytes"] for r in results) / GB / seconds, 4),
        "commit_seconds": round(commit_s, 3),
    }


def empty_box(layout: Layout, rank: int, ranks: int) -> tuple[int, dict[str, np.ndarray[Any, Any]]]:
    """(first row, pre-faulted destination arrays) of ``rank``'s box of every tensor."""
    start, _ = layout.box(rank, ranks)
    return start, layout.empty(rank, ranks)


def verify_box(layout: Layout, start: int, arrays: dict[str, np.ndarray[Any, Any]]) -> bool:
    """Whether ``arrays`` hold every tensor's rows from ``start`` on."""
    return all(layout.check(i, start, arrays[layout.key(i)]) for i in range(layout.keys))


@dataclass(frozen=True)
class StoragedRestore:
    """``restore_checkpoint`` of rank ``rank`` of ``ranks``' box of every tensor."""

    urls: tuple[str, ...]
    token: str | None
    name: str
    layout: Layout
    rank: int
    ranks: int
    client_concurrency: int = 8
    loop: str = "uvloop"
    verify: bool = True

    def prepare(self) -> Prepared:
        return _StoragedRestorer(self)


class _StoragedRestorer:
    def __init__(self, job: StoragedRestore) -> None:
        self.job = job
        self.start, self.arrays = empty_box(job.layout, job.rank, job.ranks)
        shape = job.layout.global_shape
        self.targets = {k: Shard(a, shape, (self.start, 0)) for k, a in self.arrays.items()}
        self.runner, self.client = traced_runner(
            job.urls, job.token, job.client_concurrency, job.loop
        )

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.runner.run(restore_checkpoint(self.client, self.job.name, self.targets))
        log, stats = self.client.log, self.client.stats
        return {
            "bytes": sum(a.nbytes for a in self.arrays.values()),
            "ttfb": None if log.first_byte is None else log.first_byte - t0,
            "latencies": list(log.get_latencies),
            "tier_bytes": dict(log.tier_bytes),
            "requests": stats.requests,
            "retries": stats.retries,
            "failovers": stats.failovers,
        }

    def check(self) -> dict[str, Any]:
        return {"verified": verify_box(self.job.layout, self.start, self.arrays)
                if self.job.verify else None}  # fmt: skip

    def close(self) -> None:
        try:
            self.runner.run(self.client.close())
        finally:
            self.runner.close()
