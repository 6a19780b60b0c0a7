"""Where a chunk's bytes come from: the chunk sources behind ``Client.get_chunk``.

Every source answers one ``ChunkRead`` through ``ChunkSource.read``: the bytes asked for
(written into the caller's buffer when one is given), or None when it does not have the
chunk and the next source is to be asked. The sources, in the order the read router
(``storaged.client.router``) asks them:

- ``ShmSource``: the RAM of the node on this host, through shared memory
  (``storaged.client.shm``);
- ``ColdDecodeSource``: a cold chunk decoded here from fragments fetched from their
  holders (``storaged.client.degraded``), when the plan names no hot copy;
- ``DirectSource``: a GET over the holders with failover and hedging (``Requests.call``),
  each attempt reading the body straight into the buffer (``storaged.client.direct``),
  and through aiohttp on a node that path does not reach (https);
- ``HttpSource``: the same GET, every attempt through aiohttp.

A source may leave word on the read for those after it (``bad_copy``, ``degraded``); the
router owns the order and what those words change.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import functools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import aiohttp

from storaged.client.deadlines import Bandwidth, attempt_progress
from storaged.client.direct import BodyPlan, DirectGets, NotHandled, ResponseHead
from storaged.client.documents import ClientStats, Holder
from storaged.client.errors import (
    BadRange,
    ChecksumMismatch,
    NotEnoughFragments,
    NotFound,
    ProtocolError,
    StoragedError,
    error_from_response,
)
from storaged.client.request import Requests, header_lines, owns_out
from storaged.client.shm import ShmPath, pick_node, usable
from storaged.ids import chunk_id_of_async
from storaged.shmwire import WireError
from storaged.wire import ByteRange

if TYPE_CHECKING:
    # Imported where used: a command that only asks the cluster (``storaged ls``) starts
    # without numpy and the codecs (tests/client/test_cli_start.py).
    import numpy as np

    from erasure import Codec
    from storaged.client.degraded import Decoded, FragmentBuffers

# The client's one logger, as before these modules were split out of client.py.
log = logging.getLogger("storaged.client.client")

#: What ``get_chunk`` can read into: any C-contiguous writable buffer.
WritableBuffer: TypeAlias = "bytearray | memoryview | np.ndarray[Any, Any]"


def writable_view(out: WritableBuffer) -> memoryview:
    """A flat, writable byte view of ``out``; ``TypeError`` if it is read-only or strided."""
    # An ndarray's buffer without importing numpy (``storaged ls`` starts without it).
    view = memoryview(out) if isinstance(out, bytearray | memoryview) else out.data
    if view.readonly:
        raise TypeError("output buffer is read-only")
    if not view.c_contiguous:
        raise TypeError("output buffer must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


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


@dataclass(slots=True)
class ChunkRead:
    """One read of a chunk (or ``byte_range`` of it), as each source is asked for it.

    Made by ``ChunkRead.asked`` (which checks what the caller gave); the router fills in
    the node order (``candidates``, ``balance``) and ``hedge_after`` before the sources
    that ask nodes, and the sources leave word for those after them."""

    chunk_id: str
    #: the caller's buffer, flat, or None (a buffer is allocated)
    target: memoryview | None
    byte_range: ByteRange | None
    holders: Sequence[Holder | str] | None
    #: bytes asked for, when the range says (None: to the chunk's end)
    want: int | None
    #: the GET's headers (``Range`` for a range)
    headers: dict[str, str]
    #: check the bytes against the chunk id (``verify_reads``, or a bad copy seen)
    verify: bool = False
    #: the local node whose RAM copy failed its id: not asked again over HTTP (a node
    #: serves its RAM copy as it holds it), and the copy read instead is checked here
    bad_copy: str | None = None
    #: why the decode here failed; raised if no node has the chunk either
    degraded: NotEnoughFragments | None = None
    #: the nodes to ask, in order, the first ``balance`` interchangeable
    candidates: list[str] = field(default_factory=list)
    balance: int = 0
    hedge_after: float | None = None

    @classmethod
    def asked(
        cls,
        chunk_id: str,
        out: WritableBuffer | None,
        byte_range: ByteRange | None,
        holders: Sequence[Holder | str] | None,
    ) -> ChunkRead:
        """The read ``get_chunk`` was asked for; ``BadRange`` or ``ValueError`` (a buffer
        too small for the range) before any request."""
        target = writable_view(out) if out is not None else None
        want: int | None = None
        headers: dict[str, str] = {"Accept-Encoding": "identity"}
        if byte_range is not None and (byte_range.start != 0 or byte_range.end is not None):
            if byte_range.end is not None:
                want = byte_range.end - byte_range.start
                if want < 0 or byte_range.start < 0:
                    raise BadRange(message=f"invalid range {byte_range}")
            if want != 0:  # HTTP cannot ask for nothing: the router answers it
                headers["Range"] = range_header(byte_range)
        if target is not None and want is not None and len(target) < want:
            raise ValueError(f"output buffer of {len(target)} bytes < {want} requested")
        return cls(chunk_id, target, byte_range, holders, want, headers)

    @property
    def ranged(self) -> bool:
        return "Range" in self.headers

    @property
    def skip(self) -> int:
        return self.byte_range.start if self.byte_range is not None else 0

    async def checked(self, view: memoryview) -> memoryview:
        """``view``, checked against the chunk id when ``verify`` says so (whole reads)."""
        if self.verify and not self.ranged and await chunk_id_of_async(view) != self.chunk_id:
            raise ChecksumMismatch(message=f"chunk {self.chunk_id} read back with other bytes")
        return view


class ChunkSource(Protocol):
    """A place a chunk's bytes may come from."""

    async def read(self, read: ChunkRead) -> memoryview | None:
        """The bytes ``read`` asks for, written into ``read.target`` when it is given
        (the view returned is then that part of it); None when this source does not have
        the chunk (the next is asked). Raises what ends the read (``ChunkNotFound``,
        ``BadRange``, ``ValueError`` for a buffer too small)."""
        ...


class Links(Protocol):
    """The client's connections besides its HTTP session, which it may replace while
    open (a load test's traced direct reader): sources look them up at each read."""

    direct: DirectGets | None
    shm: ShmPath | None


# --------------------------------------------------------------------------- shared memory


async def connect_shm(
    requests: Requests, request_timeout: float, max_concurrency: int
) -> ShmPath | None:
    """The shared-memory path to a seed node on this host, if there is one that answers."""
    picked = pick_node(await requests.cluster_document(), requests.seeds)
    if picked is None:
        return None
    node_id, path = picked
    try:
        return await ShmPath.connect(
            node_id,
            path,
            requests.token,
            max_concurrency,
            request_timeout,
            # A mapping is an answer of a few bytes: a metadata deadline.
            read_within=2 * requests.deadlines.metadata,
        )
    except (OSError, WireError, TimeoutError, StoragedError) as exc:
        log.warning("shared-memory path to %s not available (%s): using HTTP", node_id, exc)
        return None


class ShmSource:
    """The chunk from the RAM of the node on this host (``links.shm``), checked like any
    read; None when that node's RAM does not have it or the path is off or broken. A copy
    that fails its id is left as ``bad_copy``: the read then goes elsewhere, checked."""

    def __init__(self, links: Links, stats: ClientStats) -> None:
        self.links, self.stats = links, stats

    async def read(self, read: ChunkRead) -> memoryview | None:
        shm = usable(self.links.shm)
        if shm is None:
            return None
        try:
            local = await shm.get(read.chunk_id, read.target, read.byte_range)
        except ChecksumMismatch as exc:
            log.error("%s: taking the chunk from another copy", exc)
            read.bad_copy = shm.node_id
            read.verify = True
            return None
        if local is not None:
            self.stats.shm_chunks_downloaded += 1
            self.stats.shm_bytes_downloaded += len(local)
        return local


# --------------------------------------------------------------------------- bodies


async def read_body(
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
    progress = attempt_progress()  # bytes arriving put a hedge off (client/deadlines.py)
    while True:
        piece = await stream.readany()
        if not piece:
            break
        if progress is not None:
            progress.note()
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


async def direct_get(
    requests: Requests,
    direct: DirectGets | None,
    node: str,
    path: str,
    plan_body: Callable[[ResponseHead], BodyPlan],
    extra_lines: str = "",
) -> memoryview:
    """``GET path`` on ``node`` through the direct reader (``NotHandled`` when the node
    is not plain HTTP); the body as ``plan_body`` placed it, or the error it answered."""
    where = requests.direct_target(node)
    if where is None or direct is None:
        raise NotHandled(f"{node}: not a plain-http node")
    addr, prefix, head_lines = where
    request = f"GET {prefix}{path} HTTP/1.1\r\n{head_lines}{extra_lines}\r\n"
    async with asyncio.timeout(requests.request_timeout):
        head, body = await direct.get(addr, request.encode("latin-1"), plan_body)
    if head.status >= 400:
        raise error_from_response(
            head.status,
            bytes(body),
            head.headers.get("content-type"),
            head.headers.get("retry-after"),
        )
    return body


# --------------------------------------------------------------------------- nodes


class HttpSource:
    """The chunk from the nodes: a GET over ``read.candidates`` with failover and hedging
    after ``read.hedge_after`` (``Requests.call``), every attempt through aiohttp. A raced
    answer is checked against the id before it is taken; never None (``NotFound`` when no
    node has the chunk)."""

    def __init__(self, requests: Requests, bandwidth: Bandwidth) -> None:
        self.requests, self.bandwidth = requests, bandwidth

    def attempt(self, read: ChunkRead) -> Callable[[str], Awaitable[memoryview]] | None:
        """How an attempt reads on a node other than through aiohttp; None: it does not."""
        return None

    async def read(self, read: ChunkRead) -> memoryview:
        target = read.target
        view = await self.requests.call(
            "GET",
            f"/v1/chunks/{read.chunk_id}",
            functools.partial(self._handle, read),
            candidates=read.candidates,
            headers=read.headers,
            next_node_on=(NotFound, ProtocolError, ChecksumMismatch),
            balance=read.balance,
            direct=self.attempt(read),
            hedge_after=read.hedge_after,
            accept=functools.partial(self._verified, read),
            observe=self.observe,
        )
        if target is not None and view.obj is not target.obj:
            # A hedge answered first, into its own buffer; the attempt that wrote into
            # ``target`` is cancelled by now. Deliberate copy, on this path only.
            target[: len(view)] = view
            view = target[: len(view)]
        return view

    def observe(self, view: memoryview, seconds: float) -> None:
        self.bandwidth.observe(len(view), seconds)

    @staticmethod
    async def _handle(read: ChunkRead, resp: aiohttp.ClientResponse) -> memoryview:
        length = resp.content_length
        whole, to_skip = _skip_to_range(read, resp.status, resp.headers, length)
        expected = (
            read.want
            if read.want is not None
            else (length - to_skip if length is not None else None)
        )
        dest = read.target if owns_out() else None  # a hedge reads into a buffer of its own
        return await read.checked(await read_body(resp, dest, expected, to_skip, whole))

    @staticmethod
    async def _verified(read: ChunkRead, view: memoryview) -> None:
        # A raced read: whichever answer comes first is checked before it is taken.
        if not read.verify and not read.ranged and await chunk_id_of_async(view) != read.chunk_id:
            raise ChecksumMismatch(message=f"chunk {read.chunk_id} read back with other bytes")


def _skip_to_range(
    read: ChunkRead, status: int, headers: Mapping[str, str], length: int | None
) -> tuple[bool, int]:
    """Whether a ranged read's answer is the whole chunk (a server that ignores Range
    answers 200 with it), and the bytes to skip to the range; a 206's ``Content-Range``
    checked (``ProtocolError``). ``headers``: aiohttp's (any case) or a direct GET's (lower
    case)."""
    whole = read.ranged and status == 200
    if read.ranged and status == 206:
        check_content_range(headers.get("content-range"), read.skip, length)
    return whole, read.skip if whole else 0


def _plan_body(read: ChunkRead, dest: memoryview | None, head: ResponseHead) -> BodyPlan:
    """Where a direct GET's body goes: the same decisions as ``HttpSource._handle`` and
    ``read_body``, made before any body byte."""
    length = head.content_length
    whole, to_skip = _skip_to_range(read, head.status, head.headers, length)
    body = length - to_skip
    expected = read.want if read.want is not None else body
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


class DirectSource(HttpSource):
    """``HttpSource`` whose attempts read the body straight into the destination buffer
    (``links.direct``); on a node that path does not reach (https), and when the client
    has no direct reader, an attempt goes through aiohttp as ``HttpSource``'s do."""

    def __init__(self, requests: Requests, bandwidth: Bandwidth, links: Links) -> None:
        super().__init__(requests, bandwidth)
        self.links = links

    def attempt(self, read: ChunkRead) -> Callable[[str], Awaitable[memoryview]] | None:
        direct = self.links.direct
        if direct is None:
            return None
        requests = self.requests
        path = f"/v1/chunks/{read.chunk_id}"
        # The head lines this request adds to those every direct request carries.
        extra_lines = header_lines(
            {k: v for k, v in read.headers.items() if requests.base_headers.get(k) != v}
        )

        async def attempt(node: str) -> memoryview:
            # Decided here, in the attempt's task: the head is parsed in a socket callback.
            plan = functools.partial(_plan_body, read, read.target if owns_out() else None)
            return await read.checked(
                await direct_get(requests, self.links.direct, node, path, plan, extra_lines)
            )

        return attempt


# --------------------------------------------------------------------------- cold decode

#: Cold chunks a client fetches fragments for and decodes at once, per core: one decoding
#: while the next one's fragments arrive (1 and 3 measured the same). Without a bound,
#: fragments were fetched far ahead of the decodes (171-198 fragment buffers, 342-396 MiB,
#: alive at once in a 1 GiB restore on 2 cores), each in fresh memory.
COLD_CHUNKS_PER_CORE = 2


class ColdDecodeSource:
    """A cold chunk decoded here from fragments fetched from their holders (extension
    E12), when ``read.holders`` (from ``plan``) name fragments and no hot copy and this
    client can make the cluster's codec; None otherwise (a hot copy is one fast GET away,
    or the nodes decode). Too few fragments leave ``read.degraded`` and None: the plan may
    be stale, and a node can still rebuild the chunk.

    Whole chunks decoded for a range stay, ``cache_bytes`` of them newest first, for the
    further ranges a restore reads out of them.

    At most ``COLD_CHUNKS_PER_CORE`` chunks a core are fetched and decoded at once (the
    others wait before asking for any fragment), and their fragments are received into
    buffers reused from chunk to chunk (``FragmentBuffers``): as many as those chunks take."""

    def __init__(
        self,
        requests: Requests,
        bandwidth: Bandwidth,
        links: Links,
        decode_slots: asyncio.Semaphore,
        cache_bytes: int,
    ) -> None:
        self.requests, self.bandwidth, self.links = requests, bandwidth, links
        self.decode_slots = decode_slots
        self.cache_bytes = cache_bytes
        self.chunks_at_once = COLD_CHUNKS_PER_CORE * max(1, os.cpu_count() or 1)
        self._chunk_slots = asyncio.Semaphore(self.chunks_at_once)
        #: the cluster's erasure codec, made on first use (None: not yet, or none here)
        self._codec: Codec | None = None
        #: cold chunks decoded here, oldest first (a future while the decode runs, shared by
        #: the ranges asked meanwhile), and their bytes once done
        self._decodes: collections.OrderedDict[str, asyncio.Future[bytes]] = (
            collections.OrderedDict()
        )
        self._decoded_bytes = 0
        #: receive buffers of fragments, reused from decode to decode (made on first use)
        self._buffers: FragmentBuffers | None = None

    def clear(self) -> None:
        self._decodes.clear()
        self._decoded_bytes = 0
        if self._buffers is not None:
            self._buffers.clear()

    def buffers(self) -> FragmentBuffers:
        """The pool fragments are received into: the fragments of the chunks decoded at once,
        and one chunk's more (a failed fragment's replacement, a hedge)."""
        if self._buffers is None:
            from erasure import HEADER_SIZE
            from storaged.client.degraded import FragmentBuffers

            cluster = self.requests.known_cluster()
            k = cluster.erasure.k if cluster.erasure is not None else 1
            per_chunk = cluster.max_chunk_size + k * (HEADER_SIZE + 1)
            self._buffers = FragmentBuffers((self.chunks_at_once + 1) * per_chunk)
        return self._buffers

    async def read(self, read: ChunkRead) -> memoryview | None:
        sources = self.fragment_sources(read.holders)
        codec = self.codec() if sources is not None else None
        if sources is None or codec is None:
            return None
        try:
            return await self._decode(read.chunk_id, codec, sources, read.target, read.byte_range)
        except NotEnoughFragments as exc:
            # The plan may be stale (repair moves fragments): a node can still look for
            # them cluster-wide and rebuild. Its 404 would say less than this error.
            read.degraded = exc
            return None

    def fragment_sources(
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
            self.requests.learn_url(holder.node, holder.url)
            for index in holder.fragments:
                sources.setdefault(index, []).append(holder.node)
        return sources or None

    def codec(self) -> Codec | None:
        """The cluster's codec, or None when this client cannot make it (then nodes decode)."""
        erasure = self.requests.known_cluster().erasure
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

    async def _decode(
        self,
        chunk_id: str,
        codec: Codec,
        sources: Mapping[int, Sequence[str]],
        target: memoryview | None,
        byte_range: ByteRange | None,
    ) -> memoryview:
        """The chunk (or ``byte_range`` of it) decoded here, written into ``target`` when
        given."""
        if target is not None and byte_range is None and chunk_id not in self._decodes:
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
        in the cache."""
        for _ in range(3):
            pending = self._decodes.get(chunk_id)
            if pending is None:
                break
            self._decodes.move_to_end(chunk_id)
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # this request was cancelled
                # The request that decoded it was cancelled, not this one: decode here.

        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._decodes[chunk_id] = future
        try:
            decoded = await self._decode_fresh(chunk_id, codec, sources, None)
            assert isinstance(decoded.data, bytes)
        except BaseException as exc:
            if self._decodes.get(chunk_id) is future:
                del self._decodes[chunk_id]
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: nobody else may be waiting for it
            raise
        future.set_result(decoded.data)
        if self._decodes.get(chunk_id) is future:
            self._decoded_bytes += len(decoded.data)
            self._trim()
        return decoded.data

    def _trim(self) -> None:
        # Oldest out first, the newest too if it alone is over the budget; decodes still
        # running hold no bytes yet and stay.
        for key in builtins.list(self._decodes):
            if self._decoded_bytes <= self.cache_bytes:
                break
            entry = self._decodes[key]
            if entry.done():
                del self._decodes[key]
                self._decoded_bytes -= len(entry.result())

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

        async with self._chunk_slots:
            decoded = await decode_cold(
                chunk_id, codec, sources, fetch, self.decode_slots, out, self.buffers()
            )
        stats = self.requests.stats
        stats.chunks_decoded += 1
        stats.fragments_downloaded += decoded.fetched
        stats.fragments_skipped += decoded.skipped
        return decoded

    async def _get_fragment(self, chunk_id: str, index: int, nodes: Sequence[str]) -> memoryview:
        """Fragment ``index`` of a chunk, whole and unchecked (the codec checks it), from one
        of ``nodes`` (extension E12), in a buffer of ``buffers()``; ``FragmentNotFound`` or
        ``ConnectionFailed`` when none gives it after a try or two each (another index will
        do as well)."""
        from erasure import HEADER_SIZE

        path = f"/v1/chunks/{chunk_id}/fragments/{index}"
        cluster = self.requests.known_cluster()
        # A fragment is at most a k-th of a chunk (rounded up) plus its header.
        limit = cluster.max_chunk_size + HEADER_SIZE
        erasure = cluster.erasure

        def sized(length: int | None) -> int:
            if length is None or length > limit:
                raise ProtocolError(message=f"fragment answer of {length} bytes (max {limit})")
            return length

        buffers = self.buffers()

        # Each attempt (a hedge too) receives into a buffer of its own.
        async def handle(resp: aiohttp.ClientResponse) -> memoryview:
            size = sized(resp.content_length)
            return await read_body(resp, buffers.take(size), size, 0)

        def plan_body(head: ResponseHead) -> BodyPlan:
            return BodyPlan(buffers.take(sized(head.content_length)), 0)

        direct = self.links.direct

        async def attempt(node: str) -> memoryview:
            return await direct_get(self.requests, self.links.direct, node, path, plan_body)

        return await self.requests.call(
            "GET",
            path,
            handle,
            candidates=list(nodes),
            next_node_on=(NotFound, ProtocolError),
            balance=len(nodes),
            direct=attempt if direct is not None else None,
            # Another index serves as well as this one: no long retries of a dead holder.
            max_attempts=2 * len(nodes),
            hedge_after=self.bandwidth.deadline(limit // (erasure.k if erasure else 1)),
            observe=self._observe,
        )

    def _observe(self, view: memoryview, seconds: float) -> None:
        self.bandwidth.observe(len(view), seconds)
