"""The HTTP API of API.md on aiohttp: routes translate requests into ``Node`` calls.

Errors are raised as ``ApiError`` anywhere and turned into responses in one
middleware. Bodies are msgpack unless the request prefers JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
from aiohttp import web

from storaged import __version__
from storaged.errors import ApiError, bad_request
from storaged.ids import is_checkpoint_name, is_chunk_id
from storaged.manifest import check_manifest, unpack_limited
from storaged.node import STATES, Node, state_name
from tiers import ByteRange, ChunkNotFound

log = logging.getLogger("storaged.http")

NODE: web.AppKey[Node] = web.AppKey("node", Node)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_JSON_BODY = 64 * 2**20


# ---- encoding -------------------------------------------------------------------------------
def wants_json(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    if "application/json" not in accept:
        return False
    return "application/msgpack" not in accept or accept.index("application/json") < accept.index(
        "application/msgpack"
    )


def reply(
    request: web.Request, body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    if wants_json(request):
        return web.Response(
            body=json.dumps(body).encode(),
            status=status,
            content_type="application/json",
            headers=headers,
        )
    return web.Response(
        body=msgpack.packb(body, use_bin_type=True),
        status=status,
        content_type="application/msgpack",
        headers=headers,
    )


async def read_document(request: web.Request, max_size: int) -> Any:
    """A msgpack (or JSON) request body, size-capped while it streams in."""
    if request.content_length is not None and request.content_length > max_size:
        raise ApiError(413, "too_large", f"body over {max_size} bytes")
    body = bytearray()
    async for piece in request.content.iter_any():
        body += piece
        if len(body) > max_size:
            raise ApiError(413, "too_large", f"body over {max_size} bytes")
    ctype = request.headers.get("Content-Type", "application/msgpack").split(";")[0].strip()
    if ctype == "application/json":
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"body is not valid JSON: {exc}") from exc
    return unpack_limited(bytes(body), max_size)


# ---- middleware -----------------------------------------------------------------------------
_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    411: "length_required",
    413: "too_large",
}


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app[NODE]
    try:
        return await handler(request)
    except ApiError as exc:
        node.metrics.errors.labels(exc.code).inc()
        return reply(request, exc.body(), exc.status, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _STATUS_CODES.get(exc.status, "error")
        node.metrics.errors.labels(code).inc()
        return reply(request, {"error": code, "message": exc.reason}, exc.status)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("internal error on %s %s", request.method, request.path)
        node.metrics.errors.labels("internal").inc()
        return reply(request, {"error": "internal", "message": f"{type(exc).__name__}"}, 500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[NODE].config.token
    if token and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token")
    return await handler(request)


# ---- chunks ---------------------------------------------------------------------------------
def _chunk_id(request: web.Request) -> str:
    cid = request.match_info["id"]
    if not is_chunk_id(cid):
        raise ApiError(400, "bad_chunk_id", "a chunk id is 64 lowercase hex characters (BLAKE3)")
    return cid


async def _body_pieces(
    request: web.Request, size: int, stall_timeout: float
) -> AsyncIterator[bytes]:
    """The body as the transport delivers it; each wait for bytes is bounded."""
    remaining = size
    loop = asyncio.get_running_loop()
    try:
        # One timeout for the whole body, re-armed before each read (cheaper than a new
        # one per piece) and disarmed while the consumer works on a piece.
        async with asyncio.timeout(None) as stall:
            while remaining > 0:
                stall.reschedule(loop.time() + stall_timeout)
                try:
                    # readchunk hands over one buffered piece as is; readany() would join.
                    data, _ = await request.content.readchunk()
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                except Exception as exc:  # aiohttp's payload errors on a broken connection
                    log.info("PUT body broke off: %s", exc)
                    return
                stall.reschedule(None)
                if not data:
                    return
                remaining -= len(data)
                yield data
    except TimeoutError:
        log.info("PUT body stalled for %.1f s: abandoned", stall_timeout)


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
    status, body = await node.put_chunk(
        cid, size, _body_pieces(request, size, node.config.body_timeout)
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


# Only for loadtest.nodesend's baseline: "response" answers chunk GETs the old way
# (web.Response, whose body aiohttp joins to the head in a new bytes object on Python
# < 3.12.9). Read once at import: the node's environment does not change.
_GET_SEND = os.environ.get("STORAGED_GET_SEND", "stream")


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
        raise ApiError(404, "chunk_not_found", f"chunk {cid} is not held by the cluster") from exc
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
    if _GET_SEND == "response":
        return web.Response(
            body=body, status=status, headers=headers, content_type="application/octet-stream"
        )
    return await _send_body(request, body, status, headers)


async def head_chunk(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    cid = _chunk_id(request)
    states = await node.chunk_states([cid])
    if cid not in states:
        raise ApiError(404, "chunk_not_found", f"chunk {cid} is not held by the cluster")
    state, size = states[cid]
    if node.memory_has(cid):
        tier = "memory"
    elif node.nvme_has(cid):
        tier = "nvme"
    else:
        held = (await node.holdings(node.membership.alive_ids(), [cid]))[cid]
        tier = "cold"
        if any(h.memory for h in held):
            tier = "memory"
        elif any(h.nvme for h in held):
            tier = "nvme"
    if size < 0:
        data, _ = await node.read_chunk(cid)
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
    doc = await read_document(request, node.config.max_manifest_size)
    ids = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not all(is_chunk_id(c) for c in ids):
        raise bad_request('body must be {"chunks": [chunk id, ...]}')
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
    doc = await read_document(request, node.config.max_manifest_size)
    # Validation hashes and walks the whole manifest: keep it off the loop.
    checked = await asyncio.to_thread(check_manifest, doc, node.config.max_chunk_size)
    status, body = await node.commit(name, checked)
    return reply(request, body, status)


async def get_checkpoint(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    name = _name(request)
    if "status" in request.query:
        return reply(request, await node.checkpoint_status(name))
    if "plan" in request.query:
        return reply(request, await node.restore_plan(name))
    record = await node.get_checkpoint(name)
    assert record.manifest is not None
    if wants_json(request):
        manifest = msgpack.unpackb(record.manifest, raw=False)
        return reply(request, manifest)
    return web.Response(body=record.manifest, content_type="application/msgpack")


async def delete_checkpoint(request: web.Request) -> web.Response:
    node = request.app[NODE]
    await node.delete_checkpoint(_name(request))
    return web.Response(status=204)


async def list_checkpoints(request: web.Request) -> web.Response:
    node = request.app[NODE]
    prefix = request.query.get("prefix", "")
    records = await node.list_checkpoints(prefix)
    states: dict[str, str] = {}
    if records and "nostate" not in request.query:
        for record in records:
            states[record.name] = (await node.checkpoint_status(record.name))["state"]
    return reply(
        request,
        {
            "checkpoints": [
                {
                    "name": r.name,
                    "created": r.created,
                    "bytes": r.total_bytes,
                    "state": states.get(r.name, "memory"),
                }
                for r in records
            ]
        },
    )


# ---- cluster and admin -------------------------------------------------------------------
async def cluster(request: web.Request) -> web.Response:
    node = request.app[NODE]
    nodes = []
    for spec in node.membership.nodes():
        alive = node.membership.is_alive(spec.id)
        usage = node.usage() if spec.id == node.id else node.membership.info(spec.id).get("usage")
        entry: dict[str, Any] = {"id": spec.id, "url": spec.url, "alive": alive}
        for tier in STATES:
            u = (usage or {}).get(tier, {})
            entry[tier] = {"used": u.get("used", 0), "capacity": u.get("capacity", 0)}
        nodes.append(entry)
    cfg = node.config
    return reply(
        request,
        {
            "nodes": nodes,
            "replication": cfg.replication,
            "erasure": {"codec": cfg.codec, "k": cfg.k, "n": cfg.n},
            "max_chunk_size": cfg.max_chunk_size,
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
    r = app.router
    r.add_post("/v1/chunks/missing", missing_chunks)
    r.add_put("/v1/chunks/{id}", put_chunk)
    r.add_get("/v1/chunks/{id}", get_chunk, allow_head=False)
    r.add_head("/v1/chunks/{id}", head_chunk)
    r.add_get("/v1/checkpoints", list_checkpoints)
    r.add_put("/v1/checkpoints/{name:.+}", put_checkpoint)
    r.add_get("/v1/checkpoints/{name:.+}", get_checkpoint)
    r.add_delete("/v1/checkpoints/{name:.+}", delete_checkpoint)
    r.add_get("/v1/cluster", cluster)
    r.add_post("/v1/admin/evict", evict)
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
    await node.start()
    await site.start()
    log.info("node %s serving %s (peer %s)", node.id, node.config.node.url, node.config.node.peer)
    try:
        await stop.wait()
    except BaseException:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await node.close()
        raise
    # Graceful stop (I5): reads go on being served while RAM-only chunks drain to disk;
    # PUTs are refused from here on.
    try:
        await node.shutdown()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
