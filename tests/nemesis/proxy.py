"""A TCP fault proxy on every directed peer link, run in a thread with its own event loop.

Node ``a`` dials node ``b`` through link ``(a, b)``: a listening port of this process that
forwards to ``b``'s peer port (``STORAGED_PEER_ROUTES`` points ``a`` at it). Each link has
a mode that the nemesis changes while traffic flows:

- ``PASS``: forward both ways.
- ``DELAY``: forward, each piece held ``delay`` seconds first (order kept).
- ``DROP``: new connections are reset at once; open ones keep flowing unless cut.
- ``BLACKHOLE``: accept and stall: nothing is forwarded either way (new connections are
  not even dialled through) until the mode changes; held bytes flow late then.

``cut`` resets every open connection of a link (a one-off, whatever the mode). A
partition is a set of links put in ``DROP`` (after a cut) or ``BLACKHOLE`` for a while.

The proxies run on their own loop so that the test's loop (the workload) and the links'
forwarding do not wait on each other; the async methods of ``FaultProxies`` may be awaited
from any other loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import socket
import struct
import threading
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

Link = tuple[str, str]  # (dialling node, dialled node)

_PIECE = 256 * 1024


class LinkMode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    DROP = "drop"
    BLACKHOLE = "blackhole"


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed host or a firewall would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class _LinkState:
    link: Link
    target: tuple[str, int]
    mode: LinkMode = LinkMode.PASS
    delay: float = 0.0
    #: set while bytes may flow (any mode but BLACKHOLE)
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = field(
        default_factory=set
    )
    server: asyncio.Server | None = None
    accepted: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        self.flowing.set()


class FaultProxies:
    """One proxy per directed link from each of ``dialers`` (default: the peers
    themselves) to each of ``peers`` (name -> real address) but itself.

    ``start(ports)`` binds link ``i`` (in ``links`` order) on ``127.0.0.1:ports[i]``;
    ``routes(node)`` is that node's ``STORAGED_PEER_ROUTES``, ``endpoints(node)`` the
    addresses that reach each peer through ``node``'s own links (the etcd members as one
    node dials them). ``close()`` stops the thread and resets every connection.
    """

    def __init__(
        self, peers: dict[str, tuple[str, int]], dialers: Iterable[str] | None = None
    ) -> None:
        self.peers = dict(peers)
        froms = list(self.peers if dialers is None else dialers)
        self.links: list[Link] = [(a, b) for a in froms for b in self.peers if a != b]
        self.ports: dict[Link, int] = {}
        self._states: dict[Link, _LinkState] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fault-proxies", daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- life cycle (blocking; call from a thread or before the test's loop runs) --------
    def start(self, base_port: int) -> None:
        self._thread.start()
        self.ports = {link: base_port + i for i, link in enumerate(self.links)}
        self._submit(self._bind_all()).result(timeout=30)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._submit(self._shutdown()).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def routes(self, node: str) -> str:
        """``STORAGED_PEER_ROUTES`` for ``node``: every peer reached through its own link."""
        return ",".join(f"{b}=127.0.0.1:{self.ports[(a, b)]}" for (a, b) in self.links if a == node)

    def endpoints(self, node: str) -> list[str]:
        """``host:port`` of ``node``'s link to each peer, in the peers' order."""
        return [f"127.0.0.1:{self.ports[(node, b)]}" for b in self.peers if (node, b) in self.ports]

    def links_of(self, node: str) -> list[Link]:
        """The links ``node`` dials."""
        return [link for link in self.links if link[0] == node]

    # ---- faults (awaitable from any loop) ------------------------------------------------
    async def set_mode(self, links: Iterable[Link], mode: LinkMode, delay: float = 0.0) -> None:
        await self._await(self._set_mode(list(links), mode, delay))

    async def cut(self, links: Iterable[Link]) -> int:
        """Reset the open connections of ``links``; returns how many were cut."""
        return await self._await(self._cut(list(links)))

    async def heal_all(self) -> None:
        await self.set_mode(self.links, LinkMode.PASS)

    def counts(self) -> dict[str, int]:
        """Connections accepted and refused (DROP) over all links, for the report."""
        accepted = sum(s.accepted for s in self._states.values())
        refused = sum(s.refused for s in self._states.values())
        return {"accepted": accepted, "refused": refused}

    # ---- the proxies' own loop -----------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        result: T = await asyncio.wrap_future(self._submit(coro))
        return result

    async def _bind_all(self) -> None:
        for link in self.links:
            state = _LinkState(link, self.peers[link[1]])
            self._states[link] = state
            state.server = await asyncio.start_server(
                functools.partial(self._accepted, state), "127.0.0.1", self.ports[link]
            )

    async def _shutdown(self) -> None:
        for state in self._states.values():
            if state.server is not None:
                state.server.close()
            state.flowing.set()
        await self._cut(list(self._states))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _set_mode(self, links: list[Link], mode: LinkMode, delay: float) -> None:
        for link in links:
            state = self._states[link]
            state.mode = mode
            state.delay = delay if mode is LinkMode.DELAY else 0.0
            if mode is LinkMode.BLACKHOLE:
                state.flowing.clear()
            else:
                state.flowing.set()

    async def _cut(self, links: list[Link]) -> int:
        cut = 0
        for link in links:
            state = self._states[link]
            for inbound, outbound in list(state.conns):
                reset(inbound)
                if outbound is not None:
                    reset(outbound)
                cut += 1
            state.conns.clear()
        return cut

    def _accepted(
        self, state: _LinkState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if state.mode is LinkMode.DROP:
            state.refused += 1
            reset(writer)
            return
        state.accepted += 1
        task = asyncio.get_running_loop().create_task(self._forward(state, reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(
        self, state: _LinkState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        entry: tuple[asyncio.StreamWriter, asyncio.StreamWriter | None] = (writer, None)
        state.conns.add(entry)
        upstream: asyncio.StreamWriter | None = None
        try:
            await state.flowing.wait()  # a black hole does not even dial through
            if entry not in state.conns:
                return  # cut while waiting
            up_reader, upstream = await asyncio.open_connection(*state.target)
            state.conns.discard(entry)
            entry = (writer, upstream)
            state.conns.add(entry)
            await asyncio.gather(
                self._pump(state, reader, upstream), self._pump(state, up_reader, writer)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass  # the peer is down or the link was cut: the node sees a lost connection
        finally:
            state.conns.discard(entry)
            reset(writer)
            if upstream is not None:
                reset(upstream)

    @staticmethod
    async def _pump(
        state: _LinkState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                await state.flowing.wait()
                piece = await reader.read(_PIECE)
                if not piece:
                    break
                if state.delay:
                    await asyncio.sleep(state.delay)
                await state.flowing.wait()  # read just before a black hole opened: hold it
                writer.write(piece)
                await writer.drain()
        finally:
            # Either side ending ends the connection both ways (the peer protocol has no
            # half-closed use).
            reset(writer)
