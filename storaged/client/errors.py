"""Typed errors of the storaged client.

Every error the service returns becomes a ``StoragedError`` (``storaged.wire``'s, the
root the server's domain errors share) carrying the API's stable
error code (``code``), its human message, the HTTP status and the decoded error body.
``error_from_response`` is the one place where a response becomes an exception.
Failures that never reached a server (refused connection, timeout, a request the
client refuses to send) carry ``status=None`` and a client-side code.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from storaged.wire import ErrorCode

# The wire's root of every coded error, the server's too; re-exported from here.
from storaged.wire import StoragedError as StoragedError


class BadRequest(StoragedError):
    """A 400: the request was refused and nothing changed."""

    default_code = ErrorCode.BAD_REQUEST


class BadChunkId(BadRequest):
    default_code = ErrorCode.BAD_CHUNK_ID


class ChecksumMismatch(BadRequest):
    """The bytes do not hash to the chunk id (on upload, or on a verified read)."""

    default_code = ErrorCode.CHECKSUM_MISMATCH


class Truncated(BadRequest):
    default_code = ErrorCode.TRUNCATED


class BodyTooSlow(StoragedError):
    """A PUT body arrived slower than the node allows (its ``body_min_rate``): nothing was
    stored. Retried (HTTP 408): a congested link may carry the next try faster."""

    default_code = ErrorCode.BODY_TOO_SLOW


class BadName(BadRequest):
    default_code = ErrorCode.BAD_NAME


class BadManifest(BadRequest):
    default_code = ErrorCode.BAD_MANIFEST


class BadRange(BadRequest):
    default_code = ErrorCode.BAD_RANGE


class TooLarge(BadRequest):
    default_code = ErrorCode.TOO_LARGE


class LengthRequired(BadRequest):
    default_code = ErrorCode.LENGTH_REQUIRED


class Unauthorized(StoragedError):
    default_code = ErrorCode.UNAUTHORIZED


class Forbidden(StoragedError):
    default_code = ErrorCode.FORBIDDEN


class NotFound(StoragedError, KeyError):
    """Something named does not exist (also a ``KeyError``)."""

    default_code = ErrorCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the args
        return StoragedError.__str__(self)


class ChunkNotFound(NotFound):
    default_code = ErrorCode.CHUNK_NOT_FOUND


class FragmentNotFound(NotFound):
    """A node does not hold the fragment asked of it (extension E12)."""

    default_code = ErrorCode.FRAGMENT_NOT_FOUND


class NotEnoughFragments(ChunkNotFound):
    """A cold chunk could not be decoded: fewer than ``needed`` good fragments could be
    read (``available``). Also a ``ChunkNotFound``: the cluster cannot produce the chunk."""

    default_code = ErrorCode.NOT_ENOUGH_FRAGMENTS

    def __init__(self, message: str, *, available: int, needed: int) -> None:
        super().__init__(message=message)
        self.available = available
        self.needed = needed


class CheckpointNotFound(NotFound):
    default_code = ErrorCode.CHECKPOINT_NOT_FOUND


class Conflict(StoragedError):
    """A 409: the request contradicts what the cluster holds; nothing changed."""

    default_code = ErrorCode.CONFLICT


class MissingChunks(Conflict):
    """A commit named chunks the cluster does not hold; ``missing`` lists them."""

    default_code = ErrorCode.MISSING_CHUNKS

    def __init__(self, *args: Any, missing: Sequence[str] | None = None, **kwargs: Any) -> None:
        """``StoragedError``'s arguments; ``missing`` goes into the body as the server's
        document has it."""
        super().__init__(*args, **kwargs)
        if missing is not None:
            self.body = {**self.body, "missing": list(missing)}
        value = self.body.get("missing", [])
        #: Ids of the chunks the cluster does not hold, as the server listed them.
        self.missing: list[str] = [str(v) for v in value] if isinstance(value, list) else []


class Exists(Conflict):
    """A different manifest is already committed under this name (checkpoints are immutable)."""

    default_code = ErrorCode.EXISTS


class Unavailable(StoragedError):
    """The cluster cannot serve now (a 503, or no node reachable). Retried before raised."""

    default_code = ErrorCode.UNAVAILABLE


class InsufficientReplicas(Unavailable):
    default_code = ErrorCode.INSUFFICIENT_REPLICAS


class MemoryFull(Unavailable):
    default_code = ErrorCode.MEMORY_FULL


class StorageFull(StoragedError):
    """A 507 (extension E16): a node's disk tier is full, so the cluster cannot keep what
    the request needs until space is freed or nodes are added. Not retried after a pause
    (waiting does not clear it); a chunk PUT tries each other node once, since another
    entry node may place the chunk on nodes with room. ``full`` names the full tiers:
    ``[{"node", "url", "tier"}, ...]``."""

    default_code = ErrorCode.STORAGE_FULL

    @property
    def full(self) -> list[dict[str, str]]:
        value = self.body.get("full")
        if not isinstance(value, list):
            return []
        return [
            {str(k): str(v) for k, v in entry.items()} for entry in value if isinstance(entry, dict)
        ]


class NvmeFull(StorageFull):
    """A node's nvme tier is full: its RAM holds chunks that cannot drain, so it takes no
    new copies (a PUT), or a checkpoint cannot reach ``nvme`` (``Client.wait``)."""

    default_code = ErrorCode.NVME_FULL


class ColdFull(StorageFull):
    """A node's cold tier is full: a checkpoint cannot reach ``cold`` (``Client.wait``)."""

    default_code = ErrorCode.COLD_FULL


class ConnectionFailed(Unavailable):
    """No response: connection refused or reset, or the request timed out."""

    default_code = ErrorCode.CONNECTION_FAILED


class ProtocolError(StoragedError):
    """A response the client cannot make sense of (wrong length, undecodable body)."""

    default_code = ErrorCode.BAD_RESPONSE


class NotStoraged(ProtocolError):
    """Another server answers at the URL (a web server, etcd) with a success that is not
    one of storaged's documents (its errors keep the class of their status, with
    ``foreign`` set)."""

    default_code = ErrorCode.NOT_STORAGED


class ServerError(StoragedError):
    default_code = ErrorCode.SERVER_ERROR


_BY_CODE: dict[str, type[StoragedError]] = {
    cls.default_code: cls
    for cls in (
        BadRequest,
        BadChunkId,
        ChecksumMismatch,
        Truncated,
        BodyTooSlow,
        BadName,
        BadManifest,
        BadRange,
        TooLarge,
        LengthRequired,
        Unauthorized,
        Forbidden,
        NotFound,
        ChunkNotFound,
        FragmentNotFound,
        CheckpointNotFound,
        MissingChunks,
        Exists,
        Unavailable,
        InsufficientReplicas,
        MemoryFull,
        StorageFull,
        NvmeFull,
        ColdFull,
    )
}

# When the body names no code we know, the status decides the class.
_BY_STATUS: dict[int, type[StoragedError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    408: BodyTooSlow,
    409: Conflict,
    411: LengthRequired,
    413: TooLarge,
    416: BadRange,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
    507: StorageFull,
}


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date), or None."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


_API_TYPES = ("application/json", "application/msgpack", "application/x-msgpack")


def is_api_content_type(content_type: str | None) -> bool:
    """Whether a response says it is one of storaged's documents (JSON or msgpack)."""
    return (content_type or "").split(";")[0].strip().lower() in _API_TYPES


def decode_body(raw: bytes, content_type: str | None) -> Any:
    """Decode a msgpack or JSON body; raise ``ValueError`` when it is neither."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype == "application/json":
        return json.loads(raw)
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        if ctype in ("", "application/msgpack", "application/x-msgpack"):
            try:
                return json.loads(raw)
            except ValueError:
                pass
        raise ValueError(f"undecodable {ctype or 'untyped'} body: {exc}") from exc


def error_from_response(
    status: int,
    raw: bytes,
    content_type: str | None = None,
    retry_after: str | None = None,
) -> StoragedError:
    """The typed exception for an error response (``status`` >= 400).

    The class follows the body's ``error`` code when known, else the status; an
    undecodable body still gives an error of the status's class, with the raw text
    (truncated) as the message.
    """
    body: Mapping[str, Any] = {}
    message = ""
    code: str | None = None
    try:
        decoded = decode_body(raw, content_type) if raw else {}
    except ValueError:
        decoded = None
        message = raw[:200].decode("utf-8", "replace")
    if isinstance(decoded, dict):
        body = decoded
        if isinstance(decoded.get("error"), str):
            code = decoded["error"]
        if isinstance(decoded.get("message"), str):
            message = decoded["message"]
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else StoragedError
    foreign = code is None and status not in (502, 503, 504)
    if code is None:
        code = cls.default_code if cls is not StoragedError else f"http_{status}"
    error = cls(code, message, status, body, retry_after=parse_retry_after(retry_after))
    if foreign and not is_api_content_type(content_type):
        # storaged answers every error with its document; a page of HTML, or etcd's
        # "404 page not found", is another server (a proxy's 502-504 stay retryable)
        error.foreign = foreign_answer(status, content_type)
    return error


def foreign_answer(status: int, content_type: str | None) -> str:
    """What an answer that is not storaged's was, for ``StoragedError.foreign``."""
    kind = (content_type or "no content type").split(";")[0].strip()
    return f"it answered HTTP {status} {kind}, not storaged's JSON or msgpack"


def is_retryable(error: BaseException) -> bool:
    """True for failures worth retrying after a pause: 502/503/504, 408 (a body the node
    found too slow) and lost connections."""
    if isinstance(error, ConnectionFailed):
        return True
    return isinstance(error, StoragedError) and error.status in (408, 502, 503, 504)
