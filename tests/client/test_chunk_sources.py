"""One suite for every chunk source (``storaged.client.sources``), against in-process nodes.

Each source is asked for the same reads of a chunk the nodes hold, through
``ChunkSource.read`` alone (no other source behind it): the whole chunk, into a buffer of
the caller's, ranges with and without an end, a buffer too small, a range outside the
chunk, and a chunk no node has. What every source must do is checked the same way; what
differs (a source without the chunk answers None, the nodes' GET ``ChunkNotFound``) is
said where it differs. The shared-memory source runs against an in-process node given a
listener, as ``storaged serve`` gives its node one (``tests/service/test_shm_node.py``).

Then the read router's fallback rules (``storaged.client.router``) on the same nodes: a
decode that finds too few fragments leaves the read to the nodes, and its error is the
one raised when no node has the chunk either.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from storaged.client import Client, save_checkpoint
from storaged.client.documents import Holder
from storaged.client.errors import BadRange, ChunkNotFound, NotEnoughFragments
from storaged.client.shm import shm_wanted
from storaged.client.sources import (
    ChunkRead,
    ChunkSource,
    ColdDecodeSource,
    DirectSource,
    HttpSource,
    ShmSource,
)
from storaged.ids import chunk_id_of
from storaged.wire import ByteRange
from tests.conftest import ADMIN_TOKEN, TOKEN
from tests.service.inproc import InprocCluster, InprocFactory

SOURCES = ("shm", "cold", "direct", "http")
#: a chunk of an odd size, over one 1 MiB send slice (the body arrives in several pieces)
SIZE = 1_500_001
#: a chunk id no node holds
ABSENT = chunk_id_of(b"no node holds this chunk")


@dataclass
class Setup:
    """A source, the client it belongs to, and a chunk the nodes hold."""

    kind: str
    client: Client
    source: ChunkSource
    chunk_id: str
    size: int
    cluster: InprocCluster
    #: the plan's holders, for the cold source (it reads nothing without them)
    holders: list[Holder] | None = None

    def asked(
        self,
        chunk_id: str,
        out: bytearray | memoryview | None = None,
        byte_range: ByteRange | None = None,
        holders: list[Holder] | None = None,
    ) -> ChunkRead:
        """The read as the router would hand it to this source."""
        router = self.client._reads
        read = router.asked(chunk_id, out, byte_range, holders or self.holders)
        if isinstance(self.source, HttpSource):
            router.aim(read)
        return read

    async def read(
        self,
        out: bytearray | memoryview | None = None,
        byte_range: ByteRange | None = None,
    ) -> memoryview:
        view = await self.source.read(self.asked(self.chunk_id, out, byte_range))
        assert view is not None, f"the {self.kind} source did not have the chunk"
        return view


async def _save(client: Client, name: str) -> str:
    """Save one chunk of ``SIZE`` random bytes as checkpoint ``name``; its chunk id."""
    data = np.frombuffer(np.random.default_rng(7).bytes(SIZE), dtype=np.uint8)
    await save_checkpoint(client, name, {0: {"w": data}})
    plan = await client.plan(name)
    assert len(plan) == 1, plan
    return next(iter(plan))


@contextlib.asynccontextmanager
async def _setup(kind: str, factory: InprocFactory) -> AsyncIterator[Setup]:
    from storaged.front.http import http_error
    from storaged.front.shm import ShmListener, socket_path

    cluster = await factory.start(4)
    async with contextlib.AsyncExitStack() as stack:
        if kind == "shm":
            if not shm_wanted(None):
                pytest.skip("STORAGED_SHM=0 here: no shared-memory path")
            entry = cluster.node(0)
            # The in-process harness runs no shared-memory listener: node 0 gets one.
            listener = ShmListener(entry, socket_path(entry.config.data_dir), http_error)
            await listener.start()
            entry.shm_info = listener.info()
            stack.push_async_callback(listener.close)
        client = Client(cluster.urls, token=TOKEN, shm=kind == "shm", direct_reads=kind != "http")
        await stack.enter_async_context(client)
        chunk_id = await _save(client, f"sources/{kind}")
        holders: list[Holder] | None = None
        source: ChunkSource
        router = client._reads
        if kind == "shm":
            assert client.shm is not None and client.shm.node_id == cluster.node_id(0)
            source = ShmSource(client, client.stats)
        elif kind == "cold":
            await client.wait(f"sources/{kind}", "cold", timeout=60)
            for level in ("memory", "nvme"):  # the plan then names every fragment
                await client.evict(f"sources/{kind}", level, admin_token=ADMIN_TOKEN)
            plan = await client.plan(f"sources/{kind}")
            holders = plan[chunk_id]
            assert holders and all(h.tier == "cold" and h.fragments for h in holders), plan
            source = ColdDecodeSource(
                client._requests, client.bandwidth, client, router.cold.decode_slots, 1 << 30
            )
        elif kind == "direct":
            assert client.direct is not None
            source = DirectSource(client._requests, client.bandwidth, client)
        else:
            source = HttpSource(client._requests, client.bandwidth)
        yield Setup(kind, client, source, chunk_id, SIZE, cluster, holders)


@pytest.fixture(params=SOURCES)
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Setup]:
    factory = InprocFactory(tmp_path)
    try:
        async with _setup(request.param, factory) as each:
            yield each
    finally:
        await factory.close_all()


async def test_every_source_reads_a_chunk_whole_and_in_ranges(setup: Setup) -> None:
    whole = bytes(await setup.read())
    assert len(whole) == setup.size and chunk_id_of(whole) == setup.chunk_id

    out = bytearray(setup.size + 10)
    view = await setup.read(out)
    assert view.obj is out and len(view) == setup.size, "not read into the caller's buffer"
    assert bytes(out[: setup.size]) == whole and out[setup.size :] == bytes(10)

    part = await setup.read(None, ByteRange(1000, 5000))
    assert bytes(part) == whole[1000:5000]
    exact = bytearray(4000)
    view = await setup.read(exact, ByteRange(1_200_000, 1_204_000))
    assert view.obj is exact and bytes(exact) == whole[1_200_000:1_204_000]

    tail = await setup.read(None, ByteRange(setup.size - 100))
    assert bytes(tail) == whole[-100:]


async def test_every_source_refuses_a_buffer_too_small_and_a_range_outside(setup: Setup) -> None:
    with pytest.raises(ValueError):
        await setup.read(bytearray(setup.size - 1))
    with pytest.raises(ValueError, match="output buffer"):
        await setup.read(bytearray(10), ByteRange(0, 11))  # said before any request
    with pytest.raises(BadRange):
        await setup.read(None, ByteRange(setup.size + 10, setup.size + 20))


async def test_a_chunk_no_node_has_is_none_or_not_found(setup: Setup) -> None:
    """A source without the chunk answers None (the next is asked); the nodes' GET, the
    last source, raises ``ChunkNotFound``."""
    holders = None
    if setup.kind == "cold":
        # fragments the plan would name, of a chunk no node has
        holders = [
            Holder(setup.cluster.node_id(i), setup.cluster.url(i), "cold", (i,)) for i in range(4)
        ]
    read = setup.asked(ABSENT, None, None, holders)
    if isinstance(setup.source, HttpSource):
        with pytest.raises(ChunkNotFound):
            await setup.source.read(read)
    else:
        assert await setup.source.read(read) is None
    if setup.kind == "cold":
        assert isinstance(read.degraded, NotEnoughFragments), "the decode's failure is kept"


async def test_the_router_raises_the_decode_failure_when_no_node_has_the_chunk(
    tmp_path: Path,
) -> None:
    """Too few fragments to decode here: the nodes are asked, and when none has the chunk
    the decode's ``NotEnoughFragments`` is raised rather than their 404."""
    factory = InprocFactory(tmp_path)
    try:
        cluster = await factory.start(4)
        async with Client(cluster.urls, token=TOKEN, shm=False) as client:
            holders = [Holder(cluster.node_id(i), cluster.url(i), "cold", (i,)) for i in range(4)]
            with pytest.raises(NotEnoughFragments):
                await client.get_chunk(ABSENT, holders=holders)
            with pytest.raises(ChunkNotFound):
                await client.get_chunk(ABSENT)
            assert client.stats.chunks_downloaded == 0
    finally:
        await factory.close_all()


def test_the_suite_covers_every_source_the_router_asks() -> None:
    """A source added to the router needs a kind in ``SOURCES`` (and so this suite)."""
    router = Client(["http://127.0.0.1:9"], token=TOKEN)._reads
    asked = {type(router.shm), type(router.cold), type(router.nodes)}
    assert asked == {ShmSource, ColdDecodeSource, DirectSource}
