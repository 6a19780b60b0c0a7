"""A lease of the co-located path (``storaged.front.shm``) on an in-process node: its size and
what a graceful stop does with it.

A client talks to the node's real Unix socket by hand (``_Raw``), to do what the client
library never does: resize its memfd, hold a lease across a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from storaged.front.http import http_error
from storaged.front.shm import ShmListener, socket_path
from storaged.ids import chunk_id_of
from storaged.node import Node
from storaged.shmwire import FrameReader, send_frame
from tests.conftest import TOKEN
from tests.service.inproc import InprocFactory
from tiers import memory as memory_module
from tiers.nvme import NvmeTier

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


class _Raw:
    """The wire protocol by hand: one connection, one request at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock, accept_fds=True)
        self.rid = 0

    async def ask(self, doc: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        self.rid += 1
        await send_frame(self.sock, {**doc, "rid": self.rid})
        async with asyncio.timeout(60):
            reply = await self.reader.read()
        assert reply.get("rid") == self.rid, reply
        return reply, (self.reader.take_fd() if reply.get("fd") else None)


@contextlib.asynccontextmanager
async def _listening(node: Node) -> AsyncIterator[_Raw]:
    """``node`` with a shared-memory listener (the in-process harness runs none), and an
    authenticated connection to it."""
    listener = ShmListener(node, socket_path(node.config.data_dir), http_error)
    await listener.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    raw = _Raw(sock)
    try:
        await asyncio.get_running_loop().sock_connect(sock, str(listener.path))
        await send_frame(sock, {"op": "hello", "token": TOKEN})
        assert (await raw.reader.read()).get("ok") is True
        yield raw
    finally:
        raw.reader.close()
        sock.close()
        await listener.close()


def _unsealed_memfd(nbytes: int) -> int:
    """A lease's memfd as the node made it before its size was sealed at creation."""
    fd = os.memfd_create("storaged-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


async def test_a_node_deep_in_the_tree_under_a_deep_tmpdir_still_listens(
    inproc: InprocFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Unix socket path holds 108 bytes. A data directory too deep for its own
    ``shm/node.sock`` falls back to the temp dir; a ``TMPDIR`` too deep as well (pytest's
    own under xdist was: the node exited with ``AF_UNIX path too long``) falls back to
    ``/tmp``. The node listens and a client says hello either way."""
    deep = tmp_path.joinpath(*["a-directory-deep-in-the-tree"] * 5)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = socket_path(deep / "node-data")
    assert len(os.fsencode(path)) < 100 and not path.is_relative_to(deep), path
    assert path != socket_path(deep / "other-node-data")  # one per data directory
    cluster = await inproc.start(3)
    listener = ShmListener(cluster.node(0), path, http_error)
    await listener.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    reader = FrameReader(sock, accept_fds=True)
    try:
        await asyncio.get_running_loop().sock_connect(sock, str(listener.path))
        await send_frame(sock, {"op": "hello", "token": TOKEN})
        async with asyncio.timeout(30):
            assert (await reader.read()).get("ok") is True
    finally:
        reader.close()
        sock.close()
        await listener.close()


@pytest.mark.parametrize("resize", [48 * MiB, 4096], ids=["grown", "shrunk"])
async def test_seal_refuses_a_memfd_not_of_the_leased_size(
    inproc: InprocFactory, monkeypatch: pytest.MonkeyPatch, resize: int
) -> None:
    """Defence in depth behind the lease's size seals: were a lease's memfd resized all
    the same (here: made without them), the seal checks the size the seals then fix, and
    refuses (400 ``seal_refused``, nothing stored, nothing counted beyond the lease) a
    memfd grown (the node would keep 48 MiB counted as 64 KiB) or shrunk (the node's
    mapping of it failed: a 500 ``internal``)."""
    monkeypatch.setattr(memory_module, "_new_memfd", _unsealed_memfd)
    cluster = await inproc.start(3)
    node = cluster.node(0)
    blob = os.urandom(4096)
    async with _listening(node) as raw:
        before = node.memory.usage()
        reply, fd = await raw.ask({"op": "lease", "size": 64 << 10})
        assert fd is not None, reply
        try:
            os.ftruncate(fd, resize)
            with mmap.mmap(fd, max(resize, len(blob)), mmap.MAP_SHARED) as m:
                m[: len(blob)] = blob
        finally:
            os.close(fd)
        leased = node.memory.usage().used
        assert leased == before.used + (64 << 10)
        sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
        assert (sealed["status"], sealed.get("error")) == (400, "seal_refused"), sealed
        assert "release it" in sealed["message"]
        assert not node.memory.has(chunk_id_of(blob))
        assert node.memory.usage().used == leased
        released, _ = await raw.ask({"op": "release", "lease": reply["lease"]})
        assert released.get("ok") is True
        assert node.memory.usage().used == before.used
        assert node.memory.usage().count == before.count


async def _stop(cluster_node: Node, timeout: float) -> asyncio.Task[bool]:
    """``cluster_node.shutdown(timeout)`` under way, once the node is stopping."""
    task = asyncio.create_task(cluster_node.shutdown(timeout))
    for _ in range(200):
        if cluster_node.stopping:
            return task
        await asyncio.sleep(0.01)
    raise AssertionError("the node did not begin stopping")


def _stage(fd: int, size: int, blob: bytes) -> None:
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED) as m:
            m[: len(blob)] = blob
    finally:
        os.close(fd)


async def test_graceful_stop_waits_for_a_lease_being_staged(inproc: InprocFactory) -> None:
    """A lease is a PUT in flight from the moment it is taken: a graceful stop that
    begins while a client stages into one refuses new leases, waits for that one, seals
    it (acked, 201) and drains it to disk before it closes. (Before, the stop waited only
    for seals under way: it closed under the client, whose seal was never answered.)"""
    cluster = await inproc.start(3, drain_workers=0)
    node = cluster.node(0)
    blob = os.urandom(1 * MiB)
    cid = chunk_id_of(blob)
    async with _listening(node) as raw:
        reply, fd = await raw.ask({"op": "lease", "size": len(blob)})
        assert fd is not None, reply
        stopping = await _stop(node, timeout=60.0)
        refused, more = await raw.ask({"op": "lease", "size": 4096})
        assert (refused["status"], refused["error"]) == (503, "shutting_down") and more is None
        await asyncio.sleep(0.3)  # the client still staging
        assert not stopping.done(), "the stop did not wait for the lease"
        await asyncio.to_thread(_stage, fd, len(blob), blob)
        sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
        assert sealed["status"] == 201 and sealed["chunk"] == cid, sealed
        assert len(sealed["replicas"]) == 3
        assert await asyncio.wait_for(stopping, 60), "the stop left acked chunks RAM-only"
    cluster.members[0].node = None  # closed by its shutdown
    if cluster.members[0].runner is not None:
        await cluster.members[0].runner.cleanup()
        cluster.members[0].runner = None
    disk = await NvmeTier.open(node.config.data_dir / "nvme", capacity=1 << 40)
    try:
        assert disk.has(cid), "the chunk acked during the stop is not on the node's disk"
        assert bytes(await disk.get(cid)) == blob
    finally:
        await disk.close()


async def test_lease_held_past_the_stop_is_not_sealed_after_it(inproc: InprocFactory) -> None:
    """A graceful stop waits for a lease as for a PUT, bounded by its timeout; a seal that
    comes after that is refused (503 ``shutting_down``: the client puts it over HTTP
    elsewhere) and nothing of it is stored or acked, since the stop's drain is over."""
    cluster = await inproc.start(3)
    node = cluster.node(0)
    blob = os.urandom(64 << 10)
    async with _listening(node) as raw:
        reply, fd = await raw.ask({"op": "lease", "size": len(blob)})
        assert fd is not None, reply
        stopping = await _stop(node, timeout=0.5)
        assert await asyncio.wait_for(stopping, 60)
        assert node.writes_closed
        await asyncio.to_thread(_stage, fd, len(blob), blob)
        sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
        assert (sealed["status"], sealed.get("error")) == (503, "shutting_down"), sealed
        assert node.writes.inflight == 0
        assert "\nstoraged_shm_leases 0.0\n" in node.metrics.render().decode()
    cluster.members[0].node = None
    if cluster.members[0].runner is not None:
        await cluster.members[0].runner.cleanup()
        cluster.members[0].runner = None
    for i in (1, 2):
        assert not cluster.node(i).holds_hot(chunk_id_of(blob))
