"""What the workload did and saw, for the checker: chunks (regenerable from the seed),
checkpoints with the outcome of every commit and delete, every body read, and a bounded
log of events (workload and faults) in time order to explain a violation."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np

from storaged.ids import chunk_id_of
from storaged.retention import Policy

#: events kept for the report (a soak would otherwise grow without bound)
LOG_LIMIT = 50_000


def content(seed: int, key: str, size: int) -> bytes:
    """The bytes of chunk ``key``: a function of the seed and the key alone."""
    digest = blake3.blake3(f"{seed}/{key}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
    return rng.bytes(size)


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    key: str
    size: int


@dataclass
class CheckpointRecord:
    """One checkpoint name: what was committed under it and what the cluster answered.

    ``outcome``: ``acked`` (a 201/200 commit), ``unknown`` (every attempt failed without an
    answer: it may or may not exist), ``refused`` (a 4xx: it must not exist). Two manifests
    when two commits raced under the name; ``winner`` is the index of the acked one.
    """

    name: str
    writer: int
    manifests: list[dict[str, Any]]
    chunks: list[str]
    outcome: str = "pending"
    winner: int | None = None
    #: None, "acked" (204) or "unknown" (no answer)
    deleted: str | None = None
    statuses: list[str] = field(default_factory=list)
    #: an archive of it was asked for (it may be in the archive, even if not confirmed)
    archive_asked: bool = False
    #: the cluster said it is archived: from then on it must restore byte-exact, also
    #: after its delete (read through the archive)
    archived: bool = False

    @property
    def live(self) -> bool:
        """Acknowledged and not (possibly) deleted: it must restore byte-exact."""
        return self.outcome == "acked" and self.deleted is None


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    text: str
    at: float


class History:
    def __init__(self, seed: int, retention: Policy | None = None) -> None:
        self.seed = seed
        #: the retention policy the nodes apply (what it may delete need not be there)
        self.retention = retention or Policy()
        self.t0 = time.monotonic()
        self.chunks: dict[str, ChunkSpec] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}
        self.violations: list[Violation] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: collections.deque[tuple[float, str]] = collections.deque(maxlen=LOG_LIMIT)
        #: chunk id -> notable things done to it (reuse, dedup, aborts, re-PUTs), bounded
        self.chunk_notes: dict[str, list[str]] = collections.defaultdict(list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        self.log.append((self.now(), text))

    def note_chunk(self, cid: str, text: str) -> None:
        notes = self.chunk_notes[cid]
        if len(notes) < 40:
            notes.append(f"t={self.now():.1f} {text}")

    def violate(self, invariant: str, text: str) -> None:
        self.violations.append(Violation(invariant, text, self.now()))
        self.note(f"VIOLATION {invariant}: {text}")

    # ---- chunks ------------------------------------------------------------------------
    def chunk(self, key: str, size: int) -> tuple[str, bytes]:
        """(id, bytes) of chunk ``key``, remembered so the checker can regenerate it."""
        data = content(self.seed, key, size)
        cid = chunk_id_of(data)
        self.chunks.setdefault(cid, ChunkSpec(key, size))
        return cid, data

    def bytes_of(self, cid: str) -> bytes:
        spec = self.chunks[cid]
        return content(self.seed, spec.key, spec.size)

    def check_body(self, cid: str, status: int, body: bytes, start: int = 0) -> bool:
        """I7 on one answer: a 200 must hash to ``cid``; a 206 must be the slice at
        ``start``. Returns False (and records the violation) when the bytes are wrong."""
        if status == 200:
            self.counts["bodies_checked"] += 1
            if chunk_id_of(body) == cid:
                return True
            detail = f"{len(body)} bytes hashing to {chunk_id_of(body)}"
        elif status == 206:
            self.counts["bodies_checked"] += 1
            expected = self.bytes_of(cid)[start : start + len(body)]
            if body == expected and len(body) > 0:
                return True
            detail = f"{len(body)} bytes at {start} differ from the chunk's"
        else:
            return True
        self.counts["wrong"] += 1
        self.violate("I7", f"GET {cid[:12]} answered {status} with wrong bytes: {detail}")
        return False

    # ---- checkpoints -------------------------------------------------------------------
    def live_checkpoints(self) -> list[CheckpointRecord]:
        return [r for r in self.checkpoints.values() if r.live]

    def story(self, cid: str) -> str:
        """Everything recorded about chunk ``cid``: for a violation's report."""
        named = [r.name for r in self.checkpoints.values() if cid in r.chunks]
        spec = self.chunks.get(cid)
        lines = [f"chunk {cid} ({spec.key if spec else '?'}), named by {named}"]
        lines += [f"  {n}" for n in self.chunk_notes.get(cid, [])]
        return "\n".join(lines)
