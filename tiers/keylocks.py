"""One asyncio lock per key: the tiers' (a put or delete of a key at a time) and the
node's (one change of a chunk's holdings at a time)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _KeyLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class KeyLocks:
    """One asyncio lock per key, created on demand and dropped once no one holds or
    waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _KeyLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[key]

    def busy(self, key: str) -> bool:
        """Whether ``key``'s lock is held or waited for."""
        return key in self._locks

    def users(self, key: str) -> int:
        """How many hold or wait for ``key``'s lock."""
        entry = self._locks.get(key)
        return entry.users if entry is not None else 0
