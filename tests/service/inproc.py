"""Nodes in the test's own event loop: real ``Node``s, each serving its real HTTP app and
peer server on 127.0.0.1, so that the fixture that fails a blocked event loop also covers
node code, and a test can look at (and break) a node's tiers, index and catalogue directly.

A node stopped with ``kill`` is the equivalent of a dead process: its HTTP site and peer
server close without draining (requests in flight are cancelled, peers see their
connections drop) and its RAM is gone; ``restart`` opens it again from its data directory.
Where a scenario needs a real crash or SIGTERM, use ``storaged.tools.local_cluster.LocalCluster``.

``EtcdInprocCluster`` runs the same nodes on an etcd's membership and catalogue; the
``inproc`` fixture starts those under ``--coordinator etcd``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from aiohttp import web

from storaged.config import Config, NodeSpec
from storaged.front.http import http_error, make_app
from storaged.front.shm import ShmListener, socket_path
from storaged.ids import chunk_id_of
from storaged.node import Node
from storaged.tools.local_cluster import ClusterError, default_erasure, free_port_block
from tests.conftest import FAST_SETTINGS, TOKEN
from tiers.memory import Allocation

SECRET = "inproc-cluster-secret-0123456789"

#: tests/conftest.py's FAST_SETTINGS as flat Config fields (a Config takes no [tiers] table);
#: RAM and chunks are smaller since every node lives in this process
INPROC_SETTINGS: dict[str, Any] = {
    **{k: v for k, v in FAST_SETTINGS.items() if k != "tiers"},
    "max_chunk_size": 4 * 2**20,
    "memory_capacity": 64 * 2**20,
    "nvme_capacity": 1 * 2**30,
    "cold_capacity": 1 * 2**30,
}


async def wait_until(
    what: str, check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0
) -> None:
    """Poll ``check`` (sync or async) every 50 ms until it is true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


@dataclass
class Member:
    index: int
    config: Config
    node: Node | None = None
    runner: web.AppRunner | None = None


@dataclass
class InprocCluster:
    """``nodes`` in-process nodes with data under ``root``; ``per_node[i]`` overrides settings
    of node ``i`` (e.g. its ``peer_routes`` or ``put_wait``)."""

    root: Path
    nodes: int = 4
    settings: dict[str, Any] = field(default_factory=dict)
    per_node: dict[int, dict[str, Any]] = field(default_factory=dict)
    members: list[Member] = field(default_factory=list)
    port: int = 0

    # ---- addresses and configuration ------------------------------------------------------
    def node_id(self, i: int) -> str:
        return f"n{i}"

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + i}"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(self.nodes)]

    def peer_port(self, i: int) -> int:
        return self.port + self.nodes + i

    def index_of(self, node_id: str) -> int:
        return int(node_id[1:])

    #: ports taken from the block per node: its HTTP site (its url) and its peer port
    PORTS_PER_NODE = 2

    def listen_addr(self, i: int) -> tuple[str, int]:
        """Where node ``i``'s HTTP site listens: at its url (a subclass that advertises a
        proxy there listens elsewhere)."""
        return self.members[i].config.node.http_addr

    def _config(self, i: int) -> Config:
        specs = tuple(
            NodeSpec(
                self.node_id(j),
                self.url(j),
                f"127.0.0.1:{self.peer_port(j)}",
                str(self.root / self.node_id(j)),
            )
            for j in range(self.nodes)
        )
        k, n = default_erasure(self.nodes)
        values = {**INPROC_SETTINGS, "k": k, "n": n, **self.settings, **self.per_node.get(i, {})}
        return dataclasses.replace(
            Config(node_id=self.node_id(i), nodes=specs, token=TOKEN, cluster_secret=SECRET),
            **values,
        ).validate()

    def configure(self, i: int, **overrides: Any) -> None:
        """Change node ``i``'s settings for its next (re)start."""
        self.per_node[i] = {**self.per_node.get(i, {}), **overrides}

    # ---- nodes ----------------------------------------------------------------------------
    def node(self, i: int) -> Node:
        """The running node ``i`` (fails if it is stopped)."""
        node = self.members[i].node
        if node is None:
            raise AssertionError(f"{self.node_id(i)} is not running")
        return node

    def http_connections(self, i: int) -> int:
        """Open client connections to node ``i``'s HTTP site (0 when it is stopped)."""
        runner = self.members[i].runner
        server = runner.server if runner is not None else None
        return len(server.connections) if server is not None else 0

    def running(self) -> list[int]:
        return [m.index for m in self.members if m.node is not None]

    async def start(self, timeout: float = 60.0) -> None:
        for attempt in range(3):
            self.port = free_port_block(self.nodes * self.PORTS_PER_NODE)
            self.members = [Member(i, self._config(i)) for i in range(self.nodes)]
            try:
                for i in range(self.nodes):
                    await self.start_node(i)
            except OSError:
                # Another process took a port between the check and the bind.
                await self.close()
                if attempt == 2:
                    raise
                continue
            await self.wait_converged(timeout)
            return

    async def start_node(self, i: int) -> None:
        member = self.members[i]
        if member.node is not None:
            raise ClusterError(f"{self.node_id(i)} is already running")
        member.config = self._config(i)
        node = await self.open_node(member.config)
        runner = web.AppRunner(
            make_app(node),
            access_log=None,
            keepalive_timeout=member.config.keepalive_timeout,
            handler_cancellation=True,
            # kill() is a dead process: requests in flight are cut, not waited for
            shutdown_timeout=0.0,
        )
        try:
            await runner.setup()
            await node.start()
            host, port = self.listen_addr(i)
            await web.TCPSite(runner, host, port, backlog=128).start()
        except BaseException:
            with contextlib.suppress(Exception):
                await runner.cleanup()
            await node.close()
            raise
        member.node, member.runner = node, runner

    async def open_node(self, config: Config) -> Node:
        """The node for ``config``, not started (a subclass injects its coordinator here)."""
        return await Node.open(config)

    async def kill(self, i: int) -> None:
        """Stop node ``i`` like a dead process: nothing drains, its RAM is lost, and its HTTP
        site stops listening with every open connection cut (a client in the middle of a
        request sees the connection drop, never an answer). ``runner.cleanup`` alone waits
        for the requests in flight (aiohttp takes ``shutdown_timeout=0`` for no limit) and
        stops reading their bodies: a PUT under way was answered 400 truncated once its
        body budget was spent, and a GET whose reader had stopped held the kill."""
        member = self.members[i]
        node, runner = member.node, member.runner
        member.node = member.runner = None
        if runner is not None:
            for site in runner.sites:
                with contextlib.suppress(Exception):
                    await site.stop()
            server = runner.server
            for handler in server.connections if server is not None else []:
                if handler.transport is not None:
                    handler.transport.abort()
                handler.force_close()
            with contextlib.suppress(Exception):
                await runner.cleanup()
        if node is not None:
            await node.close()

    async def restart(self, i: int, timeout: float = 60.0) -> None:
        """Open node ``i`` again from its data directory and wait until all agree who is up."""
        await self.kill(i)
        await self.start_node(i)
        await self.wait_converged(timeout)

    async def wait_converged(self, timeout: float = 60.0) -> None:
        """Until every running node sees exactly the running nodes as alive."""
        running = {self.node_id(i) for i in self.running()}

        def agreed() -> bool:
            return all(set(self.node(i).membership.alive_ids()) == running for i in self.running())

        await wait_until(f"nodes agree that {sorted(running)} are up", agreed, timeout)

    async def close(self) -> None:
        for member in self.members:
            await self.kill(member.index)

    # ---- what the nodes hold ----------------------------------------------------------------
    def hot_holders(self, chunk_id: str) -> list[str]:
        """Running nodes with a copy of ``chunk_id`` in RAM or on nvme."""
        return [self.node_id(i) for i in self.running() if self.node(i).holds_hot(chunk_id)]

    def fragments(self, chunk_id: str) -> set[int]:
        """Fragment indexes of ``chunk_id`` held by the running nodes."""
        out: set[int] = set()
        for i in self.running():
            out |= self.node(i).fragments.get(chunk_id, set())
        return out

    def order(self, chunk_id: str) -> list[int]:
        """Node indexes in ``chunk_id``'s placement order (as the first running node sees it)."""
        first = self.node(self.running()[0])
        return [self.index_of(n) for n in first.placement().order(chunk_id)]


@dataclass
class EtcdInprocCluster(InprocCluster):
    """In-process nodes whose membership and catalogue are etcd's (``settings`` carries the
    ``coordinator`` URL, with a key prefix of this cluster's own)."""

    ttl: int = 3
    catalogue_options: dict[str, Any] = field(default_factory=dict)

    async def open_node(self, config: Config) -> Node:
        # Imported here: the embedded runs need no etcd client installed.
        from storaged.coord.etcd import EtcdSession
        from storaged.coord.etcd_catalogue import EtcdCatalogue
        from storaged.coord.etcd_membership import EtcdMembership

        session = EtcdSession(config.coordinator)
        membership = EtcdMembership(config, session, ttl=self.ttl)
        options = self.catalogue_options
        return await Node.open(
            config,
            membership=membership,
            catalogue=lambda node: EtcdCatalogue(node, session, **options),
        )


class InprocFactory:
    """Starts in-process clusters; ``close_all`` stops every node (the fixture calls it).
    With ``coordinator`` (a fresh coordinator URL per call) the clusters run on etcd."""

    def __init__(self, root: Path, coordinator: Callable[[], str] | None = None) -> None:
        self.root = root
        self.coordinator = coordinator
        self.clusters: list[InprocCluster] = []

    async def start(
        self,
        nodes: int = 4,
        *,
        per_node: dict[int, dict[str, Any]] | None = None,
        archive: str = "",
        **settings: Any,
    ) -> InprocCluster:
        """``archive``: the archive every node points at (``archive_endpoint`` and the other
        ``archive_*`` settings go in ``settings``; credentials in the environment)."""
        if archive:
            settings = {**settings, "archive": archive}
        root = self.root / f"inproc{len(self.clusters)}"
        cluster: InprocCluster
        if self.coordinator is None:
            cluster = InprocCluster(root, nodes, settings, dict(per_node or {}))
        else:
            settings = {**settings, "coordinator": self.coordinator()}
            cluster = EtcdInprocCluster(root, nodes, settings, dict(per_node or {}))
        self.clusters.append(cluster)
        await cluster.start()
        return cluster

    async def close_all(self) -> None:
        for cluster in self.clusters:
            await cluster.close()


@dataclass
class ShmInprocCluster(InprocCluster):
    """In-process nodes each given a shared-memory listener, as ``storaged serve`` gives its
    node one: a client on this host then puts and reads through its first seed's node by
    shared memory, as it does with node processes. A node's listener closes when the node
    is killed (``kill``, ``crash``); a restarted node gets a new one."""

    listeners: dict[int, ShmListener] = field(default_factory=dict)

    async def start_node(self, i: int) -> None:
        await super().start_node(i)
        node = self.node(i)
        listener = ShmListener(node, socket_path(node.config.data_dir), http_error)
        try:
            await listener.start()
        except BaseException:
            await super().kill(i)
            raise
        node.shm_info = listener.info()
        self.listeners[i] = listener

    async def kill(self, i: int) -> None:
        listener = self.listeners.pop(i, None)
        if listener is not None:
            await listener.close()
        await super().kill(i)


@dataclass
class EtcdShmInprocCluster(ShmInprocCluster, EtcdInprocCluster):
    """``ShmInprocCluster``'s listeners on ``EtcdInprocCluster``'s coordination."""


async def start_with_shm(
    factory: InprocFactory, nodes: int = 4, **settings: Any
) -> ShmInprocCluster:
    """``factory.start(nodes, **settings)`` with a shared-memory listener on every node
    (``ShmInprocCluster``); stopped by the factory's ``close_all`` as its own clusters."""
    root = factory.root / f"inproc{len(factory.clusters)}"
    cluster: ShmInprocCluster
    if factory.coordinator is None:
        cluster = ShmInprocCluster(root, nodes, settings)
    else:
        settings = {**settings, "coordinator": factory.coordinator()}
        cluster = EtcdShmInprocCluster(root, nodes, settings)
    factory.clusters.append(cluster)
    await cluster.start()
    return cluster


async def put_bytes(node: Node, data: bytes) -> tuple[int, dict[str, Any]]:
    """PUT ``data`` as one chunk through ``node``'s write path (as the HTTP layer does)."""

    async def body() -> Any:
        yield memoryview(data)

    return await node.put_chunk(chunk_id_of(data), len(data), body())


async def hog_memory(node: Node) -> list[Allocation]:
    """Take every free byte of ``node``'s RAM tier (as outstanding allocations), so that PUTs
    to it meet a real ``memory_full``; give it back with ``release_memory``."""
    held: list[Allocation] = []
    for size in (2**20, 64 * 2**10, 4 * 2**10):
        # bounded: at most capacity / size allocations of each size
        for _ in range(node.config.memory_capacity // size + 1):
            try:
                held.append(await node.memory.allocate(size, timeout=0))
            except Exception:
                break
    return held


def release_memory(node: Node, held: list[Allocation]) -> None:
    while held:
        node.memory.release(held.pop())


# ---- a fault proxy for one peer link ----------------------------------------------------------
_PREFIX_LEN = 4


class TcpProxy:
    """A TCP proxy to ``target``, each connection to a connection of its own there:
    ``relay_up`` forwards what the connection sends (a subclass reads into it),
    ``relay_down`` what comes back. ``link`` makes the state a connection's two directions
    share. ``close`` cuts every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[Any]] = set()  # the connections' own tasks
        self._tasks: set[asyncio.Task[None]] = set()  # their downstream relays
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self, port: int = 0) -> int:
        """Listen on ``port`` (0: one the kernel picks); the port listened on."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        # A connection's task ends once its transports are cut (a cancelled one, asyncio
        # logs); one held on something else (a gate) is cancelled after a while.
        if self._serving:
            await asyncio.wait(self._serving, timeout=1.0)
        for task in [*self._serving, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._serving, *self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers += [writer, up_writer]
        link = self.link()
        down = asyncio.create_task(self.relay_down(up_reader, writer, link))
        self._tasks.add(down)
        down.add_done_callback(self._tasks.discard)
        try:
            await self.relay_up(reader, up_writer, link)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            up_writer.transport.abort()
            writer.transport.abort()

    def link(self) -> Any:
        """The state a new connection's two directions share (none here)."""
        return None

    async def relay_down(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Any
    ) -> None:
        """The answers, as they come, each piece shown to ``seen_down`` first."""
        with contextlib.suppress(OSError):
            while piece := await reader.read(1 << 16):
                self.seen_down(piece, link)
                writer.write(piece)
                await writer.drain()
        writer.transport.abort()

    def seen_down(self, piece: bytes, link: Any) -> None:
        """A piece of an answer, about to go down (nothing is done with it here)."""

    async def relay_up(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Any
    ) -> None:
        raise NotImplementedError


class PeerLinkProxy(TcpProxy):
    """A TCP proxy for one node's connections to one peer (route them here with the node's
    ``peer_routes``). It understands the peer protocol's framing from client to server just
    enough to find chunk bodies: with ``flip``, it flips one byte of the first put body of
    ``chunk_id`` it forwards; with ``gate``, it holds that put (header and body) until the
    gate is set. ``put_seen`` is set once such a put arrived here."""

    def __init__(
        self,
        target: tuple[str, int],
        chunk_id: str,
        *,
        flip: bool = True,
        gate: asyncio.Event | None = None,
    ) -> None:
        super().__init__(target)
        self.chunk_id = chunk_id
        self.flip = flip
        self.gate = gate
        self.put_seen = asyncio.Event()
        self.flipped = 0

    async def relay_up(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Any
    ) -> None:
        await self._requests(reader, writer)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward frames (u32 length, msgpack header, body) one by one."""
        while True:
            prefix = await reader.readexactly(_PREFIX_LEN)
            packed = await reader.readexactly(int.from_bytes(prefix, "big"))
            header = msgpack.unpackb(packed, raw=False)
            if header.get("op") == "put":
                size = int(header.get("size", 0))
            else:
                size = int(header.get("body", 0) or 0)
            ours = header.get("op") == "put" and header.get("id") == self.chunk_id
            if ours:
                self.put_seen.set()
                if self.gate is not None:
                    await self.gate.wait()
            writer.write(prefix + packed)
            left = size
            first = ours and self.flip and self.flipped == 0
            while left:
                piece = bytearray(await reader.read(min(left, 1 << 16)))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", left)
                if first:
                    piece[0] ^= 0xFF
                    self.flipped += 1
                    first = False
                left -= len(piece)
                writer.write(piece)
                await writer.drain()
            await writer.drain()
