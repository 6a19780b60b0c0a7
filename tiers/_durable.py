"""One file per value, written durably and checked on every read: the nvme and cold tiers.

Layout under ``root``::

    .lock                 flock'ed while a tier has the directory open (one owner at a time)
    ab/cd/<key>           a value whose key starts with "abcd": file header, then payload
    ab/cd/.<key>.<n>.tmp  a write in progress; removed at open (a crash left it)
    quarantine/<key>.<ns> files that failed their check, moved aside for inspection

Write discipline: temp file in the final directory, ``writev`` of the file header and the
payload parts (never joined into one buffer), fsync, rename over the final name, fsync the
directory (and the parents of any directory just made). A crash leaves either the whole
file under its name or a temp file; ENOSPC or EDQUOT anywhere on the way removes the temp
file and raises ``TierFull``. Deletes unlink without a directory fsync: after a power
loss a deleted value may come back, whole and valid (garbage collection deletes it again).

File header, version 1 (little-endian, 64 bytes)::

    offset size field
         0    8 magic        b"STORAGED"
         8    2 version      1
        10    2 kind         1 = chunk (nvme), 2 = erasure fragment (cold)
        12    4 index        fragment index (0 for a chunk)
        16    8 length       payload bytes after the header
        24   32 digest       raw BLAKE3-256 chunk id the value belongs to
        56    4 reserved     0
        60    4 header_crc   CRC-32C of bytes 0..59

Every read checks the header (checksum, magic, version, kind, digest and index against
the file's name, length against the file's size) and then the payload (each tier's own
check: BLAKE3 for chunks, the fragment's header and CRC for fragments). A file that fails
is moved to ``quarantine/``, leaves the index, and the read raises ``CorruptChunk``.

The index (key -> payload size) is rebuilt at open from the file names and sizes: the
contents are checked when read (or by a scrubber), not at start-up.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import crc32c

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
)
from tiers.keylocks import KeyLocks

log = logging.getLogger("storaged.tiers")

MAGIC = b"STORAGED"
FILE_VERSION = 1
KIND_CHUNK = 1
KIND_FRAGMENT = 2
HEADER_SIZE = 64
_HEAD = struct.Struct("<8sHHIQ32sI")
_CRC = struct.Struct("<I")
assert _HEAD.size + _CRC.size == HEADER_SIZE

TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
LOCK_FILE = ".lock"
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_HEX = frozenset("0123456789abcdef")


class InvalidValue(Exception):
    """A value (being stored, or read back from a file) failed its check."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _CorruptFile(Exception):
    def __init__(self, inode: int, reason: str) -> None:
        super().__init__(reason)
        self.inode = inode
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FileHeader:
    kind: int
    index: int
    length: int
    digest: bytes

    def pack(self) -> bytes:
        body = _HEAD.pack(MAGIC, FILE_VERSION, self.kind, self.index, self.length, self.digest, 0)
        return body + _CRC.pack(crc32c.crc32c(body))


def parse_file_header(head: BytesLike) -> FileHeader:
    """Decode and check a file header; raises ``InvalidValue`` with the reason."""
    view = memoryview(head).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise InvalidValue(f"file shorter than its {HEADER_SIZE}-byte header")
    (stored_crc,) = _CRC.unpack_from(view, _HEAD.size)
    if crc32c.crc32c(view[: _HEAD.size]) != stored_crc:
        raise InvalidValue("file header checksum mismatch")
    magic, version, kind, index, length, digest, reserved = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise InvalidValue(f"bad magic {magic!r}")
    if version != FILE_VERSION or reserved != 0:
        raise InvalidValue(f"unsupported file version {version} (reserved {reserved})")
    return FileHeader(kind=kind, index=index, length=length, digest=digest)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writev_all(fd: int, parts: Sequence[memoryview]) -> None:
    """``os.writev`` until every byte of ``parts`` is written (writes may be partial)."""
    pending = [p for p in parts if p.nbytes]
    while pending:
        # Linux caps one call at IOV_MAX buffers and about 2 GiB; the loop takes the rest.
        written = os.writev(fd, pending[:1024])
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


def preadv_all(fd: int, parts: Sequence[memoryview], offset: int) -> int:
    """Fill ``parts`` from ``offset``; returns the bytes read (short only at end of file)."""
    pending = [p for p in parts if p.nbytes]
    total = 0
    while pending:
        got = os.preadv(fd, pending[:1024], offset + total)
        if got == 0:
            break
        total += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]
    return total


@dataclass(slots=True)
class _Files:
    """A tier's directory of value files: where a key's file lives (two levels of
    directories by its first hex digits), the durable write, the checked read, quarantine,
    and the scan that rebuilds the index at open. Runs in worker threads; what a key means
    and what makes a value valid are the tier's (``parse_key``, ``check_value``)."""

    root: str
    kind: int
    name: str
    parse_key: Callable[[str], tuple[bytes, int]]
    check_value: Callable[[str, Sequence[memoryview]], None]
    #: second-level directories known to exist (made durably, or found at open)
    dirs: set[str] = field(default_factory=set)
    #: leftover temp files the scan removed (crash evidence, for logs and tests)
    removed_temp_files: int = 0

    def check_or_raise(self, key: str, parts: Sequence[memoryview]) -> None:
        try:
            self.check_value(key, parts)
        except InvalidValue as exc:
            raise CorruptChunk(key, exc.reason) from None

    def paths(self, key: str) -> tuple[str, str, str]:
        """(first-level dir, second-level dir, file path) of ``key``."""
        d1 = os.path.join(self.root, key[:2])
        d2 = os.path.join(d1, key[2:4])
        return d1, d2, os.path.join(d2, key)

    def write(self, key: str, header: bytes, parts: Sequence[memoryview], check: bool) -> None:
        # The check runs in another thread while this one writes and fsyncs (both release
        # the GIL): the rename waits for its verdict. The check pool never waits on anything,
        # so this cannot deadlock however many writes are in flight.
        pending = _check_pool().submit(self.check_or_raise, key, parts) if check else None
        d1, d2, final = self.paths(key)
        try:
            try:
                self._ensure_dirs(d1, d2)
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    raise TierFull(f"{self.name} disk full making {d2}: {exc}") from exc
                raise
            _write_parts(
                final,
                [memoryview(header), *parts],
                before_rename=None if pending is None else pending.result,
            )
        except TierFull:
            if pending is not None:
                pending.result()  # bad input is reported as such, full disk or not
            raise

    def _ensure_dirs(self, d1: str, d2: str) -> None:
        if d2 in self.dirs:
            return
        for parent, child in ((self.root, d1), (d1, d2)):
            try:
                os.mkdir(child)
            except FileExistsError:
                continue
            fsync_dir(parent)  # the new directory entry must survive a crash too
        self.dirs.add(d2)

    def read(self, key: str, path: str, out: memoryview | None) -> bytes | memoryview:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            length = st.st_size - HEADER_SIZE
            if length < 0:
                raise _CorruptFile(st.st_ino, f"file of {st.st_size} bytes has no whole header")
            if out is not None and out.nbytes != length:
                raise _CorruptFile(st.st_ino, f"file holds {length} bytes, index {out.nbytes}")
            if out is None:
                # A new bytes object per read: no zero-filling, malloc reuses freed memory
                # (measured 0.8 ms per 8 MiB against 5-10 ms for a fresh anonymous map), and
                # it is immutable, so the caller's view stays valid and unchanged.
                head = os.pread(fd, HEADER_SIZE, 0)
                payload: bytes | memoryview = os.pread(fd, length, HEADER_SIZE)
                got = len(head) + len(payload)
            else:
                head_buf = bytearray(HEADER_SIZE)
                payload = out
                got = preadv_all(fd, [memoryview(head_buf), out], 0)
                head = bytes(head_buf)
            if got != st.st_size:
                raise _CorruptFile(st.st_ino, f"short read: {got} of {st.st_size} bytes")
            try:
                self._check_header(key, head, length)
                self.check_value(key, [memoryview(payload)])
            except InvalidValue as exc:
                raise _CorruptFile(st.st_ino, exc.reason) from None
            return payload
        finally:
            os.close(fd)

    def _check_header(self, key: str, head: bytes, length: int) -> None:
        header = parse_file_header(head)
        digest, index = self.parse_key(key)
        if header.kind != self.kind:
            raise InvalidValue(f"file of kind {header.kind} in a {self.name} tier")
        if header.digest != digest or header.index != index:
            raise InvalidValue(
                f"file header names {header.digest.hex()}.{header.index}, not its file name"
            )
        if header.length != length:
            raise InvalidValue(f"file header says {header.length} bytes, file holds {length}")

    def quarantine(self, key: str, inode: int, reason: str) -> bool:
        """Move the bad file aside (unless it was replaced meanwhile). True if it is gone."""
        path = self.paths(key)[2]
        try:
            if os.stat(path).st_ino != inode:
                return False
        except FileNotFoundError:
            return True
        qdir = os.path.join(self.root, QUARANTINE)
        os.makedirs(qdir, exist_ok=True)
        target = os.path.join(qdir, f"{key}.{time.time_ns()}")
        os.rename(path, target)
        with contextlib.suppress(OSError):
            fsync_dir(qdir)
            fsync_dir(os.path.dirname(path))
        log.warning(
            "%s tier: %s failed its check (%s); moved to %s", self.name, key, reason, target
        )
        return True

    def scan(self) -> Iterator[tuple[str, str, int]]:
        """(key, path, payload size) of every value file; removes temp files on the way."""
        for first in _subdirs(self.root):
            for second in _subdirs(first.path):
                self.dirs.add(second.path)
                for entry in os.scandir(second.path):
                    name = entry.name
                    if name.startswith(".") and name.endswith(TMP_SUFFIX):
                        _unlink_quietly(entry.path)
                        self.removed_temp_files += 1
                        continue
                    if not (entry.is_file(follow_symlinks=False) and self._owns(name)):
                        log.warning("%s tier: ignoring stray file %s", self.name, entry.path)
                        continue
                    if name[:2] != first.name or name[2:4] != second.name:
                        log.warning("%s tier: ignoring misplaced file %s", self.name, entry.path)
                        continue
                    yield name, entry.path, entry.stat(follow_symlinks=False).st_size - HEADER_SIZE

    def _owns(self, name: str) -> bool:
        try:
            self.parse_key(name)
        except ValueError:
            return False
        return True


class DurableTier(Tier):
    """Base of the disk tiers: files, index, capacity, checks and quarantine.

    Subclasses name their ``kind`` and say what a key means (``_parse_key``) and what makes
    a value valid (``_check_value``). Open with ``await Subclass.open(root, capacity)``.
    """

    kind: ClassVar[int]

    def __init__(self, root: Path, capacity: int, *, _token: object = None) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError(f"use `await {type(self).__name__}.open(root, capacity)`")
        if capacity < 0:
            raise ValueError(f"negative capacity {capacity}")
        self.root = root
        self._root = str(root)
        self._capacity = capacity
        self._index: dict[str, int] = {}
        self._used = 0
        self._reserved = 0
        self._locks = KeyLocks()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._lock_fd = -1
        self._closed = False
        #: leftover temp files removed at open (crash evidence, for logs and tests)
        self.removed_temp_files = 0
        self._files = _Files(self._root, self.kind, self.name, self._parse_key, self._check_value)

    @classmethod
    async def open(cls, root: Path | str, capacity: int) -> Self:
        """Open (creating it if needed) the store at ``root``: take its lock, remove leftover
        temp files and rebuild the index. Raises ``TierError`` when another tier holds it."""
        tier = cls(Path(root), capacity, _token=_OPEN_TOKEN)
        await asyncio.to_thread(tier._open_sync)
        return tier

    # --- what subclasses define ----------------------------------------------------------

    @abc.abstractmethod
    def _parse_key(self, key: str) -> tuple[bytes, int]:
        """``(digest, index)`` recorded in the file header for ``key``; raises InvalidKey."""

    @abc.abstractmethod
    def _check_value(self, key: str, parts: Sequence[memoryview]) -> None:
        """Raise ``InvalidValue`` unless the concatenated ``parts`` are a valid value for
        ``key``. Runs in a worker thread."""

    def _index_added(self, key: str) -> None:
        """Called after ``key`` enters the index."""

    def _index_removed(self, key: str) -> None:
        """Called after ``key`` leaves the index."""

    # --- the tier interface -----------------------------------------------------------

    async def put(self, key: str, data: BytesLike, *, verified: bool = False) -> None:
        """Store ``data`` durably under ``key`` (fsynced file and directory on return).

        Checks the value unless ``verified`` (``CorruptChunk``, nothing written). Raises
        ``TierFull`` when over capacity or the disk is full (nothing half-written left),
        ``InvalidKey`` for a key this tier cannot hold. A key already held is left as it
        is. Cancelling the caller does not cancel the write: it completes or fails whole.
        """
        await self.put_parts(key, (data,), verified=verified)

    async def put_parts(
        self, key: str, parts: Sequence[BytesLike], *, verified: bool = False
    ) -> None:
        """``put`` of the concatenation of ``parts``, written with one ``writev``: no join."""
        self._check_open()
        digest, index = self._parse_key(key)
        views = [memoryview(p).cast("B") for p in parts]
        await self._shielded(self._store(key, views, digest, index, verified))

    async def get(self, key: str, byte_range: ByteRange | None = None) -> memoryview:
        """The value (or a slice), read whole and checked; a new buffer the caller keeps.

        A range still reads and checks the whole value: the check covers all of it.
        Raises ``ChunkNotFound``, ``InvalidRange``, ``CorruptChunk`` (the file is then in
        quarantine and gone from this tier).
        """
        size = self._size_of(key)
        start, end = (byte_range or ByteRange()).resolve(size)
        buf = await self._read(key, None)
        return memoryview(buf)[start:end].toreadonly()

    async def read_into(self, key: str, out: memoryview) -> None:
        """Read the checked value into ``out`` (exactly its size, e.g. a buffer from
        ``MemoryTier.allocate``). On ``CorruptChunk`` the contents of ``out`` are undefined.
        Raises ``ValueError`` when ``out`` has the wrong size, else as ``get``."""
        size = self._size_of(key)
        if out.nbytes != size or out.readonly:
            raise ValueError(f"need a writable buffer of {size} bytes for {key}")
        await self._read(key, out.cast("B"))

    async def stat(self, key: str) -> ChunkStat:
        return ChunkStat(key, self._size_of(key))

    def has(self, key: str) -> bool:
        """Whether the index holds ``key`` now (no I/O: the file is checked when read)."""
        return key in self._index

    async def delete(self, key: str) -> None:
        """Remove ``key``; idempotent. Completes even if the caller is cancelled."""
        self._check_open()
        self._parse_key(key)
        await self._shielded(self._remove(key))

    async def keys(self) -> AsyncIterator[str]:
        for key in list(self._index):
            yield key

    def usage(self) -> TierUsage:
        """``used`` counts payload bytes (file headers and directories are not counted)."""
        return TierUsage(used=self._used, capacity=self._capacity, count=len(self._index))

    async def close(self) -> None:
        """Wait for writes and deletes in flight, then release the directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # --- internals: the event loop side ------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name} tier at {self._root} is closed")

    def _size_of(self, key: str) -> int:
        self._check_open()
        size = self._index.get(key)
        if size is None:
            self._parse_key(key)
            raise ChunkNotFound(key)
        return size

    async def _shielded(self, coro: Any) -> None:
        """Run ``coro`` to completion even if the awaiting caller is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(_forget_task(self._tasks))
        await asyncio.shield(task)

    def _add(self, key: str, size: int) -> None:
        self._index[key] = size
        self._used += size
        self._index_added(key)

    def _drop(self, key: str) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        self._index_removed(key)
        return True

    async def _store(
        self, key: str, parts: list[memoryview], digest: bytes, index: int, verified: bool
    ) -> None:
        size = sum(p.nbytes for p in parts)
        async with self._locks.hold(key):
            if key in self._index:
                if not verified:
                    await asyncio.to_thread(self._files.check_or_raise, key, parts)
                return
            if self._used + self._reserved + size > self._capacity:
                if not verified:  # bad input is reported as such, full or not
                    await asyncio.to_thread(self._files.check_or_raise, key, parts)
                raise TierFull(
                    f"{self.name} tier full: {self._used} + {size} bytes over capacity"
                    f" {self._capacity}"
                )
            header = FileHeader(self.kind, index, size, digest).pack()
            self._reserved += size
            try:
                await asyncio.to_thread(self._files.write, key, header, parts, not verified)
            finally:
                self._reserved -= size
            self._add(key, size)

    async def _remove(self, key: str) -> None:
        async with self._locks.hold(key):
            if self._drop(key):
                await asyncio.to_thread(_unlink_quietly, self._files.paths(key)[2])

    async def _read(self, key: str, out: memoryview | None) -> bytes | memoryview:
        path = self._files.paths(key)[2]
        try:
            return await asyncio.to_thread(self._files.read, key, path, out)
        except FileNotFoundError:
            # Deleted under us, or removed behind our back: either way, not here.
            await self._forget_if_vanished(key, path)
            raise ChunkNotFound(key) from None
        except _CorruptFile as exc:
            await self._quarantine(key, exc.inode, exc.reason)
            raise CorruptChunk(key, exc.reason) from None

    async def _forget_if_vanished(self, key: str, path: str) -> None:
        """Drop ``key`` from the index if its file is gone (removed behind the tier's back).
        Under the key's lock, so that a put or delete in flight cannot be mistaken for it."""
        async with self._locks.hold(key):
            if key in self._index and not await asyncio.to_thread(os.path.exists, path):
                log.warning("%s tier: %s vanished from disk", self.name, key)
                self._drop(key)

    async def _quarantine(self, key: str, inode: int, reason: str) -> None:
        async with self._locks.hold(key):
            gone = await asyncio.to_thread(self._files.quarantine, key, inode, reason)
            if gone:
                self._drop(key)

    # --- internals: worker threads ----------------------------------------------------

    def _open_sync(self) -> None:
        os.makedirs(self._root, exist_ok=True)
        self._lock_fd = os.open(
            os.path.join(self._root, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise TierError(f"{self._root} is open by another {self.name} tier") from None
        for key, path, size in self._files.scan():
            if size < 0:
                with contextlib.suppress(OSError):
                    self._files.quarantine(key, os.stat(path).st_ino, "shorter than a header")
                continue
            self._add(key, size)
        self.removed_temp_files = self._files.removed_temp_files


_OPEN_TOKEN = object()


def write_file_durably(path: Path | str, data: BytesLike | Sequence[BytesLike]) -> None:
    """Write ``data`` (or the concatenation of its parts, with one ``writev``) to ``path``
    durably: temp file in the same directory, fsync, rename, fsync the directory.

    On return the file survives a crash whole; if this raises, ``path`` is untouched (an
    older file under that name stays as it was) and no temp file is left. Raises
    ``TierFull`` on ENOSPC or EDQUOT, ``OSError`` otherwise. Blocking: call it in a thread.
    The directory must exist; temp files are named ``.<name>.<pid>.<n>.tmp``.
    """
    parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
    _write_parts(os.fspath(path), [memoryview(p).cast("B") for p in parts])


def _write_parts(
    final: str, parts: Sequence[memoryview], before_rename: Callable[[], object] | None = None
) -> None:
    """The durable write. ``before_rename`` may raise to abandon it (temp file removed)."""
    directory, name = os.path.split(final)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{next(_TMP_SEQ)}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                writev_all(fd, parts)
                os.fsync(fd)
            finally:
                os.close(fd)
            if before_rename is not None:
                before_rename()
            os.rename(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        try:
            fsync_dir(directory or ".")
        except BaseException:
            # The rename may not survive a power loss and the caller will hear that the
            # write failed: take the file back rather than leave it half-promised.
            _unlink_quietly(final)
            raise
    except OSError as exc:
        if exc.errno in _FULL_ERRNOS:
            raise TierFull(f"disk full writing {final}: {exc}") from exc
        raise


_TMP_SEQ = itertools.count()
_CHECK_POOL: ThreadPoolExecutor | None = None
_CHECK_POOL_LOCK = threading.Lock()


def _check_pool() -> ThreadPoolExecutor:
    """Threads for the value checks that run alongside writes."""
    global _CHECK_POOL
    with _CHECK_POOL_LOCK:
        if _CHECK_POOL is None:
            _CHECK_POOL = ThreadPoolExecutor(
                max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="tier-check"
            )
        return _CHECK_POOL


def _subdirs(path: str) -> Iterator[os.DirEntry[str]]:
    """The two-hex-digit fan-out directories directly under ``path``."""
    for entry in os.scandir(path):
        if len(entry.name) == 2 and set(entry.name) <= _HEX and entry.is_dir(follow_symlinks=False):
            yield entry


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _forget_task(tasks: set[asyncio.Future[Any]]) -> Any:
    def done(task: asyncio.Future[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the shielded caller may be gone: mark it retrieved

    return done
