"""Background stages of a chunk's life: drain, encode, repair, GC, scrub (one module each)."""

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
