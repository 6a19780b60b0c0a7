"""Async client of the storaged HTTP API (``/work/shared/API.md``, version 1).

One ``Client`` talks to a whole cluster: it learns the membership from
``GET /v1/cluster`` on any of the URLs it is given, sends each chunk PUT to the
chunk's first placement node (rendezvous order over the live nodes), spreads GETs
over the holders of each chunk (least in-flight requests first) and fails over
to other holders, then to any node, when one fails. Every request is bounded in
time; 502/503/504 and lost connections are retried with jittered backoff,
honouring ``Retry-After``. Service errors surface as typed ``StoragedError``s.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import contextvars
import functools
import itertools
import logging
import os
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypeVar
from urllib.parse import quote, urlsplit

import aiohttp
import msgpack

from storaged.client.deadlines import Bandwidth, Deadlines, SlowNodes
from storaged.client.direct import BodyPlan, DirectGets, NotHandled, ResponseHead
from storaged.client.errors import (
    BadName,
    BadRange,
    CheckpointNotFound,
    ChecksumMismatch,
    ChunkNotFound,
    ColdFull,
    ConnectionFailed,
    NotEnoughFragments,
    NotFound,
    NotStoraged,
    NvmeFull,
    ProtocolError,
    StoragedError,
    StorageFull,
    TooLarge,
    Unavailable,
    decode_body,
    error_from_response,
    foreign_answer,
    is_api_content_type,
    is_retryable,
)
from storaged.client.retry import RetryPolicy
from storaged.client.shm import ShmPath, in_thread, pick_node, shm_wanted, usable
from storaged.ids import chunk_id_of, chunk_id_of_async, is_checkpoint_name, is_chunk_id
from storaged.placement import rendezvous_order
from storaged.shmwire import WireError
from storaged.wire import STATES, ByteRange, BytesLike, state_at_least, state_rank

if TYPE_CHECKING:
    # Imported where used: a command that only asks the cluster (``storaged ls``) starts
    # without numpy and the codecs (tests/client/test_cli_start.py).
    import numpy as np

    from erasure import Codec
    from storaged.client.degraded import Decoded

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What ``get_chunk`` can read into: any C-contiguous writable buffer.
WritableBuffer: TypeAlias = "bytearray | memoryview | np.ndarray[Any, Any]"

MSGPACK: Final = "application/msgpack"
# Bodies are streamed to the socket in slices this big: the transport buffers (copies)
# only what the kernel does not take at once, and memory stays bounded per request.
_SEND_SLICE = 1 << 20


# --------------------------------------------------------------------------- documents


@dataclass(frozen=True, slots=True)
class TierSpace:
    used: int
    capacity: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    id: str
    url: str
    alive: bool
    #: Space per tier ("memory", "nvme", "cold") as the node reported it.
    tiers: Mapping[str, TierSpace] = field(default_factory=dict)
    #: Being drained (docs/API.md E13): it serves what it holds but takes no new copies.
    draining: bool = False


@dataclass(frozen=True, slots=True)
class ErasureInfo:
    codec: str
    k: int
    n: int


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """The membership and settings from ``GET /v1/cluster``."""

    nodes: tuple[NodeInfo, ...]
    replication: int
    erasure: ErasureInfo | None
    max_chunk_size: int

    @property
    def live(self) -> tuple[NodeInfo, ...]:
        return tuple(node for node in self.nodes if node.alive)

    def node(self, node_id: str) -> NodeInfo:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @classmethod
    def from_wire(cls, doc: Any) -> ClusterInfo:
        """Parse a ``/v1/cluster`` document; ``ProtocolError`` when it lacks what API.md lists."""
        try:
            nodes = []
            for raw in doc["nodes"]:
                tiers = {
                    tier: TierSpace(int(raw[tier]["used"]), int(raw[tier]["capacity"]))
                    for tier in STATES
                    if isinstance(raw.get(tier), dict)
                }
                nodes.append(
                    NodeInfo(
                        str(raw["id"]),
                        str(raw["url"]).rstrip("/"),
                        bool(raw["alive"]),
                        tiers,
                        raw.get("state") == "draining",
                    )
                )
            erasure_doc = doc.get("erasure")
            erasure = (
                ErasureInfo(str(erasure_doc["codec"]), int(erasure_doc["k"]), int(erasure_doc["n"]))
                if isinstance(erasure_doc, dict)
                else None
            )
            return cls(tuple(nodes), int(doc["replication"]), erasure, int(doc["max_chunk_size"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(message=f"malformed cluster document: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class PutResult:
    chunk: str
    size: int
    replicas: tuple[str, ...]
    state: str
    #: False when the cluster already held the chunk (HTTP 200 rather than 201).
    created: bool


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    chunk: str
    size: int
    tier: str | None
    state: str | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    name: str
    #: Number of distinct chunks the checkpoint names.
    chunks: int
    #: Their total size.
    bytes: int
    #: False when the identical manifest was already committed (HTTP 200 rather than 201).
    created: bool


@dataclass(frozen=True, slots=True)
class FullTier:
    """A node's full disk tier that keeps ``chunks`` of a checkpoint from a level (E16)."""

    node: str
    url: str
    #: "nvme" (keeps them from nvme, and so from cold) or "cold" (from cold)
    tier: str
    chunks: int
    full_since: float | None = None
    cause: str | None = None

    def describe(self) -> str:
        since = "" if self.full_since is None else f" for {time.time() - self.full_since:.0f} s"
        cause = f" ({self.cause})" if self.cause else ""
        return f"{self.tier} tier full on node {self.node} ({self.url}){since}{cause}"


@dataclass(frozen=True, slots=True)
class CheckpointStatus:
    """``?status``: how many distinct chunks reached at least each level, and the overall one."""

    state: str
    chunks: int
    memory: int
    nvme: int
    cold: int
    #: Chunks no node holds any more, when the node reports it (None: not reported).
    lost: int | None = None
    #: Full disk tiers that keep some of its chunks from nvme or cold (E16).
    blocked: tuple[FullTier, ...] = ()

    def reached(self, level: str) -> bool:
        return state_at_least(self.state, level)

    def blocked_from(self, level: str) -> list[FullTier]:
        """The full tiers that keep it from ``level`` (a full nvme keeps it from cold too);
        empty once it reached ``level``."""
        if self.reached(level) or level == "memory":
            return []
        tiers = ("nvme",) if level == "nvme" else ("nvme", "cold")
        return [b for b in self.blocked if b.tier in tiers]


def blocked_error(name: str, status: CheckpointStatus, level: str) -> StorageFull | None:
    """``NvmeFull`` (or ``ColdFull``) saying why checkpoint ``name`` cannot reach
    ``level`` now, when full disk tiers keep it from it; None otherwise."""
    blocked = status.blocked_from(level)
    if not blocked:
        return None
    cls: type[StorageFull] = NvmeFull if any(b.tier == "nvme" for b in blocked) else ColdFull
    why = "; ".join(f"{b.describe()}, {b.chunks} of its chunks wait for it" for b in blocked)
    full = [{"node": b.node, "url": b.url, "tier": b.tier} for b in blocked]
    return cls(
        message=f"checkpoint {name} cannot reach {level} until disk space is freed: {why}",
        body={"error": cls.default_code, "full": full},
    )


@dataclass(frozen=True, slots=True)
class TierCost:
    """A checkpoint in one tier now: its chunks with a copy there (cold: ``k`` or more
    fragments), their bytes, and the bytes the tier stores for them (every copy, every
    fragment)."""

    chunks: int
    bytes: int
    stored: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> TierCost:
        return cls(int(doc["chunks"]), int(doc["bytes"]), int(doc["stored"]))


@dataclass(frozen=True, slots=True)
class CheckpointCosts:
    """What a checkpoint costs (extension E17, ``list(costs=True)``): its distinct chunks,
    the bytes of those another checkpoint names too (``shared``), where its chunks are now,
    and ``stored``, the bytes all tiers hold for it; ``lost``: chunks no live node holds."""

    chunks: int
    shared: int
    shared_chunks: int
    memory: TierCost
    nvme: TierCost
    cold: TierCost
    stored: int
    lost: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> CheckpointCosts:
        return cls(
            int(doc["chunks"]),
            int(doc["shared"]),
            int(doc["shared_chunks"]),
            TierCost.from_wire(doc["memory"]),
            TierCost.from_wire(doc["nvme"]),
            TierCost.from_wire(doc["cold"]),
            int(doc["stored"]),
            int(doc["lost"]),
        )


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    name: str
    created: float
    bytes: int
    state: str
    #: With ``Client.list(costs=True)`` (extension E17); else None.
    costs: CheckpointCosts | None = None


@dataclass(frozen=True, slots=True)
class Holder:
    """A node that can serve a chunk, and from which tier."""

    node: str
    url: str
    tier: str
    #: The fragment indexes a ``cold`` holder has (extension E8; empty when not reported).
    fragments: tuple[int, ...] = ()


#: ``?plan``: chunk id -> holders, fastest tier first.
RestorePlanDoc = dict[str, list[Holder]]


@dataclass(slots=True)
class ClientStats:
    """Counters since the client was opened (or ``reset``). Not thread-safe; one loop."""

    #: HTTP attempts made for the caller's requests (background refreshes not included).
    requests: int = 0
    #: ``GET /v1/cluster`` attempts made in the background after a node failed to answer.
    background_requests: int = 0
    retries: int = 0
    failovers: int = 0
    chunks_uploaded: int = 0
    bytes_uploaded: int = 0
    #: Chunks ``put_chunks`` did not send because the cluster already held them.
    chunks_skipped: int = 0
    bytes_skipped: int = 0
    chunks_downloaded: int = 0
    bytes_downloaded: int = 0
    #: Cold chunks this client decoded itself from fragments (``storaged.client.degraded``).
    chunks_decoded: int = 0
    fragments_downloaded: int = 0
    #: Fragments not used: refused, unreachable, or failing their checks.
    fragments_skipped: int = 0
    #: Of the uploads and downloads above, those through shared memory (``storaged.client.shm``).
    shm_chunks_uploaded: int = 0
    shm_bytes_uploaded: int = 0
    shm_chunks_downloaded: int = 0
    shm_bytes_downloaded: int = 0
    #: Requests sent to another node too because one missed its deadline (hedges).
    hedges: int = 0
    #: Of the logical requests that were hedged, those a later attempt answered first.
    hedge_wins: int = 0

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One attempt of a logical request (``Client._call``)."""

    node: str
    started: float
    #: may write into the caller's buffer (no other attempt that may was running)
    owns_out: bool
    #: started while another attempt still ran (a hedge or a failover beside a laggard)
    hedge: bool


# Set in each attempt's own task: False when another attempt of the same request may be
# writing into the caller's buffer, so this one must read into a buffer of its own.
_OWNS_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("owns_out", default=True)


def owns_out() -> bool:
    """In an attempt of ``Client._call``: whether it may write into the caller's buffer."""
    return _OWNS_OUT.get()


class WaitTimeout(TimeoutError):
    """``Client.wait`` ran out of time; ``status`` is the last one seen (None if none)."""

    def __init__(self, message: str, status: CheckpointStatus | None) -> None:
        super().__init__(message)
        self.status = status


class BlockedWatch:
    """Follows the statuses of a wait for ``level``: ``check`` raises ``blocked_error``
    once full disk tiers have kept the checkpoint from it for ``BLOCKED_FOR`` seconds of
    polls in a row (a mark cleared at once, space freed meanwhile, does not fail a wait)."""

    BLOCKED_FOR = 1.0

    def __init__(self, name: str, level: str) -> None:
        self.name, self.level = name, level
        self._since: float | None = None

    def check(self, status: CheckpointStatus) -> None:
        error = blocked_error(self.name, status, self.level)
        if error is None:
            self._since = None
            return
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since >= self.BLOCKED_FOR:
            raise error


# --------------------------------------------------------------------------- helpers


def _without_hidden_resends(session: aiohttp.ClientSession) -> None:
    """Make ``session`` send each request once: ``_call`` counts and retries sends itself.

    aiohttp resends a PUT or DELETE (and GET, HEAD: RFC 9112's idempotent methods) once,
    unseen, when the connection closes before the answer. A DELETE the node carried out
    before its answer was lost then comes back 404 to the call that deleted it, and
    ``_call`` never learns that an attempt may have reached the node (``replayed``): the
    caller is told "no such checkpoint" and keeps believing in one that is gone. aiohttp
    has no public switch; its own ``test_utils`` sets this attribute, and
    ``tests/client/test_client_cluster.py`` fails if the resend comes back."""
    if not hasattr(session, "_retry_connection"):
        raise RuntimeError(
            "this aiohttp has no ClientSession._retry_connection: storaged's client cannot "
            "turn off its hidden resends (see storaged/client/client.py)"
        )
    session._retry_connection = False


def base_url(url: str) -> str:
    """A node's base URL as given (``http://host:port``, trailing ``/`` dropped); a bare
    ``host:port`` means ``http://host:port``. ``ValueError`` for one that names no host."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in ("http", "https"):
        raise ValueError(f"{url}: a node URL is http://host:port (or https://)")
    if not rest:
        raise ValueError(f"{url}: a node URL names a host (http://host:port)")
    return url


def _refused(exc: BaseException) -> bool:
    """Whether a failed attempt found nothing listening (connection refused)."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        if isinstance(exc, aiohttp.ClientConnectorError):
            return exc.os_error is not None and isinstance(exc.os_error, ConnectionRefusedError)
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def range_header(byte_range: ByteRange) -> str:
    """``Range`` header for an exclusive-end ``ByteRange`` (the wire's end is inclusive)."""
    if byte_range.start < 0 or (byte_range.end is not None and byte_range.end <= byte_range.start):
        raise ValueError(f"cannot request {byte_range}: empty or negative")
    if byte_range.end is None:
        return f"bytes={byte_range.start}-"
    return f"bytes={byte_range.start}-{byte_range.end - 1}"


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(?:\d+|\*)")


def check_content_range(value: str | None, start: int, length: int | None) -> None:
    """``ProtocolError`` unless a 206's ``Content-Range`` starts at ``start`` and spans
    ``length`` bytes (when the length is known)."""
    match = _CONTENT_RANGE.fullmatch(value.strip()) if value else None
    if match is None:
        raise ProtocolError(message=f"206 answer with Content-Range {value!r}", status=206)
    first, last = int(match[1]), int(match[2])
    if first != start or last < first or (length is not None and last - first + 1 != length):
        raise ProtocolError(
            message=f"206 answer with Content-Range {value!r} for {length} bytes from {start}",
            status=206,
        )


def _header_lines(headers: Mapping[str, str]) -> str:
    """``headers`` as HTTP/1.1 head lines; ``ValueError`` for a name or value that would
    break the head (a line break, or a name with a colon or space)."""
    lines = []
    for name, value in headers.items():
        if any(c in name for c in ":\r\n ") or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} cannot be sent")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


def writable_view(out: WritableBuffer) -> memoryview:
    """A flat, writable byte view of ``out``; ``TypeError`` if it is read-only or strided."""
    # An ndarray's buffer without importing numpy (``storaged ls`` starts without it).
    view = memoryview(out) if isinstance(out, bytearray | memoryview) else out.data
    if view.readonly:
        raise TypeError("output buffer is read-only")
    if not view.c_contiguous:
        raise TypeError("output buffer must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


async def _slices(view: memoryview) -> AsyncIterator[memoryview]:
    for offset in range(0, len(view), _SEND_SLICE):
        yield view[offset : offset + _SEND_SLICE]


async def run_all(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Await all, in order; on the first failure cancel the rest, wait for them, and raise it."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _put_result(doc: Any, status: int) -> PutResult:
    """A PUT's answer (HTTP or shared memory) as a ``PutResult``."""
    try:
        return PutResult(
            str(doc["chunk"]),
            int(doc["size"]),
            tuple(str(r) for r in doc.get("replicas", ())),
            str(doc.get("state", "memory")),
            status == 201,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(message=f"malformed PUT answer: {exc!r}") from exc


def _as_bytes_view(data: BytesLike) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise TypeError("chunk data must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


# --------------------------------------------------------------------------- the client


class Client:
    """An async session with a storaged cluster. Use as ``async with Client(urls) as c``.

    ``urls``: one node URL or several; the rest of the cluster is learned from the
    first that answers. ``token``: the client bearer token, if the nodes require one.
    ``max_concurrency`` bounds the requests in flight; ``retry`` says how failures are
    retried; ``request_timeout`` bounds each attempt (``connect_timeout`` its
    connection, ``read_timeout`` each wait for body bytes).

    ``direct_reads``: chunk GETs to plain-http nodes read their bodies straight into
    the destination buffer (``storaged.client.direct``) instead of through aiohttp;
    anything that path does not read (https, chunked bodies) still goes through
    aiohttp. ``None`` (the default) uses it with the client's own session and not
    with a session given to ``open``, whose hooks, headers and proxy settings it would
    bypass; ``True`` uses it with any session, ``False`` never.

    ``decode_cache_bytes``: cold chunks this client decoded itself (see ``get_chunk``)
    stay this many bytes' worth, newest first, for further ranges of them: a restore
    reads many items out of one chunk, and each would otherwise decode it again.

    ``shm``: chunks go to and come from the node on this host through shared memory
    (``storaged.client.shm``) when one of the URLs is such a node. ``None`` (the
    default) and ``True`` use it where it applies, unless ``STORAGED_SHM=0``; ``False``
    keeps to HTTP. Whatever that path cannot do goes the HTTP way.

    ``deadlines`` (``storaged.client.deadlines``): how long a read-only request waits
    for one node before it is sent to the next as well (a hung node accepts connections
    and never answers); default ``Deadlines.from_env()``, the ``STORAGED_*_DEADLINE``
    variables over the defaults. ``read_timeout`` stays the bound of a request no other
    node can answer.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        max_concurrency: int = 8,
        retry: RetryPolicy | None = None,
        request_timeout: float = 120.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        missing_batch: int = 512,
        hash_threads: int | None = None,
        suspect_seconds: float = 2.0,
        verify_reads: bool = False,
        direct_reads: bool | None = None,
        decode_cache_bytes: int = 128 << 20,
        shm: bool | None = None,
        refused_fails_fast: bool = False,
        deadlines: Deadlines | None = None,
    ) -> None:
        seeds = [urls] if isinstance(urls, str) else list(urls)
        if not seeds:
            raise ValueError("need at least one node URL")
        if max_concurrency < 1 or missing_batch < 1:
            raise ValueError("max_concurrency and missing_batch must be >= 1")
        self._seeds = [base_url(url) for url in seeds]
        self._refused_fails_fast = refused_fails_fast
        self._token = token
        self._retry = retry or RetryPolicy()
        self._deadlines = deadlines if deadlines is not None else Deadlines.from_env()
        #: the bandwidth chunk reads have had so far: their deadlines follow from it
        self.bandwidth = Bandwidth(self._deadlines)
        #: nodes that missed a deadline: asked last
        self._slow = SlowNodes(self._deadlines.slow_for)
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, connect=connect_timeout, sock_read=read_timeout
        )
        self._max_concurrency = max_concurrency
        self._missing_batch = missing_batch
        self._hash_threads = hash_threads or max(1, os.cpu_count() or 1)
        self._suspect_seconds = suspect_seconds
        self._verify_reads = verify_reads
        self._direct_reads = direct_reads
        self._request_timeout = request_timeout
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        #: keep-alive connections of the direct read path; None when it is off
        self.direct: DirectGets | None = None
        self._shm_option = shm
        #: the shared-memory path to the node on this host; None when off or not applicable
        self.shm: ShmPath | None = None
        #: node base URL -> ((host, port), path prefix, request head lines), or None: https
        self._direct_targets: dict[str, tuple[tuple[str, int], str, str] | None] = {}
        self._base_headers: dict[str, str] = {}

        self._session: aiohttp.ClientSession | None = None
        self._owns_session = True
        self._request_slots = asyncio.Semaphore(max_concurrency)
        self._hash_slots = asyncio.Semaphore(self._hash_threads)
        self._cluster: ClusterInfo | None = None
        #: node id (or seed URL before the membership is known) -> base URL
        self._urls: dict[str, str] = {url: url for url in self._seeds}
        self._inflight: dict[str, int] = {}
        #: headers every request carries when the session is the caller's
        self._extra_headers: dict[str, str] = {}
        self._suspect_until: dict[str, float] = {}
        self._rotation = itertools.count()
        self._refresh_task: asyncio.Task[None] | None = None
        self._last_refresh = 0.0
        self._rng = random.Random()
        #: the cluster's erasure codec, made on first use (None: not yet, or none here)
        self._codec: Codec | None = None
        #: cold chunks decoded here, oldest first (a future while the decode runs, shared by
        #: the ranges asked meanwhile), and their bytes once done
        self._cold_decodes: collections.OrderedDict[str, asyncio.Future[bytes]] = (
            collections.OrderedDict()
        )
        self._cold_decoded_bytes = 0
        self._decode_cache_bytes = decode_cache_bytes
        self.stats = ClientStats()

    def __repr__(self) -> str:  # never shows the token
        nodes = len(self._cluster.nodes) if self._cluster else "?"
        return f"Client({self._seeds!r}, nodes={nodes})"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self, session: aiohttp.ClientSession | None = None) -> None:
        """Open the HTTP session and learn the cluster; ``Unavailable`` if no URL answers."""
        # Chunk bytes are incompressible: ask for every body as it is.
        headers = {"Accept": MSGPACK, "Accept-Encoding": "identity"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        self._base_headers = headers
        if self._session is None:
            if session is not None:
                # A caller's session has its own defaults: ours go with every request.
                self._session, self._owns_session = session, False
                self._extra_headers = headers
            else:
                self._session = aiohttp.ClientSession(
                    # Idle connections go before a node's own 15 s keep-alive closes them:
                    # a request on one the node is closing fails (it is not resent unseen).
                    # A hedge holds a connection beside the attempt it races.
                    connector=aiohttp.TCPConnector(
                        limit=self._max_concurrency * (1 + self._deadlines.max_hedges) + 8,
                        keepalive_timeout=10.0,
                    ),
                    headers=headers,
                    timeout=self._timeout,
                    auto_decompress=False,
                )
            _without_hidden_resends(self._session)
        use_direct = self._owns_session if self._direct_reads is None else self._direct_reads
        if use_direct and self.direct is None:
            self.direct = DirectGets(
                connect_timeout=self._connect_timeout,
                read_timeout=self._read_timeout,
                pool_size=self._max_concurrency + 8,
            )
        try:
            await self.refresh_cluster()
            if shm_wanted(self._shm_option) and self.shm is None:
                await self._open_shm()
        except BaseException:
            await self.close()
            raise

    async def _open_shm(self) -> None:
        """Connect to the shared-memory listener of a seed node on this host, if any."""
        picked = pick_node(await self.cluster_document(), self._seeds)
        if picked is None:
            return
        node_id, path = picked
        try:
            self.shm = await ShmPath.connect(
                node_id,
                path,
                self._token,
                self._max_concurrency,
                self._request_timeout,
                # A mapping is an answer of a few bytes: a metadata deadline.
                read_within=2 * self._deadlines.metadata,
            )
        except (OSError, WireError, TimeoutError, StoragedError) as exc:
            log.warning("shared-memory path to %s not available (%s): using HTTP", node_id, exc)

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh_task
            self._refresh_task = None
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None
        if self.direct is not None:
            await self.direct.close()
            self.direct = None
        self._cold_decodes.clear()
        self._cold_decoded_bytes = 0
        if self.shm is not None:
            await self.shm.close()
            self.shm = None

    @property
    def cluster(self) -> ClusterInfo:
        """The membership as last learned; ``RuntimeError`` before ``open``."""
        if self._cluster is None:
            raise RuntimeError("client is not open")
        return self._cluster

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines

    def slow_nodes(self) -> builtins.list[str]:
        """Nodes that missed a deadline lately (asked after the others)."""
        return self._slow.nodes()

    @property
    def max_chunk_size(self) -> int:
        """The cluster's largest accepted chunk (savers cut streams no coarser)."""
        return self.cluster.max_chunk_size

    async def refresh_cluster(self) -> ClusterInfo:
        """Ask ``GET /v1/cluster`` again (known live nodes first, then the seed URLs)."""
        return await self._refresh_cluster(background=False)

    async def _refresh_cluster(self, *, background: bool) -> ClusterInfo:
        known = [node.id for node in self._cluster.live] if self._cluster else []
        candidates = list(dict.fromkeys([*known, *self._seeds]))

        async def handle(resp: aiohttp.ClientResponse) -> ClusterInfo:
            return ClusterInfo.from_wire(await self._decoded(resp))

        info = await self._call(
            "GET", "/v1/cluster", handle, candidates=candidates, background=background
        )
        self._cluster = info
        self._last_refresh = time.monotonic()
        for node in info.nodes:
            self._urls[node.id] = node.url
        return info

    async def cluster_document(self) -> dict[str, Any]:
        """``GET /v1/cluster`` as the node sent it, with any fields beyond API.md's
        (for tools that show them); also refreshes ``cluster``."""
        known = [node.id for node in self._cluster.live] if self._cluster else []

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            doc = await self._decoded(resp)
            self._cluster = ClusterInfo.from_wire(doc)
            return dict(doc)

        return await self._call(
            "GET", "/v1/cluster", handle, candidates=list(dict.fromkeys([*known, *self._seeds]))
        )

    # ------------------------------------------------------------------ placement

    def placement(self, chunk_id: str) -> list[str]:
        """Live node ids in rendezvous order for ``chunk_id`` (the first holds the hot copy)."""
        return rendezvous_order(chunk_id, [node.id for node in self.cluster.live])

    def _by_load(self, nodes: Sequence[str]) -> list[str]:
        """``nodes`` least in-flight first; ties rotate so that idle nodes share the load."""
        if not nodes:
            return []
        shift = next(self._rotation) % len(nodes)
        rotated = [*nodes[shift:], *nodes[:shift]]
        return sorted(rotated, key=lambda node: self._inflight.get(node, 0))

    def _any_nodes(self) -> list[str]:
        live = [node.id for node in self.cluster.live]
        rest = [node.id for node in self.cluster.nodes if not node.alive]
        return [*self._by_load(live), *rest]

    def _suspected(self, node: str, now: float) -> bool:
        return self._suspect_until.get(node, 0.0) > now

    def _suspect(self, node: str) -> None:
        self._suspect_until[node] = time.monotonic() + self._suspect_seconds
        self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        if self._session is None or (self._refresh_task and not self._refresh_task.done()):
            return
        if time.monotonic() - self._last_refresh < 1.0:
            return

        async def refresh() -> None:
            try:
                await self._refresh_cluster(background=True)
            except StoragedError as exc:
                log.debug("cluster refresh failed: %s", exc)

        self._refresh_task = asyncio.get_running_loop().create_task(refresh())

    # ------------------------------------------------------------------ transport

    def _url(self, node: str, path_query: str) -> str:
        try:
            return self._urls[node] + path_query
        except KeyError:
            raise Unavailable(message=f"no URL known for node {node!r}") from None

    async def _decoded(self, resp: aiohttp.ClientResponse) -> Any:
        raw = await resp.read()
        content_type = resp.headers.get("Content-Type")
        try:
            return decode_body(raw, content_type)
        except ValueError as exc:
            if not is_api_content_type(content_type):
                # a web page, etcd's plain text: another server answers at this URL
                error = NotStoraged(
                    message=f"{resp.url.origin()}: {foreign_answer(resp.status, content_type)}",
                    status=resp.status,
                )
                error.foreign = foreign_answer(resp.status, content_type)
                raise error from None
            raise ProtocolError(message=str(exc), status=resp.status) from exc

    async def _call(
        self,
        method: str,
        path_query: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        candidates: Sequence[str] | None = None,
        body: Callable[[], Any] | None = None,
        headers: Mapping[str, str] | None = None,
        next_node_on: tuple[type[StoragedError], ...] = (),
        balance: int = 0,
        direct: Callable[[str], Awaitable[T]] | None = None,
        max_attempts: int | None = None,
        background: bool = False,
        hedge_after: float | Literal["metadata"] | None = "metadata",
        accept: Callable[[T], Awaitable[None]] | None = None,
        observe: Callable[[T, float], None] | None = None,
    ) -> T:
        """One logical request: attempts over ``candidates`` with failover and retries.

        ``handle`` runs while the response is open, only for status < 400. A lost
        connection or timeout marks the node suspect and moves on to the next
        candidate at once (waiting only when every candidate has failed in a row);
        502/503/504 wait (``Retry-After`` honoured) and try again; an error in
        ``next_node_on`` moves to the next candidate and is raised once all gave it.
        Errors raised after an attempt that may have reached the server carry
        ``replayed = True``. The first ``balance`` candidates are interchangeable (holders
        of the same bytes): the least loaded of them is picked once a request slot is
        free, not before (many fetches queued at once would otherwise all pick one node).
        ``direct``, when given, makes an attempt on a node instead of aiohttp (same slots,
        load counting and error handling); when it raises ``NotHandled`` the attempt is
        made through aiohttp after all. ``max_attempts`` caps the retry policy's.
        ``background`` attempts count in ``stats.background_requests`` only (not in
        ``requests``, ``failovers`` or ``retries``: those describe the caller's requests).

        Hedging (``storaged.client.deadlines``): an attempt still unanswered
        ``hedge_after`` seconds after it started marks its node slow (ordered last from
        then on) and the request goes to the next candidate too, at most
        ``Deadlines.max_hedges`` times; the first good answer is taken and the other
        attempts are cancelled (their connections closed) before this returns.
        ``"metadata"`` (the default) is ``Deadlines.metadata`` for GET and HEAD and no
        hedging for other methods; None never hedges (writes). In a raced request each
        answer goes through ``accept`` (which raises a ``StoragedError`` to refuse it)
        before it is taken. An attempt that started while another still runs sees
        ``owns_out()`` False: it must not write into a buffer the other may be writing.
        ``observe`` gets the answer taken and the seconds its attempt took.
        """
        session = self._session
        if session is None:
            raise RuntimeError("client is not open")
        now = time.monotonic()
        given = list(candidates) if candidates is not None else self._any_nodes()
        slow = self._slow
        interchangeable = set(given[:balance])

        def arranged() -> tuple[list[str], int]:
            """The candidates, fine ones first, then suspected, then slow ones; and the
            interchangeable head left at the front."""
            now = time.monotonic()
            fine = [n for n in given if n not in slow and not self._suspected(n, now)]
            suspected = [n for n in given if n not in slow and self._suspected(n, now)]
            order = [*fine, *suspected, *(n for n in given if n in slow)]
            return order, len(interchangeable & set(fine))

        order, balance = arranged()
        if not order:
            raise Unavailable(message="no node to send the request to")
        deadline: float | None
        if hedge_after == "metadata":
            deadline = self._deadlines.metadata if method in ("GET", "HEAD") else None
        else:
            deadline = hedge_after
        max_hedges = self._deadlines.max_hedges if deadline is not None else 0
        started = now
        attempts = 0
        position = 0
        lost_in_a_row = 0
        refused_in_a_row = 0
        replayed = False
        refused_by: list[StoragedError] = []
        limit = self._retry.max_attempts if max_attempts is None else max_attempts
        running: dict[asyncio.Future[T], _Attempt] = {}
        hedges = 0
        start_next = True
        retry_at: float | None = None
        #: to raise once the attempts still running have failed too
        final: StoragedError | None = None

        async def attempt(node: str, owns: bool) -> T:
            _OWNS_OUT.set(owns)  # this task's context only
            self._inflight[node] = self._inflight.get(node, 0) + 1
            try:
                if direct is not None:
                    try:
                        return await direct(node)
                    except NotHandled:
                        pass
                async with session.request(
                    method,
                    self._url(node, path_query),
                    data=body() if body is not None else None,
                    headers={**self._extra_headers, **(headers or {})}
                    if self._extra_headers
                    else headers,
                ) as resp:
                    if resp.status >= 400:
                        raise error_from_response(
                            resp.status,
                            await resp.read(),
                            resp.headers.get("Content-Type"),
                            resp.headers.get("Retry-After"),
                        )
                    return await handle(resp)
            finally:
                self._inflight[node] -= 1

        def fail(error: StoragedError) -> None:
            """Raise ``error`` now, or once the attempts still running have failed too."""
            nonlocal final
            if not running:
                raise self._mark(error, replayed) from error.__cause__
            final = error

        try:
            while True:
                if start_next and final is None and len(running) <= max_hedges:
                    start_next = False
                    slot = not running
                    if slot:
                        if retry_at is not None:
                            await asyncio.sleep(max(0.0, retry_at - time.monotonic()))
                            retry_at = None
                            lost_in_a_row = 0
                        await self._request_slots.acquire()
                        if attempts == 0:
                            # Waiting for the slot, other requests may have found a node
                            # slow or gone: the order is made now, not when this was asked.
                            order, balance = arranged()
                    try:
                        if position == 0 and balance > 1 and not running:
                            # Rotate, then a stable sort by load: equally loaded holders take
                            # turns instead of the first one always winning the tie.
                            shift = next(self._rotation) % balance
                            head = [*order[shift:balance], *order[:shift]]
                            head.sort(key=lambda n: self._inflight.get(n, 0))
                            order[:balance] = head
                        busy = {a.node for a in running.values()}
                        for _ in range(len(order)):
                            if order[position % len(order)] not in busy:
                                break
                            position += 1
                        node = order[position % len(order)]
                        owns = not any(a.owns_out for a in running.values())
                        task = asyncio.ensure_future(attempt(node, owns))
                    except BaseException:
                        if slot:
                            self._request_slots.release()
                        raise
                    if slot:
                        task.add_done_callback(lambda _: self._request_slots.release())
                    running[task] = _Attempt(node, time.monotonic(), owns, not slot)
                    attempts += 1
                    if background:
                        self.stats.background_requests += 1
                    else:
                        self.stats.requests += 1
                if not running:
                    assert final is not None
                    raise self._mark(final, replayed) from final.__cause__
                timeout: float | None = None
                if (
                    deadline is not None
                    and hedges < max_hedges
                    and final is None
                    and len({a.node for a in running.values()}) < len(order)
                ):
                    newest = max(a.started for a in running.values())
                    timeout = max(0.0, newest + deadline - time.monotonic())
                done, _ = await asyncio.wait(
                    running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    assert deadline is not None
                    late = time.monotonic() - deadline
                    for each in running.values():
                        if each.started <= late and each.node not in slow:
                            log.info(
                                "%s %s: no answer from %s in %.1f s, asking another node too",
                                method,
                                path_query,
                                each.node,
                                deadline,
                            )
                            slow.mark(each.node)
                    hedges += 1
                    if not background:
                        self.stats.hedges += 1
                    position += 1
                    start_next = True
                    continue
                finished = next(iter(done))  # the others that are done come next round
                this = running.pop(finished)
                node = this.node
                try:
                    result = finished.result()
                    if accept is not None and (hedges or running):
                        await accept(result)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    error: StoragedError = ConnectionFailed(
                        message=f"{method} {path_query} on {node}: {type(exc).__name__}: {exc}"
                    )
                    error.__cause__ = exc
                    self._suspect(node)
                    replayed = replayed or method != "GET"
                    lost_in_a_row += 1
                    refused_in_a_row = refused_in_a_row + 1 if _refused(exc) else 0
                    position += 1
                    if not background:
                        self.stats.failovers += 1
                    if self._refused_fails_fast and refused_in_a_row >= len(order):
                        # nothing listens at any of them (a command's typo, a stopped
                        # cluster): say so now rather than after the backoff of a restart
                        fail(error)
                        continue
                    if lost_in_a_row < len(order) and self._may_retry(attempts, started, limit):
                        start_next = True  # an untried node remains: no need to wait
                        continue
                except StoragedError as exc:
                    error = exc
                    lost_in_a_row = refused_in_a_row = 0
                    if method != "GET" and exc.status == 503:
                        # A refused write may have been partly carried out (a delete's
                        # tombstone on some nodes): what a retry answers may reflect it.
                        replayed = True
                    if isinstance(exc, ChecksumMismatch):
                        slow.mark(node)  # wrong bytes: ask it last from now on
                    if isinstance(exc, next_node_on):
                        refused_by.append(exc)
                        position += 1
                        if len(refused_by) < len(order):
                            start_next = True
                            continue
                        fail(exc)
                        continue
                    if not is_retryable(exc):
                        raise self._mark(exc, replayed) from None
                    if exc.status in (502, 504):
                        position += 1  # a proxy failure: another entry node may fare better
                else:
                    if hedges and this.hedge:
                        self.stats.hedge_wins += not background
                    if observe is not None:
                        observe(result, time.monotonic() - this.started)
                    return result
                if not self._may_retry(attempts, started, limit):
                    if refused_by and isinstance(error, ConnectionFailed):
                        # Some nodes answered "not here" and the others were unreachable:
                        # the answer we got is more telling than the lost connection.
                        fail(refused_by[-1])
                    else:
                        fail(error)
                    continue
                if running:
                    continue  # an attempt still runs: it may yet answer
                if not background:
                    self.stats.retries += 1
                retry_after = error.retry_after if isinstance(error, StoragedError) else None
                retry_at = time.monotonic() + self._retry.delay(attempts, retry_after, self._rng)
                start_next = True
        finally:
            for pending in running:
                pending.cancel()
            if running:
                # Cancelled attempts close their connections and stop writing into any
                # buffer before the caller may reuse it.
                await asyncio.gather(*running, return_exceptions=True)

    def _may_retry(self, attempts: int, started: float, limit: int) -> bool:
        return attempts < limit and time.monotonic() - started < self._retry.deadline

    @staticmethod
    def _mark(error: StoragedError, replayed: bool) -> StoragedError:
        error.replayed = replayed
        return error

    # ------------------------------------------------------------------ chunks

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str:
        """Upload one chunk; return its id once ``replication`` nodes hold it in RAM.

        ``chunk_id``, when given, must be the BLAKE3 of ``data`` (the server refuses a
        mismatch with ``ChecksumMismatch``); otherwise it is computed in a thread.
        """
        return (await self.put_chunk_result(data, chunk_id)).chunk

    async def put_chunk_result(self, data: BytesLike, chunk_id: str | None = None) -> PutResult:
        """``put_chunk`` with the server's answer (replicas, state, created or not)."""
        view = _as_bytes_view(data)
        if chunk_id is not None and not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        shm = usable(self.shm)
        if shm is not None and 0 < len(view) <= self.cluster.max_chunk_size:
            # The node hashes what it is handed: no id needed here.
            handed = await shm.put(view, chunk_id)
            if handed is not None:
                result = _put_result(handed[1], handed[0])
                self.stats.chunks_uploaded += 1
                self.stats.bytes_uploaded += len(view)
                self.stats.shm_chunks_uploaded += 1
                self.stats.shm_bytes_uploaded += len(view)
                return result
            if chunk_id is None:
                # As the shared-memory copy did: a cancelled caller (a saver that reuses
                # the buffer) resumes only once no thread reads ``view`` any more.
                chunk_id = await in_thread(chunk_id_of, view)
        if chunk_id is None:
            chunk_id = await chunk_id_of_async(view)
        elif not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        limit = self.cluster.max_chunk_size
        if len(view) > limit:
            raise TooLarge(message=f"chunk of {len(view)} bytes exceeds max_chunk_size {limit}")
        size = len(view)
        # A draining node takes no copy: sent there, the body would take one more hop.
        draining = {n.id for n in self.cluster.nodes if n.draining}
        placement = [n for n in self.placement(chunk_id) if n not in draining]
        others = [n.id for n in self.cluster.nodes if n.id not in placement]

        async def handle(resp: aiohttp.ClientResponse) -> PutResult:
            return _put_result(await self._decoded(resp), resp.status)

        result = await self._call(
            "PUT",
            f"/v1/chunks/{chunk_id}",
            handle,
            candidates=[*placement, *others],
            # A full node refuses at once (E16); another entry node may place the chunk on
            # nodes with room. Each node is tried once: a full disk does not pass by waiting.
            next_node_on=(NvmeFull,),
            body=lambda: _slices(view),
            headers={
                "Content-Length": str(size),
                "Content-Type": "application/octet-stream",
            },
        )
        self.stats.chunks_uploaded += 1
        self.stats.bytes_uploaded += size
        return result

    async def missing_chunks(self, chunk_ids: Sequence[str]) -> list[str]:
        """The ids among ``chunk_ids`` the cluster does not hold, in request order."""
        missing: list[str] = []
        for lo in range(0, len(chunk_ids), self._missing_batch):
            batch = list(chunk_ids[lo : lo + self._missing_batch])
            payload: bytes = msgpack.packb({"chunks": batch})

            def body(payload: bytes = payload) -> bytes:
                return payload

            async def handle(resp: aiohttp.ClientResponse) -> list[str]:
                doc = await self._decoded(resp)
                if not isinstance(doc, dict) or not isinstance(doc.get("missing"), list):
                    raise ProtocolError(message="malformed /v1/chunks/missing answer")
                return [str(c) for c in doc["missing"]]

            missing += await self._call(
                "POST",
                "/v1/chunks/missing",
                handle,
                body=body,
                headers={"Content-Type": MSGPACK},
                # A question, though a POST: asking a second node changes nothing.
                hedge_after=self._deadlines.metadata,
            )
        return missing

    async def evict(
        self, name: str, tier: str, *, admin_token: str | None = None
    ) -> dict[str, int]:
        """Admin (``POST /v1/admin/evict``, docs/API.md): push checkpoint ``name``'s
        chunks out of RAM (``tier="memory"``) or off nvme (``"nvme"``) wherever a colder
        durable copy exists; dirty RAM and not-yet-cold nvme copies stay. Returns the copies
        dropped per tier. ``admin_token`` is sent instead of the client token: a cluster
        with a client token refuses admin calls without it (``Forbidden``).
        ``ValueError`` for another tier, ``CheckpointNotFound``."""
        if tier not in ("memory", "nvme"):
            raise ValueError(f"tier must be 'memory' or 'nvme', not {tier!r}")
        self._checkpoint_path(name)  # BadName before any request
        payload: bytes = msgpack.packb({"checkpoint": name, "tier": tier})

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, int]:
            doc = await self._decoded(resp)
            try:
                return {str(k): int(v) for k, v in doc["evicted"].items()}
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ProtocolError(message=f"malformed evict answer: {exc!r}") from exc

        headers = {"Content-Type": MSGPACK}
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        return await self._call(
            "POST", "/v1/admin/evict", handle, body=lambda: payload, headers=headers
        )

    async def drain(
        self, node_id: str, *, cancel: bool = False, admin_token: str | None = None
    ) -> dict[str, Any]:
        """Admin (``POST /v1/nodes/{id}/drain``, docs/API.md E13): mark ``node_id``
        draining (no new placements; its data is copied to where placement without it
        says), or active again with ``cancel``. Returns ``{"node", "state", "unreached"}``
        (``unreached``: members the embedded mode could not tell now). ``NotFound`` for an
        unknown node."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            return self._document(await self._decoded(resp), "drain", ("node", "state"))

        payload: bytes = msgpack.packb({"cancel": cancel})
        return await self._call(
            "POST",
            f"/v1/nodes/{quote(node_id, safe='')}/drain",
            handle,
            body=lambda: payload,
            headers=self._admin_headers(admin_token, {"Content-Type": MSGPACK}),
        )

    async def drain_progress(
        self, node_id: str, *, admin_token: str | None = None
    ) -> dict[str, Any]:
        """Admin (``GET /v1/nodes/{id}/drain``): ``{"node", "state", "chunks",
        "fragments", "chunks_pending", "fragments_pending", "can_leave"}`` as the node
        answers now; ``Unavailable`` (``node_unavailable``) when it does not answer."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            return self._document(await self._decoded(resp), "drain progress", ("can_leave",))

        return await self._call(
            "GET",
            f"/v1/nodes/{quote(node_id, safe='')}/drain",
            handle,
            headers=self._admin_headers(admin_token, {}),
        )

    @staticmethod
    def _admin_headers(admin_token: str | None, headers: dict[str, str]) -> dict[str, str]:
        # Sent instead of the client token: admin endpoints refuse the client token.
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        return headers

    @staticmethod
    def _document(doc: Any, what: str, required: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(doc, dict) or any(key not in doc for key in required):
            raise ProtocolError(message=f"malformed {what} answer: {doc!r:.200}")
        return dict(doc)

    async def chunk_ids(self, chunks: Sequence[BytesLike]) -> list[str]:
        """BLAKE3 ids of ``chunks``, hashed in threads (at most ``hash_threads`` at a time)."""

        async def one(data: BytesLike) -> str:
            async with self._hash_slots:
                return await chunk_id_of_async(data)

        return await run_all([one(c) for c in chunks])

    async def put_chunks(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None = None
    ) -> list[str]:
        """Upload the chunks the cluster does not hold yet; return every chunk's id, in order.

        Works in batches: hash (threads), ask ``POST /v1/chunks/missing``, PUT what is
        missing, each chunk once even if it occurs several times; the batches overlap so
        that hashing the next one runs while this one uploads. Returns once every chunk
        is acknowledged (or held already); raises the first failure otherwise.
        """
        if chunk_ids is not None and len(chunk_ids) != len(chunks):
            raise ValueError("chunk_ids must match chunks one to one")
        ids: list[str] = [""] * len(chunks)
        uploads: dict[str, asyncio.Future[None]] = {}

        async def batch(lo: int, hi: int) -> None:
            if chunk_ids is None:
                ids[lo:hi] = await self.chunk_ids(chunks[lo:hi])
            else:
                ids[lo:hi] = chunk_ids[lo:hi]
            first: dict[str, int] = {}
            for index in range(lo, hi):
                first.setdefault(ids[index], index)
            missing = set(await self.missing_chunks(list(first)))
            waits: list[Awaitable[None]] = []
            for chunk, index in first.items():
                if chunk not in missing:
                    self.stats.chunks_skipped += 1
                    self.stats.bytes_skipped += _as_bytes_view(chunks[index]).nbytes
                    continue
                if chunk not in uploads:  # another batch may be uploading it already
                    uploads[chunk] = asyncio.ensure_future(self._put_quiet(chunks[index], chunk))
                waits.append(uploads[chunk])
            await run_all(waits)

        step = self._missing_batch
        try:
            await run_all(
                [batch(lo, min(lo + step, len(chunks))) for lo in range(0, len(chunks), step)]
            )
        finally:
            for future in uploads.values():
                future.cancel()
            await asyncio.gather(*uploads.values(), return_exceptions=True)
        return ids

    async def _put_quiet(self, data: BytesLike, chunk_id: str) -> None:
        await self.put_chunk_result(data, chunk_id)

    async def head_chunk(self, chunk_id: str) -> ChunkInfo:
        """Size, tier and state of a chunk; ``ChunkNotFound`` when the cluster does not hold it."""
        self._check_chunk_id(chunk_id)

        async def handle(resp: aiohttp.ClientResponse) -> ChunkInfo:
            length = resp.headers.get("Content-Length")
            if length is None:
                raise ProtocolError(message="HEAD answer without Content-Length")
            return ChunkInfo(
                chunk_id,
                int(length),
                resp.headers.get("X-Storaged-Tier"),
                resp.headers.get("X-Storaged-State"),
            )

        try:
            return await self._call(
                "HEAD",
                f"/v1/chunks/{chunk_id}",
                handle,
                candidates=self._read_candidates(chunk_id, None)[0],
                next_node_on=(NotFound,),
            )
        except NotFound as exc:  # HEAD has no body: the status is all we get
            raise ChunkNotFound(message=f"chunk {chunk_id} not found", status=exc.status) from None

    def _read_candidates(
        self, chunk_id: str, holders: Sequence[Holder | str] | None
    ) -> tuple[list[str], int]:
        """Holders (least loaded among the hot ones first), then the rest in placement order;
        and how many leading candidates are interchangeable hot holders."""
        ordered: list[str] = []
        balance = 0
        if holders:
            hot: list[str] = []
            cold: list[str] = []
            for holder in holders:
                if isinstance(holder, Holder):
                    self._urls.setdefault(holder.node, holder.url.rstrip("/"))
                    (cold if holder.tier == "cold" else hot).append(holder.node)
                else:
                    hot.append(holder)
            ordered = [*self._by_load(list(dict.fromkeys(hot))), *self._by_load(cold)]
            # Any node rebuilds a cold-only chunk: then the cold holders are interchangeable.
            balance = len(dict.fromkeys(hot)) or len(cold)
        placement = self.placement(chunk_id)
        first = self._by_load(placement[: self.cluster.replication]) if not holders else []
        if not holders:
            balance = len(first)
        rest = [n.id for n in self.cluster.nodes]
        return list(dict.fromkeys([*ordered, *first, *placement, *rest])), balance

    async def get_chunk(
        self,
        chunk_id: str,
        out: WritableBuffer | None = None,
        byte_range: ByteRange | None = None,
        *,
        holders: Sequence[Holder | str] | None = None,
    ) -> memoryview:
        """Read a chunk (or ``byte_range`` of it, exclusive end) and return a view of the bytes.

        With ``out`` the bytes are written into its start and the returned view is that
        part of ``out``; ``out`` must be large enough (``ValueError`` otherwise, before
        any request when the size is known). Without it a buffer is allocated.
        ``holders`` (from ``plan``) are tried first, least loaded first; then other
        nodes. Raises ``ChunkNotFound`` when no node has it, ``BadRange`` for a range
        outside the chunk.
        """
        self._check_chunk_id(chunk_id)
        target = writable_view(out) if out is not None else None
        want: int | None = None
        headers: dict[str, str] = {"Accept-Encoding": "identity"}
        if byte_range is not None and (byte_range.start != 0 or byte_range.end is not None):
            if byte_range.end is not None:
                want = byte_range.end - byte_range.start
                if want < 0 or byte_range.start < 0:
                    raise BadRange(message=f"invalid range {byte_range}")
                if want == 0:  # HTTP cannot ask for nothing
                    return (target if target is not None else memoryview(bytearray()))[:0]
            headers["Range"] = range_header(byte_range)
        if target is not None and want is not None and len(target) < want:
            raise ValueError(f"output buffer of {len(target)} bytes < {want} requested")
        ranged = "Range" in headers
        skip = byte_range.start if byte_range is not None else 0
        shm = usable(self.shm)
        #: the local node whose RAM copy failed its id: not asked again over HTTP (a node
        #: serves its RAM copy as it holds it), and the copy read instead is checked here
        bad_copy: str | None = None
        if shm is not None:
            # From the local node's RAM when it has the chunk there; checked like any read.
            try:
                local = await shm.get(chunk_id, target, byte_range)
            except ChecksumMismatch as exc:
                log.error("%s: taking the chunk from another copy", exc)
                local = None
                bad_copy = shm.node_id
            if local is not None:
                self.stats.chunks_downloaded += 1
                self.stats.bytes_downloaded += len(local)
                self.stats.shm_chunks_downloaded += 1
                self.stats.shm_bytes_downloaded += len(local)
                return local

        verify = self._verify_reads or bad_copy is not None

        async def checked(view: memoryview) -> memoryview:
            if verify and not ranged and await chunk_id_of_async(view) != chunk_id:
                raise ChecksumMismatch(message=f"chunk {chunk_id} read back with other bytes")
            return view

        async def handle(resp: aiohttp.ClientResponse) -> memoryview:
            # A server that ignores Range answers 200 with the whole chunk: skip to the range.
            whole = ranged and resp.status == 200
            to_skip = skip if whole else 0
            length = resp.content_length
            if ranged and resp.status == 206:
                check_content_range(resp.headers.get("Content-Range"), skip, length)
            expected = (
                want if want is not None else (length - to_skip if length is not None else None)
            )
            dest = target if owns_out() else None  # a hedge reads into a buffer of its own
            return await checked(await self._read_body(resp, dest, expected, to_skip, whole))

        def plan_body(dest: memoryview | None, head: ResponseHead) -> BodyPlan:
            # The same decisions as handle() and _read_body, made before any body byte.
            whole = ranged and head.status == 200
            to_skip = skip if whole else 0
            length = head.content_length
            if ranged and head.status == 206:
                check_content_range(head.headers.get("content-range"), skip, length)
            body = length - to_skip
            expected = want if want is not None else body
            if body > expected and not whole:
                raise ProtocolError(message=f"response longer than the {expected} bytes expected")
            if body < expected:
                short = max(body, 0)
                raise ProtocolError(message=f"response of {short} bytes, expected {expected}")
            if dest is None:
                return BodyPlan(memoryview(bytearray(expected)), to_skip)
            if len(dest) < expected:
                raise ValueError(f"output buffer of {len(dest)} bytes < {expected} to read")
            return BodyPlan(dest[:expected], to_skip)

        path = f"/v1/chunks/{chunk_id}"
        direct = self.direct
        # The head lines this request adds to those every direct request carries.
        extra_lines = _header_lines(
            {k: v for k, v in headers.items() if self._base_headers.get(k) != v}
        )

        async def direct_get(node: str) -> memoryview:
            # Decided here, in the attempt's task: the head is parsed in a socket callback.
            plan = functools.partial(plan_body, target if owns_out() else None)
            return await checked(await self._direct_get(node, path, plan, extra_lines))

        async def verified(view: memoryview) -> None:
            # A raced read: whichever answer comes first is checked before it is taken.
            if not verify and not ranged and await chunk_id_of_async(view) != chunk_id:
                raise ChecksumMismatch(message=f"chunk {chunk_id} read back with other bytes")

        size_hint = want if want is not None else len(target) if target is not None else None
        if size_hint is None:
            size_hint = self.cluster.max_chunk_size

        degraded: NotEnoughFragments | None = None
        sources = self._fragment_sources(holders)
        codec = self._erasure_codec() if sources is not None else None
        if sources is not None and codec is not None:
            try:
                view = await self._decode_cold(chunk_id, codec, sources, target, byte_range)
            except NotEnoughFragments as exc:
                # The plan may be stale (repair moves fragments): a node can still look for
                # them cluster-wide and rebuild. Its 404 would say less than this error.
                degraded = exc
            else:
                self.stats.chunks_downloaded += 1
                self.stats.bytes_downloaded += len(view)
                return view
        candidates, balance = self._read_candidates(chunk_id, holders)
        if bad_copy in candidates:
            if candidates.index(bad_copy) < balance:
                balance -= 1
            candidates.remove(bad_copy)
        try:
            view = await self._call(
                "GET",
                path,
                handle,
                candidates=candidates,
                headers=headers,
                next_node_on=(NotFound, ProtocolError, ChecksumMismatch),
                balance=balance,
                direct=direct_get if direct is not None else None,
                hedge_after=self.bandwidth.deadline(size_hint),
                accept=verified,
                observe=self._observe_read,
            )
        except NotFound:
            if degraded is not None:
                raise degraded from None
            raise
        if target is not None and view.obj is not target.obj:
            # A hedge answered first, into its own buffer; the attempt that wrote into
            # ``target`` is cancelled by now. Deliberate copy, on this path only.
            target[: len(view)] = view
            view = target[: len(view)]
        self.stats.chunks_downloaded += 1
        self.stats.bytes_downloaded += len(view)
        return view

    def _observe_read(self, view: memoryview, seconds: float) -> None:
        self.bandwidth.observe(len(view), seconds)

    # ------------------------------------------------------------------ degraded reads

    def _fragment_sources(
        self, holders: Sequence[Holder | str] | None
    ) -> dict[int, list[str]] | None:
        """Fragment index -> nodes holding it, when ``holders`` (from ``plan``) name fragments
        and no hot copy; None otherwise (a hot copy is one fast GET away)."""
        if not holders:
            return None
        sources: dict[int, list[str]] = {}
        for holder in holders:
            if not isinstance(holder, Holder) or holder.tier != "cold":
                return None
            self._urls.setdefault(holder.node, holder.url.rstrip("/"))
            for index in holder.fragments:
                sources.setdefault(index, []).append(holder.node)
        return sources or None

    def _erasure_codec(self) -> Codec | None:
        """The cluster's codec, or None when this client cannot make it (then nodes decode)."""
        erasure = self.cluster.erasure
        if erasure is None:
            return None
        from erasure import InvalidParameters, make_codec

        codec = self._codec
        if codec is None or (codec.name, codec.k, codec.n) != (erasure.codec, erasure.k, erasure.n):
            try:
                codec = make_codec(erasure.codec, erasure.k, erasure.n)
            except InvalidParameters as exc:  # e.g. "isal" without pyeclib on this host
                log.debug("degraded reads go through the nodes: %s", exc)
                return None
            self._codec = codec
        return codec

    async def _decode_cold(
        self,
        chunk_id: str,
        codec: Codec,
        sources: Mapping[int, Sequence[str]],
        target: memoryview | None,
        byte_range: ByteRange | None,
    ) -> memoryview:
        """The chunk (or ``byte_range`` of it) decoded here from fragments fetched from their
        holders (``storaged.client.degraded``), written into ``target`` when given."""
        if target is not None and byte_range is None and chunk_id not in self._cold_decodes:
            # The whole chunk into the caller's buffer: decoded straight into it (no joined
            # copy to allocate and copy again), and not kept, as nobody reads a part later.
            decoded = await self._decode_fresh(chunk_id, codec, sources, target)
            return memoryview(decoded.data)
        whole = memoryview(await self._decoded_chunk(chunk_id, codec, sources))
        start, end = 0, len(whole)
        if byte_range is not None:
            start = byte_range.start
            end = len(whole) if byte_range.end is None else byte_range.end
            if start >= len(whole) or end > len(whole):
                raise BadRange(
                    message=f"range {byte_range} outside chunk {chunk_id} of {len(whole)} bytes"
                )
        if target is None:
            return whole[start:end]
        if len(target) < end - start:
            raise ValueError(f"output buffer of {len(target)} bytes < {end - start} to read")
        # A deliberate copy: the codec joins the decoded blocks into a new buffer.
        target[: end - start] = whole[start:end]
        return target[: end - start]

    async def _decoded_chunk(
        self, chunk_id: str, codec: Codec, sources: Mapping[int, Sequence[str]]
    ) -> bytes:
        """The whole chunk, decoded here once for all the ranges asked of it while it stays
        in the cache (``decode_cache_bytes``)."""
        for _ in range(3):
            pending = self._cold_decodes.get(chunk_id)
            if pending is None:
                break
            self._cold_decodes.move_to_end(chunk_id)
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # this request was cancelled
                # The request that decoded it was cancelled, not this one: decode here.

        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._cold_decodes[chunk_id] = future
        try:
            decoded = await self._decode_fresh(chunk_id, codec, sources, None)
            assert isinstance(decoded.data, bytes)
        except BaseException as exc:
            if self._cold_decodes.get(chunk_id) is future:
                del self._cold_decodes[chunk_id]
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: nobody else may be waiting for it
            raise
        future.set_result(decoded.data)
        if self._cold_decodes.get(chunk_id) is future:
            self._cold_decoded_bytes += len(decoded.data)
            # Oldest out first, the newest too if it alone is over the budget; decodes still
            # running hold no bytes yet and stay.
            for key in builtins.list(self._cold_decodes):
                if self._cold_decoded_bytes <= self._decode_cache_bytes:
                    break
                entry = self._cold_decodes[key]
                if entry.done():
                    del self._cold_decodes[key]
                    self._cold_decoded_bytes -= len(entry.result())
        return decoded.data

    async def _decode_fresh(
        self,
        chunk_id: str,
        codec: Codec,
        sources: Mapping[int, Sequence[str]],
        out: memoryview | None,
    ) -> Decoded:
        from storaged.client.degraded import decode_cold

        async def fetch(index: int) -> memoryview:
            return await self._get_fragment(chunk_id, index, sources[index])

        decoded = await decode_cold(chunk_id, codec, sources, fetch, self._hash_slots, out)
        self.stats.chunks_decoded += 1
        self.stats.fragments_downloaded += decoded.fetched
        self.stats.fragments_skipped += decoded.skipped
        return decoded

    async def _get_fragment(self, chunk_id: str, index: int, nodes: Sequence[str]) -> memoryview:
        """Fragment ``index`` of a chunk, whole and unchecked (the codec checks it), from one
        of ``nodes`` (extension E12); ``FragmentNotFound``/``ConnectionFailed`` when none
        gives it after a try or two each (another index will do as well)."""
        from erasure import HEADER_SIZE

        path = f"/v1/chunks/{chunk_id}/fragments/{index}"
        # A fragment is at most a k-th of a chunk (rounded up) plus its header.
        limit = self.cluster.max_chunk_size + HEADER_SIZE
        erasure = self.cluster.erasure

        def sized(length: int | None) -> int:
            if length is None or length > limit:
                raise ProtocolError(message=f"fragment answer of {length} bytes (max {limit})")
            return length

        async def handle(resp: aiohttp.ClientResponse) -> memoryview:
            return await self._read_body(resp, None, sized(resp.content_length), 0)

        def plan_body(head: ResponseHead) -> BodyPlan:
            return BodyPlan(memoryview(bytearray(sized(head.content_length))), 0)

        direct = self.direct

        async def direct_get(node: str) -> memoryview:
            return await self._direct_get(node, path, plan_body)

        return await self._call(
            "GET",
            path,
            handle,
            candidates=list(nodes),
            next_node_on=(NotFound, ProtocolError),
            balance=len(nodes),
            direct=direct_get if direct is not None else None,
            # Another index serves as well as this one: no long retries of a dead holder.
            max_attempts=2 * len(nodes),
            hedge_after=self.bandwidth.deadline(limit // (erasure.k if erasure else 1)),
            observe=self._observe_read,
        )

    @staticmethod
    async def _read_body(
        resp: aiohttp.ClientResponse,
        out: memoryview | None,
        expected: int | None,
        skip: int,
        whole_chunk: bool = False,
    ) -> memoryview:
        """Stream the body into ``out`` (or a new buffer), dropping its first ``skip`` bytes.

        ``whole_chunk``: the node ignored our Range; bytes past ``expected`` are dropped
        (the connection is then closed rather than drained).
        """
        if out is None:
            if expected is None:
                # No length announced (chunked encoding): the one place we join pieces.
                raw = await resp.read()
                return memoryview(raw)[skip:]
            out = memoryview(bytearray(expected))
        limit = len(out) if expected is None else expected
        if expected is not None and len(out) < expected:
            raise ValueError(f"output buffer of {len(out)} bytes < {expected} to read")
        pos = 0
        stream = resp.content
        while True:
            piece = await stream.readany()
            if not piece:
                break
            if skip:
                dropped = min(skip, len(piece))
                skip -= dropped
                piece = piece[dropped:]
                if not piece:
                    continue
            end = pos + len(piece)
            if end > limit and whole_chunk:
                piece = piece[: limit - pos]
                end = limit
            if end > limit:
                raise ProtocolError(message=f"response longer than the {limit} bytes expected")
            out[pos:end] = piece
            pos = end
            if whole_chunk and pos == limit:
                break
        if expected is not None and pos != expected:
            raise ProtocolError(message=f"response of {pos} bytes, expected {expected}")
        return out[:pos]

    async def _direct_get(
        self,
        node: str,
        path: str,
        plan_body: Callable[[ResponseHead], BodyPlan],
        extra_lines: str = "",
    ) -> memoryview:
        """``GET path`` on ``node`` through the direct reader (``NotHandled`` when the node
        is not plain HTTP); the body as ``plan_body`` placed it, or the error it answered."""
        where = self._direct_target(node)
        direct = self.direct
        if where is None or direct is None:
            raise NotHandled(f"{node}: not a plain-http node")
        addr, prefix, head_lines = where
        request = f"GET {prefix}{path} HTTP/1.1\r\n{head_lines}{extra_lines}\r\n"
        async with asyncio.timeout(self._request_timeout):
            head, body = await direct.get(addr, request.encode("latin-1"), plan_body)
        if head.status >= 400:
            raise error_from_response(
                head.status,
                bytes(body),
                head.headers.get("content-type"),
                head.headers.get("retry-after"),
            )
        return body

    def _direct_target(self, node: str) -> tuple[tuple[str, int], str, str] | None:
        """Where a direct GET to ``node`` goes: address, path prefix and the head lines
        every request carries (Host, ours); None for a node the direct path does not reach."""
        base = self._urls.get(node)
        if base is None:
            return None
        try:
            return self._direct_targets[base]
        except KeyError:
            pass
        target: tuple[tuple[str, int], str, str] | None = None
        parts = urlsplit(base)
        if parts.scheme == "http" and parts.hostname and "@" not in parts.netloc:
            port = parts.port or 80
            lines = _header_lines({"Host": parts.netloc, **self._base_headers})
            target = ((parts.hostname, port), parts.path.rstrip("/"), lines)
        self._direct_targets[base] = target
        return target

    @staticmethod
    def _check_chunk_id(chunk_id: str) -> None:
        if not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")

    # ------------------------------------------------------------------ checkpoints

    @staticmethod
    def _checkpoint_path(name: str) -> str:
        if not is_checkpoint_name(name):
            raise BadName(message=f"invalid checkpoint name {name!r}")
        return f"/v1/checkpoints/{name}"

    async def commit(self, name: str, manifest: Mapping[str, Any]) -> CommitResult:
        """Commit ``manifest`` under ``name``: the checkpoint becomes visible, immutably.

        Raises ``MissingChunks`` (its ``missing`` lists them), ``Exists`` for a different
        manifest under that name, ``BadManifest``. Committing the identical manifest
        again succeeds with ``created=False``.
        """
        path = self._checkpoint_path(name)
        payload = msgpack.packb(manifest)

        async def handle(resp: aiohttp.ClientResponse) -> CommitResult:
            doc = await self._decoded(resp)
            try:
                chunks = doc["chunks"]
                return CommitResult(
                    str(doc.get("name", name)),
                    len(chunks) if isinstance(chunks, list) else int(chunks),
                    int(doc["bytes"]),
                    resp.status == 201,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(message=f"malformed commit answer: {exc!r}") from exc

        return await self._call(
            "PUT", path, handle, body=lambda: payload, headers={"Content-Type": MSGPACK}
        )

    async def get_manifest(self, name: str) -> dict[str, Any]:
        """The manifest as committed; ``CheckpointNotFound`` if there is none."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            doc = await self._decoded(resp)
            if not isinstance(doc, dict):
                raise ProtocolError(message="manifest is not a map")
            return doc

        return await self._checkpoint_call("GET", name, "", handle)

    async def status(self, name: str) -> CheckpointStatus:
        """Durability of a checkpoint (see ``CheckpointStatus``)."""

        async def handle(resp: aiohttp.ClientResponse) -> CheckpointStatus:
            doc = await self._decoded(resp)
            try:
                return CheckpointStatus(
                    str(doc["state"]),
                    int(doc["chunks"]),
                    int(doc["memory"]),
                    int(doc["nvme"]),
                    int(doc["cold"]),
                    None if doc.get("lost") is None else int(doc["lost"]),
                    tuple(
                        FullTier(
                            str(b["node"]),
                            str(b["url"]),
                            str(b["tier"]),
                            int(b["chunks"]),
                            None if b.get("full_since") is None else float(b["full_since"]),
                            None if b.get("cause") is None else str(b["cause"]),
                        )
                        for b in doc.get("blocked") or ()
                    ),
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ProtocolError(message=f"malformed status: {exc!r}") from exc

        return await self._checkpoint_call("GET", name, "?status", handle)

    async def plan(self, name: str) -> RestorePlanDoc:
        """Who can serve each chunk of a checkpoint, fastest tier first."""

        async def handle(resp: aiohttp.ClientResponse) -> RestorePlanDoc:
            doc = await self._decoded(resp)
            try:
                return {
                    str(chunk): [
                        Holder(
                            str(h["node"]),
                            str(h["url"]),
                            str(h["tier"]),
                            tuple(int(i) for i in h.get("fragments", ())),
                        )
                        for h in holders
                    ]
                    for chunk, holders in doc["chunks"].items()
                }
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ProtocolError(message=f"malformed plan: {exc!r}") from exc

        plan = await self._checkpoint_call("GET", name, "?plan", handle)
        for holders in plan.values():
            for holder in holders:
                self._urls.setdefault(holder.node, holder.url.rstrip("/"))
        return plan

    async def delete(self, name: str) -> None:
        """Delete a checkpoint (its chunks are freed once no other checkpoint names them).

        ``CheckpointNotFound`` if there is none; not raised when an earlier attempt of
        this same call may have deleted it before its answer was lost.
        """

        async def handle(resp: aiohttp.ClientResponse) -> None:
            await resp.read()

        try:
            await self._checkpoint_call("DELETE", name, "", handle)
        except CheckpointNotFound as exc:
            if not exc.replayed:
                raise

    async def wait(
        self,
        name: str,
        state: str = "memory",
        # The signature; asyncio.timeout around it would lose the last status.
        timeout: float = 60.0,
    ) -> CheckpointStatus:
        """Poll ``status`` until ``name`` reaches ``state``; ``WaitTimeout`` after ``timeout`` s.

        ``NvmeFull`` (or ``ColdFull``) instead, within a second or two, when a node's full
        disk tier keeps it from ``state`` (extension E16): waiting would not help."""
        state_rank(state)
        deadline = time.monotonic() + timeout
        pause = 0.05
        last: CheckpointStatus | None = None
        stuck = BlockedWatch(name, state)
        while True:
            last = await self.status(name)
            if last.reached(state):
                return last
            stuck.check(last)
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"checkpoint {name} is {last.state} after {timeout}s, waiting for {state}",
                    last,
                )
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)

    async def _checkpoint_call(
        self,
        method: str,
        name: str,
        query: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[T]],
    ) -> T:
        return await self._call(method, self._checkpoint_path(name) + query, handle)

    async def list(self, prefix: str = "", *, costs: bool = False) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints whose names start with ``prefix``, sorted by name; with
        ``costs``, each with its ``CheckpointCosts`` (one catalogue snapshot and one question
        to the nodes for the whole listing, on the node's side)."""
        params = [f"prefix={quote(prefix, safe='/')}"] if prefix else []
        if costs:
            params.append("costs")
        query = "?" + "&".join(params) if params else ""

        async def handle(resp: aiohttp.ClientResponse) -> builtins.list[CheckpointInfo]:
            doc = await self._decoded(resp)
            try:
                return [
                    CheckpointInfo(
                        str(c["name"]),
                        float(c["created"]),
                        int(c["bytes"]),
                        str(c["state"]),
                        CheckpointCosts.from_wire(c["costs"]) if costs else None,
                    )
                    for c in doc["checkpoints"]
                ]
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(message=f"malformed checkpoint list: {exc!r}") from exc

        return await self._call("GET", f"/v1/checkpoints{query}", handle)
