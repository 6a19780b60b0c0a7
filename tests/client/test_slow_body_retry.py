"""A PUT whose body trickles in slower than the node's ``body_min_rate`` is refused with
408 ``body_too_slow`` (API.md E4) and stores nothing, and the client sends it again
(``is_retryable``): end to end, through the real client and real in-process nodes.

Every node's HTTP site sits behind a TCP proxy it advertises as its url, so the client
reaches the nodes through the proxies only (peers talk directly). The proxies trickle
the upload of the first ``slow`` connections that carry a chunk PUT; the others pass at
full speed. The proxies also record the status line each trickled connection was
answered with, so the tests see the node's 408 itself, not only the client's outcome.

The 408 closes its connection (RFC 9110 §15.5.9: ``Connection: close``) and says how long
to wait (``Retry-After``: what the rest of the body would have taken, at most the budget);
the client closes the connection on it, which stops the refused body's upload, and sends
the chunk again on a new connection after the wait. Before, the connection stayed open:
the node read the rest of the refused body to throw it away, and the client sent the chunk
again on that same connection once the rest had gone through (here every retry went over
the same trickled connection, and the put failed after 25 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field

import pytest

from storaged.client import BodyTooSlow, RetryPolicy
from storaged.ids import chunk_id_of
from tests.client.helpers import CLIENT_SETTINGS, client_for
from tests.service.inproc import InprocCluster, InprocFactory, TcpProxy

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: a body gets max(2 s, size / 1 MiB/s) to arrive: 2 s for the 1 MiB chunks sent here (a
#: loaded machine gets the untrickled retry through in far less)
SETTINGS = {**CLIENT_SETTINGS, "body_min_rate": MiB, "body_min_time": 2.0}
#: what a trickled upload passes per second: an eighth of the budget's rate
TRICKLE = 128 << 10
#: the request line of a chunk PUT, the marker of a connection to trickle
PUT_LINE = b"PUT /v1/chunks/"


@dataclass
class Trickle:
    """Which chunk-PUT connections the proxies slow down, and what they were answered."""

    slow: int
    #: the first line of each trickled connection's answer
    answers: list[bytes] = field(default_factory=list)
    #: connections that carried a chunk PUT
    puts: int = 0
    #: the Retry-After of each trickled connection's answer
    waits: list[bytes] = field(default_factory=list)

    def claim(self) -> bool:
        """A connection just carried its first chunk PUT: is it trickled?"""
        self.puts += 1
        if self.slow <= 0:
            return False
        self.slow -= 1
        return True


@dataclass
class Link:
    """One proxied connection: trickled, and its PUT's answer recorded."""

    slowed: bool = False
    answered: bool = False


class TrickleProxy(TcpProxy):
    """Forwards to a node's HTTP site; the upload of a connection ``trickle`` claims goes at
    ``TRICKLE`` bytes a second from its first chunk PUT on."""

    def __init__(self, target: int, trickle: Trickle) -> None:
        super().__init__(("127.0.0.1", target))
        self.trickle = trickle

    def link(self) -> Link:
        return Link()

    async def relay_up(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link
    ) -> None:
        seen = False
        with contextlib.suppress(OSError):
            while piece := await reader.read(16 << 10 if link.slowed else 1 << 16):
                if not seen and PUT_LINE in piece:
                    seen = True
                    link.slowed = self.trickle.claim()
                writer.write(piece)
                await writer.drain()
                if link.slowed:
                    await asyncio.sleep(len(piece) / TRICKLE)

    def seen_down(self, piece: bytes, link: Link) -> None:
        # HTTP/1.1 answers one request at a time: once the connection is trickled (the
        # answers to its requests before the PUT went down already), the next answer is
        # the PUT's.
        if link.slowed and not link.answered:
            head = piece.partition(b"\r\n\r\n")[0].split(b"\r\n")
            self.trickle.answers.append(head[0])
            self.trickle.waits += [h.split(b":", 1)[1].strip() for h in head
                                   if h.lower().startswith(b"retry-after:")]  # fmt: skip
            link.answered = True


@dataclass
class ProxiedCluster(InprocCluster):
    """In-process nodes that advertise a ``TrickleProxy`` as their url and listen behind it."""

    trickle: Trickle = field(default_factory=lambda: Trickle(0))
    proxies: list[TrickleProxy] = field(default_factory=list)

    #: url (the proxy), peer port, and the HTTP site behind the proxy
    PORTS_PER_NODE = 3

    def listen_addr(self, i: int) -> tuple[str, int]:
        return "127.0.0.1", self.port + 2 * self.nodes + i

    async def start(self, timeout: float = 60.0) -> None:
        await super().start(timeout)
        for i in range(self.nodes):
            proxy = TrickleProxy(self.listen_addr(i)[1], self.trickle)
            self.proxies.append(proxy)
            await proxy.start(self.port + i)

    async def close(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        await super().close()


async def _proxied(inproc: InprocFactory, slow: int) -> ProxiedCluster:
    cluster = ProxiedCluster(inproc.root / f"proxied{len(inproc.clusters)}", 4, dict(SETTINGS))
    cluster.trickle = Trickle(slow)
    inproc.clusters.append(cluster)  # stopped with the others after the test
    await cluster.start()
    return cluster


async def test_a_trickled_put_is_408_and_the_client_sends_it_again(
    inproc: InprocFactory,
) -> None:
    cluster = await _proxied(inproc, slow=1)
    data = os.urandom(MiB)
    async with client_for(cluster, retry=RetryPolicy(max_attempts=4, deadline=60.0)) as client:
        chunk_id = await client.put_chunk(data)
        assert chunk_id == chunk_id_of(data)
        # The node refused the trickled body itself: 408, before the client sent it again.
        assert cluster.trickle.answers == [b"HTTP/1.1 408 Request Timeout"]
        # About 256 of 1024 KiB came in the 2 s budget: the rest would have taken 6 s more,
        # and the client is told to wait the budget (its cap) before it sends it again.
        assert cluster.trickle.waits == [b"2"]
        # The chunk went again on a new connection (the second to carry a PUT), not after
        # the rest of the refused body on the trickled one.
        assert cluster.trickle.puts == 2, "the retry went over the trickled connection"
        assert client.stats.retries >= 1
        # The 408 halved the client's upload window (storaged.client.pacing) once.
        assert client.stats.upload_window_halvings == 1
        assert len(cluster.hot_holders(chunk_id)) >= 3
        assert bytes(await client.get_chunk(chunk_id)) == data


async def test_a_put_trickled_on_every_try_fails_as_body_too_slow_and_stores_nothing(
    inproc: InprocFactory,
) -> None:
    cluster = await _proxied(inproc, slow=100)
    data = os.urandom(MiB)
    chunk_id = chunk_id_of(data)
    policy = RetryPolicy(max_attempts=3, deadline=60.0)
    async with client_for(cluster, retry=policy) as client:
        with pytest.raises(BodyTooSlow) as refused:
            await client.put_chunk(data)
        assert refused.value.status == 408 and refused.value.code == "body_too_slow"
        assert cluster.trickle.answers == [b"HTTP/1.1 408 Request Timeout"] * 3
        assert cluster.trickle.waits == [b"2"] * 3
        # Each try went after the halving the one before caused: each halved the window.
        assert client.stats.upload_window_halvings == 3
        # Nothing was stored, and no reservation is left behind on any node.
        assert cluster.hot_holders(chunk_id) == []
        for i in cluster.running():
            assert cluster.node(i).memory.usage().used == 0
        assert await client.missing_chunks([chunk_id]) == [chunk_id]
