"""The manifest catalogue a node keeps: committed checkpoints and tombstones, durably on disk.

A checkpoint's record lives on the ``replication`` nodes its name's placement
picks. One file per name under ``<data>/catalog/``: a header (magic, version,
CRC-32C of the body) and a msgpack body, written temp + fsync + rename + fsync
of the directory. A deleted checkpoint leaves a tombstone so that a node which
missed the delete cannot bring it back.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import crc32c
import msgpack

from tiers._durable import write_file_durably

_MAGIC = b"SDCK"
_VERSION = 1
_HEADER = struct.Struct(">4sBI")  # magic, version, crc32c(body)


class CheckpointNotFound(KeyError):
    """No committed checkpoint of that name on this node."""


@dataclass(slots=True)
class CatalogRecord:
    name: str
    digest: str
    created: float
    committed: float
    total_bytes: int
    chunks: list[str]
    #: the canonical msgpack manifest (None for a tombstone)
    manifest: bytes | None = None
    deleted: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "created": self.created,
            "committed": self.committed,
            "bytes": self.total_bytes,
            "chunks": self.chunks,
            "manifest": self.manifest,
            "deleted": self.deleted,
        }

    @classmethod
    def from_wire(cls, doc: dict[str, Any], *, listed: bool = False) -> CatalogRecord:
        """The record ``to_wire`` wrote; ``listed``: as a listing gives it, without its
        manifest and chunk list (``doc`` need not hold them)."""
        return cls(
            name=str(doc["name"]),
            digest=str(doc["digest"]),
            created=float(doc["created"]),
            committed=float(doc["committed"]),
            total_bytes=int(doc["bytes"]),
            chunks=[] if listed else [str(c) for c in doc["chunks"]],
            manifest=None if listed else doc.get("manifest"),
            deleted=doc.get("deleted"),
        )


def _file_name(name: str) -> str:
    return quote(name, safe="") + ".ckpt"


def _encode(record: CatalogRecord) -> list[bytes]:
    body = msgpack.packb(record.to_wire(), use_bin_type=True)
    return [_HEADER.pack(_MAGIC, _VERSION, crc32c.crc32c(body)), body]


def _decode(blob: bytes) -> CatalogRecord:
    if len(blob) < _HEADER.size:
        raise ValueError("short catalog file")
    magic, version, crc = _HEADER.unpack_from(blob)
    body = memoryview(blob)[_HEADER.size :]
    if magic != _MAGIC or version != _VERSION or crc32c.crc32c(body) != crc:
        raise ValueError("bad catalog file header or checksum")
    return CatalogRecord.from_wire(msgpack.unpackb(body, raw=False))


class Catalog:
    """Records by name; tombstones win over a record of the same digest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._records: dict[str, CatalogRecord] = {}
        self._lock = asyncio.Lock()
        self.corrupt: list[str] = []

    @classmethod
    async def open(cls, root: Path) -> Catalog:
        catalog = cls(root)
        await asyncio.to_thread(catalog._scan)
        return catalog

    def _scan(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        quarantine = self.root / "quarantine"
        for entry in os.scandir(self.root):
            if not entry.is_file():
                continue
            if entry.name.startswith(".tmp"):
                os.unlink(entry.path)
                continue
            if not entry.name.endswith(".ckpt"):
                continue
            try:
                record = _decode(Path(entry.path).read_bytes())
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                # A damaged record is kept aside, never served; its replicas on other nodes
                # still hold the checkpoint.
                quarantine.mkdir(exist_ok=True)
                os.replace(entry.path, quarantine / entry.name)
                self.corrupt.append(f"{entry.name}: {exc}")
                continue
            if unquote(entry.name[: -len(".ckpt")]) == record.name:
                self._records[record.name] = record

    # ---- reads -------------------------------------------------------------------------
    def get(self, name: str) -> CatalogRecord:
        """The live record of ``name``; raises CheckpointNotFound (also for a tombstone)."""
        record = self._records.get(name)
        if record is None or record.deleted is not None:
            raise CheckpointNotFound(name)
        return record

    def raw(self, name: str) -> CatalogRecord | None:
        """The record or tombstone of ``name``, if any."""
        return self._records.get(name)

    def records(self, prefix: str = "", *, tombstones: bool = False) -> list[CatalogRecord]:
        return sorted(
            (
                r
                for r in self._records.values()
                if r.name.startswith(prefix) and (tombstones or r.deleted is None)
            ),
            key=lambda r: r.name,
        )

    def referenced_chunks(self) -> set[str]:
        out: set[str] = set()
        for record in self._records.values():
            if record.deleted is None:
                out.update(record.chunks)
        return out

    # ---- writes ------------------------------------------------------------------------
    async def store(self, record: CatalogRecord) -> bool:
        """Durably store ``record`` (a commit or a tombstone). Returns False, changing nothing,
        when it would undo a newer tombstone or replace a live record of another digest."""
        async with self._lock:
            current = self._records.get(record.name)
            if current is not None:
                if current.deleted is None and record.deleted is None:
                    return current.digest == record.digest
                if current.deleted is not None and record.deleted is not None:
                    return True
                # A commit after a delete is a new checkpoint only if it came later; a
                # delete older than the live record it meets is of an earlier checkpoint.
                if current.deleted is not None and record.committed <= current.deleted:
                    return False
                if record.deleted is not None and record.deleted <= current.committed:
                    return False
            await asyncio.to_thread(
                write_file_durably, self.root / _file_name(record.name), _encode(record)
            )
            self._records[record.name] = record
            return True

    async def forget(self, names: Iterable[str]) -> None:
        """Drop old tombstones (and their files) once every node has seen them."""
        async with self._lock:
            for name in names:
                record = self._records.get(name)
                if record is not None and record.deleted is not None:
                    del self._records[name]
                    path = self.root / _file_name(name)
                    await asyncio.to_thread(path.unlink, missing_ok=True)
