"""The DRAM tier, which is also the node's buffer pool.

The service receives chunk bodies straight into buffers from ``allocate()`` (the view
of the ``Allocation`` handle it returns) and hands the handle to ``put()``, which keeps
the buffer by reference: one copy of the bytes (socket -> buffer) on the way in.
Readers borrow the stored bytes with ``lease()``: no copy on the way out either.

Memory accounting and the pool, the policy callers may rely on:

* Buffers come in size classes (8 per doubling, multiples of 4 KiB, so an 8 MiB
  chunk takes exactly an 8 MiB buffer and no value wastes more than 1/8 of its
  size). Everything is counted by its buffer's class size.
* ``capacity`` bounds *all* the memory the pool holds: stored values, outstanding
  allocations, buffers of deleted values still under a lease, and free pooled
  buffers kept for reuse. Free buffers are trimmed (unmapped) whenever room is
  needed for a buffer of another class, and by ``trim()``.
* ``usage().used`` is what is *not* free: stored values, outstanding allocations
  and leased leftovers. ``used + stats().free_bytes <= capacity`` always holds.
* New buffers are anonymous ``mmap``s populated by the kernel (``MAP_POPULATE``) in
  a worker thread: measured 2.4 ms per 8 MiB against 5-6 ms for ``bytearray(n)``,
  and the populate runs without the GIL, so the event loop keeps going.

Dirty and clean: a new value is dirty (only in RAM). ``mark_clean(key)`` says it was
drained to disk; only clean values are evicted (least recently used first, ``get``
and ``lease`` refresh recency), never dirty ones. Allocations and copying puts that
find no room evict clean values, then wait up to their timeout for room (a delete, a
``mark_clean``, a ``release`` or the end of a lease wakes them), then raise
``TierFull``. Waiting is not strictly first-come first-served.

``get()`` (the generic tier interface) returns a view that stays valid forever
without a copy: the buffer it points into is *detached* from the pool, so when the
value is later deleted or evicted that buffer is dropped (freed once the caller's
views die) instead of being reused. The hot paths of the service use ``lease()``,
which lets the buffer go back to the pool as soon as the last lease ends.

This tier checks BLAKE3 on ``put`` (unless told the caller did) and does not re-hash
on reads: the bytes never leave this process' memory.

Shared segments (the co-located fast path, ``storaged.front.shm``): ``lease_shared``
reserves a buffer's worth of capacity and backs it with a fresh ``memfd`` whose pages
are already allocated, for a client on the same host to map and fill. Its size is fixed
from then on (grow and shrink seals, added before anyone else sees it): a client can
neither make it hold more than is counted (by ``ftruncate``, ``fallocate`` or writes
past its end) nor shrink it under the node's mapping. ``seal_shared`` adds the write
seal (the kernel refuses while any writable mapping of it remains, so from then on
nobody can change the bytes), checks its size once more, maps it read-only here and
turns it into an ordinary allocation, which ``put`` adopts without a copy or
``release`` frees. A sealed segment is never reused: its buffer is dropped, not pooled,
when the value goes. ``release_shared`` ends a lease that was never sealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from erasure.content import chunk_id_of
from tiers.base import (
    ByteRange,
    BytesLike,
    ChunkNotFound,
    ChunkStat,
    CorruptChunk,
    Tier,
    TierError,
    TierFull,
    TierUsage,
    check_chunk_id,
    chunk_id_of_async,
)

_T = TypeVar("_T")

PAGE = 4096
#: Below this, hashing or copying costs less than a hop to a worker thread.
_INLINE_BYTES = 64 * 1024
#: Below this, mapping a new buffer costs less than a hop to a worker thread.
_INLINE_MAP_BYTES = 256 * 1024


def size_class(size: int) -> int:
    """The buffer size that holds ``size`` bytes: 0, or a multiple of 4 KiB less than 1/8 above."""
    if size < 0:
        raise ValueError(f"negative size {size}")
    if size == 0:
        return 0
    if size <= PAGE:
        return PAGE
    step = max(PAGE, 1 << ((size - 1).bit_length() - 4))
    return -(-size // step) * step


def _map_buffer(nbytes: int) -> mmap.mmap | bytearray:
    """A zeroed, pre-faulted buffer of ``nbytes`` (a multiple of 4 KiB, or 0)."""
    if nbytes == 0:
        return bytearray()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    if not getattr(mmap, "MAP_POPULATE", 0):  # not Linux: touch every page ourselves
        memoryview(buf)[::PAGE] = bytes(len(range(0, nbytes, PAGE)))
    return buf


#: mappings of a shared segment set up whole at once (the pages exist: fallocate made
#: them), not one fault per 4 KiB page as it is first touched
SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: a lease's size is fixed when it is handed out: what the client stages into is what is
#: counted (no ``ftruncate``, no ``fallocate`` and no write past the end succeeds)
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS = fcntl.F_SEAL_WRITE | _SIZE_SEALS | fcntl.F_SEAL_SEAL


class SealRefused(TierError):
    """A shared segment could not be sealed: a writable mapping of it still exists, its
    size is not the one leased, or the length is outside it. Nothing was stored; the lease
    stays the caller's to release."""


def _new_memfd(nbytes: int) -> int:
    """A memfd of ``nbytes`` whose pages are allocated now (so a mapping does not fault
    them in one by one while a client stages into it), its size sealed."""
    fd = os.memfd_create("storaged-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _seal_and_map(fd: int, nbytes: int) -> mmap.mmap:
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise SealRefused("the segment is still mapped writable: unmap it first") from exc
        raise SealRefused(f"cannot seal the segment: {exc}") from exc
    # Sealed, the size cannot change any more: checked now, it is what is kept. (The size
    # seals of the lease make this hold already; a held memfd larger than counted would
    # escape the capacity, a smaller one could not be mapped.)
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise SealRefused(
            f"the segment is {size} bytes, not the {nbytes} leased: nothing stored, release it"
        )
    return mmap.mmap(fd, nbytes, flags=SHARED_POPULATED, prot=mmap.PROT_READ)


class SharedSegment:
    """A leased memfd of ``nbytes`` (a size class) for a value of up to ``size`` bytes.

    ``fd`` is the tier's; the caller passes a duplicate to the client and must not close
    it. Ends through exactly one of ``MemoryTier.seal_shared`` or ``release_shared``."""

    __slots__ = ("fd", "nbytes", "size")

    def __init__(self, fd: int, nbytes: int, size: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.size = size


class _Buffer:
    """One pooled buffer and what holds it."""

    __slots__ = ("detached", "fd", "leases", "mem", "nbytes", "stored")

    def __init__(self, mem: mmap.mmap | bytearray, nbytes: int, fd: int = -1) -> None:
        self.mem = mem
        self.nbytes = nbytes
        self.leases = 0
        #: a view escaped through get(): never reuse, drop when no longer stored
        self.detached = False
        #: an index entry refers to it
        self.stored = False
        #: the sealed memfd behind a shared buffer (kept to hand read-only copies out), or -1
        self.fd = fd


class Allocation:
    """A buffer lent by ``MemoryTier.allocate`` (or a sealed shared segment): its one
    handle from the allocation to its end. ``view`` is exactly the size asked (writable,
    but read-only for a sealed segment). The handle is the caller's until it passes it to
    ``put`` or ``put_local_copy`` (which take it over, stored or not) or to ``release``;
    after that neither the handle nor its view may be used, and passing it again (or a
    handle of another tier) is a ``ValueError``."""

    __slots__ = ("_buf", "view")

    def __init__(self, buf: _Buffer, view: memoryview, lent: set[Allocation]) -> None:
        self.view = view
        #: the pool buffer while the caller holds the handle, None once given back
        self._buf: _Buffer | None = buf
        lent.add(self)

    @property
    def outstanding(self) -> bool:
        """Whether the handle is still the caller's (not yet put or released)."""
        return self._buf is not None


def _take(allocation: Allocation, lent: set[Allocation]) -> _Buffer:
    """The pool buffer of ``allocation``, which ends the handle (``lent``: its tier's
    outstanding ones). ``ValueError`` for a handle not among them, or no handle at all."""
    buf = allocation._buf if isinstance(allocation, Allocation) else None
    if buf is None or allocation not in lent:
        raise ValueError("not an outstanding allocation of this tier")
    lent.remove(allocation)
    allocation._buf = None
    return buf


@dataclass(slots=True)
class _Entry:
    buf: _Buffer
    size: int
    dirty: bool


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """A snapshot of the pool, for metrics and tests. Byte counts are buffer (class) sizes."""

    capacity: int
    #: stored values + outstanding allocations + leased leftovers of deleted values
    used: int
    #: free pooled buffers kept for reuse (counted against capacity too)
    free_bytes: int
    free_buffers: int
    count: int
    #: bytes of the values themselves (unrounded)
    value_bytes: int
    dirty_count: int
    dirty_bytes: int
    #: clean values no lease holds: what eviction could free now
    evictable_bytes: int
    allocations: int
    allocated_bytes: int
    leases: int


class _Pool:
    """The buffer pool: pooled buffers by size class and the memory they count. ``used``
    (every buffer not free) plus the free buffers never exceed ``capacity``; room is made
    by trimming free buffers of other classes, then by ``evict`` (the tier's least
    recently used clean, unleased value; ``evictable``: the bytes it could free in all).
    Waiters for room are woken by ``wake``. ``closed`` is the tier's: closed, it hands
    out nothing and keeps nothing."""

    def __init__(
        self,
        capacity: int,
        *,
        evictable: Callable[[], int],
        evict: Callable[[], bool],
        dirty_bytes: Callable[[], int],
    ) -> None:
        self.capacity = capacity
        self._evictable = evictable
        self._evict = evict
        self._dirty_bytes = dirty_bytes
        self.free: dict[int, list[_Buffer]] = {}
        self.free_bytes = 0
        self.free_count = 0
        self.used = 0  # class bytes of every buffer not in the free lists
        self.waiters: list[asyncio.Future[None]] = []
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise TierError("memory tier is closed")

    def put_free(self, buf: _Buffer) -> None:
        self.free.setdefault(buf.nbytes, []).append(buf)
        self.free_bytes += buf.nbytes
        self.free_count += 1

    def trim(self) -> int:
        """Unmap every free buffer; returns the bytes released."""
        released = self.free_bytes
        self.free.clear()
        self.free_bytes = 0
        self.free_count = 0
        return released

    def unreserve(self, nbytes: int) -> None:
        """Give back ``nbytes`` counted as used for memory that never became a buffer."""
        self.used -= nbytes
        self.wake()

    async def prefault(self, nbytes: int, count: int) -> int:
        added = 0
        while added < count and self.used + self.free_bytes + nbytes <= self.capacity:
            self.used += nbytes  # held while it is being mapped
            try:
                mem = await asyncio.to_thread(_map_buffer, nbytes)
            finally:
                if not self.closed:
                    self.used -= nbytes
            if self.closed:
                break
            self.put_free(_Buffer(mem, nbytes))
            self.wake()
            added += 1
        return added

    def recycle(self, buf: _Buffer) -> None:
        """A buffer nobody holds any more: back to the free lists, or dropped."""
        if buf.fd >= 0:
            os.close(buf.fd)  # the mapping keeps the pages for views still alive
            buf.fd = -1
        if self.closed:
            return
        self.used -= buf.nbytes
        if not (buf.detached or self.closed):
            self.put_free(buf)
        self.wake()

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def take_free(self, nbytes: int) -> _Buffer | None:
        free = self.free.get(nbytes)
        if not free:
            return None
        buf = free.pop()
        self.free_bytes -= nbytes
        self.free_count -= 1
        self.used += nbytes
        return buf

    def trim_one(self, keep: int) -> None:
        """Unmap one free buffer, of another class than ``keep`` when there is one."""
        victim = next((n for n, bufs in self.free.items() if bufs and n != keep), keep)
        self.free[victim].pop()
        self.free_bytes -= victim
        self.free_count -= 1

    def try_reserve(self, nbytes: int) -> _Buffer | bool | None:
        """Without waiting: a pooled buffer, True (``nbytes`` of new memory reserved: map
        it), or None (no room even after trimming and evicting all that may be)."""
        buf = self.take_free(nbytes)
        if buf is not None:
            return buf
        if self.used + nbytes - self._evictable() > self.capacity:
            return None  # evicting everything evictable would not be enough: evict nothing
        while self.used + self.free_bytes + nbytes > self.capacity:
            if self.free_bytes:
                self.trim_one(nbytes)
            elif not self._evict():
                return None
            else:
                buf = self.take_free(nbytes)
                if buf is not None:
                    return buf
        self.used += nbytes
        return True

    async def reserve(self, nbytes: int, timeout: float) -> None:
        """Count ``nbytes`` of new memory as used (for a shared segment): a pooled buffer
        of that class, if one is free, is unmapped to make the room."""
        # A pooled buffer it returns is dropped: its bytes stay counted, now for the segment.
        await self.acquire(nbytes, timeout, map_new=False)

    async def acquire(self, nbytes: int, timeout: float, map_new: bool = True) -> _Buffer:
        if nbytes > self.capacity:
            raise TierFull(f"{nbytes} bytes can never fit in a {self.capacity}-byte memory tier")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.check_open()
            got = self.try_reserve(nbytes)
            if isinstance(got, _Buffer):
                return got
            if got and not map_new:
                return _Buffer(bytearray(), nbytes)
            if got:
                try:
                    if nbytes <= _INLINE_MAP_BYTES:
                        mem = _map_buffer(nbytes)
                    else:
                        mem = await asyncio.to_thread(_map_buffer, nbytes)
                except BaseException as exc:
                    self.used -= nbytes
                    self.wake()
                    if isinstance(exc, (MemoryError, OSError)):
                        raise TierFull(f"cannot map {nbytes} bytes: {exc}") from exc
                    raise
                return _Buffer(mem, nbytes)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TierFull(
                    f"no room for {nbytes} bytes within {timeout}s: {self.used} used"
                    f" ({self._dirty_bytes()} dirty) of {self.capacity}"
                )
            fut: asyncio.Future[None] = loop.create_future()
            self.waiters.append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass  # loop once more: room may have come with the deadline
            finally:
                if fut in self.waiters:
                    self.waiters.remove(fut)

    async def run_on_buffer(self, buf: _Buffer, fn: Callable[[], _T], nbytes: int) -> _T:
        """``fn()`` (which reads or writes ``buf``) in a worker thread unless small.

        If it fails, ``buf`` is recycled, and if the caller is cancelled meanwhile, only
        once the thread has let go of it: a buffer is never reused under a running copy.
        """
        if nbytes <= _INLINE_BYTES:
            try:
                return fn()
            except BaseException:
                self.recycle(buf)
                raise
        task = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self.recycle_after(t, buf))
            raise
        except BaseException:
            self.recycle(buf)
            raise

    def recycle_after(self, task: asyncio.Future[Any], buf: _Buffer) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: the caller was cancelled and no longer cares
        self.recycle(buf)


class _Index:
    """The values held: each key's buffer and size, dirty ones in arrival order (the
    drain's), clean ones least recently used first (eviction's), and the byte counts the
    pool makes room by (``evictable``: clean values no lease holds). A buffer no lease
    holds any more goes to ``recycle`` when its value leaves."""

    def __init__(self, recycle: Callable[[_Buffer], None]) -> None:
        self._recycle = recycle
        self.entries: dict[str, _Entry] = {}
        # Clean values, least recently used first; dirty ones in arrival order (drain order).
        self.clean: OrderedDict[str, None] = OrderedDict()
        self.dirty: dict[str, None] = {}
        #: keys whose value is a local copy kept for reads only (``put_local_copy``)
        self.local_copies: set[str] = set()
        self.value_bytes = 0
        self.dirty_bytes = 0
        self.evictable = 0  # class bytes of clean, unleased entries

    def lookup(self, key: str) -> _Entry:
        entry = self.entries.get(key)
        if entry is None:
            check_chunk_id(key)
            raise ChunkNotFound(key)
        return entry

    def touch(self, key: str, entry: _Entry) -> None:
        if not entry.dirty:
            self.clean.move_to_end(key)

    def insert(self, key: str, buf: _Buffer, size: int) -> None:
        buf.stored = True
        self.entries[key] = _Entry(buf, size, dirty=True)
        self.dirty[key] = None
        self.dirty_bytes += size
        self.value_bytes += size

    def make_held(self, key: str) -> None:
        """A local copy becomes this tier's held value of ``key``: dirty (to be drained)."""
        self.local_copies.discard(key)
        entry = self.entries[key]
        if not entry.dirty:
            entry.dirty = True
            del self.clean[key]
            if entry.buf.leases == 0:
                self.evictable -= entry.buf.nbytes
            self.dirty[key] = None
            self.dirty_bytes += entry.size

    def remove(self, key: str) -> _Entry:
        entry = self.entries.pop(key)
        self.local_copies.discard(key)
        buf = entry.buf
        self.value_bytes -= entry.size
        if entry.dirty:
            del self.dirty[key]
            self.dirty_bytes -= entry.size
        else:
            del self.clean[key]
            if buf.leases == 0:
                self.evictable -= buf.nbytes
        buf.stored = False
        if buf.leases == 0:
            self._recycle(buf)
        return entry


class MemoryTier(Tier):
    """Chunks in RAM, bounded by ``capacity`` bytes; the node's buffer pool.

    ``put_timeout`` is how long ``allocate`` (by default) and copying ``put`` wait for
    room before ``TierFull``. ``on_evict(key)`` is called (on the event loop) for each
    value evicted to make room; it is not called for ``delete``.
    """

    name = "memory"

    def __init__(
        self,
        capacity: int,
        *,
        put_timeout: float = 5.0,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"negative capacity {capacity}")
        self._put_timeout = put_timeout
        self._on_evict = on_evict
        #: handles lent by ``allocate`` and ``seal_shared`` and not yet given back
        self._allocations: set[Allocation] = set()
        self._leases = 0
        #: shared segments leased and neither sealed nor released
        self._shared: set[SharedSegment] = set()
        self._pool = _Pool(
            capacity,
            evictable=lambda: self._index.evictable,
            evict=self._evict_one,
            dirty_bytes=lambda: self._index.dirty_bytes,
        )
        self._index = _Index(self._pool.recycle)

    # --- the buffer pool -------------------------------------------------------------

    async def allocate(self, size: int, timeout: float | None = None) -> Allocation:
        """A writable, pre-faulted buffer of exactly ``size`` bytes (the handle's ``view``),
        counted against capacity.

        Makes room by evicting clean values, then waits up to ``timeout`` seconds (default
        ``put_timeout``) for room, then raises ``TierFull`` (at once when ``size`` can
        never fit). The handle is the caller's until it passes it to ``put`` (which always
        takes it over, stored or not) or to ``release``. Its bytes are not zeroed when
        reused from the pool.
        """
        self._pool.check_open()
        nbytes = size_class(size)
        buf = await self._pool.acquire(nbytes, self._put_timeout if timeout is None else timeout)
        return Allocation(buf, memoryview(buf.mem)[:size], self._allocations)

    def release(self, allocation: Allocation) -> None:
        """Give back a handle from ``allocate`` that was not passed to ``put``.

        Raises ``ValueError`` for anything else (a handle already released or put, or
        another tier's). The caller must not touch the view afterwards: its memory will
        be reused.
        """
        self._pool.recycle(_take(allocation, self._allocations))

    async def prefault(self, size: int, count: int) -> int:
        """Map ``count`` free buffers for values of ``size`` bytes ahead of need, as far as
        capacity allows without evicting. Returns how many were added."""
        self._pool.check_open()
        return await self._pool.prefault(size_class(size), count)

    def trim(self) -> int:
        """Unmap every free pooled buffer; returns the bytes released."""
        return self._pool.trim()

    # --- shared segments --------------------------------------------------------------

    async def lease_shared(self, size: int, timeout: float | None = None) -> SharedSegment:
        """A memfd for a value of ``size`` (> 0) bytes, its class size counted against
        capacity as an allocation is (same waiting, same ``TierFull``). The memfd's size
        is sealed at that class size: whoever holds it can write its bytes, not resize it."""
        self._pool.check_open()
        if size <= 0:
            raise ValueError("a shared segment holds at least one byte")
        nbytes = size_class(size)
        await self._pool.reserve(nbytes, self._put_timeout if timeout is None else timeout)
        try:
            fd = await asyncio.to_thread(_new_memfd, nbytes)
        except BaseException as exc:
            self._pool.unreserve(nbytes)
            if isinstance(exc, OSError):
                raise TierFull(f"cannot create a {nbytes}-byte shared segment: {exc}") from exc
            raise
        if self._pool.closed:
            os.close(fd)
            raise TierError("memory tier is closed")
        seg = SharedSegment(fd, nbytes, size)
        self._shared.add(seg)
        return seg

    def release_shared(self, seg: SharedSegment) -> None:
        """End a lease that was not sealed: the memfd is closed, its room given back.
        Idempotent (a segment already sealed or released is left alone)."""
        if seg not in self._shared:
            return
        self._shared.remove(seg)
        os.close(seg.fd)
        if not self._pool.closed:
            self._pool.unreserve(seg.nbytes)

    async def seal_shared(self, seg: SharedSegment, length: int) -> Allocation:
        """Seal ``seg`` against every write, map it read-only here and return its first
        ``length`` bytes as an allocation (for ``put``, which adopts it, ``put_local_copy``
        or ``release``).

        Raises ``SealRefused`` (a writable mapping remains, the memfd is not the size
        leased, or a bad length): the lease is then still the caller's."""
        self._pool.check_open()
        if seg not in self._shared:
            raise ValueError("not an outstanding shared segment of this tier")
        if not 0 < length <= seg.size:
            raise SealRefused(f"length {length} outside the leased {seg.size} bytes")
        mem = await asyncio.to_thread(_seal_and_map, seg.fd, seg.nbytes)
        if seg not in self._shared:  # released meanwhile (tier closed)
            mem.close()
            raise TierError("memory tier is closed")
        self._shared.remove(seg)
        buf = _Buffer(mem, seg.nbytes, seg.fd)
        buf.detached = True  # sealed: never back to the pool
        return Allocation(buf, memoryview(mem)[:length], self._allocations)

    def is_shared(self, key: str) -> bool:
        """Whether the value of ``key`` lives in a sealed shared segment."""
        entry = self._index.entries.get(key)
        return entry is not None and entry.buf.fd >= 0

    @contextlib.asynccontextmanager
    async def lease_fd(self, key: str) -> AsyncIterator[tuple[int, int]]:
        """Like ``lease``, for a value in a shared segment: (its sealed memfd, its size),
        valid until the block ends (hand out a duplicate, never the fd itself). Raises
        ``ChunkNotFound`` when ``key`` is not held or not in a shared segment."""
        entry = self._index.lookup(key)
        if entry.buf.fd < 0:
            raise ChunkNotFound(key)
        async with self.lease(key) as view:
            yield entry.buf.fd, view.nbytes

    # --- the tier interface -----------------------------------------------------------

    async def put(self, key: str, data: BytesLike | Allocation, *, verified: bool = False) -> None:
        """Store ``data`` under ``key`` as a dirty value.

        An ``Allocation`` of this tier is stored by reference and belongs to the tier from
        this call on, whatever the outcome: on any error it is released, and after success
        the caller must not write to its view (a handle not outstanding: ``ValueError``).
        Bytes are copied into a pool buffer (waiting up to ``put_timeout`` for room, then
        ``TierFull``). BLAKE3(data) must equal ``key`` unless ``verified``: otherwise
        ``CorruptChunk`` and nothing is stored. A key already held is left as it is.
        """
        if isinstance(data, Allocation):
            self._pool.check_open()  # closed, the tier dropped every handle already
            buf = _take(data, self._allocations)
            await self._put_allocated(key, data.view, buf, verified)
        else:
            await self._put_copy(key, data, verified)

    async def _put_allocated(
        self, key: str, view: memoryview, buf: _Buffer, verified: bool
    ) -> None:
        try:
            self._pool.check_open()
            check_chunk_id(key)
        except BaseException:
            self._pool.recycle(buf)
            raise
        if not verified:
            digest = await self._pool.run_on_buffer(buf, partial(chunk_id_of, view), view.nbytes)
            if digest != key:
                self._pool.recycle(buf)
                raise CorruptChunk(key, f"BLAKE3 of the data is {digest}")
        self._keep(key, buf, view.nbytes)

    async def _put_copy(self, key: str, data: BytesLike, verified: bool) -> None:
        self._pool.check_open()
        check_chunk_id(key)
        src = memoryview(data).cast("B")
        if key in self._index.entries:
            if not verified:
                digest = await chunk_id_of_async(src)
                if digest != key:
                    raise CorruptChunk(key, f"BLAKE3 of the data is {digest}")
            if key in self._index.local_copies:
                self._index.make_held(key)
            return
        try:
            buf = await self._pool.acquire(size_class(src.nbytes), self._put_timeout)
        except TierFull:
            # bad input is reported as such
            if not verified and await chunk_id_of_async(src) != key:
                raise CorruptChunk(key, "BLAKE3 of the data does not match") from None
            raise
        dst = memoryview(buf.mem)[: src.nbytes]
        # The one deliberate copy of this path. Hashing our copy rather than the source
        # guarantees that what is stored is what was checked.
        fill = partial(_copy_and_hash, dst, src, not verified)
        copied: str | None = await self._pool.run_on_buffer(buf, fill, src.nbytes)
        if not verified and copied != key:
            self._pool.recycle(buf)
            raise CorruptChunk(key, f"BLAKE3 of the data is {copied}")
        self._keep(key, buf, src.nbytes)

    def _keep(self, key: str, buf: _Buffer, size: int) -> None:
        """The end of a checked put: ``buf`` becomes the value of ``key``, or, when the tier
        closed or ``key`` got a value meanwhile, goes back (a local copy of ``key`` is held
        from now on: the put's bytes are the key's)."""
        if self._pool.closed or key in self._index.entries:
            self._pool.recycle(buf)
            if key in self._index.local_copies:
                self._index.make_held(key)
            return
        self._index.insert(key, buf, size)

    async def get(self, key: str, byte_range: ByteRange | None = None) -> memoryview:
        """A read-only view of the value (or a slice), valid for as long as the caller keeps
        it, without a copy: see the module docstring ("detached" buffers)."""
        self._pool.check_open()
        entry = self._index.lookup(key)
        start, end = (byte_range or ByteRange()).resolve(entry.size)
        entry.buf.detached = True
        self._index.touch(key, entry)
        return memoryview(entry.buf.mem)[start:end].toreadonly()

    @contextlib.asynccontextmanager
    async def lease(
        self, key: str, byte_range: ByteRange | None = None
    ) -> AsyncIterator[memoryview]:
        """Borrow the stored bytes: yields a read-only view, valid until the block ends.

        While a lease is held the value may be deleted or evicted (it leaves the index at
        once) but its buffer is not reused before the last lease on it ends. The view is
        released when the block ends: keep no other view or buffer export of it after that.
        Raises ``ChunkNotFound``, ``InvalidRange``.
        """
        self._pool.check_open()
        entry = self._index.lookup(key)
        start, end = (byte_range or ByteRange()).resolve(entry.size)
        buf = entry.buf
        if buf.leases == 0 and not entry.dirty:
            self._index.evictable -= buf.nbytes
        buf.leases += 1
        self._leases += 1
        self._index.touch(key, entry)
        view = memoryview(buf.mem)[start:end].toreadonly()
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):  # the caller still exports it: its problem
                view.release()
            buf.leases -= 1
            self._leases -= 1
            if buf.leases == 0:
                if self._pool.closed:
                    pass
                elif not buf.stored:
                    self._pool.recycle(buf)
                else:
                    current = self._index.entries.get(key)
                    if current is not None and current.buf is buf and not current.dirty:
                        self._index.evictable += buf.nbytes
                        self._pool.wake()

    def has(self, key: str) -> bool:
        """Whether ``key`` has a value here now, a local copy included (a value may be
        evicted right after, once clean)."""
        return key in self._index.entries

    def holds(self, key: str) -> bool:
        """Whether ``key`` is held as a copy of its own: ``has``, and not a local copy."""
        return key in self._index.entries and key not in self._index.local_copies

    def is_local_copy(self, key: str) -> bool:
        return key in self._index.local_copies

    async def put_local_copy(self, key: str, allocation: Allocation) -> bool:
        """Keep ``allocation`` (of this tier, checked against ``key``: a sealed shared
        segment) under ``key`` as a *local copy*: a clean value that serves reads here and
        nothing else. It is never drained, ``holds`` is False for it, and it is evicted
        like any clean value when room is needed. A ``put`` of the same key later makes it
        a held, dirty value (its bytes are the key's). The handle belongs to the tier from
        this call on; False (and released) when ``key`` has a value already. A handle not
        outstanding: ``ValueError``."""
        self._pool.check_open()  # closed, the tier dropped every handle already
        buf = _take(allocation, self._allocations)
        if self._pool.closed or key in self._index.entries:
            self._pool.recycle(buf)
            return False
        check_chunk_id(key)
        self._index.insert(key, buf, allocation.view.nbytes)
        self._index.local_copies.add(key)
        self.mark_clean(key)
        return True

    async def stat(self, key: str) -> ChunkStat:
        self._pool.check_open()
        return ChunkStat(key, self._index.lookup(key).size)

    async def delete(self, key: str) -> None:
        """Remove ``key`` (dirty or not); idempotent. Leased bytes stay until the lease ends."""
        self._pool.check_open()
        check_chunk_id(key)
        if key in self._index.entries:
            self._index.remove(key)
            self._pool.wake()

    async def keys(self) -> AsyncIterator[str]:
        for key in list(self._index.entries):
            yield key

    def usage(self) -> TierUsage:
        return TierUsage(
            used=self._pool.used, capacity=self._pool.capacity, count=len(self._index.entries)
        )

    def stats(self) -> MemoryStats:
        return MemoryStats(
            capacity=self._pool.capacity,
            used=self._pool.used,
            free_bytes=self._pool.free_bytes,
            free_buffers=self._pool.free_count,
            count=len(self._index.entries),
            value_bytes=self._index.value_bytes,
            dirty_count=len(self._index.dirty),
            dirty_bytes=self._index.dirty_bytes,
            evictable_bytes=self._index.evictable,
            allocations=len(self._allocations),
            allocated_bytes=sum(a._buf.nbytes for a in self._allocations if a._buf is not None),
            leases=self._leases,
        )

    async def close(self) -> None:
        """Drop every value and buffer; waiters get ``TierError``. Idempotent."""
        if self._pool.closed:
            return
        self._pool.closed = True
        for seg in self._shared:
            os.close(seg.fd)
        self._shared.clear()
        bufs = [e.buf for e in self._index.entries.values()]
        for allocation in self._allocations:
            if allocation._buf is not None:
                bufs.append(allocation._buf)
                allocation._buf = None
        for buf in bufs:
            if buf.fd >= 0:
                os.close(buf.fd)
                buf.fd = -1
        self._index.entries.clear()
        self._index.local_copies.clear()
        self._index.clean.clear()
        self._index.dirty.clear()
        self._allocations.clear()
        self._pool.trim()
        self._pool.used = 0
        self._index.value_bytes = self._index.dirty_bytes = self._index.evictable = 0
        self._pool.wake()

    # --- dirty and clean --------------------------------------------------------------

    def mark_clean(self, key: str) -> bool:
        """The value is durable elsewhere (drained to disk): it may now be evicted.

        Returns False when ``key`` is not held (deleted meanwhile); idempotent.
        """
        entry = self._index.entries.get(key)
        if entry is None:
            return False
        if entry.dirty:
            entry.dirty = False
            del self._index.dirty[key]
            self._index.dirty_bytes -= entry.size
            self._index.clean[key] = None
            if entry.buf.leases == 0:
                self._index.evictable += entry.buf.nbytes
            self._pool.wake()
        return True

    def is_dirty(self, key: str) -> bool:
        """Whether the value is only in RAM; raises ``ChunkNotFound``."""
        return self._index.lookup(key).dirty

    def dirty_keys(self) -> list[str]:
        """The dirty keys, oldest first (a snapshot)."""
        return list(self._index.dirty)

    # --- internals --------------------------------------------------------------------

    def _evict_one(self) -> bool:
        """Evict the least recently used clean, unleased value; False when there is none."""
        for key in self._index.clean:
            if self._index.entries[key].buf.leases == 0:
                self._index.remove(key)
                if self._on_evict is not None:
                    self._on_evict(key)
                return True
        return False


def _copy_and_hash(dst: memoryview, src: memoryview, want_hash: bool) -> str | None:
    dst[:] = src
    return chunk_id_of(dst) if want_hash else None
