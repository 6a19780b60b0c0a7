"""The client's request machinery: its HTTP session, what it knows of the nodes, and one
logical request with failover, retries and hedging (``Requests.call``).

``Requests`` holds the session and the state every request consults: the membership
(``GET /v1/cluster``), each node's base URL, the requests in flight per node (reads go
to the least loaded holder), the nodes suspected after a lost connection and those
ordered last after a missed deadline (``SlowNodes``). ``_Request`` is one call of
``Requests.call``: the attempts over its candidates, made and judged one step at a time.
The chunk sources (``storaged.client.sources``) and the write path make their requests
through it; ``Client`` owns one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
import msgpack

from storaged.client.deadlines import (
    PROGRESS_CAP,
    Deadlines,
    Progress,
    SlowNodes,
    set_attempt_progress,
)
from storaged.client.direct import NotHandled
from storaged.client.documents import ClientStats, ClusterInfo
from storaged.client.errors import (
    BadName,
    ChecksumMismatch,
    ConnectionFailed,
    NotStoraged,
    ProtocolError,
    StoragedError,
    Unavailable,
    decode_body,
    error_from_response,
    foreign_answer,
    is_api_content_type,
    is_retryable,
)
from storaged.client.pacing import OTHER, UploadWindow, outcome_of
from storaged.client.retry import RetryPolicy
from storaged.ids import is_checkpoint_name, is_chunk_id
from storaged.placement import rendezvous_order

# The client's one logger, as before these modules were split out of client.py.
log = logging.getLogger("storaged.client.client")

T = TypeVar("T")

MSGPACK: Final = "application/msgpack"

#: node base URL -> ((host, port), path prefix, request head lines), or None: not plain http
DirectTarget = tuple[tuple[str, int], str, str] | None


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One attempt of a logical request (``Requests.call``)."""

    node: str
    started: float
    #: may write into the caller's buffer (no other attempt that may was running)
    owns_out: bool
    #: started while another attempt still ran (a hedge or a failover beside a laggard)
    hedge: bool
    #: when its answer's bytes last arrived (noted by the body readers)
    progress: Progress


# Set in each attempt's own task: False when another attempt of the same request may be
# writing into the caller's buffer, so this one must read into a buffer of its own.
_OWNS_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("owns_out", default=True)


def owns_out() -> bool:
    """In an attempt of ``Requests.call``: whether it may write into the caller's buffer."""
    return _OWNS_OUT.get()


# --------------------------------------------------------------------------- helpers


def _without_hidden_resends(session: aiohttp.ClientSession) -> None:
    """Make ``session`` send each request once: ``call`` counts and retries sends itself.

    aiohttp resends a PUT or DELETE (and GET, HEAD: RFC 9112's idempotent methods) once,
    unseen, when the connection closes before the answer. A DELETE the node carried out
    before its answer was lost then comes back 404 to the call that deleted it, and
    ``call`` never learns that an attempt may have reached the node (``replayed``): the
    caller is told "no such checkpoint" and keeps believing in one that is gone. aiohttp
    has no public switch; its own ``test_utils`` sets this attribute, and
    ``tests/client/test_client_cluster.py`` fails if the resend comes back."""
    if not hasattr(session, "_retry_connection"):
        raise RuntimeError(
            "this aiohttp has no ClientSession._retry_connection: storaged's client cannot "
            "turn off its hidden resends (see storaged/client/request.py)"
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


def header_lines(headers: Mapping[str, str]) -> str:
    """``headers`` as HTTP/1.1 head lines; ``ValueError`` for a name or value that would
    break the head (a line break, or a name with a colon or space)."""
    lines = []
    for name, value in headers.items():
        if any(c in name for c in ":\r\n ") or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} cannot be sent")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


#: documents at least this long are decoded in a thread (a 1 MiB msgpack map takes a few ms)
_DECODE_IN_THREAD: Final = 1 << 20


async def decoded(resp: aiohttp.ClientResponse) -> Any:
    """The API document a response carries; ``NotStoraged`` when another server answered,
    ``ProtocolError`` for a malformed one."""
    raw = await resp.read()
    content_type = resp.headers.get("Content-Type")
    try:
        if len(raw) < _DECODE_IN_THREAD:
            return decode_body(raw, content_type)
        # a large manifest (a 405B model's: tens of ms of msgpack) is decoded off the loop
        return await asyncio.to_thread(decode_body, raw, content_type)
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


def document(doc: Any, what: str, required: tuple[str, ...]) -> dict[str, Any]:
    """``doc`` as a map with the ``required`` keys; ``ProtocolError`` otherwise."""
    if not isinstance(doc, dict) or any(key not in doc for key in required):
        raise ProtocolError(message=f"malformed {what} answer: {doc!r:.200}")
    return dict(doc)


def admin_headers(admin_token: str | None, headers: dict[str, str]) -> dict[str, str]:
    # Sent instead of the client token: admin endpoints refuse the client token.
    if admin_token is not None:
        headers["Authorization"] = f"Bearer {admin_token}"
    return headers


def checkpoint_path(name: str) -> str:
    """``/v1/checkpoints/{name}``; ``BadName`` (before any request) for an invalid name."""
    if not is_checkpoint_name(name):
        raise BadName(message=f"invalid checkpoint name {name!r}")
    return f"/v1/checkpoints/{name}"


def check_chunk_id(chunk_id: str) -> None:
    if not is_chunk_id(chunk_id):
        raise ValueError(f"not a chunk id: {chunk_id!r}")


def _mark(error: StoragedError, replayed: bool) -> StoragedError:
    error.replayed = replayed
    return error


# --------------------------------------------------------------------------- the nodes


class Requests:
    """The session and the knowledge of the nodes that one ``Client``'s requests share.

    ``seeds``: the base URLs the client was given; ``timeout`` bounds each attempt of the
    session it makes (``trace_configs`` go to that session too); ``stats`` is the client's.
    """

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        token: str | None,
        retry: RetryPolicy,
        deadlines: Deadlines,
        timeout: aiohttp.ClientTimeout,
        max_concurrency: int,
        suspect_seconds: float,
        refused_fails_fast: bool,
        stats: ClientStats,
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        self.seeds = list(seeds)
        self.token = token
        self.retry = retry
        self.deadlines = deadlines
        #: nodes that missed a deadline: asked last
        self.slow = SlowNodes(deadlines.slow_for)
        self.timeout = timeout
        #: bounds a direct GET as ``timeout`` bounds one through the session
        self.request_timeout = timeout.total
        self.max_concurrency = max_concurrency
        self.suspect_seconds = suspect_seconds
        self.refused_fails_fast = refused_fails_fast
        self.stats = stats
        self.trace_configs = tuple(trace_configs)
        self.session: aiohttp.ClientSession | None = None
        self.owns_session = True
        #: the headers every request carries (the session's own, or sent with each)
        self.base_headers: dict[str, str] = {}
        #: headers every request carries when the session is the caller's
        self.extra_headers: dict[str, str] = {}
        self.request_slots = asyncio.Semaphore(max_concurrency)
        #: how many bodies of ``paced`` requests go at once (``storaged.client.pacing``)
        self.upload_window = UploadWindow(max_concurrency, stats)
        self.cluster: ClusterInfo | None = None
        #: node id (or seed URL before the membership is known) -> base URL
        self.urls: dict[str, str] = {url: url for url in self.seeds}
        self.inflight: dict[str, int] = {}
        self.rotation = itertools.count()
        self.rng = random.Random()
        self._suspect_until: dict[str, float] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._last_refresh = 0.0
        self._direct_targets: dict[str, DirectTarget] = {}

    # ------------------------------------------------------------------ session

    def open_session(self, session: aiohttp.ClientSession | None) -> None:
        """Use ``session`` (the caller's) or make one, once."""
        # Chunk bytes are incompressible: ask for every body as it is.
        headers = {"Accept": MSGPACK, "Accept-Encoding": "identity"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        self.base_headers = headers
        if self.session is not None:
            return
        if session is not None:
            # A caller's session has its own defaults: ours go with every request.
            self.session, self.owns_session = session, False
            self.extra_headers = headers
        else:
            self.session = aiohttp.ClientSession(
                # Idle connections go before a node's own 15 s keep-alive closes them:
                # a request on one the node is closing fails (it is not resent unseen).
                # A hedge holds a connection beside the attempt it races.
                connector=aiohttp.TCPConnector(
                    limit=self.max_concurrency * (1 + self.deadlines.max_hedges) + 8,
                    keepalive_timeout=10.0,
                ),
                headers=headers,
                timeout=self.timeout,
                auto_decompress=False,
                trace_configs=list(self.trace_configs) or None,
            )
        _without_hidden_resends(self.session)

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh_task
            self._refresh_task = None
        if self.session is not None and self.owns_session:
            await self.session.close()
        self.session = None

    def known_cluster(self) -> ClusterInfo:
        """The membership as last learned; ``RuntimeError`` before the client opened."""
        if self.cluster is None:
            raise RuntimeError("client is not open")
        return self.cluster

    def _cluster_candidates(self) -> list[str]:
        known = [node.id for node in self.cluster.live] if self.cluster else []
        return list(dict.fromkeys([*known, *self.seeds]))

    async def refresh_cluster(self, *, background: bool = False) -> ClusterInfo:
        """Ask ``GET /v1/cluster`` again (known live nodes first, then the seed URLs)."""

        async def handle(resp: aiohttp.ClientResponse) -> ClusterInfo:
            return ClusterInfo.from_wire(await decoded(resp))

        info = await self.call(
            "GET",
            "/v1/cluster",
            handle,
            candidates=self._cluster_candidates(),
            background=background,
        )
        self.cluster = info
        self._last_refresh = time.monotonic()
        for node in info.nodes:
            self.urls[node.id] = node.url
        return info

    async def admin(
        self,
        method: str,
        path: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        doc: Mapping[str, Any],
        admin_token: str | None,
    ) -> T:
        """An admin request whose body is ``doc`` in msgpack, sent with ``admin_token``
        instead of the client token (``admin_headers``)."""
        payload: bytes = msgpack.packb(doc)
        return await self.call(
            method,
            path,
            handle,
            body=lambda: payload,
            headers=admin_headers(admin_token, {"Content-Type": MSGPACK}),
        )

    async def cluster_document(self) -> dict[str, Any]:
        """``GET /v1/cluster`` as the node sent it; also refreshes ``cluster``."""

        async def handle(resp: aiohttp.ClientResponse) -> dict[str, Any]:
            doc = await decoded(resp)
            self.cluster = ClusterInfo.from_wire(doc)
            return dict(doc)

        return await self.call("GET", "/v1/cluster", handle, candidates=self._cluster_candidates())

    # ------------------------------------------------------------------ nodes

    def placement(self, chunk_id: str) -> list[str]:
        """Live node ids in rendezvous order for ``chunk_id`` (the first holds the hot copy)."""
        return rendezvous_order(chunk_id, [node.id for node in self.known_cluster().live])

    def url(self, node: str, path_query: str) -> str:
        try:
            return self.urls[node] + path_query
        except KeyError:
            raise Unavailable(message=f"no URL known for node {node!r}") from None

    def learn_url(self, node: str, url: str) -> None:
        """A node's URL, as a plan or a holder names it (the membership's stays)."""
        self.urls.setdefault(node, url.rstrip("/"))

    def by_load(self, nodes: Sequence[str]) -> list[str]:
        """``nodes`` least in-flight first; ties rotate so that idle nodes share the load."""
        if not nodes:
            return []
        shift = next(self.rotation) % len(nodes)
        rotated = [*nodes[shift:], *nodes[:shift]]
        return sorted(rotated, key=lambda node: self.inflight.get(node, 0))

    def any_nodes(self) -> list[str]:
        cluster = self.known_cluster()
        live = [node.id for node in cluster.live]
        rest = [node.id for node in cluster.nodes if not node.alive]
        return [*self.by_load(live), *rest]

    def suspected(self, node: str, now: float) -> bool:
        return self._suspect_until.get(node, 0.0) > now

    def suspect(self, node: str) -> None:
        self._suspect_until[node] = time.monotonic() + self.suspect_seconds
        self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        if self.session is None or (self._refresh_task and not self._refresh_task.done()):
            return
        if time.monotonic() - self._last_refresh < 1.0:
            return

        async def refresh() -> None:
            try:
                await self.refresh_cluster(background=True)
            except StoragedError as exc:
                log.debug("cluster refresh failed: %s", exc)

        self._refresh_task = asyncio.get_running_loop().create_task(refresh())

    def direct_target(self, node: str) -> DirectTarget:
        """Where a direct GET to ``node`` goes: address, path prefix and the head lines
        every request carries (Host, ours); None for a node the direct path does not reach."""
        base = self.urls.get(node)
        if base is None:
            return None
        try:
            return self._direct_targets[base]
        except KeyError:
            pass
        target: DirectTarget = None
        parts = urlsplit(base)
        if parts.scheme == "http" and parts.hostname and "@" not in parts.netloc:
            port = parts.port or 80
            lines = header_lines({"Host": parts.netloc, **self.base_headers})
            target = ((parts.hostname, port), parts.path.rstrip("/"), lines)
        self._direct_targets[base] = target
        return target

    # ------------------------------------------------------------------ requests

    async def call(
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
        paced: bool = False,
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
        ``observe`` gets the answer taken and the seconds its attempt took (a hedge that
        won: since the first attempt started). A ``paced`` request's attempts also take
        room in the upload window (``storaged.client.pacing``; chunk uploads).
        """
        session = self.session
        if session is None:
            raise RuntimeError("client is not open")
        if hedge_after == "metadata":
            deadline = self.deadlines.metadata if method in ("GET", "HEAD") else None
        else:
            deadline = hedge_after
        request = _Request(
            self,
            session,
            _Send(method, path_query, handle, body, headers, direct),
            list(candidates) if candidates is not None else self.any_nodes(),
            balance=balance,
            next_node_on=next_node_on,
            limit=self.retry.max_attempts if max_attempts is None else max_attempts,
            background=background,
            deadline=deadline,
            accept=accept,
            observe=observe,
            paced=paced,
        )
        return await request.run()


@dataclass(frozen=True, slots=True)
class _Send(Generic[T]):
    """What each attempt of a request sends, and how its answer is read."""

    method: str
    path_query: str
    handle: Callable[[aiohttp.ClientResponse], Awaitable[T]]
    body: Callable[[], Any] | None
    headers: Mapping[str, str] | None
    direct: Callable[[str], Awaitable[T]] | None


class _Request(Generic[T]):
    """One logical request of ``Requests.call``: its attempts, made and judged in turn."""

    def __init__(
        self,
        requests: Requests,
        session: aiohttp.ClientSession,
        send: _Send[T],
        given: list[str],
        *,
        balance: int,
        next_node_on: tuple[type[StoragedError], ...],
        limit: int,
        background: bool,
        deadline: float | None,
        accept: Callable[[T], Awaitable[None]] | None,
        observe: Callable[[T, float], None] | None,
        paced: bool = False,
    ) -> None:
        self.requests, self.session, self.send = requests, session, send
        self.window = requests.upload_window if paced else None
        self.started = time.monotonic()
        self.given = given
        self.interchangeable = set(given[:balance])
        self.order, self.balance = self.arranged()
        if not self.order:
            raise Unavailable(message="no node to send the request to")
        self.next_node_on, self.limit, self.background = next_node_on, limit, background
        self.deadline, self.accept, self.observe = deadline, accept, observe
        self.max_hedges = requests.deadlines.max_hedges if deadline is not None else 0
        self.attempts = 0
        #: when the first attempt started (its request slot taken)
        self.first_started = self.started
        self.position = 0
        self.lost_in_a_row = 0
        self.refused_in_a_row = 0
        self.replayed = False
        self.refused_by: list[StoragedError] = []
        self.running: dict[asyncio.Future[T], _Attempt] = {}
        self.hedges = 0
        self.start_next = True
        self.retry_at: float | None = None
        #: to raise once the attempts still running have failed too
        self.final: StoragedError | None = None

    def arranged(self) -> tuple[list[str], int]:
        """The candidates, fine ones first, then suspected, then slow ones; and the
        interchangeable head left at the front."""
        now = time.monotonic()
        slow, suspected = self.requests.slow, self.requests.suspected
        fine = [n for n in self.given if n not in slow and not suspected(n, now)]
        doubted = [n for n in self.given if n not in slow and suspected(n, now)]
        order = [*fine, *doubted, *(n for n in self.given if n in slow)]
        return order, len(self.interchangeable & set(fine))

    async def run(self) -> T:
        try:
            while True:
                if self.start_next and self.final is None and len(self.running) <= self.max_hedges:
                    await self._start_attempt()
                if not self.running:
                    assert self.final is not None
                    raise _mark(self.final, self.replayed) from self.final.__cause__
                done, _ = await asyncio.wait(
                    self.running, timeout=self._hedge_timeout(), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    # Unless bytes that arrived meanwhile put it off (a timer may wake a
                    # hair early: under a millisecond left counts as due).
                    if (self._hedge_timeout() or 0.0) < 1e-3:
                        self._hedge()
                    continue
                finished = next(iter(done))  # the others that are done come next round
                this = self.running.pop(finished)
                error: StoragedError | None
                try:
                    result = finished.result()
                    if self.accept is not None and (self.hedges or self.running):
                        await self.accept(result)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    error = self._lost(this.node, exc)
                except StoragedError as exc:
                    error = self._refused(this.node, exc)
                else:
                    return self._taken(this, result)
                if error is not None:
                    self._failed(error)
        finally:
            for pending in self.running:
                pending.cancel()
            if self.running:
                # Cancelled attempts close their connections and stop writing into any
                # buffer before the caller may reuse it.
                await asyncio.gather(*self.running, return_exceptions=True)

    async def _start_attempt(self) -> None:
        """Start an attempt on the next candidate (in a request slot unless it is a hedge)."""
        self.start_next = False
        slots = self.requests.request_slots
        slot = not self.running
        window = self.window if slot else None
        episode = 0
        if slot:
            if self.retry_at is not None:
                await asyncio.sleep(max(0.0, self.retry_at - time.monotonic()))
                self.retry_at = None
                self.lost_in_a_row = 0
            if window is not None:
                episode = await window.acquire()
            try:
                await slots.acquire()
            except BaseException:
                if window is not None:
                    window.release(episode, OTHER)
                raise
            if self.attempts == 0:
                # Waiting for the slot, other requests may have found a node
                # slow or gone: the order is made now, not when this was asked.
                self.order, self.balance = self.arranged()
        try:
            node = self._next_node()
            owns = not any(a.owns_out for a in self.running.values())
            progress = Progress()
            task = asyncio.ensure_future(self._attempt(node, owns, progress))
        except BaseException:
            if slot:
                slots.release()
            if window is not None:
                window.release(episode, OTHER)
            raise
        if slot:
            task.add_done_callback(lambda _: slots.release())
        if window is not None:
            task.add_done_callback(lambda done: window.release(episode, outcome_of(done)))
        now = time.monotonic()
        self.running[task] = _Attempt(node, now, owns, not slot, progress)
        if not self.attempts:
            self.first_started = now
        self.attempts += 1
        if self.background:
            self.requests.stats.background_requests += 1
        else:
            self.requests.stats.requests += 1

    def _next_node(self) -> str:
        order, balance = self.order, self.balance
        if self.position == 0 and balance > 1 and not self.running:
            # Rotate, then a stable sort by load: equally loaded holders take
            # turns instead of the first one always winning the tie.
            inflight = self.requests.inflight
            shift = next(self.requests.rotation) % balance
            head = [*order[shift:balance], *order[:shift]]
            head.sort(key=lambda n: inflight.get(n, 0))
            order[:balance] = head
        busy = {a.node for a in self.running.values()}
        for _ in range(len(order)):
            if order[self.position % len(order)] not in busy:
                break
            self.position += 1
        return order[self.position % len(order)]

    async def _attempt(self, node: str, owns: bool, progress: Progress) -> T:
        _OWNS_OUT.set(owns)  # this task's context only
        set_attempt_progress(progress)
        send, inflight = self.send, self.requests.inflight
        extra = self.requests.extra_headers
        inflight[node] = inflight.get(node, 0) + 1
        try:
            if send.direct is not None:
                try:
                    return await send.direct(node)
                except NotHandled:
                    pass
            async with self.session.request(
                send.method,
                self.requests.url(node, send.path_query),
                data=send.body() if send.body is not None else None,
                headers={**extra, **(send.headers or {})} if extra else send.headers,
            ) as resp:
                if resp.status >= 400:
                    error = error_from_response(
                        resp.status,
                        await resp.read(),
                        resp.headers.get("Content-Type"),
                        resp.headers.get("Retry-After"),
                    )
                    if resp.status == 408:
                        # The node refused a body too slow for it: the rest of it would
                        # only be read to be thrown away, over the link that is too slow
                        # already. Closing the connection stops its upload.
                        resp.close()
                    raise error
                return await send.handle(resp)
        finally:
            inflight[node] -= 1

    def _hedge_timeout(self) -> float | None:
        """How long to wait for an answer before hedging; None: wait for one."""
        if (
            self.deadline is None
            or self.hedges >= self.max_hedges
            or self.final is not None
            or len({a.node for a in self.running.values()}) >= len(self.order)
        ):
            return None
        newest = max(a.started for a in self.running.values())
        due = newest + self.deadline
        arrived = [a.progress.last for a in self.running.values() if a.progress.last]
        if arrived:
            # Bytes still arriving: no hedge while they do (within read_floor), up to
            # PROGRESS_CAP deadlines (module docstring of storaged.client.deadlines).
            still = max(arrived) + self.requests.deadlines.read_floor
            due = max(due, min(still, newest + PROGRESS_CAP * self.deadline))
        return max(0.0, due - time.monotonic())

    def _hedge(self) -> None:
        """No answer within the deadline: mark the late nodes slow, ask the next one too."""
        assert self.deadline is not None
        late = time.monotonic() - self.deadline
        slow = self.requests.slow
        for each in self.running.values():
            if each.started <= late and each.node not in slow:
                log.info(
                    "%s %s: no answer from %s in %.1f s, asking another node too",
                    self.send.method,
                    self.send.path_query,
                    each.node,
                    self.deadline,
                )
                slow.mark(each.node)
        self.hedges += 1
        if not self.background:
            self.requests.stats.hedges += 1
        self.position += 1
        self.start_next = True

    def _taken(self, this: _Attempt, result: T) -> T:
        if self.hedges and this.hedge:
            self.requests.stats.hedge_wins += not self.background
        if self.observe is not None:
            # A hedge that wins ran for less time than the read took: timed from its own
            # start, the reads measured would look faster than they are and the deadlines
            # would tighten at each win, hedging more (on a saturated link, most reads).
            # So a raced answer is timed from the request's first attempt.
            since = self.first_started if this.hedge else this.started
            self.observe(result, time.monotonic() - since)
        return result

    def _fail(self, error: StoragedError) -> None:
        """Raise ``error`` now, or once the attempts still running have failed too."""
        if not self.running:
            raise _mark(error, self.replayed) from error.__cause__
        self.final = error

    def _may_retry(self) -> bool:
        return (
            self.attempts < self.limit
            and time.monotonic() - self.started < self.requests.retry.deadline
        )

    def _lost(self, node: str, exc: BaseException) -> StoragedError | None:
        """A lost connection or timeout: the error to judge further, or None when the
        next attempt is decided already."""
        method = self.send.method
        error = ConnectionFailed(
            message=f"{method} {self.send.path_query} on {node}: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        self.requests.suspect(node)
        self.replayed = self.replayed or method != "GET"
        self.lost_in_a_row += 1
        self.refused_in_a_row = self.refused_in_a_row + 1 if _refused(exc) else 0
        self.position += 1
        if not self.background:
            self.requests.stats.failovers += 1
        if self.requests.refused_fails_fast and self.refused_in_a_row >= len(self.order):
            # nothing listens at any of them (a command's typo, a stopped
            # cluster): say so now rather than after the backoff of a restart
            self._fail(error)
            return None
        if self.lost_in_a_row < len(self.order) and self._may_retry():
            self.start_next = True  # an untried node remains: no need to wait
            return None
        return error

    def _refused(self, node: str, exc: StoragedError) -> StoragedError | None:
        """An error answer: the error to judge further, or None when the next attempt is
        decided already."""
        self.lost_in_a_row = self.refused_in_a_row = 0
        if self.send.method != "GET" and exc.status == 503:
            # A refused write may have been partly carried out (a delete's
            # tombstone on some nodes): what a retry answers may reflect it.
            self.replayed = True
        if isinstance(exc, ChecksumMismatch):
            self.requests.slow.mark(node)  # wrong bytes: ask it last from now on
        if isinstance(exc, self.next_node_on):
            self.refused_by.append(exc)
            self.position += 1
            if len(self.refused_by) < len(self.order):
                self.start_next = True
                return None
            self._fail(exc)
            return None
        if not is_retryable(exc):
            raise _mark(exc, self.replayed) from None
        if exc.status in (502, 504):
            self.position += 1  # a proxy failure: another entry node may fare better
        return exc

    def _failed(self, error: StoragedError) -> None:
        """After a failed attempt: give up, wait for the others, or retry after a pause."""
        if not self._may_retry():
            if self.refused_by and isinstance(error, ConnectionFailed):
                # Some nodes answered "not here" and the others were unreachable:
                # the answer we got is more telling than the lost connection.
                self._fail(self.refused_by[-1])
            else:
                self._fail(error)
            return
        if self.running:
            return  # an attempt still runs: it may yet answer
        if not self.background:
            self.requests.stats.retries += 1
        policy = self.requests.retry
        self.retry_at = time.monotonic() + policy.delay(
            self.attempts, error.retry_after, self.requests.rng
        )
        self.start_next = True
