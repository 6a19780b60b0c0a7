"""The checkpoint catalogue in etcd: a commit is one transaction, GC reads one revision.

Upholds, for the node (see ``storaged.coord.catalogue.Catalogue``):

- **I4 commits**: a commit creates ``ckpt/<name>`` only if it does not exist (compare
  ``create_revision == 0``) or replaces a tombstone only if that tombstone is unchanged
  (compare ``mod_revision``); the record, its inline manifest and its chunk ids go in the
  same transaction, so of two racing commits one wins and the other writes nothing. Once
  etcd answers, the record is on a quorum of etcd members.
- **I3, the catalogue's part**: ``references()`` pages through the records and the chunk
  ids at *one* etcd revision, read after ``taken_at``: every commit that answered before
  ``taken_at`` is in it.

etcd refuses requests over about 1.5 MiB. A manifest over ``inline_manifest`` bytes is
stored as content-addressed chunks of at most ``max_chunk_size`` on the data plane
(``DataPlane.put_chunk``: three RAM copies, then drained and encoded like any chunk);
etcd keeps their ids and sizes, and ``references()`` names them so GC keeps them. Chunk
ids over ``inline_refs`` bytes are written in parts before the transaction, which then
checks that each part still exists (a delete in between removes them).

**No live record ever lacks a chunk-id part**, under any interleaving of commits (parts,
transaction, retries), deletes, ``compact_tombstones`` and ``compact_orphans``. Parts of
``<name>#<tag>`` are written by a commit of that digest and removed by a delete or an
orphan compaction only:

- A commit's transaction succeeds only if each of its parts exists at that revision, so
  the record and all its parts exist together from then on. A retry writes the same
  bytes under the same keys again (after a lost reply, a part may be older than any scan).
- A delete tombstones the record and removes every part of the name in one transaction
  that checks the record unchanged: a tombstone names no part.
- ``compact_tombstones`` removes a tombstone only if unchanged: never a record or a part.
- ``compact_orphans`` reads every record at one revision R and removes a part that no
  record of R owns in a transaction that also checks ``ckpt/<name>`` is still what it was
  at R (absent at R: still absent). If that transaction succeeds, the record of the name
  is one that does not own the part (or there is none): nothing names the part. A commit
  of it whose transaction lands before the removal changed ``ckpt/<name>``, so the
  removal fails; one that lands after finds the part gone, fails, and writes it again.
  The horizon (parts older than the previous scan) only spares commits in flight that
  retry; safety rests on the compares.

A record found short of a part all the same (damage from outside: an operator, an older
version) is refused by reads and ``references()`` (GC frees nothing) until ``repair()``
rewrites the part from its manifest, in a transaction that checks the record unchanged:
a delete or a new commit of the name in between wins, and a tombstone gets no part.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import blake3
import msgpack
from etcd3aio.kv import KVService

from storaged.coord.catalogue import Catalogue, CommitConflict, CoordinatorUnavailable, References
from storaged.coord.etcd import (
    EtcdSession,
    RevisionCompacted,
    compare_mod_revision,
    kv_response,
)
from storaged.coord.manifest_store import CatalogRecord, CheckpointNotFound
from storaged.coord.policy_store import PolicyStore, document, policy_of
from storaged.errors import BadInput
from storaged.ids import chunk_id_of
from storaged.manifest import MAX_INT, check_manifest
from storaged.retention import Policy

if TYPE_CHECKING:
    from storaged.node.services import DataPlane

log = logging.getLogger("storaged.coord.catalogue")

_FORMAT = 1
_HEX_ID = re.compile(r"[0-9a-f]{64}")
#: chunk ids per refs part (32 bytes each: 256 KiB)
_IDS_PER_PART = 8192
#: keys per page of a listing or a references() read
_PAGE = 200
#: a commit, a delete: tries against concurrent changes of the same name
_TRIES = 8
#: reads of references() started again after their revision was compacted
_SNAPSHOT_TRIES = 3
#: a delete whose transaction's answer was lost: reads of its outcome, this far apart (s)
_LOST_READS = 3
_LOST_PAUSE = 0.5


def pack_ids(ids: list[str]) -> bytes:
    """Chunk ids as 32 bytes each (half their hex); anything else as a msgpack list."""
    if all(_HEX_ID.fullmatch(c) for c in ids):
        return b"\x01" + b"".join(bytes.fromhex(c) for c in ids)
    packed: bytes = msgpack.packb(ids, use_bin_type=True)
    return b"\x02" + packed


def unpack_ids(blob: bytes) -> list[str]:
    view = memoryview(blob)
    if blob[:1] == b"\x01":
        # one hex() of the whole part, then slices: 3x faster than a hex() per id
        text = view[1:].hex()
        return [text[i : i + 64] for i in range(0, len(text), 64)]
    if blob[:1] == b"\x02":
        return [str(c) for c in msgpack.unpackb(view[1:], raw=False)]
    raise ValueError("unknown chunk-id part format")


@dataclass(eq=False, repr=False)
class EtcdCatalogue(Catalogue):
    """``name -> record`` in etcd; the node's data plane holds manifests too big for it."""

    node: DataPlane | None
    session: EtcdSession
    _: KW_ONLY
    inline_manifest: int = 512 * 2**10
    inline_refs: int = 512 * 2**10
    tombstone_ttl: float = 24 * 3600.0
    compact_interval: float = 300.0
    #: when the last compaction ran (monotonic), None before the first: monotonic time
    #: counts from an arbitrary point (boot, on Linux), so a 0.0 here held back every
    #: compaction for a freshly booted machine's first ``compact_interval`` seconds
    _last_compaction: float | None = field(default=None, init=False)
    #: the etcd revision of the last orphan scan: parts created after it are too young
    _orphan_horizon: int = field(default=0, init=False)
    #: names whose live record a read found without all its chunk-id parts
    _damaged: set[str] = field(default_factory=set, init=False)

    # ---- keys --------------------------------------------------------------------------
    def _ckpt(self, name: str = "") -> str:
        return self.session.key("ckpt", name)

    def _manifest(self, name: str, digest: str | None = None) -> str:
        return self.session.key("manifest", f"{name}#{_tag(digest)}")

    def _refs(self, name: str, digest: str | None = None, part: int | None = None) -> str:
        tail = "" if part is None else f"#{part:06d}"
        return self.session.key("refs", f"{name}#{_tag(digest)}{tail}")

    # ---- commit ------------------------------------------------------------------------
    async def commit(self, record: CatalogRecord) -> bool:
        if record.manifest is None:
            raise ValueError("a commit needs the manifest")
        kv = await self.session.kv()
        summary: dict[str, Any] = {
            "format": _FORMAT,
            "name": record.name,
            "digest": record.digest,
            "created": record.created,
            "committed": record.committed,
            "bytes": record.total_bytes,
            "count": len(record.chunks),
            "deleted": None,
        }
        ops = []
        if len(record.manifest) > self.inline_manifest:
            summary["manifest_chunks"] = await self._store_manifest_chunks(record.manifest)
        else:
            ops.append(
                KVService.txn_op_put(self._manifest(record.name, record.digest), record.manifest)
            )
        parts = _parts(record.chunks)
        summary["parts"] = len(parts)
        part_keys = [self._refs(record.name, record.digest, i) for i in range(len(parts))]
        inline = sum(len(p) for p in parts) <= self.inline_refs
        if inline:
            ops += [KVService.txn_op_put(k, p) for k, p in zip(part_keys, parts, strict=True)]
        ops.append(KVService.txn_op_put(self._ckpt(record.name), _pack(summary)))
        key = self._ckpt(record.name)
        # The first try expects a free name; after that, the tombstone seen last.
        expect = KVService.txn_compare_create_revision(key, 0)
        for _ in range(_TRIES):
            compares = [expect]
            if not inline:
                await self._put_parts(part_keys, parts)
                # A delete between those puts and this txn removed them: then retry.
                compares += [
                    KVService.txn_compare_create_revision(k, 0, result=_GREATER) for k in part_keys
                ]
            reply = await self.session.call(
                f"commit of {record.name!r}",
                kv.txn(compares, ops, [KVService.txn_op_get(key)]),
            )
            if reply.succeeded:
                return True
            kvs = kv_response(reply)
            if not kvs:
                expect = KVService.txn_compare_create_revision(key, 0)
                continue  # a refs part was deleted under us, or the tombstone compacted
            existing = _unpack(kvs[0].value)
            if existing.get("deleted") is None:
                if existing["digest"] == record.digest:
                    return False
                raise CommitConflict(f"checkpoint {record.name!r} exists with other contents")
            expect = compare_mod_revision(key, kvs[0].mod_revision)
        raise CommitConflict(f"checkpoint {record.name!r} keeps changing: committed concurrently")

    async def _put_parts(self, keys: list[str], parts: list[bytes]) -> None:
        kv = await self.session.kv()
        for k, p in zip(keys, parts, strict=True):
            await self.session.call("a chunk-id part", kv.put(k, p))

    async def _store_manifest_chunks(self, manifest: bytes) -> list[list[Any]]:
        """Put the manifest on the data plane as chunks of at most ``max_chunk_size``;
        their [id, size] in order."""
        node = self.node
        if node is None:
            raise CoordinatorUnavailable("a manifest this large needs the node's data plane")
        step = node.config.max_chunk_size
        out: list[list[Any]] = []
        for start in range(0, len(manifest), step):
            piece = memoryview(manifest)[start : start + step]
            chunk_id = await asyncio.to_thread(_chunk_id, piece)

            async def body(p: memoryview = piece) -> AsyncIterator[bytes | bytearray | memoryview]:
                yield p

            await node.put_chunk(chunk_id, len(piece), body())
            out.append([chunk_id, len(piece)])
        return out

    # ---- reads ---------------------------------------------------------------------------
    async def find(self, name: str) -> CatalogRecord | None:
        kv = await self.session.kv()
        prefix = self._refs(name)
        reply = await self.session.call(
            f"read of {name!r}",
            kv.txn(
                [],
                [
                    KVService.txn_op_get(self._ckpt(name)),
                    KVService.txn_op_get(prefix, range_end=self.session.range_end(prefix)),
                    KVService.txn_op_get(
                        self._manifest(name), range_end=self.session.range_end(self._manifest(name))
                    ),
                ],
            ),
        )
        kvs = kv_response(reply, 0)
        if not kvs:
            return None
        summary = _unpack(kvs[0].value)
        record = _record(summary)
        if record.deleted is not None:
            return record
        mine = self._refs(name, record.digest).encode() + b"#"
        parts = sorted((p for p in kv_response(reply, 1) if p.key.startswith(mine)), key=_key)
        if len(parts) != summary["parts"]:
            self._damaged.add(name)
            raise CoordinatorUnavailable(f"checkpoint {name!r}: its chunk ids are incomplete")
        record.chunks = [c for p in parts for c in unpack_ids(p.value)]
        chunks = summary.get("manifest_chunks")
        if chunks is not None:
            record.manifest = await self._read_manifest_chunks([str(c[0]) for c in chunks])
        else:
            want = self._manifest(name, record.digest).encode()
            found = [m.value for m in kv_response(reply, 2) if m.key == want]
            if not found:
                raise CoordinatorUnavailable(f"checkpoint {name!r}: its manifest is missing")
            record.manifest = bytes(found[0])
        return record

    async def _read_manifest_chunks(self, ids: list[str]) -> bytes:
        node = self.node
        if node is None:
            raise CoordinatorUnavailable("the manifest lives on the data plane: no node here")
        pieces = [(await node.read_chunk(chunk_id))[0] for chunk_id in ids]
        return b"".join(pieces)  # deliberate copy: the record owns its manifest

    async def _pages(
        self, prefix: str, revision: int = 0, *, keys_only: bool = False
    ) -> AsyncIterator[tuple[Any, int]]:
        """(key-value, revision) over ``prefix`` in key order, every page at one revision."""
        kv = await self.session.kv()
        start: bytes = prefix.encode()
        end = self.session.range_end(prefix)
        while True:
            reply = await self.session.call(
                f"range over {prefix!r}",
                kv.get(start, end, revision=revision, limit=_PAGE, keys_only=keys_only),
            )
            revision = revision or int(reply.header.revision)
            for item in reply.kvs:
                yield item, revision
            if not reply.more or not reply.kvs:
                return
            start = bytes(reply.kvs[-1].key) + b"\x00"

    async def list(self, prefix: str = "") -> list[CatalogRecord]:
        out = []
        async for item, _ in self._pages(self._ckpt(prefix)):
            record = _record(_unpack(item.value))
            if record.deleted is None:
                out.append(record)
        return out

    async def delete(self, name: str) -> None:
        """Tombstone ``name``'s live record (``Catalogue.delete``). A transaction whose
        answer is lost (etcd applied it, or not, and the call timed out) is not an error:
        the tombstone carries a token of this call, and reading it back says the delete is
        done. Only the record first read is deleted: one a new commit put under the name
        meanwhile is never touched. ``CoordinatorUnavailable`` when etcd does not answer
        (also after ``_LOST_READS`` reads following a lost answer)."""
        kv = await self.session.kv()
        key = self._ckpt(name)
        token = secrets.token_hex(16)
        #: the mod_revision of the live record this call deletes (the first one read)
        target: int | None = None
        lost: CoordinatorUnavailable | None = None
        for _ in range(_TRIES):
            got = await self._read_record(name, key, retries=_LOST_READS if lost else 1)
            item = got.kvs[0] if got.kvs else None
            summary = _unpack(item.value) if item is not None else {}
            if summary.get("deleted") is not None and summary.get("deleted_by") == token:
                return  # ours: applied, though its answer was lost
            if (
                item is None
                or summary.get("deleted") is not None
                or (target is not None and item.mod_revision != target)
            ):
                if lost is not None:
                    # The record this call meant went while its answer was lost (a commit may
                    # have taken the name since): it is deleted, by this call or another.
                    return
                raise CheckpointNotFound(name)
            target = int(item.mod_revision)
            summary["deleted"] = time.time()
            summary["deleted_by"] = token
            summary.pop("manifest_chunks", None)
            refs, manifests = self._refs(name), self._manifest(name)
            try:
                reply = await self.session.call(
                    f"delete of {name!r}",
                    kv.txn(
                        [compare_mod_revision(key, target)],
                        [
                            KVService.txn_op_put(key, _pack(summary)),
                            KVService.txn_op_delete(refs, range_end=self.session.range_end(refs)),
                            KVService.txn_op_delete(
                                manifests, range_end=self.session.range_end(manifests)
                            ),
                        ],
                    ),
                )
            except CoordinatorUnavailable as exc:
                lost = exc  # applied or not: the next read tells
                continue
            if reply.succeeded:
                return
        if lost is not None:
            raise lost
        raise CoordinatorUnavailable(f"checkpoint {name!r} keeps changing: delete not done")

    async def _read_record(self, name: str, key: str, *, retries: int) -> Any:
        """``key``'s range answer, read up to ``retries`` times while etcd does not answer."""
        kv = await self.session.kv()
        for attempt in range(retries):
            try:
                return await self.session.call(f"read of {name!r}", kv.get(key))
            except CoordinatorUnavailable:
                if attempt == retries - 1:
                    raise
                await asyncio.sleep(_LOST_PAUSE)
        raise AssertionError("unreachable")

    # ---- GC ------------------------------------------------------------------------------
    async def references(self) -> References:
        for _ in range(_SNAPSHOT_TRIES):
            taken_at = time.time()
            try:
                return await self._snapshot(taken_at)
            except RevisionCompacted:
                log.info("references: the revision was compacted while reading; again")
        raise CoordinatorUnavailable("references: etcd compacted every revision read at")

    async def _snapshot(self, taken_at: float) -> References:
        live: dict[tuple[str, str], tuple[CatalogRecord, int]] = {}
        extra: set[str] = set()
        revision = 0
        async for item, at in self._pages(self._ckpt()):
            revision = at
            summary = _unpack(item.value)
            record = _record(summary)
            if record.deleted is None:
                live[(record.name, _tag(record.digest))] = (record, int(summary["parts"]))
                extra.update(str(c[0]) for c in summary.get("manifest_chunks") or ())
        seen: dict[tuple[str, str], int] = {}
        if revision:
            async for item, _ in self._pages(self.session.key("refs", ""), revision):
                name, tag, _part = _key(item).rsplit("#", 2)
                entry = live.get((name.removeprefix(self.session.key("refs", "")), tag))
                if entry is None:
                    continue  # a losing commit's parts, or a tombstone's leftovers
                entry[0].chunks.extend(unpack_ids(item.value))
                seen[(entry[0].name, tag)] = seen.get((entry[0].name, tag), 0) + 1
        damaged = sorted(
            name for (name, tag), (_, parts) in live.items() if seen.get((name, tag), 0) != parts
        )
        if damaged:
            # Fail safe: GC frees nothing until repair() has rewritten their parts.
            self._damaged.update(damaged)
            raise CoordinatorUnavailable(
                f"checkpoint {damaged[0]!r}: its chunk ids are incomplete"
                + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else "")
            )
        chunks = set(extra)
        for record, _ in live.values():
            chunks.update(record.chunks)
        records = tuple(sorted((r for r, _ in live.values()), key=lambda r: r.name))
        return References(frozenset(chunks), records, taken_at, complete=True)

    def policy_store(self) -> EtcdPolicyStore:
        return EtcdPolicyStore(self.session)

    async def repair(self) -> int:
        """Rewrites the missing chunk-id parts of the records a read of this catalogue found
        incomplete (``repair_record``), then compacts tombstones older than
        ``tombstone_ttl`` and orphan chunk-id parts (at most every ``compact_interval`` s);
        returns how many keys were written or went."""
        damaged, self._damaged = self._damaged, set()
        done = 0
        for name in sorted(damaged):
            try:
                done += await self.repair_record(name)
            except CoordinatorUnavailable as exc:
                log.warning("checkpoint %r: its chunk ids not repaired yet: %s", name, exc)
                self._damaged.add(name)
        now = time.monotonic()
        if (
            self._last_compaction is not None
            and now - self._last_compaction < self.compact_interval
        ):
            return done
        self._last_compaction = now
        return (
            done + await self.compact_tombstones(self.tombstone_ttl) + await self.compact_orphans()
        )

    async def repair_record(self, name: str) -> int:
        """Rewrite the chunk-id parts that ``name``'s live record lacks (or holds other
        bytes in) from its manifest, as the commit derived them; returns parts written.

        Each part goes in a transaction that checks the record unchanged, so a delete or a
        new commit of the name in between wins and nothing is written for a record that is
        gone. A manifest that does not give the record's chunk list (it is not a manifest
        of that digest, or of that many chunks) is left as it is, with an ERROR: reads and
        ``references()`` go on refusing the record (fail safe). Raises
        ``CoordinatorUnavailable`` when etcd, or a manifest on the data plane, is out of
        reach (a later pass tries again)."""
        kv = await self.session.kv()
        key = self._ckpt(name)
        refs, manifests = self._refs(name), self._manifest(name)
        reply = await self.session.call(
            f"read of {name!r}",
            kv.txn(
                [],
                [
                    KVService.txn_op_get(key),
                    KVService.txn_op_get(refs, range_end=self.session.range_end(refs)),
                    KVService.txn_op_get(manifests, range_end=self.session.range_end(manifests)),
                ],
            ),
        )
        kvs = kv_response(reply, 0)
        if not kvs:
            return 0
        summary = _unpack(kvs[0].value)
        if summary.get("deleted") is not None:
            return 0
        digest, revision = str(summary["digest"]), int(kvs[0].mod_revision)
        stored = {bytes(p.key).decode(): bytes(p.value) for p in kv_response(reply, 1)}
        mine = [self._refs(name, digest, i) for i in range(int(summary["parts"]))]
        if all(k in stored for k in mine):
            return 0  # complete (a repair of another node's, or the damage was seen stale)
        parts = await self._parts_from_manifest(name, summary, kv_response(reply, 2), len(mine))
        if parts is None:
            return 0
        written = 0
        for part_key, part in zip(mine, parts, strict=True):
            if stored.get(part_key) == part:
                continue
            put = await self.session.call(
                f"repair of {name!r}",
                kv.txn(
                    [compare_mod_revision(key, revision)], [KVService.txn_op_put(part_key, part)]
                ),
            )
            if not put.succeeded:
                log.info("checkpoint %r changed during its repair: left to what changed it", name)
                return written
            written += 1
        log.warning(
            "checkpoint %r: %d of its %d chunk-id part(s) were missing or damaged in etcd; "
            "rewritten from its manifest",
            name,
            written,
            len(parts),
        )
        return written

    async def _parts_from_manifest(
        self, name: str, summary: dict[str, Any], kept: Sequence[Any], count: int
    ) -> Sequence[bytes] | None:
        """The ``count`` chunk-id parts of record ``summary`` as its commit derived them,
        from its manifest (on the data plane, or among the ``kept`` manifest keys of the
        name); None, with an ERROR, when that manifest is missing or does not give them."""
        digest = str(summary["digest"])
        chunks = summary.get("manifest_chunks")
        if chunks is not None:
            manifest = await self._read_manifest_chunks([str(c[0]) for c in chunks])
        else:
            want = self._manifest(name, digest).encode()
            found = [bytes(m.value) for m in kept if m.key == want]
            if not found:
                log.error("checkpoint %r: chunk ids incomplete and its manifest missing", name)
                return None
            manifest = found[0]
        try:
            ids = await asyncio.to_thread(_chunk_ids_of, manifest, digest)
        except ValueError as exc:
            log.error("checkpoint %r: chunk ids incomplete, not rebuilt: %s", name, exc)
            return None
        parts = _parts(ids)
        if len(ids) != summary["count"] or len(parts) != count:
            log.error(
                "checkpoint %r: chunk ids incomplete, not rebuilt: its manifest names %d "
                "chunk(s), the record %d",
                name,
                len(ids),
                summary["count"],
            )
            return None
        return parts

    async def compact_orphans(self) -> int:
        """Remove chunk-id parts no live record owns (a commit that lost its race or died
        between its parts and its transaction) that already existed at the previous call.

        A part goes only in a transaction that also checks its name's record unchanged
        since the scan (absent then: still absent), so a commit that lands between the
        scan and the delete keeps every part it names (see the module docstring)."""
        kv = await self.session.kv()
        owned: set[tuple[str, str]] = set()
        #: each name's record (live or tombstone) at the scan's revision: its mod_revision
        versions: dict[str, int] = {}
        ckpts = self._ckpt()
        # The revision first: with no record at all, the pages would not tell it.
        counted = await self.session.call(
            "record count", kv.get(ckpts, self.session.range_end(ckpts), count_only=True)
        )
        revision = int(counted.header.revision)
        async for item, _ in self._pages(ckpts, revision):
            record = _record(_unpack(item.value))
            versions[_key(item).removeprefix(ckpts)] = int(item.mod_revision)
            if record.deleted is None:
                owned.add((record.name, _tag(record.digest)))
        horizon, self._orphan_horizon = self._orphan_horizon, revision
        removed = 0
        if not horizon:
            return 0
        refs = self.session.key("refs", "")
        async for item, _ in self._pages(refs, revision, keys_only=True):
            name, tag, _part = _key(item).removeprefix(refs).rsplit("#", 2)
            if (name, tag) in owned or item.create_revision > horizon:
                continue
            seen = versions.get(name)
            unchanged = (
                KVService.txn_compare_create_revision(self._ckpt(name), 0)
                if seen is None
                else compare_mod_revision(self._ckpt(name), seen)
            )
            reply = await self.session.call(
                "orphan compaction",
                kv.txn(
                    [compare_mod_revision(item.key, item.mod_revision), unchanged],
                    [KVService.txn_op_delete(item.key)],
                ),
            )
            removed += int(bool(reply.succeeded))
        if removed:
            log.info("compacted %d orphan chunk-id part(s)", removed)
        return removed

    async def compact_tombstones(self, older_than: float) -> int:
        """Remove tombstones deleted more than ``older_than`` s ago; each only if unchanged
        since it was read (a commit may have reused the name)."""
        kv = await self.session.kv()
        cutoff = time.time() - older_than
        removed = 0
        async for item, _ in self._pages(self._ckpt()):
            summary = _unpack(item.value)
            deleted = summary.get("deleted")
            if deleted is None or deleted > cutoff:
                continue
            reply = await self.session.call(
                "tombstone compaction",
                kv.txn(
                    [compare_mod_revision(item.key, item.mod_revision)],
                    [KVService.txn_op_delete(item.key)],
                ),
            )
            removed += int(bool(reply.succeeded))
        if removed:
            log.info("compacted %d checkpoint tombstone(s)", removed)
        return removed


#: etcd's Compare.GREATER (etcd3aio exposes the enum only through protobuf)
_GREATER = 1


def _pack(doc: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(doc, use_bin_type=True)
    return packed


def _unpack(blob: bytes) -> dict[str, Any]:
    doc = msgpack.unpackb(blob, raw=False)
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CoordinatorUnavailable("a catalogue record in etcd has an unknown format")
    return doc


def _parts(chunks: list[str]) -> list[bytes]:
    """A record's chunk list as its refs parts (what commit writes and repair rewrites)."""
    return [pack_ids(chunks[i : i + _IDS_PER_PART]) for i in range(0, len(chunks), _IDS_PER_PART)]


def _chunk_ids_of(manifest: bytes, digest: str) -> list[str]:
    """The chunk list a commit of ``manifest`` gave its record (``CheckedManifest.chunks``:
    distinct ids in first-seen order); ValueError unless ``manifest`` is the checked
    manifest of ``digest``. Blocking: run it in a thread."""
    if chunk_id_of(manifest) != digest:
        raise ValueError("its manifest does not hash to the record's digest")
    try:
        # The limits were checked at the commit: a later, stricter setting must not refuse it.
        checked = check_manifest(
            msgpack.unpackb(manifest, raw=False), MAX_INT, max_items_per_key=sys.maxsize
        )
    except (BadInput, ValueError, TypeError) as exc:
        raise ValueError(f"its manifest does not check: {exc}") from exc
    if checked.digest != digest:
        raise ValueError("its manifest does not encode back to the record's digest")
    return list(checked.chunks)


def _chunk_id(data: memoryview) -> str:
    digest: str = blake3.blake3(data).hexdigest()
    return digest


def _tag(digest: str | None) -> str:
    """What stands for a manifest digest in keys: short and of fixed length."""
    return "" if digest is None else blake3.blake3(digest.encode()).hexdigest()[:32]


def _key(item: Any) -> str:
    return bytes(item.key).decode()


def _record(summary: dict[str, Any]) -> CatalogRecord:
    """The record as listed: no manifest, no chunk list."""
    return CatalogRecord.from_wire(summary, listed=True)


class EtcdPolicyStore(PolicyStore):
    origin = "etcd"

    def __init__(self, session: EtcdSession) -> None:
        self.session = session
        self.key = session.key("retention")

    async def load(self) -> Policy | None:
        kv = await self.session.kv()
        reply = await self.session.call("read of the retention policy", kv.get(self.key))
        kvs = list(reply.kvs)
        if not kvs:
            return None
        return policy_of(bytes(kvs[0].value))

    async def save(self, policy: Policy) -> None:
        kv = await self.session.kv()
        if not policy:
            await self.session.call("delete of the retention policy", kv.delete(self.key))
            return
        await self.session.call("write of the retention policy", kv.put(self.key, document(policy)))
