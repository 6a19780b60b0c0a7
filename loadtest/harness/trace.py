"""``TracedClient``: a ``Client`` that times every chunk request (first byte, whole body,
ack) and counts bytes by the ``X-Storaged-Tier`` header; ``traced_runner`` opens one on a
fresh loop. The direct read path is traced by ``TracedGets`` (a ``DirectGets`` that notes
when each GET is sent and its head arrives); the session's requests through the
``Client``'s public ``trace_configs``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp

from loadtest.harness.machine import GB, new_loop
from loadtest.harness.report import percentile
from storaged.client import Client
from storaged.client.client import Holder, WritableBuffer
from storaged.client.direct import Addr, BodyPlan, DirectGets, Planner, ResponseHead, Result
from storaged.wire import ByteRange


@dataclass
class _Fetch:
    start: float = 0.0
    headers: float = 0.0


_current_fetch: contextvars.ContextVar[_Fetch | None] = contextvars.ContextVar(
    "loadtest_fetch", default=None
)


@dataclass
class RequestLog:
    """What a ``TracedClient`` saw, on ``time.monotonic``."""

    #: first response headers of any chunk GET (the restore's first byte)
    first_byte: float | None = None
    #: seconds from sending a chunk GET (its last attempt) to the body in place
    get_latencies: list[float] = field(default_factory=list)
    #: seconds from sending a chunk PUT to its 200/201 (the ack)
    put_latencies: list[float] = field(default_factory=list)
    #: body bytes of chunk GETs by X-Storaged-Tier
    tier_bytes: dict[str, int] = field(default_factory=dict)


def _chunk_request(method: str, url: Any) -> bool:
    return "/v1/chunks/" in str(url.path) and method in ("GET", "PUT")


class TracedGets(DirectGets):
    """``DirectGets`` that notes in ``log`` when each chunk GET is sent and when its 200/206
    head arrives, as aiohttp's trace hooks do for the aiohttp path."""

    def __init__(
        self,
        log: RequestLog,
        *,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        idle_timeout: float,
    ) -> None:
        super().__init__(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            pool_size=pool_size,
            idle_timeout=idle_timeout,
        )
        self.log = log

    async def get(self, addr: Addr, request: bytes, planner: Planner) -> Result:
        fetch = _current_fetch.get()
        if fetch is not None:
            fetch.start = time.monotonic()  # a retry or failover restarts the clock

        def answered(head: ResponseHead) -> BodyPlan:
            # The client's planner sees only the heads of chunks it will read.
            now = time.monotonic()
            if self.log.first_byte is None or now < self.log.first_byte:
                self.log.first_byte = now
            tier = head.headers.get("x-storaged-tier", "?")
            self.log.tier_bytes[tier] = self.log.tier_bytes.get(tier, 0) + head.content_length
            return planner(head)

        return await super().get(addr, request, answered)


class TracedClient(Client):
    """A ``Client`` whose session records every chunk request in ``self.log``.

    Open it with ``open_traced`` (the session the client makes carries the trace hooks,
    given through ``Client``'s ``trace_configs``). Chunk GETs read directly, as with
    ``Client``'s own session (``direct_reads=False`` to measure aiohttp's), are traced by
    its ``TracedGets``. It measures the network paths, so it takes no shared-memory path
    to a node on this host (``shm=False`` unless asked: what goes through shared memory is
    not an HTTP request and is not in ``log``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_start)
        trace.on_request_end.append(self._on_end)
        kwargs.setdefault("direct_reads", True)
        kwargs.setdefault("shm", False)
        kwargs["trace_configs"] = [*kwargs.get("trace_configs", ()), trace]
        super().__init__(*args, **kwargs)
        self.log = RequestLog()

    async def open_traced(self) -> None:
        await self.open()
        if self.direct is not None:
            # The direct read path, traced: the same settings, reporting to self.log.
            plain = self.direct
            self.direct = TracedGets(
                self.log,
                connect_timeout=plain.connect_timeout,
                read_timeout=plain.read_timeout,
                pool_size=plain.pool_size,
                idle_timeout=plain.idle_timeout,
            )
            await plain.close()

    async def _on_start(
        self, session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any
    ) -> None:
        ctx.start = time.monotonic()
        fetch = _current_fetch.get()
        if fetch is not None:
            fetch.start = ctx.start  # a retry or failover restarts the clock

    async def _on_end(
        self, session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any
    ) -> None:
        now = time.monotonic()
        resp = params.response
        if not _chunk_request(params.method, params.url) or resp.status >= 300:
            return
        if params.method == "PUT":
            self.log.put_latencies.append(now - ctx.start)
            return
        if self.log.first_byte is None or now < self.log.first_byte:
            self.log.first_byte = now
        tier = resp.headers.get("X-Storaged-Tier", "?")
        size = resp.content_length or 0
        self.log.tier_bytes[tier] = self.log.tier_bytes.get(tier, 0) + size

    async def get_chunk(
        self,
        chunk_id: str,
        out: WritableBuffer | None = None,
        byte_range: ByteRange | None = None,
        *,
        holders: Sequence[Holder | str] | None = None,
    ) -> memoryview:
        fetch = _Fetch()
        token = _current_fetch.set(fetch)
        try:
            view = await super().get_chunk(chunk_id, out, byte_range, holders=holders)
        finally:
            _current_fetch.reset(token)
        self.log.get_latencies.append(time.monotonic() - fetch.start)
        return view


def traced_runner(
    urls: Sequence[str], token: str | None, max_concurrency: int, loop: str
) -> tuple[asyncio.Runner, TracedClient]:
    """A runner on a fresh ``loop`` and a ``TracedClient`` already opened in it (the runner is
    closed again if the client does not open). The caller closes the client, then the runner."""
    runner = asyncio.Runner(loop_factory=lambda: new_loop(loop))
    client = TracedClient(list(urls), token=token, max_concurrency=max_concurrency)
    try:
        runner.run(client.open_traced())
    except BaseException:
        runner.close()
        raise
    return runner, client


def client_cpu(results: Sequence[Mapping[str, Any]], nbytes: int) -> dict[str, float | None]:
    """CPU seconds per GB of the workers' timed windows, and the share spent in the kernel."""
    total = sum(float(r["cpu"]) for r in results)
    system = sum(float(r.get("cpu_sys", 0.0)) for r in results)
    return {
        "client_cpu_s_per_gb": round(total / (nbytes / GB), 4) if nbytes else None,
        "client_cpu_sys_share": round(system / total, 3) if total > 0 else None,
    }


def summarize_latencies(latencies: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 in ms (nearest rank), None when there is none."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
    }
