"""The vocabulary server, client and peer protocol share: bytes, byte ranges, chunk and
checkpoint states, error codes (API.md) and the root of every error that carries one.
Chunk ids and checkpoint names are in ``storaged.ids``.

A leaf: it imports nothing of the project, so the client can speak it without loading
the server's tiers and a command line can offer its names without loading the client.
The storage leaves (``tiers``, ``erasure``) import nothing from ``storaged``; they keep
their own ``BytesLike`` and ``ByteRange`` (the same shapes) for that reason.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

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
    BAD_POLICY = "bad_policy"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    TRUNCATED = "truncated"
    LENGTH_REQUIRED = "length_required"
    TOO_LARGE = "too_large"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    # a body slower than the node allows (408): retry
    BODY_TOO_SLOW = "body_too_slow"
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
    NO_ARCHIVE = "no_archive"
    POLICY_IN_CLUSTER_FILE = "policy_in_cluster_file"
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
    ARCHIVE_UNAVAILABLE = "archive_unavailable"
    CHUNKS_UNAVAILABLE = "chunks_unavailable"
    # a full disk tier (507)
    STORAGE_FULL = "storage_full"
    NVME_FULL = "nvme_full"
    COLD_FULL = "cold_full"
    ARCHIVE_FULL = "archive_full"
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


class StoragedError(Exception):
    """A refusal with a stable ``code`` (API.md): the root of the server's domain errors
    (``storaged.errors``: their class says which HTTP status they get) and of the client's
    exceptions (``storaged.client.errors``: their class follows the code received).

    ``message`` is the human text; ``retry_after`` the seconds to wait before retrying a
    transient refusal. On the server, ``extra`` holds the fields the refusal adds to its
    error document (``missing``, ``full``...). On the client, ``status`` is the HTTP status
    received (``None`` when no response was), ``body`` the decoded error document (empty
    when there was none).
    """

    #: Code used when none is given (also the class's canonical code).
    default_code: str = ErrorCode.ERROR

    def __init__(
        self,
        code: str | None = None,
        message: str = "",
        status: int | None = None,
        body: Mapping[str, Any] | None = None,
        *,
        retry_after: float | None = None,
        **extra: Any,
    ) -> None:
        self.code = str(code or self.default_code)  # a plain str, as it always was
        self.message = message or self.code
        self.status = status
        self.body: Mapping[str, Any] = body if body is not None else {}
        #: Seconds the server asked us to wait before retrying (503 ``Retry-After``).
        self.retry_after = retry_after
        self.extra: dict[str, Any] = extra
        #: True when an earlier attempt of the same call may have reached the server
        #: before its answer was lost (so e.g. a 404 on DELETE may be our own doing).
        self.replayed = False
        #: When the answer was not one of storaged's documents (a web page, etcd's plain
        #: text: another server at the URL), what it was; empty otherwise.
        self.foreign = ""
        super().__init__(self.code, self.message)

    def __str__(self) -> str:
        where = f"HTTP {self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"
