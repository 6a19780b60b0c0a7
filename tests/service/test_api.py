"""The API.md contract, endpoint by endpoint, against a real 4-node cluster on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest

from storaged.ids import chunk_id_of
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import TOKEN
from tests.service.http import Api, manifest_for, random_chunk

pytestmark = pytest.mark.timeout(180)

MSGPACK = {"Accept": "application/msgpack"}


@pytest.fixture
async def api(cluster: LocalCluster) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as session:
        yield Api(session, cluster.urls[0], TOKEN)


async def test_the_nodes_coordinate_through_the_coordinator_asked_for(
    cluster: LocalCluster, request: pytest.FixtureRequest
) -> None:
    """The service suite runs in both modes (``--coordinator``): make sure it really does."""
    if request.config.getoption("--coordinator") == "embedded":
        assert not cluster.coordinator_url
        assert "[[nodes]]" in cluster.config_path.read_text()
        return
    from storaged.coord.etcd import EtcdSession

    session = EtcdSession(cluster.coordinator_url)
    try:
        kv = await session.kv()
        prefix = session.key("membership", "alive", "")
        reply = await kv.get(prefix, session.range_end(prefix), keys_only=True)
    finally:
        await session.close()
    alive = sorted(bytes(item.key).decode().rpartition("/")[2] for item in reply.kvs)
    assert alive == [cluster.node_id(i) for i in range(cluster.nodes)]
    assert "[[nodes]]" not in cluster.config_path.read_text()


# ---- chunks -------------------------------------------------------------------------------------
async def test_put_acks_three_distinct_replicas_then_200(api: Api, cluster: LocalCluster) -> None:
    data = random_chunk(3 * 2**20 + 17)
    cid = chunk_id_of(data)
    first = await api.put_chunk(data)
    assert first.status == 201, first.raw
    body = first.doc
    assert body["chunk"] == cid and body["size"] == len(data) and body["state"] == "memory"
    assert len(set(body["replicas"])) == 3
    assert set(body["replicas"]) <= {f"n{i}" for i in range(4)}
    again = await api.put_chunk(data, url=cluster.urls[1])
    assert again.status == 200
    assert again.doc["chunk"] == cid and again.doc["size"] == len(data)
    # Every node serves it, holder or not.
    for url in cluster.urls:
        got = await api.get_chunk(cid, url=url)
        assert got.status == 200 and got.raw == data
        assert got.headers["X-Storaged-Tier"] in ("memory", "nvme", "cold")


async def test_empty_chunk(api: Api) -> None:
    r = await api.put_chunk(b"")
    assert r.status in (200, 201)
    got = await api.get_chunk(chunk_id_of(b""))
    assert got.status == 200 and got.raw == b""


async def test_checksum_mismatch_stores_nothing_anywhere(api: Api, cluster: LocalCluster) -> None:
    data = random_chunk(1 << 20)
    wrong_id = chunk_id_of(data + b"x")
    r = await api.request("PUT", f"/v1/chunks/{wrong_id}", data=data)
    assert r.status == 400 and r.error == "checksum_mismatch"
    for url in cluster.urls:
        assert (await api.get_chunk(wrong_id, url=url)).status == 404
        assert (await api.get_chunk(chunk_id_of(data), url=url)).status == 404
    missing = await api.request("POST", "/v1/chunks/missing", doc={"chunks": [wrong_id]})
    assert missing.doc["missing"] == [wrong_id]


@pytest.mark.parametrize(
    "bad", ["abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, chunk_id_of(b"x").upper()]
)
async def test_bad_chunk_id(api: Api, bad: str) -> None:
    for method in ("PUT", "GET"):
        r = await api.request(method, f"/v1/chunks/{bad}", data=b"x" if method == "PUT" else None)
        assert r.status == 400 and r.error == "bad_chunk_id", (method, r.raw)


async def test_put_without_length_is_411(api: Api) -> None:
    data = random_chunk(1000)

    async def body() -> AsyncIterator[bytes]:
        yield data  # a generator body goes out chunked, without Content-Length

    async with api.session.put(
        f"{api.url}/v1/chunks/{chunk_id_of(data)}",
        data=body(),
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as resp:
        assert resp.status == 411
        assert json.loads(await resp.read())["error"] == "length_required"


async def test_put_too_large_is_413(api: Api) -> None:
    data = b"\0" * (16 * 2**20 + 1)
    r = await api.put_chunk(data)
    assert r.status == 413 and r.error == "too_large"


def _raw_http(port: int, head: bytes, body: bytes, *, shut: bool) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                piece = s.recv(65536)
            except TimeoutError:
                break
            if not piece:
                break
            out += piece
            if b"\r\n\r\n" in out and len(out) > 200:
                break
        return out


async def test_truncated_body_is_refused_and_leaves_nothing(
    api: Api, cluster: LocalCluster
) -> None:
    data = random_chunk(2 << 20)
    cid = chunk_id_of(data)
    port = cluster.port
    head = (
        f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    out = await asyncio.to_thread(_raw_http, port, head, data[: len(data) // 2], shut=True)
    # The server may answer 400 truncated or just drop the half-closed connection.
    if out:
        assert b" 400 " in out.split(b"\r\n")[0] and b"truncated" in out, out[:300]
    await asyncio.sleep(0.5)
    for url in cluster.urls:
        assert (await api.get_chunk(cid, url=url)).status == 404


async def test_get_ranges_and_errors(api: Api) -> None:
    data = random_chunk(100_000)
    cid = chunk_id_of(data)
    assert (await api.put_chunk(data)).status == 201
    r = await api.get_chunk(cid, headers={"Range": "bytes=10-19"})
    assert r.status == 206 and r.raw == data[10:20]
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    r = await api.get_chunk(cid, headers={"Range": "bytes=99990-"})
    assert r.status == 206 and r.raw == data[99990:]
    r = await api.get_chunk(cid, headers={"Range": "bytes=-5"})
    assert r.status == 206 and r.raw == data[-5:]
    for bad in ("bytes=200000-200010", "bytes=50-10", "lines=1-2", "bytes=1-2,5-6", "bytes=-0"):
        r = await api.get_chunk(cid, headers={"Range": bad})
        assert r.status == 416 and r.error == "bad_range", bad
    r = await api.get_chunk(chunk_id_of(b"never stored"))
    assert r.status == 404 and r.error == "chunk_not_found"


async def test_head(api: Api, cluster: LocalCluster) -> None:
    data = random_chunk(54321)
    cid = chunk_id_of(data)
    assert (await api.put_chunk(data)).status == 201
    for url in cluster.urls:
        r = await api.request("HEAD", f"/v1/chunks/{cid}", url=url)
        assert r.status == 200
        assert int(r.headers["Content-Length"]) == len(data)
        assert r.headers["X-Storaged-Tier"] in ("memory", "nvme", "cold")
        assert r.headers["X-Storaged-State"] in ("memory", "nvme", "cold")
    r = await api.request("HEAD", f"/v1/chunks/{chunk_id_of(b'nope')}")
    assert r.status == 404


async def test_missing_in_request_order(api: Api) -> None:
    held = random_chunk(1000)
    assert (await api.put_chunk(held)).status == 201
    absent = [chunk_id_of(os.urandom(8)) for _ in range(3)]
    ids = [absent[0], chunk_id_of(held), absent[1], absent[2]]
    r = await api.request("POST", "/v1/chunks/missing", doc={"chunks": ids})
    assert r.status == 200 and r.doc["missing"] == [absent[0], absent[1], absent[2]]
    bad: Any
    for bad in ({"chunks": ["zz"]}, {"nope": []}, [1, 2]):
        r = await api.request("POST", "/v1/chunks/missing", doc=bad)
        assert r.status == 400 and r.error == "bad_request"
    r = await api.request(
        "POST",
        "/v1/chunks/missing",
        data=b"\xc1garbage",
        headers={"Content-Type": "application/msgpack"},
    )
    assert r.status == 400 and r.error == "bad_request"


# ---- checkpoints --------------------------------------------------------------------------------
async def _upload(api: Api, chunks: list[bytes]) -> None:
    for c in chunks:
        assert (await api.put_chunk(c)).status in (200, 201)


async def test_commit_get_list_status_plan_delete(api: Api, cluster: LocalCluster) -> None:
    chunks = [random_chunk(1 << 20) for _ in range(3)] + [random_chunk(777)]
    await _upload(api, chunks)
    manifest = manifest_for(chunks)
    r = await api.commit("job1/step-000100", manifest)
    assert r.status == 201, r.raw
    ids = [chunk_id_of(c) for c in chunks]
    assert r.doc == {"name": "job1/step-000100", "chunks": ids, "bytes": sum(map(len, chunks))}
    assert (await api.commit("job1/step-000100", manifest, url=cluster.urls[2])).status == 200
    other = manifest_for(chunks, created=1.0)
    r = await api.commit("job1/step-000100", other)
    assert r.status == 409 and r.error == "exists"

    for url in cluster.urls:
        got = await api.request("GET", "/v1/checkpoints/job1/step-000100", url=url, headers=MSGPACK)
        assert got.status == 200 and msgpack.unpackb(got.raw) == manifest
    js = await api.request(
        "GET", "/v1/checkpoints/job1/step-000100", headers={"Accept": "application/json"}
    )
    assert js.headers["Content-Type"].startswith("application/json")
    assert json.loads(js.raw) == manifest

    await _upload(api, chunks[:1])
    assert (await api.commit("job1/step-000050", manifest_for(chunks[:1]))).status == 201
    assert (await api.commit("job2/step-1", manifest_for(chunks[:1]))).status == 201
    listing = await api.request("GET", "/v1/checkpoints?prefix=job1/")
    names = [c["name"] for c in listing.doc["checkpoints"]]
    assert names == ["job1/step-000050", "job1/step-000100"]
    entry = listing.doc["checkpoints"][1]
    assert entry["bytes"] == sum(map(len, chunks)) and entry["created"] == manifest["created"]
    assert entry["state"] in ("memory", "nvme", "cold")
    # States only move forward: the listed one is never ahead of a status asked after it
    # (the listing once judged records without their chunk lists: "cold" from the commit on).
    after = await api.request("GET", "/v1/checkpoints/job1/step-000100?status")
    forward = ["memory", "nvme", "cold"]
    assert forward.index(entry["state"]) <= forward.index(after.doc["state"]), (entry, after.doc)

    status = await api.wait_state("job1/step-000100", "cold", timeout=90)
    assert status["chunks"] == 4 and status["memory"] == status["nvme"] == status["cold"] == 4
    # The listing's states come from one question about every listed chunk (not a status
    # per checkpoint): the same answer as ``?status`` for one that has reached its last.
    listing = await api.request("GET", "/v1/checkpoints?prefix=job1/")
    listed = {c["name"]: c["state"] for c in listing.doc["checkpoints"]}
    assert listed["job1/step-000100"] == "cold", listed
    assert "complete" not in listing.doc and "costs" not in listing.doc["checkpoints"][0]
    # E17 on the wire: the first chunk is named by all three checkpoints (job2's too,
    # though it is not listed), the other three by step-000100 alone.
    costed = await api.request("GET", "/v1/checkpoints?prefix=job1/&costs&nostate")
    assert costed.status == 200 and costed.doc["complete"] is True
    costs = {c["name"]: (c["state"], c["costs"]) for c in costed.doc["checkpoints"]}
    state, big = costs["job1/step-000100"]
    assert state == "cold"  # nostate is ignored with costs
    assert big["chunks"] == 4 and big["lost"] == 0
    assert big["shared"] == len(chunks[0]) and big["shared_chunks"] == 1
    assert big["cold"]["chunks"] == 4 and big["cold"]["bytes"] == sum(map(len, chunks))
    assert set(big) == {"chunks", "shared", "shared_chunks", "memory", "nvme", "cold"} | {
        "stored",
        "lost",
    }
    assert big["stored"] == sum(big[t]["stored"] for t in ("memory", "nvme", "cold"))
    _, small = costs["job1/step-000050"]
    assert small["shared"] == len(chunks[0]) == small["cold"]["bytes"] and small["chunks"] == 1

    plan = await api.request("GET", "/v1/checkpoints/job1/step-000100?plan")
    assert plan.status == 200 and set(plan.doc["chunks"]) == set(ids)
    tiers = ["memory", "nvme", "cold"]
    for sources in plan.doc["chunks"].values():
        assert sources, "every chunk has a source"
        order = [tiers.index(s["tier"]) for s in sources]
        assert order == sorted(order), "fastest tier first"
        for s in sources:
            assert s["url"] in cluster.urls and s["node"] in {f"n{i}" for i in range(4)}

    assert (await api.request("DELETE", "/v1/checkpoints/job1/step-000100")).status == 204
    for url in cluster.urls:
        r = await api.request("GET", "/v1/checkpoints/job1/step-000100", url=url)
        assert r.status == 404 and r.error == "checkpoint_not_found"
    assert (await api.request("DELETE", "/v1/checkpoints/job1/step-000100")).status == 404
    for sub in ("?status", "?plan"):
        r = await api.request("GET", f"/v1/checkpoints/job1/step-000100{sub}")
        assert r.status == 404


async def test_commit_with_missing_chunks_commits_nothing(api: Api) -> None:
    held = random_chunk(4096)
    await _upload(api, [held])
    ghost = random_chunk(4096)
    r = await api.commit("job3/ghost", manifest_for([held, ghost]))
    assert r.status == 409 and r.error == "missing_chunks"
    assert r.doc["missing"] == [chunk_id_of(ghost)]
    assert (await api.request("GET", "/v1/checkpoints/job3/ghost")).status == 404
    listing = await api.request("GET", "/v1/checkpoints?prefix=job3/")
    assert listing.doc["checkpoints"] == []


def _bad_manifests(chunk: bytes) -> list[tuple[str, Any]]:
    good = manifest_for([chunk])
    cases: list[tuple[str, Any]] = [("not a map", [1, 2, 3]), ("format", {**good, "format": 2})]

    def with_item(**changes: Any) -> Any:
        m = json.loads(json.dumps(good))
        m["shards"][0]["items"][0].update(changes)
        return m

    cases.append(
        (
            "outside stream",
            with_item(length=len(chunk) + 1, shape=[len(chunk) + 1], global_shape=[len(chunk) + 1]),
        )
    )
    cases.append(("shape beyond global", with_item(offsets=[1])))
    cases.append(("dtype size", with_item(dtype="float32")))
    cases.append(("type", with_item(start="0")))
    m = json.loads(json.dumps(good))
    m["shards"][0]["items"].append(dict(m["shards"][0]["items"][0]))
    cases.append(("overlap", m))
    m = json.loads(json.dumps(good))
    m["shards"][0]["chunks"][0][0] = "nothex"
    cases.append(("chunk id", m))
    m = json.loads(json.dumps(good))
    m["shards"].append(dict(m["shards"][0]))
    cases.append(("rank twice", m))
    cases.append(("no shards", {**good, "shards": []}))
    cases.append(("unknown field", {**good, "extra": 1}))
    return cases


async def test_bad_manifests(api: Api) -> None:
    chunk = random_chunk(4096)
    await _upload(api, [chunk])
    for what, manifest in _bad_manifests(chunk):
        r = await api.commit("job4/bad", manifest)
        assert r.status == 400 and r.error == "bad_manifest", (what, r.raw)
    r = await api.request(
        "PUT",
        "/v1/checkpoints/job4/bad",
        data=b"\xc1\xc1",
        headers={"Content-Type": "application/msgpack"},
    )
    assert r.status == 400
    assert (await api.request("GET", "/v1/checkpoints/job4/bad")).status == 404


@pytest.mark.parametrize(
    "name", ["-lead", "a/b/c/d/e", "a//b", "a/", "sp ace", "x" * 129, ".hidden", "a/.b"]
)
async def test_bad_names(api: Api, name: str) -> None:
    r = await api.request("GET", f"/v1/checkpoints/{name}")
    assert r.status in (400, 404)
    if r.status == 400:
        assert r.error == "bad_name"
    r = await api.commit(name, manifest_for([b"x"]))
    assert r.status in (400, 404), r.raw
    if r.status == 400:
        assert r.error == "bad_name"


async def test_json_bodies_accepted(api: Api) -> None:
    chunk = random_chunk(2048)
    await _upload(api, [chunk])
    r = await api.request(
        "PUT",
        "/v1/checkpoints/job5/json",
        data=json.dumps(manifest_for([chunk])).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    assert r.status == 201 and json.loads(r.raw)["name"] == "job5/json"


# ---- cluster, auth, routing ---------------------------------------------------------------------
async def test_cluster_endpoint(api: Api, cluster: LocalCluster) -> None:
    r = await api.request("GET", "/v1/cluster")
    doc = r.doc
    assert r.status == 200 and doc["replication"] == 3
    assert doc["erasure"] == {"codec": "zfec", "k": 4, "n": 6}
    assert doc["max_chunk_size"] == 16 * 2**20
    assert [n["id"] for n in doc["nodes"]] == ["n0", "n1", "n2", "n3"]
    for n in doc["nodes"]:
        assert n["url"] in cluster.urls and n["alive"] is True
        # count: an extension (docs/API.md E10); dirty and the disk tiers' room marks: E16
        assert set(n["memory"]) == {"used", "capacity", "count", "dirty"}
        for tier in ("nvme", "cold"):
            assert set(n[tier]) == {
                "used", "capacity", "count", "state", "free", "full_since", "cause"
            }  # fmt: skip
            assert n[tier]["state"] in ("ok", "nearly_full") and n[tier]["full_since"] is None


async def test_auth(api: Api, cluster: LocalCluster) -> None:
    anon = Api(api.session, api.url, None)
    assert (await anon.request("GET", "/v1/cluster")).status == 401
    wrong = Api(api.session, api.url, "wrong")
    r = await wrong.request("GET", "/v1/cluster")
    assert r.status == 401 and r.error == "unauthorized"
    assert (await anon.request("GET", "/healthz")).status == 200


async def test_client_token_refused_on_peer_protocol(cluster: LocalCluster) -> None:
    from storaged.peer import PeerClient, PeerError

    client = PeerClient("intruder", TOKEN.encode(), connect_timeout=5, io_timeout=5)
    try:
        with pytest.raises(PeerError):
            await client.call(("127.0.0.1", cluster.peer_port), "ping", {}, timeout=5)
    finally:
        await client.close()


async def test_unknown_route_and_method(api: Api) -> None:
    r = await api.request("GET", "/v1/nothing")
    assert r.status == 404 and r.error == "not_found"
    r = await api.request("POST", "/v1/cluster", doc={})
    assert r.status == 405 and r.error == "method_not_allowed"


async def test_metrics(api: Api) -> None:
    r = await api.request("GET", "/metrics")
    text = r.raw.decode()
    assert r.status == 200
    for metric in (
        "storaged_tier_bytes",
        "storaged_drain_backlog",
        "storaged_encode_backlog",
        "storaged_ack_seconds_bucket",
        "storaged_read_bytes_total",
        "storaged_errors_total",
    ):
        assert metric in text, metric


def _stall(port: int) -> tuple[bytes, float]:
    import time

    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # half a header, then nothing
        t0 = time.monotonic()
        try:
            data = s.recv(100)
        except TimeoutError:
            data = b"<still open>"
        return data, time.monotonic() - t0


async def test_half_header_connection_is_dropped(cluster: LocalCluster) -> None:
    data, _ = await asyncio.to_thread(_stall, cluster.port)
    assert data == b"", "a stalled half header must not hold the connection"


async def test_large_manifest_and_many_ids(api: Api, cluster: LocalCluster) -> None:
    # Far over the peer protocol's 64 KiB header: node-to-node calls must carry it as a body.
    chunk = random_chunk(4000 * 8)
    await _upload(api, [chunk])
    items = [
        {"key": f"model.layers.{i}.mlp.weight", "dtype": "float64", "global_shape": [1],
         "offsets": [0], "shape": [1], "start": 8 * i, "length": 8}
        for i in range(4000)
    ]  # fmt: skip
    manifest = manifest_for([chunk])
    manifest["shards"][0]["items"] = items
    r = await api.commit("big/manifest", manifest, url=cluster.urls[3])
    assert r.status == 201, r.raw
    for url in cluster.urls:
        got = await api.request("GET", "/v1/checkpoints/big/manifest", url=url, headers=MSGPACK)
        assert got.status == 200 and msgpack.unpackb(got.raw) == manifest
    ids = [chunk_id_of(os.urandom(8)) for _ in range(5000)] + [chunk_id_of(chunk)]
    r = await api.request("POST", "/v1/chunks/missing", doc={"chunks": ids})
    assert r.status == 200 and r.doc["missing"] == ids[:-1]
    listing = await api.request("GET", "/v1/checkpoints?prefix=big/")
    assert [c["name"] for c in listing.doc["checkpoints"]] == ["big/manifest"]
