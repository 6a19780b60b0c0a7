"""The archive tier: chunks and checkpoint manifests in an object store (S3 or compatible)
or a shared file system path (``file://``, a Lustre or NFS mount).

    tier = await ArchiveTier.open("s3://bucket/cluster-a", capacity=100 << 40,
                                  s3=S3Options(endpoint="http://10.0.0.9:8080"))
    await tier.put(chunk_id, view)                 # every chunk of a checkpoint first,
    await tier.put_manifest("job/step-1", body)    # then its manifest: now it is listed
    data = await tier.get(chunk_id)                # fetched whole, BLAKE3-checked

Layout under the URL's prefix::

    chunks/<id>                 a chunk's bytes as they are, named by their id
    manifests/<name>            a checkpoint's manifest: file header (tiers._durable's,
                                kind 3), then the caller's bytes
    quarantine/<key>.<ns>       objects that failed their check, moved aside

Chunks are content-addressed, so checkpoints that share bytes share objects, and a put of
an id already held is a no-op (a HEAD, no upload). Every chunk is checked against its id
on the way in (nothing is stored when the bytes do not match) and on every read: a ranged
get fetches the whole object and hashes it (a range of unverified bytes is never served;
restores read whole chunks anyway). An object that fails is moved to ``quarantine/``, the
read raises ``CorruptChunk``, and the id is gone from the tier.

A checkpoint is archived in one order, the caller's to keep: every chunk it names, then
``put_manifest``. A half-archived checkpoint (chunks without a manifest) is never listed by
``list_manifests``; deleting goes the other way (the manifest first, then the chunks no
other manifest names: which those are is the caller's to know).

``usage()`` counts what this tier listed at open and what it has put, seen or deleted
since: other writers to the same prefix show at the next ``open`` or ``stat``. ``capacity``
is a quota the operator sets (an object store has no size of its own): a put past it
raises ``TierFull``, as does one the store refuses for want of room (a bucket quota, a full
disk; the library has no kind for it: told by the store's words, ``_FULL``).

Every call is bounded: ``ArchiveTimeouts`` gives each request a deadline and the retries a
window; a server that does not answer raises ``ArchiveUnavailable`` after about
``request * (retries + 1)`` seconds at most, refused credentials ``ArchiveDenied`` (at open:
it lists the prefix). Hashing runs in a thread for anything but small values; the store's
requests and the ``file://`` form's file I/O run on the library's own threads (obstore: a
Rust runtime), and the fsyncs of ``file://`` in a worker thread. Bytes are not copied on
their way in (the store takes the caller's buffer) nor out (a get returns a view of the
library's buffer); a manifest is copied once, behind its header (it is small).

The library is obstore (S3, GCS, Azure and local files behind one async API, Rust-backed,
zero-copy in and out). This round opens ``s3://`` and ``file://``; GCS and Azure are the
same calls with their own options, left until a server of each can be tested.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import unquote, urlsplit

import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from obstore.store import LocalStore, S3Store

from erasure.content import is_chunk_id
from tiers._durable import HEADER_SIZE, FileHeader, InvalidValue, fsync_dir, parse_file_header
from tiers.base import (
    ByteRange,
    BytesLike,
    ChunkNotFound,
    ChunkStat,
    CorruptChunk,
    InvalidKey,
    Tier,
    TierError,
    TierFull,
    TierUsage,
    check_chunk_id,
    chunk_id_of_async,
)
from tiers.keylocks import KeyLocks

if TYPE_CHECKING:
    from obstore.store import ClientConfig, ObjectStore, RetryConfig, S3Config

CHUNKS = "chunks/"
MANIFESTS = "manifests/"
QUARANTINE = "quarantine/"
#: the file header's kind of an archived manifest (1 and 2 are the nvme and cold tiers')
KIND_MANIFEST = 3
#: S3's largest single PUT: above it, a multipart upload (chunks are far smaller)
_SINGLE_PUT_BYTES = 5 << 30
#: a checkpoint name, API.md's form (``storaged.ids`` states it for the server; the tests
#: check that the two agree)
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
MANIFEST_NAME_RE = re.compile(rf"^{_SEGMENT}(/{_SEGMENT}){{0,3}}$")
#: the library reports a refused listing as a generic error, the status only in its text
_REFUSED = re.compile(r"status code: (401|403)\b")
#: a store with no room, as each says it (the library has no kind for it): Swift's bucket
#: quota through s3api (tested), Ceph RGW's quota, MinIO's full disks, ENOSPC of file://
_FULL = re.compile(
    r"EntityTooLarge|QuotaExceeded|XMinioStorageFull|status code: 507\b|os error 28\b"
)


class ArchiveUnavailable(TierError):
    """The object store did not answer in time, or failed (the message says how)."""


class ArchiveDenied(TierError):
    """The object store refused the credentials or the access."""


class ManifestNotFound(ChunkNotFound):
    """No manifest of that name (``key`` is the name)."""

    def __str__(self) -> str:
        return f"no manifest: {self.key}"


@dataclass(frozen=True, slots=True)
class ArchiveTimeouts:
    """Bounds of every call to the store, in seconds."""

    #: to open a connection
    connect: float = 5.0
    #: one request, first byte out to last byte in (an 8 MiB chunk at 1 MB/s fits)
    request: float = 30.0
    #: further attempts of a request that failed or timed out
    retries: int = 2
    #: no retry starts later than this after the first attempt
    retry_window: float = 60.0


@dataclass(frozen=True, slots=True)
class S3Options:
    """Where and as whom to reach an S3-compatible store (``s3://bucket[/prefix]``)."""

    #: an S3-compatible server (``http://host:port``: plain HTTP is allowed then);
    #: None: AWS's endpoint for ``region``
    endpoint: str | None = None
    region: str = "us-east-1"
    #: None: from the environment (``AWS_ACCESS_KEY_ID`` and the rest, as AWS's tools)
    access_key_id: str | None = None
    secret_access_key: str | None = None
    #: ``http://bucket.host/key`` instead of ``http://host/bucket/key``
    virtual_hosted_style: bool = False


def is_manifest_name(value: object) -> bool:
    return isinstance(value, str) and MANIFEST_NAME_RE.fullmatch(value) is not None


class ArchiveTier(Tier):
    """Chunks by chunk id and manifests by checkpoint name in an object store.
    ``await ArchiveTier.open(url, capacity, ...)``."""

    name = "archive"

    def __init__(self, store: ObjectStore, url: str, capacity: int, root: Path | None) -> None:
        """Use ``open``."""
        self._store = store
        self._url = url
        self._capacity = capacity
        #: the directory of a ``file://`` archive (its writes are fsynced), else None
        self._root = root
        #: what this tier knows is held (key -> size), and their sum: for ``usage``
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._reserved = 0
        #: one put or delete of a key at a time (a second put of it waits, then finds it held)
        self._locks = KeyLocks()
        self._closed = False

    @classmethod
    async def open(
        cls,
        url: str,
        capacity: int,
        *,
        s3: S3Options | None = None,
        timeouts: ArchiveTimeouts | None = None,
    ) -> Self:
        """Open the archive at ``url`` (``s3://bucket[/prefix]`` or ``file:///path``, made
        if missing) and list its chunks. Raises ``ArchiveDenied`` for refused credentials,
        ``ArchiveUnavailable`` when the store does not answer, ``ValueError`` for a URL of
        another kind."""
        # In a thread: the file:// form makes its directory
        store, root = await asyncio.to_thread(
            _open_store, url, s3 or S3Options(), timeouts or ArchiveTimeouts()
        )
        tier = cls(store, url, capacity, root)
        async with tier._mapped_errors(CHUNKS):
            async for batch in obstore.list(store, CHUNKS):
                for meta in batch:
                    key = meta["path"].removeprefix(CHUNKS)
                    if is_chunk_id(key):
                        tier._held(key, meta["size"])
        return tier

    # --- chunks ---------------------------------------------------------------------

    async def put(self, key: str, data: BytesLike) -> None:
        self._check_open()
        check_chunk_id(key)
        view = memoryview(data).cast("B")
        digest = await chunk_id_of_async(view)
        if digest != key:
            raise CorruptChunk(key, f"BLAKE3 of the bytes is {digest}")
        async with self._locks.hold(key):
            # Asked of the store, not of what this tier knows: another writer may have
            # deleted the object since (a put that trusted a stale "held" would lose it)
            try:
                held = await self.stat(key)
            except ChunkNotFound:
                pass
            else:
                if held.size == view.nbytes:
                    return  # held (content-addressed: the same bytes), by us or another writer
            await self._upload(key, view)

    async def put_missing(self, key: str, produce: Callable[[], Awaitable[BytesLike]]) -> bool:
        """Put ``chunks/<key>`` unless the store holds an object under it now: one HEAD,
        and ``produce()`` (the bytes, checked against ``key`` as ``put`` checks them) only
        when the object is missing. True when it uploaded. For a caller whose bytes are dear
        to come by (an archiver reading them from the cluster): ``put`` wants them first.
        An object found is taken as held whatever its size (the store writes objects whole;
        one changed behind the tier's back fails ``get``'s check and is quarantined)."""
        self._check_open()
        check_chunk_id(key)
        async with self._locks.hold(key):
            try:
                await self.stat(key)
                return False
            except ChunkNotFound:
                pass
            view = memoryview(await produce()).cast("B")
            digest = await chunk_id_of_async(view)
            if digest != key:
                raise CorruptChunk(key, f"BLAKE3 of the bytes is {digest}")
            await self._upload(key, view)
            return True

    async def _upload(self, key: str, view: memoryview) -> None:
        """Reserve room, PUT ``chunks/<key>`` (the store takes the buffer as it is), fsync
        it in a ``file://`` archive, count it."""
        if self._used + self._reserved + view.nbytes > self._capacity:
            raise TierFull(
                f"archive quota: {view.nbytes} bytes do not fit in {self._capacity} "
                f"({self._used} used, {self._reserved} being written)"
            )
        self._reserved += view.nbytes
        try:
            await self._write(CHUNKS + key, view)
            self._held(key, view.nbytes)
        finally:
            self._reserved -= view.nbytes

    async def get(self, key: str, byte_range: ByteRange | None = None) -> memoryview:
        self._check_open()
        check_chunk_id(key)
        try:
            async with self._mapped_errors(key):
                result = await obstore.get_async(self._store, CHUNKS + key)
                body = memoryview(await result.bytes_async())
        except ChunkNotFound:
            self._gone(key)  # another writer deleted it
            raise
        digest = await chunk_id_of_async(body)
        if digest != key:
            await self._quarantine(CHUNKS + key)
            self._gone(key)
            raise CorruptChunk(key, f"archived object's BLAKE3 is {digest}")
        self._held(key, body.nbytes)
        if byte_range is None:
            return body
        start, end = byte_range.resolve(body.nbytes)
        return body[start:end]

    async def stat(self, key: str) -> ChunkStat:
        """The size the store holds under ``chunks/<key>`` now (a HEAD: it sees other
        writers' objects too, and counts them)."""
        self._check_open()
        check_chunk_id(key)
        try:
            async with self._mapped_errors(key):
                meta = await obstore.head_async(self._store, CHUNKS + key)
        except ChunkNotFound:
            self._gone(key)
            raise
        self._held(key, meta["size"])
        return ChunkStat(key, meta["size"])

    async def delete(self, key: str) -> None:
        self._check_open()
        check_chunk_id(key)
        async with self._locks.hold(key):
            await self._delete_object(CHUNKS + key)
            self._gone(key)

    async def keys(self) -> AsyncIterator[str]:
        """The chunk ids under ``chunks/`` now, as the store lists them."""
        self._check_open()
        async with self._mapped_errors(CHUNKS):
            async for batch in obstore.list(self._store, CHUNKS):
                for meta in batch:
                    key = meta["path"].removeprefix(CHUNKS)
                    if is_chunk_id(key):
                        yield key

    def usage(self) -> TierUsage:
        return TierUsage(used=self._used, capacity=self._capacity, count=len(self._sizes))

    async def close(self) -> None:
        """Nothing to release (the library pools its connections per store); idempotent."""
        self._closed = True

    # --- manifests ------------------------------------------------------------------

    async def put_manifest(self, name: str, data: BytesLike) -> None:
        """Store (or replace) checkpoint ``name``'s manifest: call it once every chunk the
        manifest names is archived (``put`` returned), so that a listed checkpoint is a
        whole one. Raises ``ValueError`` for a name outside API.md's form."""
        self._check_open()
        _check_manifest_name(name)
        view = memoryview(data).cast("B")
        digest = bytes.fromhex(await chunk_id_of_async(view))
        header = FileHeader(KIND_MANIFEST, 0, view.nbytes, digest)
        # A deliberate copy: a manifest is small, and one buffer is one single PUT
        await self._write(MANIFESTS + name, header.pack() + view)

    async def get_manifest(self, name: str) -> memoryview:
        """Checkpoint ``name``'s manifest as it was put, checked against its header.
        Raises ``ManifestNotFound``, ``CorruptChunk`` (the object is quarantined)."""
        self._check_open()
        _check_manifest_name(name)
        path = MANIFESTS + name
        try:
            async with self._mapped_errors(name):
                result = await obstore.get_async(self._store, path)
                stored = memoryview(await result.bytes_async())
        except ChunkNotFound:
            raise ManifestNotFound(name) from None
        try:
            header = parse_file_header(stored)
            body = stored[HEADER_SIZE:]
            if header.kind != KIND_MANIFEST or header.length != body.nbytes:
                raise InvalidValue(f"kind {header.kind}, {header.length} bytes in the header")
            if bytes.fromhex(await chunk_id_of_async(body)) != header.digest:
                raise InvalidValue("BLAKE3 of the manifest does not match its header")
        except InvalidValue as exc:
            await self._quarantine(path)
            raise CorruptChunk(path, exc.reason) from None
        return body

    async def has_manifest(self, name: str) -> bool:
        """Whether checkpoint ``name``'s manifest is held now (a HEAD: its bytes are not
        read, nor checked: ``get_manifest`` checks them)."""
        self._check_open()
        _check_manifest_name(name)
        try:
            async with self._mapped_errors(name):
                await obstore.head_async(self._store, MANIFESTS + name)
        except ChunkNotFound:
            return False
        return True

    async def list_manifests(self, prefix: str = "") -> list[str]:
        """Names of the manifests held now that start with ``prefix`` (as strings do:
        ``job/step`` finds ``job/step-1``), sorted."""
        self._check_open()
        # The store lists by whole path segments: list the prefix's directory, then filter
        directory = MANIFESTS + prefix.rpartition("/")[0]
        names = []
        async with self._mapped_errors(directory):
            async for batch in obstore.list(self._store, directory.rstrip("/") + "/"):
                for meta in batch:
                    name = meta["path"].removeprefix(MANIFESTS)
                    if name.startswith(prefix) and is_manifest_name(name):
                        names.append(name)
        return sorted(names)

    async def delete_manifest(self, name: str) -> None:
        """Remove checkpoint ``name``'s manifest; idempotent. Its chunks stay."""
        self._check_open()
        _check_manifest_name(name)
        await self._delete_object(MANIFESTS + name)

    # --- the store --------------------------------------------------------------------

    async def _write(self, path: str, view: BytesLike) -> None:
        """PUT ``path`` whole (atomic: readers see the old object or the new one, never a
        part), then, in a ``file://`` archive, fsync it and the directories above it."""
        size = memoryview(view).nbytes
        async with self._mapped_errors(path):
            await obstore.put_async(self._store, path, view, use_multipart=size > _SINGLE_PUT_BYTES)
        if self._root is not None:
            await asyncio.to_thread(_fsync_tree, self._root, path)

    async def _delete_object(self, path: str) -> None:
        try:
            async with self._mapped_errors(path):
                await obstore.delete_async(self._store, path)
        except ChunkNotFound:
            pass  # the file:// form says so; S3 does not: either way, gone

    async def _quarantine(self, path: str) -> None:
        """Move a failed object to ``quarantine/`` for inspection (a copy, then a delete of
        the original). If the copy fails the object is deleted all the same: it must not
        be served, and the id's bytes are to be archived anew from a good copy."""
        aside = f"{QUARANTINE}{path.replace('/', '.')}.{time.time_ns()}"
        try:
            async with self._mapped_errors(path):
                await obstore.copy_async(self._store, path, aside)
        except TierError:
            pass
        await self._delete_object(path)

    @asynccontextmanager
    async def _mapped_errors(self, key: str) -> AsyncIterator[None]:
        """The store's errors as the tier's: missing -> ChunkNotFound(key), no room ->
        TierFull, refused -> ArchiveDenied, anything else (timeouts, connections, server
        errors) -> ArchiveUnavailable; each says which store."""
        try:
            yield
        except (FileNotFoundError, NotFoundError):
            raise ChunkNotFound(key) from None
        except (BaseError, OSError) as exc:
            text, first = str(exc), _first_line(exc)
            if _FULL.search(text):
                raise TierFull(f"{self._url}: no room: {first}") from exc
            refused = isinstance(exc, PermissionDeniedError | UnauthenticatedError)
            if refused or _REFUSED.search(text):
                raise ArchiveDenied(f"{self._url}: refused: {first}") from exc
            raise ArchiveUnavailable(f"{self._url}: {first}") from exc

    def _held(self, key: str, size: int) -> None:
        self._used += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def _gone(self, key: str) -> None:
        self._used -= self._sizes.pop(key, 0)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"archive tier at {self._url} is closed")


def _open_store(
    url: str, s3: S3Options, timeouts: ArchiveTimeouts
) -> tuple[ObjectStore, Path | None]:
    """The library's store for ``url``, and the directory of a ``file://`` one."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{url}: a file:// archive is a local path (file:///path)")
        root = Path(unquote(parts.path))
        return LocalStore(root, mkdir=True), root
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"{url}: an archive is s3://bucket[/prefix] or file:///path")
    config: S3Config = {
        "region": s3.region,
        "virtual_hosted_style_request": s3.virtual_hosted_style,
    }
    if s3.endpoint is not None:
        config["endpoint"] = s3.endpoint
    if s3.access_key_id is not None:
        config["access_key_id"] = s3.access_key_id
    if s3.secret_access_key is not None:
        config["secret_access_key"] = s3.secret_access_key
    client: ClientConfig = {
        "allow_http": (s3.endpoint or "").startswith("http://"),
        "connect_timeout": timedelta(seconds=timeouts.connect),
        "timeout": timedelta(seconds=timeouts.request),
    }
    retry: RetryConfig = {
        "max_retries": timeouts.retries,
        "retry_timeout": timedelta(seconds=timeouts.retry_window),
    }
    store = S3Store.from_url(url, config=config, client_options=client, retry_config=retry)
    return store, None


def _check_manifest_name(name: Any) -> None:
    if not is_manifest_name(name):
        raise InvalidKey(name)


def _fsync_tree(root: Path, path: str) -> None:
    """fsync ``root/path`` and every directory from its parent up to ``root`` (the store
    may have just made them)."""
    target = root / path
    fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for directory in _parents_up_to(target, root):
        fsync_dir(str(directory))


def _parents_up_to(target: Path, root: Path) -> Iterator[Path]:
    directory = target.parent
    while True:
        yield directory
        if directory == root or directory == directory.parent:
            return
        directory = directory.parent


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
