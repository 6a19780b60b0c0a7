"""The fault proxy on its own: each mode does what the nemesis relies on (an echo server
stands in for a node's peer port)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from storaged.tools.local_cluster import free_port_block
from tests.nemesis.proxy import FaultProxies, LinkMode

pytestmark = pytest.mark.timeout(60)

LINK = ("a", "b")


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while piece := await reader.read(65536):
            writer.write(piece)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxies() -> AsyncIterator[FaultProxies]:
    """Link (a, b) proxies to an echo server standing in for b; (b, a) to one for a."""
    servers = [await asyncio.start_server(_echo, "127.0.0.1", 0) for _ in range(2)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    faults = FaultProxies({"a": ("127.0.0.1", ports[0]), "b": ("127.0.0.1", ports[1])})
    await asyncio.to_thread(faults.start, free_port_block(2))
    try:
        yield faults
    finally:
        await asyncio.to_thread(faults.close)
        for server in servers:
            server.close()
            await server.wait_closed()


async def _connect(faults: FaultProxies) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", faults.ports[LINK])


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"ping")
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(4), 20)


async def test_routes_name_every_peer_through_its_own_link(proxies: FaultProxies) -> None:
    assert proxies.routes("a") == f"b=127.0.0.1:{proxies.ports[('a', 'b')]}"
    assert proxies.routes("b") == f"a=127.0.0.1:{proxies.ports[('b', 'a')]}"
    assert proxies.ports[("a", "b")] != proxies.ports[("b", "a")]


async def test_pass_and_delay_forward_the_bytes(proxies: FaultProxies) -> None:
    reader, writer = await _connect(proxies)
    assert await _roundtrip(reader, writer) == b"ping"
    await proxies.set_mode([LINK], LinkMode.DELAY, 0.05)
    assert await _roundtrip(reader, writer) == b"ping"
    writer.close()


async def test_drop_resets_new_connections_and_cut_resets_open_ones(
    proxies: FaultProxies,
) -> None:
    reader, writer = await _connect(proxies)
    assert await _roundtrip(reader, writer) == b"ping"
    await proxies.set_mode([LINK], LinkMode.DROP)
    # The open connection still flows: DROP refuses only new ones.
    assert await _roundtrip(reader, writer) == b"ping"
    # The reset may reach the client before its connect completes, or after.
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await _roundtrip(*await _connect(proxies))
    assert await proxies.cut([LINK]) == 1
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await _roundtrip(reader, writer)
    await proxies.heal_all()
    reader, writer = await _connect(proxies)
    assert await _roundtrip(reader, writer) == b"ping"
    assert proxies.counts()["refused"] == 1
    writer.close()


async def test_blackhole_stalls_until_healed_then_delivers(proxies: FaultProxies) -> None:
    reader, writer = await _connect(proxies)
    assert await _roundtrip(reader, writer) == b"ping"
    await proxies.set_mode([LINK], LinkMode.BLACKHOLE)
    writer.write(b"held")
    await writer.drain()
    stalled = asyncio.ensure_future(reader.readexactly(4))
    done, _ = await asyncio.wait([stalled], timeout=0.5)
    assert not done, "a black hole forwarded bytes"
    await proxies.heal_all()
    assert await asyncio.wait_for(stalled, 20) == b"held"
    writer.close()
