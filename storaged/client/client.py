"""Async client of the storaged HTTP API (``/work/shared/API.md``, version 1).

One ``Client`` talks to a whole cluster: it learns the membership from
``GET /v1/cluster`` on any of the URLs it is given, sends each chunk PUT to the
chunk's first placement node (rendezvous order over the live nodes), spreads GETs
over the holders of each chunk (least in-flight requests first) and fails over
to other holders, then to any node, when one fails. Every request is bounded in
time; 502/503/504 and lost connections are retried with jittered backoff,
honouring ``Retry-After``. Service errors surface as typed ``StoragedError``s.

``Client`` is the public face; the work is done by the objects it owns: the request
machinery (``storaged.client.request``), the read router and its chunk sources
(``storaged.client.router``, ``storaged.client.sources``) and the write path
(``storaged.client.writes``). The documents it returns live in
``storaged.client.documents``; every name is importable from here as before.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
import msgpack

from storaged.client.deadlines import Bandwidth, Deadlines
from storaged.client.direct import DirectGets
from storaged.client.documents import (
    ARCHIVED,
    BlockedWatch,
    CheckpointCosts,
    CheckpointInfo,
    CheckpointStatus,
    ChunkInfo,
    ClientStats,
    ClusterInfo,
    CommitResult,
    ErasureInfo,
    FullTier,
    Holder,
    NodeInfo,
    PutResult,
    RestorePlanDoc,
    RetentionInfo,
    Survives,
    TierCost,
    TierSpace,
    WaitTimeout,
    blocked_error,
)
from storaged.client.errors import (
    CheckpointNotFound,
    ChunkNotFound,
    NotFound,
    ProtocolError,
)
from storaged.client.request import (
    MSGPACK,
    Requests,
    admin_headers,
    base_url,
    check_chunk_id,
    checkpoint_path,
    decoded,
    document,
    owns_out,
)
from storaged.client.retry import RetryPolicy
from storaged.client.router import ReadRouter
from storaged.client.shm import ShmPath, shm_wanted
from storaged.client.sources import (
    WritableBuffer,
    check_content_range,
    connect_shm,
    range_header,
    writable_view,
)
from storaged.client.writes import ChunkWrites, run_all
from storaged.wire import ByteRange, BytesLike, state_rank

__all__ = [
    "MSGPACK",
    "BlockedWatch",
    "CheckpointCosts",
    "CheckpointInfo",
    "CheckpointStatus",
    "ChunkInfo",
    "Client",
    "ClientStats",
    "ClusterInfo",
    "CommitResult",
    "ErasureInfo",
    "FullTier",
    "Holder",
    "NodeInfo",
    "PutResult",
    "RestorePlanDoc",
    "TierCost",
    "TierSpace",
    "WaitTimeout",
    "WritableBuffer",
    "base_url",
    "blocked_error",
    "check_content_range",
    "owns_out",
    "range_header",
    "run_all",
    "writable_view",
]


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

    ``trace_configs``: ``aiohttp.TraceConfig``s for the session the client makes (not one
    given to ``open``), to observe its HTTP requests (a load test's latencies); reads
    through ``direct`` or shared memory are not aiohttp requests and are not traced.
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
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        seeds = [urls] if isinstance(urls, str) else list(urls)
        if not seeds:
            raise ValueError("need at least one node URL")
        if max_concurrency < 1 or missing_batch < 1:
            raise ValueError("max_concurrency and missing_batch must be >= 1")
        deadlines = deadlines if deadlines is not None else Deadlines.from_env()
        self.stats = ClientStats()
        self._requests = Requests(
            [base_url(url) for url in seeds],
            token=token,
            retry=retry or RetryPolicy(),
            deadlines=deadlines,
            timeout=aiohttp.ClientTimeout(
                total=request_timeout, connect=connect_timeout, sock_read=read_timeout
            ),
            max_concurrency=max_concurrency,
            suspect_seconds=suspect_seconds,
            refused_fails_fast=refused_fails_fast,
            stats=self.stats,
            trace_configs=trace_configs,
        )
        #: how long a request waits before the next node is asked too (the request
        #: engine's own object; a value, not a call)
        self.deadlines: Deadlines = deadlines
        #: the bandwidth chunk reads have had so far: their deadlines follow from it
        self.bandwidth = Bandwidth(deadlines)
        self._direct_reads = direct_reads
        self._shm_option = shm
        #: keep-alive connections of the direct read path; None when it is off
        self.direct: DirectGets | None = None
        #: the shared-memory path to the node on this host; None when off or not applicable
        self.shm: ShmPath | None = None
        hash_slots = asyncio.Semaphore(hash_threads or max(1, os.cpu_count() or 1))
        self._reads = ReadRouter(
            self._requests,
            self,
            bandwidth=self.bandwidth,
            decode_slots=hash_slots,
            decode_cache_bytes=decode_cache_bytes,
            verify_reads=verify_reads,
        )
        self._writes = ChunkWrites(
            self._requests, self, hash_slots=hash_slots, missing_batch=missing_batch
        )

    def __repr__(self) -> str:  # never shows the token
        cluster = self._requests.cluster
        nodes = len(cluster.nodes) if cluster else "?"
        return f"Client({self._requests.seeds!r}, nodes={nodes})"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self, session: aiohttp.ClientSession | None = None) -> None:
        """Open the HTTP session and learn the cluster; ``Unavailable`` if no URL answers."""
        requests = self._requests
        requests.open_session(session)
        use_direct = requests.owns_session if self._direct_reads is None else self._direct_reads
        if use_direct and self.direct is None:
            timeout = requests.timeout
            assert timeout.connect is not None and timeout.sock_read is not None
            self.direct = DirectGets(
                connect_timeout=timeout.connect,
                read_timeout=timeout.sock_read,
                pool_size=requests.max_concurrency + 8,
            )
        try:
            await self.refresh_cluster()
            if shm_wanted(self._shm_option) and self.shm is None:
                assert requests.request_timeout is not None
                self.shm = await connect_shm(
                    requests, requests.request_timeout, requests.max_concurrency
                )
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        await self._requests.close()
        if self.direct is not None:
            await self.direct.close()
            self.direct = None
        self._reads.close()
        if self.shm is not None:
            await self.shm.close()
            self.shm = None

    @property
    def cluster(self) -> ClusterInfo:
        """The membership as last learned; ``RuntimeError`` before ``open``."""
        return self._requests.known_cluster()

    def slow_nodes(self) -> builtins.list[str]:
        """Nodes that missed a deadline lately (asked after the others)."""
        return self._requests.slow.nodes()

    @property
    def max_chunk_size(self) -> int:
        """The cluster's largest accepted chunk (savers cut streams no coarser)."""
        return self.cluster.max_chunk_size

    async def refresh_cluster(self) -> ClusterInfo:
        """Ask ``GET /v1/cluster`` again (known live nodes first, then the seed URLs)."""
        return await self._requests.refresh_cluster()

    async def cluster_document(self) -> dict[str, Any]:
        """``GET /v1/cluster`` as the node sent it, with any fields beyond API.md's
        (for tools that show them); also refreshes ``cluster``."""
        return await self._requests.cluster_document()

    def placement(self, chunk_id: str) -> builtins.list[str]:
        """Live node ids in rendezvous order for ``chunk_id`` (the first holds the hot copy)."""
        return self._requests.placement(chunk_id)

    # ------------------------------------------------------------------ chunks

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str:
        """Upload one chunk; return its id once ``replication`` nodes hold it in RAM.

        ``chunk_id``, when given, must be the BLAKE3 of ``data`` (the server refuses a
        mismatch with ``ChecksumMismatch``); otherwise it is computed in a thread.
        """
        return (await self.put_chunk_result(data, chunk_id)).chunk

    async def put_chunk_result(self, data: BytesLike, chunk_id: str | None = None) -> PutResult:
        """``put_chunk`` with the server's answer (replicas, state, created or not)."""
        return await self._writes.put(data, chunk_id)

    async def missing_chunks(self, chunk_ids: Sequence[str]) -> builtins.list[str]:
        """The ids among ``chunk_ids`` the cluster does not hold, in request order."""
        return await self._writes.missing(chunk_ids)

    async def chunk_ids(self, chunks: Sequence[BytesLike]) -> builtins.list[str]:
        """BLAKE3 ids of ``chunks``, hashed in threads (at most ``hash_threads`` at a time)."""
        return await self._writes.chunk_ids(chunks)

    async def put_chunks(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None = None
    ) -> builtins.list[str]:
        """Upload the chunks the cluster does not hold yet; return every chunk's id, in order.

        Works in batches: hash (threads), ask ``POST /v1/chunks/missing``, PUT what is
        missing, each chunk once even if it occurs several times; the batches overlap so
        that hashing the next one runs while this one uploads. Returns once every chunk
        is acknowledged (or held already); raises the first failure otherwise.
        """
        return await self._writes.put_many(chunks, chunk_ids)

    async def head_chunk(self, chunk_id: str) -> ChunkInfo:
        """Size, tier and state of a chunk; ``ChunkNotFound`` when the cluster does not hold it."""
        check_chunk_id(chunk_id)

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
            return await self._requests.call(
                "HEAD",
                f"/v1/chunks/{chunk_id}",
                handle,
                candidates=self._reads.candidates(chunk_id, None)[0],
                next_node_on=(NotFound,),
            )
        except NotFound as exc:  # HEAD has no body: the status is all we get
            raise ChunkNotFound(message=f"chunk {chunk_id} not found", status=exc.status) from None

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
        outside the chunk. The order of the sources (shared memory, a decode here, the
        nodes) and what a failure of one changes: ``storaged.client.router``.
        """
        return await self._reads.get(chunk_id, out, byte_range, holders)

    # ------------------------------------------------------------------ admin

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
        checkpoint_path(name)  # BadName before any request

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, int]:
            doc = await decoded(resp)
            try:
                return {str(k): int(v) for k, v in doc["evicted"].items()}
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ProtocolError(message=f"malformed evict answer: {exc!r}") from exc

        doc = {"checkpoint": name, "tier": tier}
        return await self._requests.admin("POST", "/v1/admin/evict", handle, doc, admin_token)

    async def drain(
        self, node_id: str, *, cancel: bool = False, admin_token: str | None = None
    ) -> dict[str, Any]:
        """Admin (``POST /v1/nodes/{id}/drain``, docs/API.md E13): mark ``node_id``
        draining (no new placements; its data is copied to where placement without it
        says), or active again with ``cancel``. Returns ``{"node", "state", "unreached"}``
        (``unreached``: members the embedded mode could not tell now). ``NotFound`` for an
        unknown node."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            return document(await decoded(resp), "drain", ("node", "state"))

        path = f"/v1/nodes/{quote(node_id, safe='')}/drain"
        return await self._requests.admin("POST", path, handle, {"cancel": cancel}, admin_token)

    async def drain_progress(
        self, node_id: str, *, admin_token: str | None = None
    ) -> dict[str, Any]:
        """Admin (``GET /v1/nodes/{id}/drain``): ``{"node", "state", "chunks",
        "fragments", "chunks_pending", "fragments_pending", "can_leave"}`` as the node
        answers now; ``Unavailable`` (``node_unavailable``) when it does not answer."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            return document(await decoded(resp), "drain progress", ("can_leave",))

        return await self._requests.call(
            "GET",
            f"/v1/nodes/{quote(node_id, safe='')}/drain",
            handle,
            headers=admin_headers(admin_token, {}),
        )

    # ------------------------------------------------------------------ checkpoints

    async def commit(self, name: str, manifest: Mapping[str, Any]) -> CommitResult:
        """Commit ``manifest`` under ``name``: the checkpoint becomes visible, immutably.

        Raises ``MissingChunks`` (its ``missing`` lists them), ``Exists`` for a different
        manifest under that name, ``BadManifest``. Committing the identical manifest
        again succeeds with ``created=False``.
        """
        path = checkpoint_path(name)
        payload = msgpack.packb(manifest)

        async def handle(resp: aiohttp.ClientResponse) -> CommitResult:
            doc = await decoded(resp)
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

        return await self._requests.call(
            "PUT", path, handle, body=lambda: payload, headers={"Content-Type": MSGPACK}
        )

    async def get_manifest(self, name: str) -> dict[str, Any]:
        """The manifest as committed; ``CheckpointNotFound`` if there is none."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            doc = await decoded(resp)
            if not isinstance(doc, dict):
                raise ProtocolError(message="manifest is not a map")
            return doc

        return await self._requests.call("GET", checkpoint_path(name), handle)

    async def status(self, name: str) -> CheckpointStatus:
        """Durability of a checkpoint (see ``CheckpointStatus``)."""

        async def handle(resp: aiohttp.ClientResponse) -> CheckpointStatus:
            doc = await decoded(resp)
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
                    Survives.of(doc.get("survives")),
                    None if doc.get("archived") is None else bool(doc["archived"]),
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ProtocolError(message=f"malformed status: {exc!r}") from exc

        return await self._requests.call("GET", checkpoint_path(name) + "?status", handle)

    async def plan(self, name: str) -> RestorePlanDoc:
        """Who can serve each chunk of a checkpoint, fastest tier first."""

        async def handle(resp: aiohttp.ClientResponse) -> RestorePlanDoc:
            doc = await decoded(resp)
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

        plan = await self._requests.call("GET", checkpoint_path(name) + "?plan", handle)
        for holders in plan.values():
            for holder in holders:
                self._requests.learn_url(holder.node, holder.url)
        return plan

    async def archive(self, name: str, *, wait: bool = False, timeout: float = 600.0) -> bool:
        """Archive committed checkpoint ``name`` (extension E19): the nodes copy its chunks,
        then its manifest, to the archive. Returns whether it is archived: at once when it
        was already, else False while it runs in the background, or, with ``wait``, True
        once it is (``WaitTimeout`` after ``timeout`` s). Asking again is harmless, and
        finishes an archiving that a node's death cut short.

        ``CheckpointNotFound``; ``Conflict`` (``no_archive``) when the cluster has none;
        ``Unavailable`` (``archive_unavailable``) when the archive does not answer."""

        async def handle(resp: aiohttp.ClientResponse) -> bool:
            doc = await decoded(resp)
            if not isinstance(doc, dict):
                raise ProtocolError(message="archive answer is not a map")
            return bool(doc.get("archived"))

        done = await self._requests.call("POST", checkpoint_path(name) + "?archive", handle)
        if wait and not done:
            await self.wait(name, ARCHIVED, timeout=timeout)
            return True
        return done

    async def delete(self, name: str) -> None:
        """Delete a checkpoint (its chunks are freed once no other checkpoint names them).

        ``CheckpointNotFound`` if there is none; not raised when an earlier attempt of
        this same call may have deleted it before its answer was lost.
        """

        async def handle(resp: aiohttp.ClientResponse) -> None:
            await resp.read()

        try:
            await self._requests.call("DELETE", checkpoint_path(name), handle)
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
        """Poll ``status`` until ``name`` reaches ``state`` (``memory``, ``nvme``, ``cold``,
        or ``archived``: E19); ``WaitTimeout`` after ``timeout`` s.

        ``NvmeFull`` (or ``ColdFull``) instead, within a second or two, when a node's full
        disk tier keeps it from ``state`` (extension E16): waiting would not help."""
        if state != ARCHIVED:
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

    async def list(
        self, prefix: str = "", *, costs: bool = False, retention: bool = False
    ) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints whose names start with ``prefix``, sorted by name; with
        ``costs``, each with its ``CheckpointCosts`` (one catalogue snapshot and one question
        to the nodes for the whole listing, on the node's side); with ``retention``, each
        with its ``RetentionInfo`` (extension E20)."""
        params = [f"prefix={quote(prefix, safe='/')}"] if prefix else []
        if costs:
            params.append("costs")
        if retention:
            params.append("retention")
        query = "?" + "&".join(params) if params else ""

        async def handle(resp: aiohttp.ClientResponse) -> builtins.list[CheckpointInfo]:
            doc = await decoded(resp)
            try:
                return [
                    CheckpointInfo(
                        str(c["name"]),
                        float(c["created"]),
                        int(c["bytes"]),
                        str(c["state"]),
                        CheckpointCosts.from_wire(c["costs"]) if costs else None,
                        # a node without E20 (a rolling upgrade) leaves it out: not known
                        RetentionInfo.from_wire(c["retention"])
                        if retention and "retention" in c
                        else None,
                    )
                    for c in doc["checkpoints"]
                ]
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(message=f"malformed checkpoint list: {exc!r}") from exc

        return await self._requests.call("GET", f"/v1/checkpoints{query}", handle)
