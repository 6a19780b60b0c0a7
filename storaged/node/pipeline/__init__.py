"""Background stages of a chunk's life: drain, encode, repair, GC, scrub (one module each).

Drain, encode and rebalance share one shape: a queue of chunk ids, taken one at a time by
a fixed number of workers (``ChunkWorkers``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class Workers:
    """A fixed number of worker tasks of one stage, started and stopped together."""

    def __init__(self, name: str, count: int, work: Callable[[], Coroutine[Any, Any, None]]):
        self._name = name
        self._count = count
        self._work = work
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for i in range(self._count):
            self._tasks.append(asyncio.create_task(self._work(), name=f"{self._name}-{i}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()


class ChunkWorkers:
    """A stage's queue of chunk ids and the ``count`` workers that take them one at a time.

    With ``dedup``, a chunk offered while it is *pending* is not queued again: pending from
    its offer until a worker takes it or, with ``pending_while_handled``, until its
    ``handle`` returns. Subclasses say what a chunk's turn does (``handle``) and what a
    failure does (``failed``: called inside the ``except``, so it may log the traceback);
    ``offered`` and ``taken`` are for their gauges. A failure never stops a worker.
    """

    def __init__(
        self, name: str, count: int, *, dedup: bool = True, pending_while_handled: bool = False
    ) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._pending: set[str] = set()
        self._dedup = dedup
        self._pending_while_handled = pending_while_handled
        self._workers = Workers(name, count, self._worker)

    def start(self) -> None:
        self._workers.start()

    async def close(self) -> None:
        await self._workers.close()

    def offer(self, chunk_id: str) -> None:
        if self._dedup:
            if chunk_id in self._pending:
                return
            self._pending.add(chunk_id)
        self._queue.put_nowait(chunk_id)
        self.offered(chunk_id)

    @property
    def queued(self) -> int:
        """Chunks offered and not yet taken by a worker."""
        return self._queue.qsize()

    @property
    def pending(self) -> int:
        """Chunks offered and not yet done with (what ``dedup`` keeps from being queued)."""
        return len(self._pending)

    async def handle(self, chunk_id: str) -> None:
        raise NotImplementedError

    def failed(self, chunk_id: str, exc: Exception) -> None:
        raise NotImplementedError

    def offered(self, chunk_id: str) -> None:
        """A chunk was queued (for the stage's backlog gauge)."""

    def taken(self, chunk_id: str) -> None:
        """A worker took a chunk (for the stage's backlog gauge)."""

    async def _worker(self) -> None:
        while True:
            cid = await self._queue.get()
            if not self._pending_while_handled:
                self._pending.discard(cid)
            self.taken(cid)
            try:
                await self.handle(cid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed(cid, exc)
            finally:
                if self._pending_while_handled:
                    self._pending.discard(cid)
