"""The co-located fast path (``storaged.front.shm``, ``storaged.client.shm``) against real nodes.

Save and restore through ``Client``, ``AsyncSaver`` and DCP with the path on (and proof
it was used) and off; the socket's mode and token; a seal refused while the client
still maps its lease writable, and no way left to write a sealed chunk (not through the
client's descriptor, not through the node's /proc/PID/fd); a client SIGKILLed mid-lease
(the node frees its leases); a node SIGKILLed mid-seal (the client's puts complete over
HTTP and every acked chunk is still there).

Node processes (``LocalCluster``), not in-process nodes: the path is one between two
processes (a node process hands the client memory over a Unix socket, ``SCM_RIGHTS``),
and this module checks it as such: the sealed chunk is attacked through the node
process's own descriptors (``/proc/PID/fd``), a node process is SIGKILLed mid-seal,
SIGTERMed with a lease being staged and SIGSTOPped, and a client process is SIGKILLed
holding leases. The path against an in-process node with a listener is in
``tests/client/test_chunk_sources.py`` and ``tests/service/test_shm_node.py``; the other
client tests' clusters (``inproc_cluster``) give every node one too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import mmap
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from storaged.client import AsyncSaver, Client, restore_checkpoint, save_checkpoint
from storaged.client.errors import ChecksumMismatch, ChunkNotFound, Unauthorized
from storaged.client.shm import ShmPath, pick_node
from storaged.ids import chunk_id_of
from storaged.shmwire import FrameReader, WireError, send_frame
from storaged.tools.local_cluster import LocalCluster
from tests.client.helpers import client_for, client_sees_all_alive
from tests.conftest import TOKEN, ClusterFactory
from tiers.memory import size_class
from tiers.nvme import NvmeTier

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


async def _shm_socket(client: Client, node: int = 0) -> str:
    doc = await client.cluster_document()
    return str(doc["nodes"][node]["shm"]["socket"])


async def _node_doc(client: Client, node_id: str) -> dict[str, Any]:
    """The node's own entry of /v1/cluster (its own figures, not a heartbeat's)."""
    url = client.cluster.node(node_id).url
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
        session.get(f"{url}/v1/cluster", headers={"Accept": "application/json"}) as resp,
    ):
        doc = await resp.json()
    return next(n for n in doc["nodes"] if n["id"] == node_id)


async def _metric(url: str, name: str, default: float | None = None) -> float:
    """A sample of the node's /metrics; ``default`` when absent (else the test fails)."""
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
        session.get(f"{url}/metrics") as resp,
    ):
        text = await resp.text()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if match is None and default is not None:
        return default
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


async def _chunk_placed_on(
    client: Client, node_id: str, rng: np.random.Generator, size: int
) -> tuple[bytes, str]:
    """Put random chunks of ``size`` bytes until one has ``node_id`` among its replicas."""
    for _ in range(40):
        blob = rng.bytes(size)
        result = await client.put_chunk_result(blob)
        if node_id in result.replicas:
            return blob, result.chunk
    raise AssertionError(f"no chunk placed on {node_id} in 40 tries")


class RawShm:
    """The wire protocol by hand, for what the client never does (keep a mapping)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock, accept_fds=True)
        self.rid = 0

    @classmethod
    async def connect(cls, path: str, token: str) -> tuple[RawShm, dict[str, Any]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        raw = cls(sock)
        await send_frame(sock, {"op": "hello", "token": token})
        return raw, await raw.reader.read()

    async def ask(self, doc: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        self.rid += 1
        await send_frame(self.sock, {**doc, "rid": self.rid})
        async with asyncio.timeout(60):
            reply = await self.reader.read()
        assert reply.get("rid") == self.rid
        return reply, (self.reader.take_fd() if reply.get("fd") else None)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


# ---------------------------------------------------------------------- round trips


async def test_client_round_trip_uses_shared_memory(cluster: LocalCluster) -> None:
    rng = np.random.default_rng(1)
    blobs = [rng.bytes(n) for n in (1, 4096, 3 * MiB + 17, 8 * MiB)]
    async with client_for(cluster) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None and client.shm.node_id == client.cluster.nodes[0].id
        results = [await client.put_chunk_result(b) for b in blobs]
        for blob, result in zip(blobs, results, strict=True):
            assert result.chunk == chunk_id_of(blob)
            assert result.size == len(blob) and len(set(result.replicas)) == 3
            assert result.state == "memory"
        # A repeat is the "already stored" answer, through the same path.
        again = await client.put_chunk_result(blobs[2])
        assert not again.created and again.chunk == results[2].chunk
        assert client.stats.shm_chunks_uploaded == len(blobs) + 1
        for blob, result in zip(blobs, results, strict=True):
            assert bytes(await client.get_chunk(result.chunk)) == blob
        out = bytearray(MiB)
        from storaged.wire import ByteRange

        part = await client.get_chunk(results[3].chunk, out, ByteRange(5 * MiB, 6 * MiB))
        assert bytes(part) == blobs[3][5 * MiB : 6 * MiB]
        # node 0 holds every chunk of a 4-node cluster only where placement put it: those
        # it holds came from its RAM, the rest over HTTP.
        assert client.stats.shm_chunks_downloaded >= 1
        # A wrong id is refused as over HTTP, and nothing is stored.
        with pytest.raises(ChecksumMismatch):
            await client.put_chunk_result(b"not this" * 1000, chunk_id_of(b"other"))


async def test_range_reads_of_a_chunk_share_one_checked_mapping(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore reads a chunk as many ranges (one per tensor): one node request, one
    mapping and one hash serve them all, and the mapping goes once unused, never while a
    read that asked for it has yet to copy from it."""
    from storaged.client import shm as shm_module
    from storaged.wire import ByteRange

    rng = np.random.default_rng(11)
    read_ok = 'storaged_shm_ops_total{op="read",outcome="ok"}'
    async with client_for(cluster) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None
        local = client.shm.node_id
        blob, chunk = await _chunk_placed_on(client, local, rng, 4 * MiB)
        url = client.cluster.node(local).url
        before = await _metric(url, read_ok, default=0.0)
        pieces = [(i * 256 * 1024, (i + 1) * 256 * 1024) for i in range(16)]
        parts = await asyncio.gather(
            *(client.get_chunk(chunk, None, ByteRange(lo, hi)) for lo, hi in pieces)
        )
        for (lo, hi), part in zip(pieces, parts, strict=True):
            assert bytes(part) == blob[lo:hi]
        assert client.stats.shm_chunks_downloaded == len(pieces)
        assert await _metric(url, read_ok) == before + 1
        # Unused for longer than the idle time: unmapped; the next read asks the node again.
        await asyncio.sleep(shm_module._MAPPED_IDLE * 2.5)
        assert not client.shm._maps
        assert bytes(await client.get_chunk(chunk, None, ByteRange(0, 10))) == blob[:10]
        assert await _metric(url, read_ok) == before + 2
        # No room kept at all: every read that ends unmaps what nobody uses, yet the reads
        # waiting on the same mapping still copy from it (they count as users from the
        # moment they ask).
        await asyncio.sleep(shm_module._MAPPED_IDLE * 2.5)
        monkeypatch.setattr(shm_module, "_MAPPED_BYTES", 0)
        parts = await asyncio.gather(
            *(client.get_chunk(chunk, None, ByteRange(lo, hi)) for lo, hi in pieces)
        )
        assert [bytes(p) for p in parts] == [blob[lo:hi] for lo, hi in pieces]
        assert client.stats.shm_chunks_downloaded == 2 * len(pieces) + 1
        assert await _metric(url, read_ok) == before + 3
        assert not client.shm._maps


async def test_chunk_in_pooled_ram_is_read_over_http(cluster: LocalCluster) -> None:
    """A chunk the local node holds in its pooled buffers (it came over HTTP or as a
    replica's copy) is not copied into a new segment for the asker: the node answers
    chunk_not_found and the client reads it over HTTP."""
    rng = np.random.default_rng(12)
    not_found = 'storaged_shm_ops_total{op="read",outcome="chunk_not_found"}'
    async with client_for(cluster, shm=False) as http_client:
        await client_sees_all_alive(http_client)
        local = http_client.cluster.nodes[0].id
        blob, chunk = await _chunk_placed_on(http_client, local, rng, 2 * MiB)
    async with client_for(cluster) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None and client.shm.node_id == local
        url = client.cluster.node(local).url
        before = await _metric(url, not_found, default=0.0)
        assert bytes(await client.get_chunk(chunk)) == blob
        assert client.stats.shm_chunks_downloaded == 0
        assert client.stats.chunks_downloaded == 1
        assert await _metric(url, not_found) == before + 1


async def test_shm_off_by_option_and_by_environment(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob = os.urandom(2 * MiB)
    async with client_for(cluster, shm=False) as client:
        assert client.shm is None
        chunk = await client.put_chunk(blob)
        assert bytes(await client.get_chunk(chunk)) == blob
        assert client.stats.shm_chunks_uploaded == client.stats.shm_chunks_downloaded == 0
    monkeypatch.setenv("STORAGED_SHM", "0")
    async with client_for(cluster) as client:
        assert client.shm is None
    monkeypatch.delenv("STORAGED_SHM")
    async with client_for(cluster) as client:
        assert client.shm is not None


async def test_remote_looking_node_is_not_picked(cluster: LocalCluster) -> None:
    """A node whose host identity differs (another machine) keeps the client on HTTP."""
    async with client_for(cluster) as client:
        doc = await client.cluster_document()
    assert pick_node(doc, cluster.urls) is not None
    for node in doc["nodes"]:
        node["shm"]["host"] = "another-host"
    assert pick_node(doc, cluster.urls) is None
    assert pick_node(doc, ["http://127.0.0.1:1"]) is None


async def test_save_and_restore_through_client_and_async_saver(cluster: LocalCluster) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((512, 1024), dtype=np.float32)  # 2 MiB: several chunks
    state: dict[str, Any] = {"w": w, "b": rng.standard_normal(1000), "step": 7}
    name = f"shm-{uuid.uuid4().hex[:8]}"
    async with client_for(cluster) as client:
        await save_checkpoint(client, f"{name}/plain", {0: state}, chunk_size=512 << 10)
        assert client.stats.shm_chunks_uploaded > 0
        async with AsyncSaver(client, chunk_size=512 << 10) as saver:
            before = client.stats.shm_chunks_uploaded
            changed_w = w + 1
            handle = await saver.save(f"{name}/async", {0: {**state, "w": changed_w}})
            changed_w[:] = 0  # staged: the save must not see this
            await handle.acked()
            assert client.stats.shm_chunks_uploaded > before
        # shm=False: this saver's uploads go over HTTP though its client has the path.
        async with AsyncSaver(client, chunk_size=512 << 10, shm=False) as http_saver:
            before = client.stats.shm_chunks_uploaded
            uploaded = client.stats.chunks_uploaded
            handle = await http_saver.save(f"{name}/http", {0: {**state, "w": w + 2}})
            await handle.acked()
            assert client.stats.shm_chunks_uploaded == before
            assert client.stats.chunks_uploaded > uploaded
        got = await restore_checkpoint(client, f"{name}/http")
        assert np.array_equal(got["w"], w + 2)
        for tag, want in (("plain", w), ("async", w + 1)):
            before = client.stats.shm_chunks_downloaded
            got = await restore_checkpoint(client, f"{name}/{tag}")
            assert np.array_equal(got["w"], want) and got["step"] == 7
            assert client.stats.shm_chunks_downloaded > before
    async with client_for(cluster, shm=False) as client:
        got = await restore_checkpoint(client, f"{name}/async")
        assert np.array_equal(got["w"], w + 1)
        assert client.stats.shm_chunks_downloaded == 0


# ---------------------------------------------------------------------- the socket


async def test_socket_is_private_and_needs_the_token(cluster: LocalCluster) -> None:
    async with client_for(cluster) as client:
        path = await _shm_socket(client)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    for token in ("wrong-token", ""):
        raw, answer = await RawShm.connect(path, token)
        try:
            assert answer.get("error") == "unauthorized" and answer.get("status") == 401
            with pytest.raises(WireError):  # and the node hangs up
                await raw.reader.read()
        finally:
            raw.close()
    with pytest.raises(Unauthorized):
        await ShmPath.connect("n0", path, "wrong-token", 4)
    # Requests before a hello are not served either.
    raw = RawShm(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    raw.sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(raw.sock, path)
    try:
        await send_frame(raw.sock, {"op": "lease", "size": 4096, "rid": 1})
        answer = await raw.reader.read()
        assert answer.get("error") == "unauthorized" and not raw.reader.fds
    finally:
        raw.close()


def _memfds_of(pid: int) -> list[Path]:
    found = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(entry).startswith("/memfd:storaged-chunk"):
                found.append(entry)
        except OSError:
            continue  # closed meanwhile
    return found


async def test_sealed_bytes_cannot_be_changed(cluster: LocalCluster) -> None:
    """The seal is refused while the client maps its lease writable; once sealed, no
    descriptor (the client's, or the node's reopened through /proc) writes a byte."""
    blob = os.urandom(3 * MiB)
    async with client_for(cluster) as client:
        path = await _shm_socket(client)
        raw, answer = await RawShm.connect(path, TOKEN)
        try:
            assert answer.get("ok") is True
            reply, fd = await raw.ask({"op": "lease", "size": len(blob)})
            assert fd is not None
            kept = os.dup(fd)
            mapping = mmap.mmap(fd, len(blob), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            mapping[:] = blob
            refused, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
            assert refused["error"] == "seal_refused" and refused["status"] == 400
            mapping.close()
            sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
            assert sealed["status"] == 201 and sealed["chunk"] == chunk_id_of(blob), sealed
            chunk = sealed["chunk"]
            # The client's own descriptor: no writable mapping, no write, no truncate.
            with pytest.raises(PermissionError):
                mmap.mmap(kept, len(blob), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(kept, b"\xff", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(kept, 0)
            os.close(kept)
        finally:
            raw.close()
        # The node's descriptors, reopened read-write through /proc/PID/fd.
        node_pid = cluster.procs[0].pid
        memfds = _memfds_of(node_pid)
        assert memfds, "the node keeps its sealed segment"
        for entry in memfds:
            try:
                rw = os.open(entry, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                with pytest.raises(OSError) as caught:
                    os.pwrite(rw, b"\xff", 0)
                assert caught.value.errno == errno.EPERM
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(rw)
        # What is served is what was sealed, on both paths.
        assert bytes(await client.get_chunk(chunk)) == blob
    async with client_for(cluster, shm=False) as http_client:
        assert bytes(await http_client.get_chunk(chunk)) == blob


async def test_length_outside_the_lease_and_unknown_leases_are_refused(
    cluster: LocalCluster,
) -> None:
    async with client_for(cluster) as client:
        raw, _ = await RawShm.connect(await _shm_socket(client), TOKEN)
        try:
            reply, fd = await raw.ask({"op": "lease", "size": 8192})
            assert fd is not None
            os.close(fd)
            for length in (0, 8193, -1):
                refused, _ = await raw.ask(
                    {"op": "seal", "lease": reply["lease"], "length": length}
                )
                assert refused["error"] == "seal_refused", refused
            other, _ = await raw.ask({"op": "seal", "lease": 999_999, "length": 1})
            assert other["error"] == "bad_request"
            big, fd = await raw.ask({"op": "lease", "size": client.cluster.max_chunk_size + 1})
            assert big["error"] == "too_large" and fd is None
            released, _ = await raw.ask({"op": "release", "lease": reply["lease"]})
            assert released.get("ok") is True
            gone, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": 1})
            assert gone["error"] == "bad_request"
            # One connection holds at most max_client_puts leases (64 by default).
            for _ in range(64):
                held, fd = await raw.ask({"op": "lease", "size": 4096})
                assert fd is not None, held
                os.close(fd)
            more, fd = await raw.ask({"op": "lease", "size": 4096})
            assert more["error"] == "too_many_leases" and more["status"] == 503 and fd is None
        finally:
            raw.close()


def _fallocate_keep_size(fd: int, offset: int, length: int) -> int:
    """``fallocate(FALLOC_FL_KEEP_SIZE)``: pages past the end without changing the size
    (0, or the errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return 0 if libc.fallocate(fd, 1, offset, length) == 0 else ctypes.get_errno()


def _held_against_counted(pid: int) -> tuple[int, dict[int, int]]:
    """The bytes a node's memfds hold (the larger of size and pages, each), and each
    memfd's by inode."""
    held: dict[int, int] = {}
    for entry in _memfds_of(pid):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(entry)
            held[st.st_ino] = max(st.st_size, st.st_blocks * 512)
    return sum(held.values()), held


async def test_a_lease_grown_before_seal_holds_no_more_than_is_counted(
    cluster: LocalCluster,
) -> None:
    """A lease's size is fixed when it is handed out: a client that tries to make its
    memfd hold more than the node counts (grow it to 48 MiB by ftruncate, allocate past
    its end, write past its end) is refused by the kernel, and what the node keeps of it
    once sealed is exactly what its RAM tier counts. (Before, the grown memfd was kept
    whole as the chunk's RAM copy and counted as 4,096 bytes: memory_full and eviction
    never saw the rest.)"""
    blob = os.urandom(4096)
    async with client_for(cluster) as client:
        node = client.cluster.nodes[0]
        raw, _ = await RawShm.connect(await _shm_socket(client), TOKEN)
        try:
            reply, fd = await raw.ask({"op": "lease", "size": len(blob)})
            assert fd is not None, reply
            inode = os.fstat(fd).st_ino
            try:
                try:
                    os.ftruncate(fd, 48 * MiB)
                    with mmap.mmap(fd, 48 * MiB, mmap.MAP_SHARED) as grown:
                        grown[:] = b"\x01" * (48 * MiB)
                    resized = ["ftruncate"]
                except PermissionError:
                    resized = []
                with contextlib.suppress(PermissionError):
                    os.posix_fallocate(fd, 0, 56 * MiB)
                    resized.append("posix_fallocate")
                if _fallocate_keep_size(fd, 56 * MiB, 8 * MiB) == 0:
                    resized.append("fallocate(KEEP_SIZE)")
                with contextlib.suppress(PermissionError):
                    os.pwrite(fd, b"x", 64 * MiB)
                    resized.append("pwrite")
                with mmap.mmap(fd, len(blob), mmap.MAP_SHARED) as m:
                    m[:] = blob
            finally:
                os.close(fd)
            sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": 4096})
            if sealed["status"] != 201:
                assert (sealed["status"], sealed["error"]) == (400, "seal_refused"), sealed
                await raw.ask({"op": "release", "lease": reply["lease"]})
        finally:
            raw.close()
        total, held = _held_against_counted(cluster.procs[0].pid)
        used = (await _node_doc(client, node.id))["memory"]["used"]
        if sealed["status"] == 201:
            assert held.get(inode) == 4096, (
                f"the sealed chunk's memfd holds {held.get(inode)} bytes, 4096 are counted"
            )
        assert total <= used, f"the node's memfds hold {total} bytes, its RAM tier counts {used}"
        assert resized == [], f"a leased memfd was resized by {resized}"
        assert sealed["status"] == 201 and sealed["chunk"] == chunk_id_of(blob), sealed
        assert bytes(await client.get_chunk(sealed["chunk"])) == blob


async def test_a_lease_shrunk_before_seal_is_refused_not_an_internal_error(
    cluster: LocalCluster,
) -> None:
    """A client cannot shrink its lease either; had it been able to, the seal was a 500
    ``internal`` (the node's mapping of the leased size failed). A shrunk lease is never
    stored: the seal is refused (400 ``seal_refused``) or the shrink is."""
    async with client_for(cluster) as client:
        raw, _ = await RawShm.connect(await _shm_socket(client), TOKEN)
        try:
            reply, fd = await raw.ask({"op": "lease", "size": 64 << 10})
            assert fd is not None, reply
            try:
                os.ftruncate(fd, 4096)
                shrunk = True
            except PermissionError:
                shrunk = False
            finally:
                os.close(fd)
            sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": 4096})
            if shrunk:
                assert (sealed["status"], sealed.get("error")) == (400, "seal_refused"), sealed
                released, _ = await raw.ask({"op": "release", "lease": reply["lease"]})
                assert released.get("ok") is True
            else:
                assert sealed["status"] == 201, sealed
        finally:
            raw.close()
        assert not shrunk, "a leased memfd was shrunk"


async def test_a_refused_seal_falls_back_to_http_and_frees_the_lease(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seal the node refuses (here: the client's staging left a writable mapping) is a
    fallback to HTTP, and the client releases the lease the node kept for it: the node's
    RAM is not held by a dead lease until the connection closes."""
    import storaged.client.shm as client_shm

    kept: list[mmap.mmap] = []
    real_stage = client_shm._stage

    def stage_leaving_a_writable_mapping(fd: int, size: int, data: memoryview) -> None:
        kept.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
        real_stage(fd, size, data)

    blob = np.random.default_rng(7).bytes(2 * MiB + 5)
    async with client_for(cluster) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None
        node_id = client.shm.node_id
        before = (await _node_doc(client, node_id))["memory"]["used"]
        monkeypatch.setattr(client_shm, "_stage", stage_leaving_a_writable_mapping)
        try:
            result = await client.put_chunk_result(blob)
        finally:
            for m in kept:
                m.close()
        assert kept, "the shared-memory path was not tried"
        assert result.chunk == chunk_id_of(blob) and len(set(result.replicas)) == 3
        assert client.stats.shm_chunks_uploaded == 0
        assert bytes(await client.get_chunk(result.chunk)) == blob
        held = (await _node_doc(client, node_id))["memory"]["used"]
        # What the node holds now is the chunk (if it is a holder), never the lease too.
        holder = node_id in result.replicas
        assert held - before <= (size_class(len(blob)) if holder else 0), (
            f"node {node_id} RAM grew by {held - before} bytes: the refused lease is held"
        )


# ---------------------------------------------------------------------- failures

_LEASER = """
import asyncio, mmap, os, socket, sys
from storaged.ids import chunk_id_of
from storaged.shmwire import FrameReader, send_frame

async def main() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, sys.argv[1])
    reader = FrameReader(sock, accept_fds=True)
    await send_frame(sock, {"op": "hello", "token": sys.argv[2]})
    assert (await reader.read()).get("ok") is True
    for rid in range(1, 5):
        await send_frame(sock, {"op": "lease", "size": 4 << 20, "rid": rid})
        assert "lease" in await reader.read()
    # The last one staged whole and still mapped writable, never sealed.
    staged = mmap.mmap(reader.fds[-1], 4 << 20, mmap.MAP_SHARED)
    staged[:] = blob = os.urandom(4 << 20)
    print("leased", chunk_id_of(blob), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_client_killed_mid_lease_leaks_nothing(cluster_factory: ClusterFactory) -> None:
    """A client SIGKILLed holding leases, one of them staged whole and still mapped: the
    node frees their room and descriptors, nothing of the staged chunk is stored
    anywhere, and the leases no longer count as PUTs in flight (a graceful stop after
    it does not wait its ``stop_timeout`` out for them)."""
    cluster = await cluster_factory.start(3, stop_timeout=600.0)
    async with client_for(cluster, shm=False) as client:
        await client_sees_all_alive(client)
        node = client.cluster.nodes[0]
        path = await _shm_socket(client)
        used_before = (await _node_doc(client, node.id))["memory"]["used"]
        assert await _metric(node.url, "storaged_shm_leases") == 0
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _LEASER, path, TOKEN, stdout=subprocess.PIPE, env=env
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            said, staged = line.decode().split()
            assert said == "leased"
            assert await _metric(node.url, "storaged_shm_leases") == 4
            used = (await _node_doc(client, node.id))["memory"]["used"]
            assert used >= used_before + 4 * (4 << 20)
        finally:
            proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), 30)
        for _ in range(300):
            leases = await _metric(node.url, "storaged_shm_leases")
            used = (await _node_doc(client, node.id))["memory"]["used"]
            if leases == 0 and used == used_before:
                break
            await asyncio.sleep(0.1)
        assert (leases, used) == (0, used_before)
        assert not _memfds_of(cluster.procs[0].pid)
        for n in client.cluster.nodes:
            assert (await _node_doc(client, n.id))["memory"]["count"] == 0
        with pytest.raises(ChunkNotFound):
            await client.get_chunk(staged)
    # Nothing in flight is left: the stop does not wait (600 s) for the dead client.
    stopping = cluster.procs[0]
    stopping.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(stopping.wait, 60) == 0


async def test_sigterm_waits_for_a_lease_being_staged(cluster_factory: ClusterFactory) -> None:
    """A lease is a PUT in flight from the moment it is taken: a node SIGTERMed while a
    client stages into one refuses new leases, waits for that one, answers its seal (201)
    and has the chunk on its disk when it has stopped. (Before, the stop did not wait:
    the node exited under the client, whose seal was never answered.)"""
    cluster = await cluster_factory.start(3)
    blob = os.urandom(2 * MiB)
    cid = chunk_id_of(blob)
    async with client_for(cluster, shm=False) as client:
        await client_sees_all_alive(client)
        raw, _ = await RawShm.connect(await _shm_socket(client), TOKEN)
    try:
        reply, fd = await raw.ask({"op": "lease", "size": len(blob)})
        assert fd is not None, reply
        proc = cluster.procs[0]
        proc.send_signal(signal.SIGTERM)
        for _ in range(200):  # until the node is stopping: new leases are refused
            more, extra = await raw.ask({"op": "lease", "size": 4096})
            if extra is None:
                assert (more["status"], more["error"]) == (503, "shutting_down"), more
                break
            os.close(extra)
            await raw.ask({"op": "release", "lease": more["lease"]})
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the node never began stopping")
        await asyncio.sleep(0.3)  # the client still staging
        assert proc.poll() is None, "the node stopped under a lease"
        with mmap.mmap(fd, len(blob), mmap.MAP_SHARED) as m:
            m[:] = blob
        os.close(fd)
        sealed, _ = await raw.ask({"op": "seal", "lease": reply["lease"], "length": len(blob)})
        assert sealed["status"] == 201 and sealed["chunk"] == cid, sealed
    finally:
        raw.close()
    assert await asyncio.to_thread(proc.wait, 60) == 0
    disk = await NvmeTier.open(cluster.data / cluster.node_id(0) / "nvme", capacity=1 << 40)
    try:
        assert disk.has(cid), "the chunk acked during the stop is not on the node's disk"
        assert bytes(await disk.get(cid)) == blob
    finally:
        await disk.close()


async def test_node_killed_mid_seal_puts_complete_and_nothing_acked_is_lost(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory.start(4)
    rng = np.random.default_rng(3)
    # 128 MiB of random bytes: made in a thread, off the test's event loop
    blobs = await asyncio.to_thread(lambda: [rng.bytes(4 * MiB) for _ in range(32)])
    async with client_for(cluster, max_concurrency=4) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None

        async def kill_when_busy() -> None:
            for _ in range(600):
                if client.stats.shm_chunks_uploaded >= 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.to_thread(cluster.kill, 0)

        killer = asyncio.create_task(kill_when_busy())
        results = await asyncio.gather(*(client.put_chunk_result(b) for b in blobs))
        await killer
        assert not cluster.alive(0)
        assert client.shm.broken, "the shared-memory path saw its node die"
        assert 2 <= client.stats.shm_chunks_uploaded < len(blobs)
        for blob, result in zip(blobs, results, strict=True):
            assert result.chunk == chunk_id_of(blob) and len(set(result.replicas)) == 3
    # Every acked chunk is there, from the nodes left (a client now picks node 1's socket,
    # once the cluster knows node 0 is gone).
    async with client_for(cluster, shm=False) as watcher:
        for _ in range(300):
            if not (await watcher.refresh_cluster()).nodes[0].alive:
                break
            await asyncio.sleep(0.1)
        assert not watcher.cluster.nodes[0].alive
    async with client_for(cluster) as client:
        assert client.shm is not None and client.shm.node_id == cluster.node_id(1)
        missing = await client.missing_chunks([r.chunk for r in results])
        assert missing == []
        for blob, result in zip(blobs, results, strict=True):
            assert bytes(await client.get_chunk(result.chunk)) == blob


# ---------------------------------------------------------------------- DCP


@pytest.mark.torch
@pytest.mark.parametrize("shm", [None, False])
def test_dcp_writer_and_reader(cluster: LocalCluster, shm: bool | None) -> None:
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from storaged.client.dcp import StoragedReader, StoragedWriter

    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(7, generator=g)}
    name = f"shm-dcp-{uuid.uuid4().hex[:8]}/{shm}"
    writer = StoragedWriter(cluster.urls, name, TOKEN, chunk_size=256 << 10, shm=shm)
    dcp_save(state, storage_writer=writer, no_dist=True)
    assert writer.last_stats is not None
    out = {"w": torch.zeros(1024, 512), "b": torch.zeros(7)}
    reader = StoragedReader(cluster.urls, name, TOKEN, shm=shm)
    dcp_load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert reader.last_read is not None
    if shm is False:
        assert writer.last_stats.shm_chunks_uploaded == 0
        assert reader.last_read.shm_bytes == 0
    else:
        assert writer.last_stats.shm_chunks_uploaded == writer.last_stats.chunks_uploaded > 0
        assert reader.last_read.shm_bytes > 0


async def test_paused_node_the_client_gives_up_the_path_and_puts_over_http(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory.start(4)
    blob = os.urandom(MiB)
    async with client_for(cluster, request_timeout=3.0) as client:
        await client_sees_all_alive(client)
        assert client.shm is not None
        os.kill(cluster.procs[0].pid, signal.SIGSTOP)
        try:
            result = await client.put_chunk_result(blob)
        finally:
            os.kill(cluster.procs[0].pid, signal.SIGCONT)
        assert client.shm.broken and client.stats.shm_chunks_uploaded == 0
        assert result.chunk == chunk_id_of(blob) and cluster.node_id(0) not in result.replicas
    async with client_for(cluster, shm=False) as reader:
        assert bytes(await reader.get_chunk(result.chunk)) == blob
