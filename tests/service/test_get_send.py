"""Chunk GET bodies are sent as views (``server._send_body``), not as ``web.Response`` bodies.

The wire answer must be the one ``web.Response`` gave (``loadtest.harness.response_node``,
a node that still answers that way: the baseline of ``loadtest.nodesend``), and a client
that goes away in the middle of a body must leave the node as it was.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from loadtest.harness.response_node import ANSWERED, RESPONSE_NODE
from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import ADMIN_TOKEN, TOKEN, ClusterFactory
from tests.service.http import Api, manifest_for, random_chunk

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def api(cluster: LocalCluster) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as session:
        yield Api(session, cluster.urls[0], TOKEN)


def _exchange(port: int, request: bytes) -> tuple[bytes, bytes]:
    """(head, body) of one raw HTTP/1.1 exchange; the body read to Content-Length (none
    for a HEAD)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            assert got, buf
            buf += got
        head, _, body = buf.partition(b"\r\n\r\n")
        m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        size = int(m.group(1)) if m and not request.startswith(b"HEAD ") else 0
        while len(body) < size:
            got = s.recv(1 << 20)
            assert got, (head, len(body))
            body += got
        return head, body


#: headers that differ between two clusters whatever the send: the time, and how far the
#: background drain and encode of the chunk got (HEAD's state: "memory" on one cluster and
#: "nvme" on the other when one drained first, seen on a loaded machine)
_UNCOMPARED = (b"date:", b"x-storaged-state:")


def _head_lines(head: bytes) -> list[bytes]:
    """The head's status line and header lines, sorted, without ``_UNCOMPARED`` headers."""
    status, *lines = head.split(b"\r\n")
    return [status, *sorted(line for line in lines if not line.lower().startswith(_UNCOMPARED))]


def _get(cid: str, extra: str = "") -> bytes:
    return (
        f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    ).encode()


def _answered_by_response(cluster: LocalCluster) -> bool:
    """Whether node 0 of ``cluster`` answered a chunk GET with ``web.Response``."""
    return ANSWERED in cluster.log_path(0).read_text()


async def test_same_answer_as_web_response(
    api: Api, cluster: LocalCluster, cluster_factory: ClusterFactory
) -> None:
    old = await cluster_factory.start(2, replication=2, k=1, n=2, node_module=RESPONSE_NODE)
    data = random_chunk(3 * 2**20 + 5)
    cid = chunk_id_of(data)
    empty = chunk_id_of(b"")
    async with aiohttp.ClientSession() as session:
        old_api = Api(session, old.urls[0], TOKEN)
        for a in (api, old_api):
            assert (await a.put_chunk(data)).status in (200, 201)
            assert (await a.put_chunk(b"")).status in (200, 201)
    requests = [
        _get(cid),
        _get(cid, "Range: bytes=10-19\r\n"),
        _get(cid, "Range: bytes=-5\r\n"),
        _get(cid, f"Range: bytes={len(data) - 3}-\r\n"),
        _get(cid, "Range: bytes=99999999-\r\n"),
        _get(cid, "Range: lines=1-2\r\n"),
        _get(empty),
        _get(chunk_id_of(b"never stored")),
        _get("not-an-id"),
        f"HEAD /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Connection: close\r\n\r\n".encode(),
    ]
    for request in requests:
        new_head, new_body = await asyncio.to_thread(_exchange, cluster.port, request)
        old_head, old_body = await asyncio.to_thread(_exchange, old.port, request)
        assert _head_lines(new_head) == _head_lines(old_head), request
        assert new_body == old_body, request
    # The reference really is the old path, and the product's node does not take it.
    assert _answered_by_response(old) and not _answered_by_response(cluster)
    head, body = await asyncio.to_thread(_exchange, cluster.port, requests[1])
    assert head.startswith(b"HTTP/1.1 206 ") and body == data[10:20]
    head, body = await asyncio.to_thread(_exchange, cluster.port, requests[0])
    assert head.startswith(b"HTTP/1.1 200 ") and body == data


async def test_same_answer_from_nvme(cluster_factory: ClusterFactory) -> None:
    # The nvme tier's bytes (read and BLAKE3-checked per GET) go through the same send.
    # A chunk node 0 owns: it keeps the nvme copy once the chunk is cold (retention).
    data = next(
        d
        for d in (random_chunk(2 * 2**20 + 11) for _ in range(64))
        if rendezvous_order(chunk_id_of(d), ["n0", "n1"])[0] == "n0"
    )
    cid = chunk_id_of(data)
    clusters = {}
    for mode, module in (("stream", "storaged"), ("response", RESPONSE_NODE)):
        clusters[mode] = await cluster_factory.start(2, replication=2, k=1, n=2, node_module=module)
    async with aiohttp.ClientSession() as session:
        for c in clusters.values():
            a = Api(session, c.urls[0], TOKEN)
            assert (await a.put_chunk(data)).status == 201
            assert (await a.commit("send/nvme", manifest_for([data]))).status == 201
            await a.wait_state("send/nvme", "cold", timeout=60)
            for _ in range(100):  # until node 0 has dropped its RAM copy (drained by now)
                r = await a.request(
                    "POST",
                    "/v1/admin/evict",
                    doc={"checkpoint": "send/nvme", "tier": "memory"},
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                )
                assert r.status == 200
                if (await a.get_chunk(cid)).headers["X-Storaged-Tier"] == "nvme":
                    break
                await asyncio.sleep(0.1)
    requests = [_get(cid), _get(cid, "Range: bytes=10-19\r\n"), _get(cid, "Range: bytes=-5\r\n")]
    for request in requests:
        new_head, new_body = await asyncio.to_thread(_exchange, clusters["stream"].port, request)
        old_head, old_body = await asyncio.to_thread(_exchange, clusters["response"].port, request)
        assert b"x-storaged-tier: nvme" in new_head.lower(), new_head
        assert _head_lines(new_head) == _head_lines(old_head), request
        assert new_body == old_body, request
    assert new_body == data[-5:]
    assert _answered_by_response(clusters["response"])
    assert not _answered_by_response(clusters["stream"])


def _walk_away(port: int, cid: str, reset: bool, at: int) -> int:
    """GET ``cid`` with a small receive buffer, read ``at`` bytes or more of the answer
    (0: none), then leave: with a RST when ``reset``, else a plain close. Returns the bytes
    read."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.settimeout(20)
        s.connect(("127.0.0.1", port))
        s.sendall(_get(cid))
        got = 0
        while got < at:
            piece = s.recv(65536)
            assert piece
            got += len(piece)
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return got


def _open_connections(port: int) -> int:
    """TCP connections of the node's HTTP ``port`` still open on the node's side (any state
    but listening and TIME_WAIT): one the node forgot to close stays in CLOSE_WAIT."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if int(local.rsplit(":", 1)[1], 16) == port and state not in ("0A", "06"):
                    n += 1
    return n


async def _internal_errors(api: Api) -> float:
    text = (await api.request("GET", "/metrics")).raw.decode()
    m = re.search(r'^storaged_errors_total\{code="internal"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_client_leaving_mid_body_leaves_node_intact(api: Api, cluster: LocalCluster) -> None:
    data = random_chunk(16 * 2**20)
    cid = chunk_id_of(data)
    assert (await api.put_chunk(data)).status in (200, 201)
    assert (await api.get_chunk(cid)).raw == data
    errors_before = await _internal_errors(api)
    before = _open_connections(cluster.port)
    for i in range(24):
        # Half leave before the answer starts, half in the middle of the body.
        at = 0 if i % 4 < 2 else 200_000
        got = await asyncio.to_thread(_walk_away, cluster.port, cid, i % 2 == 0, at)
        assert at <= got < len(data)
    # The node closes every abandoned connection (and with it drops the queued body).
    deadline = time.monotonic() + 15
    while _open_connections(cluster.port) > before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert _open_connections(cluster.port) <= before
    # Nothing counted as an internal error, and the node still serves the whole chunk.
    assert await _internal_errors(api) == errors_before
    again = await api.get_chunk(cid)
    assert again.status == 200 and again.raw == data
    assert again.headers["X-Storaged-Tier"] == "memory"
