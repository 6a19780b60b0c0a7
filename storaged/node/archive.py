"""The archive stage: committed checkpoints copied to the archive tier, and read back
from it by a cluster that no longer holds them (docs/OPERATIONS.md "Archive tier").

``archive(name)`` reads every distinct chunk of a committed checkpoint through the node's
read path (RAM, nvme, a peer, a cold decode: whatever serves it fastest), puts it in the
archive (the tier skips ids it holds, and so does this stage before reading them), then
puts the manifest: a checkpoint is listed in the archive only once all of its chunks are
there. It is idempotent: archiving again, from any node, puts what is missing and the
manifest, so a node that dies half way leaves work that the next call finishes.

``read_through(chunk_id)`` is what a GET falls back to when no live node holds a chunk in
any tier: the bytes are fetched from the archive (checked against the id by the tier; a
corrupt object is quarantined there and never served) and kept in ``ReadThroughCache``,
RAM with a byte budget of its own, so that a second restore is served from RAM. The cache
is not a holding: it is in no index, never drained, encoded, rebalanced or counted as a
copy, and GC does not see it; what it holds is verified and content-addressed, so serving
it to a peer or a client is as safe as serving the archive's object. The durability
invariants of docs/RELIABILITY.md are untouched: nothing enters a chunk's life here.

``record(name)`` and ``listed(prefix)`` answer for checkpoints the catalogue does not know
but the archive does (a fresh cluster pointed at the archive of one torn down): their
records are built from the archived manifest, checked as a commit checks one, and carry
``extra["source"] == "archive"``.

Relies on: the archive tier's contract (``tiers/archive.py``); the read path's I7 (bytes
checked on the way). Upholds: a manifest is put only after every chunk it names.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import msgpack

from storaged.config import Config, ConfigError
from storaged.coord.manifest_store import CatalogRecord
from storaged.errors import Conflict, InsufficientStorage, NotFound, StoragedError, unavailable
from storaged.manifest import check_manifest
from storaged.wire import BytesLike
from tiers import ByteRange, ChunkNotFound, CorruptChunk, TierError, TierFull
from tiers.archive import ArchiveDenied, ArchiveTier, ManifestNotFound, S3Options
from tiers.keylocks import KeyLocks

if TYPE_CHECKING:
    from storaged.node.services import LocalStore

log = logging.getLogger("storaged.node.archive")

#: chunks read and put at once while archiving a checkpoint (each holds a chunk's bytes)
ARCHIVE_CONCURRENCY = 4
#: archive-only manifests read at once for a listing
_LISTING_CONCURRENCY = 8
#: seconds a status waits for the archive to say whether it holds the checkpoint, and a
#: listing (or an archive request) for the archive's answer: past them the answer goes
#: without it, or is 503 (the tier's own bounds, ``ArchiveTimeouts``, are tens of seconds)
STATUS_DEADLINE = 2.0
LISTING_DEADLINE = 10.0
#: where a record built from the archive came from (``CatalogRecord.extra["source"]``)
SOURCE = "source"
FROM_ARCHIVE = "archive"

#: reads a whole chunk through the node's read path (``ReadPath.read_chunk``)
ReadChunk = Callable[[str], Awaitable[tuple[bytes | memoryview, str]]]
#: the catalogue's record of a committed checkpoint (``Checkpoints.get``: 404 if none)
GetRecord = Callable[[str], Awaitable[CatalogRecord]]


class CannotOpenArchive(ConfigError):
    """The node's archive cannot be opened: it refuses to start (the message says why)."""


async def open_archive(config: Config) -> ArchiveTier:
    """The archive tier of ``config`` (``archive`` and its ``archive_*`` settings), listed
    once (the tier's ``open``). Credentials come from the environment (``AWS_*``).
    Raises ``CannotOpenArchive`` saying why when it cannot be opened."""
    s3 = S3Options(
        endpoint=config.archive_endpoint or None,
        region=config.archive_region,
        virtual_hosted_style=config.archive_virtual_hosted,
    )
    try:
        return await ArchiveTier.open(config.archive, config.archive_capacity, s3=s3)
    except (TierError, ValueError, OSError) as exc:  # OSError: a file:// path unusable
        raise CannotOpenArchive(f"archive {config.archive}: cannot open it: {exc}") from None


class ReadThroughCache:
    """Chunks read through from the archive, in RAM within ``budget`` bytes, the least
    recently used dropped first. Holds verified bytes only (the archive tier checks every
    object against its id); a chunk larger than the budget is not kept."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._chunks: OrderedDict[str, memoryview] = OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, chunk_id: str) -> memoryview | None:
        view = self._chunks.get(chunk_id)
        if view is not None:
            self._chunks.move_to_end(chunk_id)
        return view

    def put(self, chunk_id: str, view: memoryview) -> None:
        if view.nbytes > self.budget or chunk_id in self._chunks:
            return
        while self._chunks and self.used + view.nbytes > self.budget:
            _, dropped = self._chunks.popitem(last=False)
            self.used -= dropped.nbytes
        self._chunks[chunk_id] = view
        self.used += view.nbytes


@dataclass(frozen=True, slots=True)
class Archived:
    """What one ``archive`` call did: the checkpoint's distinct chunks, how many it put
    (the rest were in the archive already), and their bytes."""

    name: str
    chunks: int
    put: int
    put_bytes: int


@dataclass(eq=False, repr=False)
class Archive:
    """The archive stage (``node.archive``). ``tier`` None: no archive is configured;
    ``archive`` then answers 409 ``no_archive`` and ``archived`` False."""

    local: LocalStore
    tier: ArchiveTier | None
    cache: ReadThroughCache
    _: KW_ONLY
    read_chunk: ReadChunk
    get_record: GetRecord
    #: checkpoints being archived in the background by this node
    running: set[str] = field(default_factory=set, init=False)
    #: one fetch of a chunk from the archive at a time: concurrent readers share it
    _fetches: KeyLocks = field(default_factory=KeyLocks, init=False)

    @property
    def configured(self) -> bool:
        return self.tier is not None

    # ---- archiving -------------------------------------------------------------------------
    async def archive(self, name: str) -> Archived:
        """Archive committed checkpoint ``name``: every chunk, then its manifest.
        Idempotent. Raises 404 ``checkpoint_not_found`` (not committed), 409 ``no_archive``,
        503 ``archive_unavailable`` / ``chunks_unavailable``, 507 ``archive_full``."""
        tier = self._tier()
        record = await self.get_record(name)
        assert record.manifest is not None  # a live record carries its manifest
        ids = list(dict.fromkeys(record.chunks))
        pending = iter(ids)
        put = [0, 0]

        async def worker() -> None:
            # The workers share one iterator: each takes the next chunk when it is free.
            for chunk_id in pending:
                size = await self._archive_chunk(tier, name, chunk_id)
                if size is not None:
                    put[0] += 1
                    put[1] += size

        workers = [asyncio.ensure_future(worker()) for _ in range(ARCHIVE_CONCURRENCY)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        with _mapped(tier):
            await tier.put_manifest(name, record.manifest)
        log.info("archived %s: %d chunk(s), %d put (%d bytes)", name, len(ids), *put)
        return Archived(name, len(ids), put[0], put[1])

    async def _archive_chunk(self, tier: ArchiveTier, name: str, chunk_id: str) -> int | None:
        """Put chunk ``chunk_id`` of ``name`` into the archive unless it holds it (archived
        already, by this checkpoint or another): one HEAD, and a read from the cluster only
        when the archive lacks it. The bytes put, None when it held them."""
        got: list[BytesLike] = []

        async def read() -> BytesLike:
            got.append(await self._read_whole(name, chunk_id))
            return got[0]

        with _mapped(tier):
            if not await tier.put_missing(chunk_id, read):
                return None
        return memoryview(got[0]).nbytes

    async def _read_whole(self, name: str, chunk_id: str) -> BytesLike:
        """Chunk ``chunk_id`` of ``name`` through the read path (any tier, any node), for the
        archive; 503 ``chunks_unavailable`` when no node can give it now (not the archive's
        error: the caller maps only the archive's)."""
        try:
            data, _ = await self.read_chunk(chunk_id)
        except TierError as exc:
            why = "cannot be read from any node now"
            if not isinstance(exc, ChunkNotFound):
                why = f"cannot be read now: {exc}"
            raise unavailable(
                "chunks_unavailable", f"chunk {chunk_id} of {name} {why}", retry_after=5.0
            ) from None
        return data

    async def archived(self, name: str) -> bool:
        """Whether checkpoint ``name``'s manifest is in the archive (False with no archive).
        Raises 503 ``archive_unavailable`` when the archive does not answer."""
        if self.tier is None:
            return False
        with _mapped(self.tier):
            return await self.tier.has_manifest(name)

    async def archived_or_none(self, name: str) -> bool | None:
        """``archived``, or None when the archive does not answer within
        ``STATUS_DEADLINE`` (a status still answers, at once: clients poll it)."""
        try:
            async with asyncio.timeout(STATUS_DEADLINE):
                return await self.archived(name)
        except TimeoutError:
            log.warning("archive: no answer about %s within %.0f s", name, STATUS_DEADLINE)
            return None
        except StoragedError as exc:
            log.warning("archive: %s", exc)
            return None

    async def begin(self, name: str) -> bool:
        """Start archiving ``name`` in the background unless this node already is; False
        when it is archived already (also when only the archive knows it). Checks first,
        so that what would fail at once (no archive, an archive out of reach, a name
        neither committed nor archived) fails the call."""
        self._tier()
        if name in self.running:
            return True
        try:
            await self.get_record(name)
        except NotFound:
            if await self._probe(name):
                return False  # only the archive knows it (a fresh cluster): archived
            raise
        if await self._probe(name):
            return False
        self.running.add(name)
        self.local.spawn(self._run(name), f"archive {name}")
        return True

    async def _probe(self, name: str) -> bool:
        """``archived``, within ``LISTING_DEADLINE``: a request waits no longer for the
        archive (503 ``archive_unavailable``)."""
        try:
            async with asyncio.timeout(LISTING_DEADLINE):
                return await self.archived(name)
        except TimeoutError:
            raise unavailable(
                "archive_unavailable",
                f"the archive did not answer within {LISTING_DEADLINE:.0f} s",
                retry_after=5.0,
            ) from None

    async def _run(self, name: str) -> None:
        try:
            await self.archive(name)
        except StoragedError as exc:
            log.error("archiving %s failed: %s; archive it again to finish", name, exc)
        except Exception:
            log.exception("archiving %s failed; archive it again to finish", name)
        finally:
            self.running.discard(name)

    # ---- reading back ----------------------------------------------------------------------
    async def read_through(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview, str]:
        """The chunk from the read-through cache (tier ``memory``) or from the archive
        (``archive``), kept in the cache. ``ChunkNotFound`` when the archive does not hold
        it or its object failed the check (quarantined, not served); 503
        ``archive_unavailable`` when the archive does not answer."""
        tier = self.tier
        if tier is None:
            raise ChunkNotFound(chunk_id)
        async with self._fetches.hold(chunk_id):
            view = self.cache.get(chunk_id)
            source = "memory"
            if view is None:
                try:
                    with _mapped(tier):
                        view = await tier.get(chunk_id)
                except CorruptChunk as exc:
                    self.local.metrics.corrupt.labels("archive").inc()
                    log.error("archived %s failed its check, quarantined: %s", chunk_id, exc)
                    raise ChunkNotFound(chunk_id) from None
                self.cache.put(chunk_id, view)
                source = "archive"
        if rng is None:
            return view, source
        start, end = rng.resolve(view.nbytes)
        return view[start:end], source

    def cached(self, chunk_id: str) -> memoryview | None:
        """The chunk if the read-through cache holds it (the read path asks it after RAM
        and nvme)."""
        return self.cache.get(chunk_id)

    async def record(self, name: str) -> CatalogRecord:
        """Checkpoint ``name`` as the archive holds it: 404 ``checkpoint_not_found`` when
        it does not (or there is no archive), 503 ``archive_unavailable``."""
        tier = self.tier
        if tier is None:
            raise _not_found(name)
        try:
            with _mapped(tier):
                body = await tier.get_manifest(name)
        except (ManifestNotFound, CorruptChunk) as exc:
            if isinstance(exc, CorruptChunk):
                log.error("archived manifest of %s failed its check: %s", name, exc)
            raise _not_found(name) from None
        cfg = self.local.config
        # Decoded and checked as a commit checks a manifest, off the loop.
        checked = await asyncio.to_thread(
            lambda: check_manifest(
                msgpack.unpackb(body, raw=False),
                cfg.max_chunk_size,
                max_items_per_key=cfg.max_items_per_key,
            )
        )
        created = float(checked.manifest["created"])
        return CatalogRecord(
            name=name,
            digest=checked.digest,
            created=created,
            committed=created,
            total_bytes=checked.total_bytes,
            chunks=list(checked.chunks),
            manifest=checked.encoded,
            extra={SOURCE: FROM_ARCHIVE},
        )

    async def listed(self, prefix: str, known: set[str]) -> list[CatalogRecord]:
        """The archive's checkpoints starting with ``prefix`` that are not in ``known``
        (the catalogue's), each read from its manifest; none without an archive. 503
        ``archive_unavailable`` when the archive does not answer."""
        if self.tier is None:
            return []
        with _mapped(self.tier):
            names = [n for n in await self.tier.list_manifests(prefix) if n not in known]
        slots = asyncio.Semaphore(_LISTING_CONCURRENCY)

        async def one(name: str) -> CatalogRecord | None:
            async with slots:
                try:
                    return await self.record(name)
                except NotFound:
                    return None  # deleted since the listing, or corrupt

        found = await asyncio.gather(*(one(n) for n in names))
        return [r for r in found if r is not None]

    def _tier(self) -> ArchiveTier:
        if self.tier is None:
            raise Conflict(
                "no_archive",
                "no archive is configured on this cluster (set [archive] url in the cluster "
                "file, or --archive, on every node)",
            )
        return self.tier


def is_archived_record(record: CatalogRecord) -> bool:
    """Whether ``record`` was built from the archive (the catalogue does not know it)."""
    return record.extra.get(SOURCE) == FROM_ARCHIVE


def _not_found(name: str) -> NotFound:
    return NotFound("checkpoint_not_found", f"no checkpoint named {name!r}")


@contextmanager
def _mapped(tier: ArchiveTier) -> Iterator[None]:
    """The archive tier's errors as the service's: 507 ``archive_full``, 503
    ``archive_unavailable`` (out of reach, refused credentials: the message says which).
    ``ChunkNotFound`` and ``CorruptChunk`` pass: they are the caller's to decide."""
    try:
        yield
    except (ChunkNotFound, CorruptChunk):
        raise
    except TierFull as exc:
        raise InsufficientStorage("archive_full", str(exc)) from exc
    except ArchiveDenied as exc:
        raise unavailable("archive_unavailable", f"the archive refused access: {exc}") from exc
    except TierError as exc:
        raise unavailable("archive_unavailable", str(exc), retry_after=5.0) from exc


__all__ = [
    "Archive",
    "Archived",
    "CannotOpenArchive",
    "ReadThroughCache",
    "is_archived_record",
    "open_archive",
]
