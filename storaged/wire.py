"""The vocabulary server, client and peer protocol share: bytes, byte ranges, chunk and
checkpoint states, and error codes (API.md). Chunk ids and checkpoint names are in
``storaged.ids``.

A leaf: it imports nothing of the project, so the client can speak it without loading
the server's tiers and a command line can offer its names without loading the client.
The storage leaves (``tiers``, ``erasure``) import nothing from ``storaged``; they keep
their own ``BytesLike`` and ``ByteRange`` (the same shapes) for that reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

#: What is accepted as bytes without a copy being made.
BytesLike = bytes | bytearray | memoryview


class InvalidRange(ValueError):
    """A byte range outside the value, or with end < start."""


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of a value; ``end=None`` means to the end. (The HTTP
    ``Range`` header's end is inclusive; this one is not.)"""

    start: int = 0
    end: int | None = None

    def resolve(self, size: int) -> tuple[int, int]:
        """Return concrete ``(start, end)`` for a value of ``size`` bytes, or raise
        ``InvalidRange``."""
        end = size if self.end is None else self.end
        if self.start < 0 or end < self.start or end > size:
            raise InvalidRange(f"range [{self.start}, {self.end}) outside value of {size} bytes")
        return self.start, end


# --- states ---------------------------------------------------------------------------

#: The states a chunk (and so a checkpoint, by its weakest chunk) reaches, weakest first:
#: in RAM on three nodes, on local disk, erasure coded into the cold tier.
STATES: Final = ("memory", "nvme", "cold")


class ChunkState(enum.IntEnum):
    """A state as a rank: a later state is a larger number. The ranks are persisted by
    the node's state log, so they never change: ``MEMORY`` is 1, not 0."""

    MEMORY = 1
    NVME = 2
    COLD = 3


def state_rank(state: str) -> int:
    """The rank (``ChunkState``) of a state's name; ``ValueError`` for anything else."""
    try:
        return STATES.index(state) + 1
    except ValueError:
        raise ValueError(f"unknown durability level {state!r}; expected one of {STATES}") from None


def state_name(rank: int) -> str:
    """The name of a state's rank (``1`` -> ``"memory"``)."""
    return STATES[rank - 1]


def state_at_least(state: str, level: str) -> bool:
    """True when ``state`` is ``level`` or further along ``memory < nvme < cold``."""
    return state_rank(state) >= state_rank(level)


# --- error codes ----------------------------------------------------------------------


class ErrorCode(enum.StrEnum):
    """Every stable error code (API.md): the ``error`` of an HTTP error document, of a
    peer protocol refusal and of a shared-memory refusal, and the ``code`` of the client's
    exceptions. A member is its string (``ErrorCode.TOO_LARGE == "too_large"``, and that
    is what JSON and msgpack write), so the wire is unchanged by naming one.
    ``tests/test_wire.py`` reads the sources: a code raised anywhere must be here."""

    # bad input (400) and bounds (411, 413, 416)
    BAD_REQUEST = "bad_request"
    BAD_CHUNK_ID = "bad_chunk_id"
    BAD_NAME = "bad_name"
    BAD_MANIFEST = "bad_manifest"
    BAD_RANGE = "bad_range"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    TRUNCATED = "truncated"
    LENGTH_REQUIRED = "length_required"
    TOO_LARGE = "too_large"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    # who may ask (401, 403)
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    # missing (404)
    NOT_FOUND = "not_found"
    CHUNK_NOT_FOUND = "chunk_not_found"
    FRAGMENT_NOT_FOUND = "fragment_not_found"
    CHECKPOINT_NOT_FOUND = "checkpoint_not_found"
    NODE_NOT_FOUND = "node_not_found"
    NOT_ENOUGH_FRAGMENTS = "not_enough_fragments"
    # contradicts what is stored (409)
    CONFLICT = "conflict"
    EXISTS = "exists"
    MISSING_CHUNKS = "missing_chunks"
    # not now (503): retry
    UNAVAILABLE = "unavailable"
    INSUFFICIENT_REPLICAS = "insufficient_replicas"
    MEMORY_FULL = "memory_full"
    COORDINATOR_UNAVAILABLE = "coordinator_unavailable"
    NODE_UNAVAILABLE = "node_unavailable"
    SHUTTING_DOWN = "shutting_down"
    TOO_MANY_PUTS = "too_many_puts"
    TOO_MANY_LEASES = "too_many_leases"
    DRAINING = "draining"
    # a full disk tier (507)
    STORAGE_FULL = "storage_full"
    NVME_FULL = "nvme_full"
    COLD_FULL = "cold_full"
    # between nodes and on the shared-memory path
    ABORTED = "aborted"
    CORRUPT = "corrupt"
    IO_ERROR = "io_error"
    SEAL_REFUSED = "seal_refused"
    UNKNOWN_METHOD = "unknown_method"
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    BUSY = "busy"
    INTERNAL = "internal"
    # the client's own, when no answer (or no storaged answer) came
    ERROR = "error"
    CONNECTION_FAILED = "connection_failed"
    BAD_RESPONSE = "bad_response"
    NOT_STORAGED = "not_storaged"
    SERVER_ERROR = "server_error"
