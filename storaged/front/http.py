"""The HTTP API of API.md on aiohttp: routes translate requests into ``Node`` calls.

Domain errors (``storaged.errors.StoragedError``) and the HTTP layer's own ``ApiError``
are turned into responses in one middleware, which alone picks the status. Documents are
JSON unless the request's ``Accept`` asks for msgpack (docs/API.md): ``curl`` gets
something it can print.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgpack
from aiohttp import web

from storaged import __version__
from storaged.coord.catalogue import CatalogueUnavailable, CoordinatorUnavailable
from storaged.errors import (
    ApiError,
    BadInput,
    Conflict,
    InsufficientStorage,
    NotFound,
    StoragedError,
    TooLarge,
    Unavailable,
    bad_request,
    unavailable,
)
from storaged.front.shm import ShmListener, socket_path
from storaged.ids import is_checkpoint_name, is_chunk_id
from storaged.manifest import check_manifest, decode_document
from storaged.node import Node
from storaged.node.archive import LISTING_DEADLINE, is_archived_record
from storaged.retention import PolicyError, parse_rules
from storaged.wire import STATES, ErrorCode, state_name
from tiers import ByteRange, ChunkNotFound

log = logging.getLogger("storaged.http")

NODE: web.AppKey[Node] = web.AppKey("node", Node)
#: PUTs in flight per client address (each holds a RAM reservation on up to 3 nodes)
PUTS_BY_CLIENT: web.AppKey[dict[str, int]] = web.AppKey("puts_by_client", dict)
#: request bodies being decoded at once: each may take up to max_manifest_objects of RAM
DECODES: web.AppKey[asyncio.Semaphore] = web.AppKey("decodes", asyncio.Semaphore)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
#: the most a msgpack or JSON chunk id takes in a /missing body (66 bytes in msgpack, up to
#: 68 in JSON with a separator and a space): the body cap is this times max_missing_ids
_MISSING_ID_BYTES = 72
#: decodes of request documents at once (one per core of a small node)
_MAX_DECODES = 2


# ---- encoding -------------------------------------------------------------------------------
def _accepted(accept: str) -> dict[str, tuple[float, int]]:
    """Media types named in an ``Accept`` header: (q, position) each."""
    named: dict[str, tuple[float, int]] = {}
    for position, entry in enumerate(accept.split(",")):
        media, *params = (part.strip() for part in entry.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        named.setdefault(media.lower(), (q, position))
    return named


def wants_msgpack(request: web.Request) -> bool:
    """msgpack only when ``Accept`` names ``application/msgpack`` and prefers it to JSON
    (a higher q, or the same q listed first); wildcards and no header get JSON."""
    named = _accepted(request.headers.get("Accept", ""))
    q_msgpack, at_msgpack = named.get("application/msgpack", (0.0, 0))
    if q_msgpack <= 0:
        return False
    q_json, at_json = named.get("application/json", (0.0, 0))
    return q_msgpack > q_json or (q_msgpack == q_json and at_msgpack < at_json)


def _json_or_none(body: Any) -> bytes | None:
    try:
        return json.dumps(body, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError):
        return None


def reply(
    request: web.Request, body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """``body`` as JSON, or msgpack when the client asks for it. A document JSON cannot
    carry (binary or NaN values in a manifest's meta) goes as msgpack, its Content-Type
    saying so, rather than altered."""
    encoded = None if wants_msgpack(request) else _json_or_none(body)
    if encoded is not None:
        return web.Response(
            body=encoded, status=status, content_type="application/json", headers=headers
        )
    return web.Response(
        body=msgpack.packb(body, use_bin_type=True),
        status=status,
        content_type="application/msgpack",
        headers=headers,
    )


async def read_document(request: web.Request, max_size: int, *, code: str = "bad_request") -> Any:
    """A msgpack (or JSON) request body, size-capped while it streams in, decoded in a
    thread within ``max_manifest_objects`` objects. 413 ``too_large`` over a bound, 400
    ``code`` when it does not decode."""
    if request.content_length is not None and request.content_length > max_size:
        raise ApiError(413, "too_large", f"body over {max_size} bytes")
    body = bytearray()
    async for piece in request.content.iter_any():
        body += piece
        if len(body) > max_size:
            raise ApiError(413, "too_large", f"body over {max_size} bytes")
    ctype = request.headers.get("Content-Type", "application/msgpack").split(";")[0].strip()
    # A large document takes a second to decode: off the loop, and few at a time, since
    # each may expand to max_manifest_objects objects in RAM.
    async with request.app[DECODES]:
        return await asyncio.to_thread(
            decode_document,
            bytes(body),
            ctype.lower(),
            max_size,
            max_objects=request.app[NODE].config.max_manifest_objects,
            code=code,
        )


# ---- middleware -----------------------------------------------------------------------------
_STATUS_CODES = {
    400: ErrorCode.BAD_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    411: ErrorCode.LENGTH_REQUIRED,
    413: ErrorCode.TOO_LARGE,
}


#: the HTTP status of each kind of domain error (the one place that decides it)
_DOMAIN_STATUS: tuple[tuple[type[StoragedError], int], ...] = (
    (BadInput, 400),
    (NotFound, 404),
    (Conflict, 409),
    (TooLarge, 413),
    (Unavailable, 503),
    # 507 and not 503: a full disk is not backpressure that passes with a retry (E16)
    (InsufficientStorage, 507),
)


def http_error(exc: StoragedError) -> ApiError:
    """The response a domain error gets: its kind's status, Retry-After when it has one."""
    status = next((s for kind, s in _DOMAIN_STATUS if isinstance(exc, kind)), 500)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return ApiError(status, exc.code, exc.message, headers=headers, **exc.extra)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app[NODE]
    try:
        return await handler(request)
    except (ApiError, StoragedError) as caught:
        exc = http_error(caught) if isinstance(caught, StoragedError) else caught
        node.metrics.errors.labels(exc.code).inc()
        response = reply(request, exc.body(), exc.status, exc.headers)
        if exc.status == 408:
            # The body is too slow: the connection is not kept for another request
            # (RFC 9110 §15.5.9). aiohttp still reads and drops what comes of the body for
            # up to its lingering time before it closes (a close with unread bytes would
            # reset the connection, and the answer could be lost); our client closes the
            # connection on a 408 and sends the chunk again on a new one.
            response.force_close()
        return response
    except CatalogueUnavailable as caught:
        # A handler that did not map it itself (etcd out of reach, a leader change): the
        # client's to retry, like any 503, not an internal error with a traceback.
        code = (
            "coordinator_unavailable"
            if isinstance(caught, CoordinatorUnavailable)
            else ("catalogue_unavailable")
        )
        node.metrics.errors.labels(code).inc()
        return reply(request, {"error": code, "message": str(caught)}, 503, {"Retry-After": "1"})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _STATUS_CODES.get(exc.status, ErrorCode.ERROR)
        node.metrics.errors.labels(code).inc()
        return reply(request, {"error": code, "message": exc.reason}, exc.status)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if node.stopping:
            # A graceful stop closes the tiers and peer links while the HTTP site still
            # answers (serve() stops it last): what fails then is the stop, not a defect.
            log.warning(
                "%s %s failed while stopping: %s: %s", request.method, request.path,
                type(exc).__name__, exc,
            )  # fmt: skip
            return _stopping_reply(request, node)
        log.exception("internal error on %s %s", request.method, request.path)
        node.metrics.errors.labels("internal").inc()
        return reply(request, {"error": "internal", "message": f"{type(exc).__name__}"}, 500)


def _stopping_reply(request: web.Request, node: Node) -> web.Response:
    """503 ``shutting_down`` with ``Retry-After`` (docs/API.md E9)."""
    exc = http_error(
        unavailable("shutting_down", f"node {node.id} is stopping: ask another node", 1.0)
    )
    node.metrics.errors.labels(exc.code).inc()
    return reply(request, exc.body(), exc.status, exc.headers)


def _not_held(node: Node, chunk_id: str) -> Exception:
    """What a read that found no source answers: 404 ``chunk_not_found``, or, on a node
    that is stopping (its peer links close under it, so "no one has it" is no proof),
    503 ``shutting_down``."""
    if node.stopping:
        return unavailable("shutting_down", f"node {node.id} is stopping: ask another node", 1.0)
    return ApiError(404, "chunk_not_found", f"chunk {chunk_id} is not held by the cluster")


def _bearer_is(given: str, token: str) -> bool:
    # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: turn them
    # back into the bytes sent (a strict encode would raise, and a raise here was a 500).
    try:
        raw = given.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, f"Bearer {token}".encode())


def _admin_path(path: str) -> bool:
    """Endpoints that need the admin token: ``/v1/admin/...`` and a node's drain."""
    return path.startswith(("/v1/admin/", "/v1/nodes/"))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client endpoints need the client token (when one is set); ``/v1/admin/`` and
    ``/v1/nodes/`` need the admin token, and are closed when a client token is set without
    an admin token (a cluster with no token at all is open). The admin token also opens
    client endpoints."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    cfg = request.app[NODE].config
    given = request.headers.get("Authorization", "")
    admin = bool(cfg.admin_token) and _bearer_is(given, cfg.admin_token)
    if not (admin or not cfg.token or _bearer_is(given, cfg.token)):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token")
    if _admin_path(request.path) and not admin:
        if cfg.admin_token and not cfg.token:
            raise ApiError(401, "unauthorized", "admin endpoints need the admin token")
        if cfg.admin_token:
            raise ApiError(403, "forbidden", "admin endpoints need the admin token")
        if cfg.token:
            raise ApiError(
                403,
                "forbidden",
                "no admin token is configured: admin endpoints are closed (set [auth] "
                "admin_token, or admin_token_env, in the cluster file and restart the nodes)",
            )
    return await handler(request)


# ---- chunks ---------------------------------------------------------------------------------
def _chunk_id(request: web.Request) -> str:
    cid = request.match_info["id"]
    if not is_chunk_id(cid):
        raise ApiError(400, "bad_chunk_id", "a chunk id is 64 lowercase hex characters (BLAKE3)")
    return cid


def body_budget(size: int, min_rate: int, min_time: float) -> float:
    """Seconds a PUT body of ``size`` bytes may spend arriving (body_min_rate/_time)."""
    return max(min_time, size / min_rate)


async def _body_pieces(
    request: web.Request, size: int, stall_timeout: float, budget: float
) -> AsyncIterator[bytes]:
    """The body as the transport delivers it. Each wait for bytes is bounded by
    ``stall_timeout``, and all of them together by ``budget`` seconds: a body that
    trickles in just under the stall timeout would otherwise hold its RAM reservation
    (on every replica holder) for as long as it likes. Past the budget: 408 body_too_slow
    (a client may send it again: on a congested link the next try may fare better).
    Only the waits for the client count, not the time the consumer (peers) takes."""
    remaining = size
    loop = asyncio.get_running_loop()
    left = budget
    try:
        # One timeout for the whole body, re-armed before each read (cheaper than a new
        # one per piece) and disarmed while the consumer works on a piece.
        async with asyncio.timeout(None) as stall:
            while remaining > 0:
                waited_from = loop.time()
                stall.reschedule(waited_from + min(stall_timeout, left))
                try:
                    # readchunk hands over one buffered piece as is; readany() would join.
                    data, _ = await request.content.readchunk()
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                except Exception as exc:  # aiohttp's payload errors on a broken connection
                    log.info("PUT body broke off: %s", exc)
                    return
                stall.reschedule(None)
                left -= loop.time() - waited_from
                if not data:
                    return
                remaining -= len(data)
                yield data
    except TimeoutError:
        if left > stall_timeout:
            log.info("PUT body stalled for %.1f s: abandoned", stall_timeout)
            return
        log.info("PUT body too slow (%d of %d bytes in %.1f s): abandoned",
                 size - remaining, size, budget)  # fmt: skip
        raise ApiError(
            408,
            "body_too_slow",
            f"body too slow: {size - remaining} of {size} bytes in {budget:.1f} s "
            "(the node's body_min_rate); nothing was stored: send it again",
            headers={"Retry-After": str(_rest_seconds(size, remaining, budget))},
        ) from None


def _rest_seconds(size: int, remaining: int, budget: float) -> int:
    """The ``Retry-After`` of a 408 body_too_slow: what the rest of the body would have
    taken at the rate it came (at most the budget, at least 1 s). The client closes the
    connection on a 408, so the rest is not sent; waiting that long leaves the link to the
    bodies sharing it, as sending the rest would have, instead of starting the whole body
    again at once beside them (which measured slower on a link with more bodies in flight
    than it carries within the budget: docs/BENCHMARKS.md, the fabric)."""
    received = size - remaining
    rest = budget if received <= 0 else remaining * budget / received
    return max(1, math.ceil(min(rest, budget)))


@contextlib.contextmanager
def _put_slot(request: web.Request) -> Iterator[None]:
    """Count the PUT against its client address; 503 too_many_puts over max_client_puts.

    An address, not a connection: HTTP/1.1 carries one request at a time per connection,
    so a client holding many reservations does it over many connections."""
    puts = request.app[PUTS_BY_CLIENT]
    client = request.remote or "?"
    cap = request.app[NODE].config.max_client_puts
    if puts.get(client, 0) >= cap:
        raise unavailable(
            "too_many_puts",
            f"{cap} PUTs of this client are in flight already (max_client_puts)",
            retry_after=1.0,
        )
    puts[client] = puts.get(client, 0) + 1
    try:
        yield
    finally:
        puts[client] -= 1
        if not puts[client]:
            del puts[client]


async def put_chunk(request: web.Request) -> web.Response:
    node = request.app[NODE]
    cid = _chunk_id(request)
    size = request.content_length
    if size is None:
        raise ApiError(411, "length_required", "PUT of a chunk needs a Content-Length")
    if size > node.config.max_chunk_size:
        raise ApiError(
            413,
            "too_large",
            f"{size} bytes is over the max chunk size {node.config.max_chunk_size}",
        )
    cfg = node.config
    budget = body_budget(size, cfg.body_min_rate, cfg.body_min_time)
    with _put_slot(request):
        status, body = await node.put_chunk(
            cid, size, _body_pieces(request, size, cfg.body_timeout, budget)
        )
    return reply(request, body, status)


def _parse_range(header: str, size: int) -> ByteRange:
    m = _RANGE_RE.match(header.strip())
    if not m or (m.group(1) == "" and m.group(2) == ""):
        raise ApiError(416, "bad_range", f"unsupported Range {header!r} (one bytes=a-b range)")
    first, last = m.group(1), m.group(2)
    if first == "":
        n = int(last)
        if n == 0:
            raise ApiError(416, "bad_range", "empty suffix range")
        return ByteRange(max(0, size - n), size)
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if start >= size or (last != "" and int(last) < start):
        raise ApiError(
            416,
            "bad_range",
            f"range {header!r} outside the chunk of {size} bytes",
            size=size,
        )
    return ByteRange(start, end)


# loadtest.harness.response_node replaces this function in its own node processes to
# measure the old path (web.Response): handlers call it by its module-level name.
async def _send_body(
    request: web.Request, body: memoryview, status: int, headers: dict[str, str]
) -> web.StreamResponse:
    """Send ``body`` with status and headers as ``web.Response(body=...)`` would, without
    copying it: ``web.Response`` hands the head and body to aiohttp's ``_writelines``,
    which on Python < 3.12.9 joins them into one new bytes object (a copy of the whole
    chunk, plus its allocation's page faults, per GET). Here the head goes out on
    ``prepare`` (a small write of its own) and the body as the view itself, which uvloop
    sends without a copy and keeps (still not a copy) for what the socket does not take at
    once: the memory tier's ``get`` detaches the buffer for that reason."""
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_type = "application/octet-stream"
    resp.content_length = len(body)
    try:
        await resp.prepare(request)
        if body:
            await resp.write(body)
        await resp.write_eof()
    except ConnectionError:
        # The client went away before or during the body: nothing left to answer (not an
        # internal error). aiohttp's own write_eof after the handler meets the closed
        # transport and drops the connection, as it did for a web.Response.
        pass
    return resp


async def get_chunk(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    cid = _chunk_id(request)
    try:
        data, tier = await node.read_chunk(cid)
    except ChunkNotFound as exc:
        raise _not_held(node, cid) from exc
    size = len(data)
    headers = {"X-Storaged-Tier": tier, "Accept-Ranges": "bytes"}
    range_header = request.headers.get("Range")
    status, start, end = 200, 0, size
    if range_header is not None:
        try:
            rng = _parse_range(range_header, size)
        except ApiError as exc:
            exc.headers["Content-Range"] = f"bytes */{size}"
            raise
        start, end = rng.resolve(size)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        status = 206
    node.metrics.restore_bytes.labels(tier).inc(end - start)
    body = memoryview(data)[start:end]
    return await _send_body(request, body, status, headers)


async def get_fragment(request: web.Request) -> web.StreamResponse:
    """Extension E12 (docs/API.md): fragment ``index`` of a chunk, from this node only (a
    client that decodes a cold chunk itself asks each fragment's holder, as ``?plan``
    names it; a node that does not hold it says so rather than fetching it elsewhere)."""
    node = request.app[NODE]
    cid = _chunk_id(request)
    raw = request.match_info["index"]
    if not raw.isascii() or not raw.isdigit() or (len(raw) > 1 and raw[0] == "0"):
        raise bad_request(f"fragment index {raw!r} is not a number")
    index = int(raw)
    if index >= node.config.n:
        raise bad_request(f"fragment index {index} out of range for n={node.config.n}")
    try:
        data = await node.read_fragment(cid, index)
    except ChunkNotFound as exc:
        raise ApiError(
            404, "fragment_not_found", f"fragment {index} of {cid} is not held by this node"
        ) from exc
    node.metrics.restore_bytes.labels("fragment").inc(len(data))
    return await _send_body(request, data, 200, {"X-Storaged-Tier": "cold"})


async def head_chunk(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    cid = _chunk_id(request)
    states = await node.chunk_states([cid])
    if cid not in states:
        raise _not_held(node, cid)
    state, size = states[cid]
    if node.memory_has(cid):
        tier = "memory"
    elif node.nvme_has(cid):
        tier = "nvme"
    else:
        held = (await node.holdings(node.placement().alive, [cid]))[cid]
        tier = "cold"
        if any(h.memory for h in held):
            tier = "memory"
        elif any(h.nvme for h in held):
            tier = "nvme"
    if size < 0:
        try:
            data, _ = await node.read_chunk(cid)
        except ChunkNotFound as exc:
            # Held when asked, gone when read (collected, dropped, a wiped disk).
            raise _not_held(node, cid) from exc
        size = len(data)
    return web.Response(
        status=200,
        headers={
            "X-Storaged-Tier": tier,
            "X-Storaged-State": state_name(state),
            "Accept-Ranges": "bytes",
            "Content-Length": str(size),
        },
    )


async def missing_chunks(request: web.Request) -> web.Response:
    node = request.app[NODE]
    # Its body is only ids: a cap of its own, far below a manifest's.
    max_ids = node.config.max_missing_ids
    doc = await read_document(request, max_ids * _MISSING_ID_BYTES + 64)
    ids = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not all(is_chunk_id(c) for c in ids):
        raise bad_request('body must be {"chunks": [chunk id, ...]}')
    if len(ids) > max_ids:
        raise ApiError(413, "too_large", f"over {max_ids} ids (max_missing_ids)")
    return reply(request, {"missing": await node.missing(ids)})


# ---- checkpoints ----------------------------------------------------------------------------
def _name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not is_checkpoint_name(name):
        raise ApiError(400, "bad_name", f"{name!r} is not a valid checkpoint name")
    return name


async def put_checkpoint(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = _name(request)
    cfg = node.config
    doc = await read_document(request, cfg.max_manifest_size, code="bad_manifest")
    # Validation hashes and walks the whole manifest: keep it off the loop.
    checked = await asyncio.to_thread(
        check_manifest, doc, cfg.max_chunk_size, max_items_per_key=cfg.max_items_per_key
    )
    status, body = await node.commit(name, checked)
    return reply(request, body, status)


#: on an answer about a checkpoint the catalogue does not know but the archive does (E19)
_FROM_ARCHIVE = {"X-Storaged-Source": "archive"}


async def get_checkpoint(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    name = _name(request)
    if "status" in request.query:
        status = await node.checkpoint_status(name)
        source = _FROM_ARCHIVE if status.get("source") == "archive" else None
        return reply(request, status, headers=source)
    if "plan" in request.query:
        plan = await node.restore_plan(name)
        return reply(request, plan, headers=_FROM_ARCHIVE if "source" in plan else None)
    record = await node.get_checkpoint(name)
    assert record.manifest is not None
    headers = _FROM_ARCHIVE if is_archived_record(record) else None
    if wants_msgpack(request):
        return web.Response(
            body=record.manifest, content_type="application/msgpack", headers=headers
        )
    manifest = msgpack.unpackb(record.manifest, raw=False)
    return reply(request, manifest, headers=headers)


async def post_checkpoint(request: web.Request) -> web.Response:
    """Extension E19: ``?archive`` archives a committed checkpoint in the background (202),
    or says it is archived already (200). Without ``?archive`` a POST is not allowed here,
    as before."""
    node = request.app[NODE]
    if "archive" not in request.query:
        raise web.HTTPMethodNotAllowed("POST", ["GET", "PUT", "DELETE"])
    name = _name(request)
    if await node.archive.begin(name):
        return reply(request, {"name": name, "archived": False, "archiving": True}, 202)
    return reply(request, {"name": name, "archived": True, "archiving": False})


async def delete_checkpoint(request: web.Request) -> web.Response:
    node = request.app[NODE]
    await node.delete_checkpoint(_name(request))
    return web.Response(status=204)


async def list_checkpoints(request: web.Request) -> web.Response:
    node = request.app[NODE]
    prefix = request.query.get("prefix", "")
    costs = "costs" in request.query  # extension E17
    retention = "retention" in request.query  # extension E20
    records = await node.list_checkpoints(prefix)
    listing = None
    if records and (costs or "nostate" not in request.query):
        listing = await node.checkpoints.listing(records, costs=costs)
    entries = []
    for r in records:
        entry: dict[str, Any] = {
            "name": r.name,
            "created": r.created,
            "bytes": r.total_bytes,
            "state": listing.states.get(r.name, "memory") if listing else "memory",
        }
        if costs and listing is not None:
            if r.name not in listing.costs:
                continue  # deleted while being listed
            entry["costs"] = listing.costs[r.name]
        entries.append(entry)
    if retention and entries:
        kept = await node.retention.annotate(
            [r for r in records if r.name in {e["name"] for e in entries}]
        )
        archived = await _archived_words(node, [entry["name"] for entry in entries])
        for entry in entries:
            # "archived": the archive's word; null with no archive, or no answer in time
            entry["retention"] = {**kept[entry["name"]], "archived": archived.get(entry["name"])}
    doc: dict[str, Any] = {"checkpoints": entries}
    if costs:
        doc["complete"] = listing.complete if listing else True
    if node.archive.configured:
        await _list_archived(node, prefix, doc, costs=costs)
    return reply(request, doc)


async def _archived_words(node: Node, names: list[str]) -> dict[str, bool | None]:
    """Whether the archive holds each of ``names`` (E20's ``archived``), a few asked at once,
    each within the status's deadline (None: no answer); empty with no archive."""
    if not node.archive.configured:
        return {}
    slots = asyncio.Semaphore(8)

    async def ask(name: str) -> tuple[str, bool | None]:
        async with slots:
            return name, await node.archive.archived_or_none(name)

    return dict(await asyncio.gather(*(ask(name) for name in names)))


async def _list_archived(node: Node, prefix: str, doc: dict[str, Any], *, costs: bool) -> None:
    """Add to a listing the archive's checkpoints the catalogue does not know (E19), in
    name order with the others; an archive out of reach leaves them out and says so."""
    known = {entry["name"] for entry in doc["checkpoints"]}
    try:
        async with asyncio.timeout(LISTING_DEADLINE):
            archived = await node.archive.listed(prefix, known)
    except (Unavailable, TimeoutError) as exc:
        log.warning("listing without the archive's checkpoints: %s", exc or "no answer")
        doc["archive_unavailable"] = True
        return
    for record in archived:
        entry: dict[str, Any] = {
            "name": record.name,
            "created": record.created,
            "bytes": record.total_bytes,
            "state": "archived",
            "source": "archive",
        }
        if costs:
            entry["costs"] = archived_costs(node, record.chunks)
        doc["checkpoints"].append(entry)
    doc["checkpoints"].sort(key=lambda entry: entry["name"])


def archived_costs(node: Node, chunks: list[str]) -> dict[str, Any]:
    """E17's costs of a checkpoint only the archive holds: nothing in the cluster's tiers
    (the read-through cache is not a holding), and nothing lost."""
    costs = node.checkpoints.costs_of(chunks, {}, {}, Counter())
    costs["lost"] = 0
    return costs


# ---- cluster and admin -------------------------------------------------------------------
async def cluster(request: web.Request) -> web.Response:
    node = request.app[NODE]
    nodes = []
    view = node.membership.view()
    for spec in view.members:
        alive = spec.id in view.alive
        usage = node.usage() if spec.id == node.id else node.membership.info(spec.id).get("usage")
        info = node.heartbeat() if spec.id == node.id else node.membership.info(spec.id)
        entry: dict[str, Any] = {"id": spec.id, "url": spec.url, "alive": alive}
        entry["domain"] = spec.domain or None  # extension: its failure domain, if declared
        entry["state"] = "draining" if spec.id in view.draining else "active"
        # Extension: False until a heartbeat of this node has reached the node asked (the
        # tier figures below are then zeros that stand for "not known yet").
        entry["usage_reported"] = usage is not None
        for tier in STATES:
            u = (usage or {}).get(tier, {})
            entry[tier] = {
                "used": u.get("used", 0),
                "capacity": u.get("capacity", 0),
                "count": u.get("count", 0),
            }
            # Room marks (E16): RAM's undrained bytes; each disk tier's state (ok,
            # nearly_full, full), free bytes, and since when and why it is full.
            if tier == "memory":
                entry[tier]["dirty"] = u.get("dirty")
            else:
                entry[tier].update({k: u.get(k) for k in ("free", "full_since", "cause")})
                entry[tier]["state"] = u.get("state", "ok")
        # As of the node's last heartbeat (its own figures for this node).
        entry["down_since"] = node.membership.down_since(spec.id)
        entry["draining_since"] = node.membership.drains.draining_since(spec.id)
        entry["up_since"] = info.get("up_since")
        entry["drain_backlog"] = info.get("drain_backlog")
        entry["encode_backlog"] = info.get("encode_backlog")
        entry["repair_backlog"] = info.get("repair_backlog")
        entry["misplaced_backlog"] = info.get("misplaced_backlog")
        # When the pass those backlogs come from started: a change after it is not in them.
        entry["repair_pass_at"] = info.get("repair_pass_at")
        # GC's health (node/referenced.py): the last complete pass, and a stall with its cause.
        entry["gc"] = info.get("gc")
        # The co-located fast path (storaged.front.shm): host identity and socket, if it listens.
        entry["shm"] = info.get("shm")
        nodes.append(entry)
    cfg = node.config
    placement = node.cluster.placement()
    survives = {
        "nodes": placement.node_budget(cfg.k),
        "domain": placement.survives_a_domain(cfg.k),
        "domains": len(placement.domain_sizes()),
    }
    return reply(
        request,
        {
            "nodes": nodes,
            "replication": cfg.replication,
            "erasure": {"codec": cfg.codec, "k": cfg.k, "n": cfg.n},
            "max_chunk_size": cfg.max_chunk_size,
            # Extension: what placement over the placeable nodes survives lost at once.
            "survives": survives,
            # A cluster without a client token serves anyone: say so wherever it is looked at.
            "insecure": not cfg.token,
        },
    )


async def evict(request: web.Request) -> web.Response:
    """Admin: push a checkpoint's chunks out of RAM (``tier: memory``) or off nvme (``nvme``).

    Only copies with a colder durable copy go: dirty RAM and not-yet-cold nvme stay.
    """
    node = request.app[NODE]
    doc = await read_document(request, 1 << 20)
    if not isinstance(doc, dict) or doc.get("tier") not in ("memory", "nvme"):
        raise bad_request('body must be {"checkpoint": name, "tier": "memory"|"nvme"}')
    name = doc.get("checkpoint")
    if not is_checkpoint_name(name):
        raise ApiError(400, "bad_name", f"{name!r} is not a valid checkpoint name")
    totals = await node.evict(str(name), nvme=doc["tier"] == "nvme")
    return reply(request, {"evicted": totals})


async def pause_gc(request: web.Request) -> web.Response:
    """Admin: skip this node's GC passes for ``pause`` seconds (0 resumes). A pause counts
    as a failed pass: past the grace it is reported as a stall, like any other."""
    node = request.app[NODE]
    doc = await read_document(request, 1 << 20)
    pause = doc.get("pause") if isinstance(doc, dict) else None
    if (
        not isinstance(pause, int | float)
        or isinstance(pause, bool)
        or not math.isfinite(pause)
        or not 0 <= pause <= 7 * 24 * 3600
    ):
        raise bad_request('body must be {"pause": seconds}, 0 to 604800 (0 resumes)')
    until = node.collector.pause(float(pause))
    return reply(request, {"node": node.id, "paused_until": until or None})


async def retention_policy(request: web.Request) -> web.Response:
    """Extension E20: the retention policy in force and where it comes from."""
    node = request.app[NODE]
    try:
        policy, origin = await node.retention.policy()
    except PolicyError as exc:
        return reply(request, {"rules": [], "source": "unusable", "error": str(exc)})
    return reply(request, {"rules": policy.to_doc(), "source": origin})


async def set_retention(request: web.Request) -> web.Response:
    """Admin, extension E20: store the cluster's retention policy in the coordinator (etcd);
    a bad policy is refused whole and changes nothing."""
    node = request.app[NODE]
    doc = await read_document(request, 1 << 20)
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise bad_request('body must be {"rules": [{"prefix": ..., "keep_last": ...}, ...]}')
    try:
        policy = node.retention.check(parse_rules(doc["rules"], source="rules"))
    except PolicyError as exc:
        raise ApiError(400, "bad_policy", str(exc)) from None
    store = node.retention.store
    if store is None:
        raise ApiError(
            409,
            "policy_in_cluster_file",
            "the embedded coordination keeps no policy of its own: write [[retention]] tables "
            "in the cluster file of every node and restart them",
        )
    await store.save(policy)
    return reply(request, {"rules": policy.to_doc(), "source": store.origin})


def _node_id(request: web.Request) -> str:
    node_id = request.match_info["id"]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", node_id):
        raise ApiError(400, "bad_request", f"{node_id!r} is not a node id")
    return node_id


async def drain_node(request: web.Request) -> web.Response:
    """Admin: mark a node draining (no new placements; repair copies what it holds to where
    placement without it says), or active again with ``{"cancel": true}``."""
    node = request.app[NODE]
    node_id = _node_id(request)
    cancel = False
    if request.can_read_body:
        doc = await read_document(request, 1 << 20)
        if not isinstance(doc, dict) or not isinstance(doc.get("cancel", False), bool):
            raise bad_request('body must be empty or {"cancel": true|false}')
        cancel = bool(doc.get("cancel", False))
    return reply(request, await node.drain(node_id, cancel=cancel))


async def drain_progress(request: web.Request) -> web.Response:
    """Admin: how far a node's evacuation is, and whether it can leave."""
    node = request.app[NODE]
    return reply(request, await node.drain_progress(_node_id(request)))


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"ok": True, "node": node.id, "version": __version__})


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE]
    node.update_gauges()
    return web.Response(body=node.metrics.render(), content_type="text/plain")


# ---- app ------------------------------------------------------------------------------------
def make_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, auth_middleware])
    app[NODE] = node
    app[PUTS_BY_CLIENT] = {}
    app[DECODES] = asyncio.Semaphore(_MAX_DECODES)
    r = app.router
    r.add_post("/v1/chunks/missing", missing_chunks)
    r.add_put("/v1/chunks/{id}", put_chunk)
    r.add_get("/v1/chunks/{id}", get_chunk, allow_head=False)
    r.add_head("/v1/chunks/{id}", head_chunk)
    r.add_get("/v1/chunks/{id}/fragments/{index}", get_fragment, allow_head=False)
    r.add_get("/v1/checkpoints", list_checkpoints)
    r.add_put("/v1/checkpoints/{name:.+}", put_checkpoint)
    r.add_get("/v1/checkpoints/{name:.+}", get_checkpoint)
    r.add_delete("/v1/checkpoints/{name:.+}", delete_checkpoint)
    r.add_post("/v1/checkpoints/{name:.+}", post_checkpoint)
    r.add_get("/v1/cluster", cluster)
    r.add_post("/v1/admin/evict", evict)
    r.add_post("/v1/admin/gc", pause_gc)
    r.add_get("/v1/retention", retention_policy)
    r.add_put("/v1/admin/retention", set_retention)
    r.add_post("/v1/nodes/{id}/drain", drain_node)
    r.add_get("/v1/nodes/{id}/drain", drain_progress)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    return app


def ssl_context(node: Node) -> ssl.SSLContext | None:
    cfg = node.config
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


async def serve(node: Node, stop: asyncio.Event) -> None:
    """Run ``node``'s HTTP API until ``stop`` is set."""
    app = make_app(node)
    # keepalive_timeout also bounds a connection that has not sent complete headers:
    # aiohttp closes a connection idle in that state when the timer fires (slowloris).
    runner = web.AppRunner(
        app,
        access_log=None,
        keepalive_timeout=node.config.keepalive_timeout,
        handler_cancellation=True,
    )
    await runner.setup()
    host, port = node.config.node.http_addr
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context(node), backlog=1024)
    shm = ShmListener(node, socket_path(node.config.data_dir), http_error)
    await node.start()
    await shm.start()
    node.shm_info = shm.info()
    await site.start()
    log.info(
        "node %s serving %s (peer %s, shared memory %s)",
        node.id,
        node.config.node.url,
        node.config.node.peer,
        shm.path,
    )
    try:
        await stop.wait()
    except BaseException:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await shm.close()
        await node.close()
        raise
    # Graceful stop (I5): reads go on being served while RAM-only chunks drain to disk;
    # PUTs are refused from here on (the shared-memory listener's too: it puts through
    # the node's write path, which refuses once the node is stopping).
    try:
        await node.shutdown()
    finally:
        await shm.close()
        with contextlib.suppress(Exception):
            await runner.cleanup()
