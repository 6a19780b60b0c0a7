"""Client behaviour that needs no cluster: error mapping, retry policy, placement, and the
request engine's failover and retry decisions over a scripted transport."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgpack
import pytest

from storaged.client import client as client_module
from storaged.client.client import (
    Client,
    ClusterInfo,
    Holder,
    WaitTimeout,
    range_header,
    state_at_least,
    writable_view,
)
from storaged.client.errors import (
    BadManifest,
    BadRequest,
    CheckpointNotFound,
    ChunkNotFound,
    ConnectionFailed,
    Exists,
    MemoryFull,
    MissingChunks,
    NotFound,
    ProtocolError,
    ServerError,
    StoragedError,
    Unauthorized,
    Unavailable,
    error_from_response,
    is_retryable,
    parse_retry_after,
)
from storaged.client.retry import RetryPolicy
from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from tiers.base import ByteRange

# --------------------------------------------------------------------------- errors


def test_errors_map_codes_to_types() -> None:
    body = msgpack.packb({"error": "missing_chunks", "message": "2 missing", "missing": ["a", "b"]})
    err = error_from_response(409, body, "application/msgpack")
    assert isinstance(err, MissingChunks) and err.missing == ["a", "b"]
    assert (err.code, err.message, err.status) == ("missing_chunks", "2 missing", 409)
    assert err.body["missing"] == ["a", "b"]

    doc = json.dumps({"error": "checkpoint_not_found", "message": "no"}).encode()
    err = error_from_response(404, doc, "application/json; charset=utf-8")
    assert isinstance(err, CheckpointNotFound) and isinstance(err, KeyError)
    assert str(err) == "HTTP 404 checkpoint_not_found: no"

    for code, cls in [
        ("exists", Exists),
        ("bad_manifest", BadManifest),
        ("chunk_not_found", ChunkNotFound),
        ("memory_full", MemoryFull),
        ("unauthorized", Unauthorized),
    ]:
        err = error_from_response(400, msgpack.packb({"error": code}), None)
        assert type(err) is cls and err.code == code


def test_unknown_codes_and_garbage_bodies_fall_back_to_the_status() -> None:
    err = error_from_response(409, msgpack.packb({"error": "brand_new", "message": "m"}))
    assert type(err).__name__ == "Conflict" and err.code == "brand_new"
    err = error_from_response(404, b"<html>not here</html>", "text/html")
    assert type(err) is NotFound and err.code == "not_found" and "not here" in err.message
    err = error_from_response(500, b"", None)
    assert type(err) is ServerError and err.code == "server_error"
    err = error_from_response(418, b"\xc1\xc1", "application/msgpack")
    assert type(err) is StoragedError and err.code == "http_418"
    err = error_from_response(503, msgpack.packb({"error": "memory_full"}), None, "2.5")
    assert isinstance(err, Unavailable) and err.retry_after == 2.5
    assert MissingChunks(missing=["x"]).missing == ["x"]


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.25 ") == 0.25
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    date = "Sun, 06 Nov 1994 08:49:37 GMT"
    assert parse_retry_after(date, now=784111777.0 - 10) == pytest.approx(10.0)
    assert parse_retry_after(date, now=784111777.0 + 10) == 0.0


def test_what_is_retryable() -> None:
    assert is_retryable(ConnectionFailed())
    assert is_retryable(error_from_response(503, b""))
    assert is_retryable(error_from_response(502, b""))
    assert not is_retryable(error_from_response(500, b""))
    assert not is_retryable(error_from_response(404, b""))
    assert not is_retryable(ValueError())


# --------------------------------------------------------------------------- retry policy


def test_backoff_is_jittered_below_a_doubling_ceiling() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    rng = random.Random(7)
    for retry, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (60, 1.0)]:
        draws = [policy.backoff(retry, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.8  # actually spread, not a constant
        assert len(set(draws)) > 100


def test_retry_after_is_a_floor_with_small_jitter() -> None:
    policy = RetryPolicy(base_delay=0.05, max_retry_after=5.0)
    rng = random.Random(1)
    draws = [policy.delay(1, 2.0, rng) for _ in range(100)]
    assert all(2.0 <= d <= 2.05 for d in draws)
    assert all(5.0 <= policy.delay(3, 999.0, rng) <= 5.05 for _ in range(10))
    assert policy.delay(2, None, rng) <= 0.1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"base_delay": -1},
        {"base_delay": 2.0, "max_delay": 1.0},
        {"deadline": 0},
        {"max_retry_after": -1},
    ],
)
def test_retry_policy_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)
    with pytest.raises(ValueError):
        RetryPolicy().backoff(0)


# --------------------------------------------------------------------------- placement


def test_rendezvous_order_follows_its_definition() -> None:
    nodes = [f"node-{i}" for i in range(6)]
    chunk = chunk_id_of(b"x")

    def score(node: str) -> int:
        digest = hashlib.blake2b(f"{node}:{chunk}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    order = rendezvous_order(chunk, nodes)
    assert order == sorted(nodes, key=score, reverse=True)
    assert rendezvous_order(chunk, list(reversed(nodes))) == order


def test_rendezvous_order_is_stable_under_membership_change() -> None:
    nodes = [f"n{i}" for i in range(8)]
    moved = 0
    for i in range(300):
        chunk = chunk_id_of(str(i).encode())
        before = rendezvous_order(chunk, nodes)
        after = rendezvous_order(chunk, [n for n in nodes if n != "n3"])
        assert after == [n for n in before if n != "n3"]
        moved += before[0] == "n3"
    assert 10 < moved < 80  # roughly 1/8 of the chunks had n3 first
    firsts = {rendezvous_order(chunk_id_of(str(i).encode()), nodes)[0] for i in range(300)}
    assert firsts == set(nodes)


def test_rendezvous_ties_order_by_node_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from storaged import placement

    monkeypatch.setattr(placement, "_score", lambda node, chunk: 5)
    assert placement.rendezvous_order("c", ["b", "c", "a"]) == ["a", "b", "c"]


# --------------------------------------------------------------------------- small helpers


def test_range_header_is_inclusive_on_the_wire() -> None:
    assert range_header(ByteRange(0, 10)) == "bytes=0-9"
    assert range_header(ByteRange(5, 6)) == "bytes=5-5"
    assert range_header(ByteRange(7)) == "bytes=7-"
    with pytest.raises(ValueError):
        range_header(ByteRange(5, 5))


def test_writable_view_checks_the_buffer() -> None:
    import numpy as np

    assert len(writable_view(np.zeros((2, 3), np.float32))) == 24
    with pytest.raises(TypeError, match="read-only"):
        writable_view(memoryview(b"abc"))
    with pytest.raises(TypeError, match="contiguous"):
        writable_view(np.zeros((4, 4))[:, ::2])


def test_durability_levels_are_ordered() -> None:
    assert state_at_least("cold", "nvme") and state_at_least("nvme", "nvme")
    assert not state_at_least("memory", "nvme")
    with pytest.raises(ValueError):
        state_at_least("disk", "memory")


def test_cluster_document_parsing() -> None:
    doc = {
        "nodes": [
            {
                "id": "a",
                "url": "http://127.0.0.1:1/",
                "alive": True,
                "memory": {"used": 1, "capacity": 2},
            },
            {"id": "b", "url": "http://127.0.0.1:2", "alive": False},
        ],
        "replication": 3,
        "erasure": {"codec": "zfec", "k": 4, "n": 6},
        "max_chunk_size": 1024,
    }
    info = ClusterInfo.from_wire(doc)
    assert [n.id for n in info.live] == ["a"] and info.node("a").url == "http://127.0.0.1:1"
    assert info.node("a").tiers["memory"].capacity == 2 and info.erasure is not None
    with pytest.raises(ProtocolError):
        ClusterInfo.from_wire({"nodes": [{"id": "a"}], "replication": 3, "max_chunk_size": 1})


# --------------------------------------------------------------------------- request engine

Reply = tuple[int, dict[str, str], bytes] | BaseException


class _Content:
    def __init__(self, body: bytes, piece: int = 3) -> None:
        self._pieces = [body[i : i + piece] for i in range(0, len(body), piece)]

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


class _Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self._body = body
        self.content = _Content(body)
        self.content_length = (
            int(headers["Content-Length"]) if "Content-Length" in headers else None
        )

    async def read(self) -> bytes:
        return self._body


class ScriptedSession:
    """Answers each request with the next scripted reply for its URL's host (a transport
    stub for the retry logic, not a storaged server)."""

    def __init__(self, script: dict[str, list[Reply]]) -> None:
        self.script = script
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    @asynccontextmanager
    async def request(
        self, method: str, url: str, data: Any = None, headers: dict[str, str] | None = None
    ) -> AsyncIterator[_Response]:
        host = url.split("/")[2]
        self.calls.append((method, url, dict(headers or {})))
        if data is not None and hasattr(data, "__aiter__"):
            async for _ in data:
                pass
        reply = self.script[host].pop(0)
        if isinstance(reply, BaseException):
            raise reply
        yield _Response(*reply)


def _doc(status: int, doc: Any, **headers: str) -> Reply:
    return status, {"Content-Type": "application/msgpack", **headers}, msgpack.packb(doc)


CLUSTER = {
    "nodes": [{"id": f"n{i}", "url": f"http://h{i}", "alive": True} for i in range(3)],
    "replication": 2,
    "erasure": None,
    "max_chunk_size": 100,
}


async def scripted_client(
    script: dict[str, list[Reply]], monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> tuple[Client, ScriptedSession, list[float]]:
    sleeps: list[float] = []

    async def no_sleep(delay: float) -> None:
        sleeps.append(delay)

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    script.setdefault("h0", []).insert(0, _doc(200, CLUSTER))
    session = ScriptedSession(script)
    client = Client(["http://h0"], **kwargs)
    await client.open(session)  # type: ignore[arg-type]
    return client, session, sleeps


async def test_503_is_retried_after_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"hello"
    cid = chunk_id_of(data)
    first = rendezvous_order(cid, ["n0", "n1", "n2"])[0]
    host = "h" + first[1:]
    busy = _doc(503, {"error": "memory_full", "message": "full"}, **{"Retry-After": "1.5"})
    ok = _doc(201, {"chunk": cid, "size": 5, "replicas": ["n0", "n1"], "state": "memory"})
    script: dict[str, list[Reply]] = {host: [busy, busy, ok]}
    client, session, sleeps = await scripted_client(script, monkeypatch)
    result = await client.put_chunk_result(data)
    assert result.created and result.replicas == ("n0", "n1")
    puts = [c for c in session.calls if c[0] == "PUT"]
    assert len(puts) == 3 and all(host in url for _, url, _ in puts)  # the placement's first
    assert puts[0][2]["Content-Length"] == "5"
    assert len(sleeps) == 2 and all(1.5 <= s <= 1.6 for s in sleeps)
    assert client.stats.retries == 2


async def test_lost_connection_fails_over_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"payload"
    cid = chunk_id_of(data)
    order = rendezvous_order(cid, ["n0", "n1", "n2"])
    ok = _doc(200, {"chunk": cid, "size": 7, "replicas": [], "state": "memory"})
    script: dict[str, list[Reply]] = {
        "h" + order[0][1:]: [aiohttp.ClientConnectionError("refused")],
        "h" + order[1][1:]: [ok],
    }
    client, _, sleeps = await scripted_client(script, monkeypatch)
    result = await client.put_chunk_result(data)
    assert not result.created and sleeps == []
    assert client.stats.failovers == 1
    assert client._suspected(order[0], time.monotonic())


async def test_gives_up_with_the_last_error(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = _doc(503, {"error": "insufficient_replicas", "message": "1 live"})
    script: dict[str, list[Reply]] = {f"h{i}": [busy] * 10 for i in range(3)}
    client, _, sleeps = await scripted_client(
        script, monkeypatch, retry=RetryPolicy(max_attempts=4)
    )
    with pytest.raises(Unavailable) as info:
        await client.put_chunk(b"abc")
    assert info.value.code == "insufficient_replicas" and len(sleeps) == 3


async def test_client_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _doc(400, {"error": "bad_manifest", "message": "items overlap"})
    script: dict[str, list[Reply]] = {f"h{i}": [bad] for i in range(3)}
    client, session, sleeps = await scripted_client(script, monkeypatch)
    with pytest.raises(BadManifest, match="items overlap"):
        await client.commit("job/step-1", {"format": 1})
    assert sleeps == [] and len([c for c in session.calls if c[0] == "PUT"]) == 1
    with pytest.raises(BadRequest):
        await client.commit("../etc", {})  # refused before any request


async def test_get_tries_every_holder_then_raises_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cid = chunk_id_of(b"gone")
    missing = _doc(404, {"error": "chunk_not_found", "message": "no"})
    script: dict[str, list[Reply]] = {f"h{i}": [missing] for i in range(3)}
    client, session, _ = await scripted_client(script, monkeypatch)
    with pytest.raises(ChunkNotFound):
        await client.get_chunk(cid, holders=[Holder("n2", "http://h2", "memory")])
    gets = [url for method, url, _ in session.calls if method == "GET" and "chunks" in url]
    assert gets[0].startswith("http://h2") and len(gets) == 3


async def test_get_reads_into_the_callers_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(50))
    cid = chunk_id_of(data)
    whole: Reply = (200, {"Content-Length": "50"}, data)
    # A node that ignores Range sends everything: the client skips to the range.
    ignored: Reply = (200, {"Content-Length": "50"}, data)
    partial: Reply = (206, {"Content-Length": "10"}, data[10:20])
    short: Reply = (206, {"Content-Length": "4"}, data[10:14])
    script: dict[str, list[Reply]] = {f"h{i}": [whole, ignored, partial, short] for i in range(3)}
    client, _, _ = await scripted_client(script, monkeypatch)
    out = bytearray(64)
    view = await client.get_chunk(cid, out, holders=["n0"])
    assert bytes(view) == data and view.obj is out
    view = await client.get_chunk(cid, out, ByteRange(10, 20), holders=["n0"])
    assert bytes(view) == data[10:20] and bytes(out[:10]) == data[10:20]
    view = await client.get_chunk(cid, None, ByteRange(10, 20), holders=["n0"])
    assert bytes(view) == data[10:20]
    # A body shorter than the range asked for is a protocol error: the next node answers.
    view = await client.get_chunk(cid, None, ByteRange(10, 20), holders=["n0"])
    assert bytes(view) == data[10:20]
    with pytest.raises(ValueError, match="output buffer"):
        await client.get_chunk(cid, bytearray(3), ByteRange(0, 10))
    assert len(await client.get_chunk(cid, None, ByteRange(5, 5))) == 0


async def test_delete_after_a_lost_answer_is_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = _doc(404, {"error": "checkpoint_not_found", "message": "no"})
    script: dict[str, list[Reply]] = {
        "h0": [aiohttp.ServerDisconnectedError(), gone],
        "h1": [gone, gone],
        "h2": [gone, gone],
    }
    client, _, _ = await scripted_client(script, monkeypatch)
    monkeypatch.setattr(client, "_any_nodes", lambda: ["n0", "n1", "n2"])
    await client.delete("job/step-1")  # the first attempt may have deleted it
    with pytest.raises(CheckpointNotFound):
        await client.delete("job/step-2")


async def test_wait_times_out_with_the_last_status(monkeypatch: pytest.MonkeyPatch) -> None:
    status = _doc(200, {"state": "memory", "chunks": 4, "memory": 4, "nvme": 1, "cold": 0})
    script: dict[str, list[Reply]] = {f"h{i}": [status] * 50 for i in range(3)}
    client, _, _ = await scripted_client(script, monkeypatch)
    clock = iter(range(10_000))
    # The client's clock only: the event loop keeps the real one.
    fake_time = types.SimpleNamespace(monotonic=lambda: float(next(clock)))
    monkeypatch.setattr(client_module, "time", fake_time)
    with pytest.raises(WaitTimeout) as info:
        await client.wait("job/step-1", "nvme", timeout=5)
    assert info.value.status is not None and info.value.status.nvme == 1
    assert isinstance(info.value, TimeoutError)
    reached = await client.wait("job/step-1", "memory", timeout=5)
    assert reached.state == "memory"
    with pytest.raises(ValueError):
        await client.wait("job/step-1", "disk")


async def test_client_needs_urls_and_hides_its_token() -> None:
    client = Client("http://h0/", token="s3cret")
    assert "s3cret" not in repr(client)
    with pytest.raises(RuntimeError):
        _ = client.cluster
    with pytest.raises(ValueError):
        Client([])
