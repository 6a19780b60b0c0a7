"""Failure paths against real node processes: dead nodes, full RAM, flipped bits, restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from storaged.ids import chunk_id_of
from storaged.placement import rendezvous_order
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import ADMIN_TOKEN, TOKEN, ClusterFactory
from tests.service.http import Api, manifest_for, random_chunk

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _put_all(api: Api, chunks: list[bytes]) -> None:
    for c in chunks:
        r = await api.put_chunk(c)
        assert r.status in (200, 201), r.raw


async def _wait_dead(api: Api, node: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = (await api.request("GET", "/v1/cluster")).doc
        if not next(n for n in doc["nodes"] if n["id"] == node)["alive"]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{node} still alive after {timeout}s")


async def test_kill_one_node_during_uploads(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4)
    apis = [Api(session, url, TOKEN) for url in cluster.urls]
    acked: dict[str, bytes] = {}
    acked_after_kill = 0
    killed = asyncio.Event()
    deadline = time.monotonic() + 40

    async def uploader(worker: int) -> None:
        nonlocal acked_after_kill
        i = 0
        while time.monotonic() < deadline and len(acked) < 120:
            data = random_chunk(256 * 1024 + worker * 4096 + i)
            i += 1
            # Use the nodes that stay up (n0..n2); n3 is the one killed.
            api = apis[(worker + i) % 3]
            try:
                r = await api.put_chunk(data)
            except aiohttp.ClientError:
                continue
            if r.status in (200, 201):
                acked[chunk_id_of(data)] = data
                if killed.is_set():
                    acked_after_kill += 1
            else:
                assert r.status == 503, r.raw  # transient, never a wrong answer
                await asyncio.sleep(0.1)

    async def killer() -> None:
        while len(acked) < 30 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(cluster.kill, 3)
        killed.set()

    await asyncio.gather(*(uploader(w) for w in range(4)), killer())
    assert killed.is_set()
    assert acked_after_kill >= 20, f"acks stalled after the kill: {acked_after_kill}"
    for cid, data in acked.items():
        r = await apis[cid.__hash__() % 3].get_chunk(cid)
        assert r.status == 200 and r.raw == data, cid


async def test_insufficient_replicas_keeps_nothing(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4)
    api = Api(session, cluster.urls[0], TOKEN)
    await asyncio.to_thread(cluster.kill, 2)
    await asyncio.to_thread(cluster.kill, 3)
    await _wait_dead(api, "n2")
    await _wait_dead(api, "n3")
    data = random_chunk(100_000)
    r = await api.put_chunk(data)
    assert r.status == 503 and r.error == "insufficient_replicas"
    assert "Retry-After" in r.headers
    for url in cluster.urls[:2]:
        assert (await api.get_chunk(chunk_id_of(data), url=url)).status == 404


async def test_cold_checkpoint_survives_kill(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = [random_chunk(1 << 20) for _ in range(12)]
    await _put_all(api, chunks)
    assert (await api.commit("cold/ckpt", manifest_for(chunks))).status == 201
    await api.wait_state("cold/ckpt", "cold", timeout=120)
    # Push every hot copy out so the reads after the kill must come from fragments.
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = await api.request(
        "POST", "/v1/admin/evict", doc={"checkpoint": "cold/ckpt", "tier": "memory"}, headers=admin
    )
    assert r.status == 200
    r = await api.request(
        "POST", "/v1/admin/evict", doc={"checkpoint": "cold/ckpt", "tier": "nvme"}, headers=admin
    )
    assert r.status == 200
    await asyncio.to_thread(cluster.kill, 1, signal.SIGKILL)
    await _wait_dead(api, "n1")
    tiers = set()
    for c in chunks:
        got = await api.get_chunk(chunk_id_of(c))
        assert got.status == 200 and got.raw == c
        tiers.add(got.headers["X-Storaged-Tier"])
    assert "cold" in tiers, tiers
    plan = await api.request("GET", "/v1/checkpoints/cold/ckpt?plan")
    assert all(plan.doc["chunks"][chunk_id_of(c)] for c in chunks)


def _flip_every_file(root: Path) -> int:
    flipped = 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "quarantine" in path.parts or path.name.startswith("."):
            continue
        if path.parent.name in ("catalog",) or path.name in ("node.log", "node.pid"):
            continue
        if path.name.endswith(".state"):
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        with open(path, "r+b") as f:
            for offset in {size // 2, size - 1, 70 if size > 70 else 0}:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
        flipped += 1
    return flipped


async def test_flipped_bytes_on_one_node_never_served(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4, retain_newest=1)
    api = Api(session, cluster.urls[0], TOKEN)
    # n2 must own some chunks (so it keeps their nvme copies under retention) and not
    # others; left to chance, n2 owned none of 10 chunks in 1 run out of ~18, held only
    # fragments, and its damaged files were never read.
    nodes = [f"n{i}" for i in range(4)]
    owned: list[bytes] = []
    others: list[bytes] = []
    for i in range(400):
        c = random_chunk(512 * 1024 + i)
        bucket = owned if rendezvous_order(chunk_id_of(c), nodes)[0] == "n2" else others
        if len(bucket) < 5:
            bucket.append(c)
        if len(owned) == len(others) == 5:
            break
    chunks = owned + others
    assert len(chunks) == 10
    await _put_all(api, chunks)
    assert (await api.commit("flip/ckpt", manifest_for(chunks))).status == 201
    await api.wait_state("flip/ckpt", "cold", timeout=120)
    await asyncio.to_thread(cluster.kill, 2, signal.SIGTERM)
    flipped = await asyncio.to_thread(_flip_every_file, cluster.data / "n2")
    assert flipped > 0
    await asyncio.to_thread(cluster.start_node, 2)
    await asyncio.to_thread(cluster.wait_healthy, [2])
    victim = Api(session, cluster.urls[2], TOKEN)
    for c in chunks:
        got = await victim.get_chunk(chunk_id_of(c))
        assert got.status == 200 and got.raw == c
        part = await victim.get_chunk(chunk_id_of(c), headers={"Range": "bytes=100-199"})
        assert part.status == 206 and part.raw == c[100:200]
    # The damaged files were moved aside, not left in service.
    quarantined = list((cluster.data / "n2").rglob("quarantine/*"))
    assert len(quarantined) >= len(owned), f"corrupt files must be quarantined: {quarantined}"


async def test_restarted_node_rejoins_and_serves(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = [random_chunk(300_000 + i) for i in range(8)]
    await _put_all(api, chunks)
    assert (await api.commit("rejoin/a", manifest_for(chunks))).status == 201
    await api.wait_state("rejoin/a", "nvme", timeout=60)
    await asyncio.to_thread(cluster.kill, 1, signal.SIGKILL)
    await _wait_dead(api, "n1")
    await asyncio.to_thread(cluster.start_node, 1)
    await asyncio.to_thread(cluster.wait_healthy, [1])
    n1 = Api(session, cluster.urls[1], TOKEN)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        doc = (await api.request("GET", "/v1/cluster")).doc
        if all(n["alive"] for n in doc["nodes"]):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("n1 did not rejoin")
    for c in chunks:
        got = await n1.get_chunk(chunk_id_of(c))
        assert got.status == 200 and got.raw == c
    assert (await n1.request("GET", "/v1/checkpoints/rejoin/a")).status == 200
    # It takes writes again as a replica.
    more = [random_chunk(1000 + i) for i in range(20)]
    replicas: set[str] = set()
    for c in more:
        r = await n1.put_chunk(c)
        assert r.status == 201
        replicas.update(r.doc["replicas"])
    assert "n1" in replicas


async def test_memory_full_is_backpressure_not_loss(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    # No drain runs: RAM fills with dirty (acked) data and must not drop it; the disks
    # have room, so the refusal is backpressure (503 memory_full), not a full disk.
    cluster = await cluster_factory.start(
        4, put_wait=0.5, drain_workers=0, stop_timeout=1.0, tiers={"memory_capacity": "24MiB"}
    )
    api = Api(session, cluster.urls[0], TOKEN)
    acked: list[bytes] = []
    full = None
    for _ in range(60):
        data = random_chunk(2 << 20)
        r = await api.put_chunk(data)
        if r.status == 503:
            full = r
            break
        assert r.status == 201, r.raw
        acked.append(data)
    assert full is not None, "RAM never filled"
    assert full.error == "memory_full" and int(full.headers["Retry-After"]) >= 1
    assert acked, "something was acked before RAM filled"
    for data in acked:
        got = await api.get_chunk(chunk_id_of(data))
        assert got.status == 200 and got.raw == data


async def test_ram_full_of_chunks_a_full_nvme_cannot_take_is_nvme_full(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """nvme too small to drain into (its configured capacity; tests/service/test_full_disk.py
    fills a real disk): RAM fills with dirty (acked) data, nothing acked is dropped, and
    the refusal names the full tier (507 nvme_full, E16), long before ``put_wait``."""
    put_wait = 8.0
    cluster = await cluster_factory.start(
        4,
        put_wait=put_wait,
        # a graceful stop waits this long to drain RAM, which can never fit on this nvme
        stop_timeout=1.0,
        tiers={"memory_capacity": "24MiB", "nvme_capacity": "1MiB"},
    )
    api = Api(session, cluster.urls[0], TOKEN)
    acked: list[bytes] = []
    full = None
    took = 0.0
    for _ in range(60):
        data = random_chunk(2 << 20)
        began = time.monotonic()
        r = await api.put_chunk(data)
        took = time.monotonic() - began
        if r.status >= 500:
            full = r
            break
        assert r.status == 201, r.raw
        acked.append(data)
    assert full is not None, "RAM never filled"
    assert full.status == 507 and full.error == "nvme_full", full.raw
    assert "nvme tier full on node n" in full.doc["message"], full.doc
    assert {f["tier"] for f in full.doc["full"]} == {"nvme"}
    assert took < put_wait / 2, f"refused after {took:.1f} s: the RAM wait, not the disk's word"
    assert acked, "something was acked before RAM filled"
    for data in acked:
        got = await api.get_chunk(chunk_id_of(data))
        assert got.status == 200 and got.raw == data


async def test_repair_restores_three_copies_after_a_node_dies(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    # No encoder: chunks stay hot-only, so three hot copies are what keeps them.
    cluster = await cluster_factory.start(5, encode_workers=0)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = [random_chunk(200_000 + i) for i in range(10)]
    replicas: dict[str, list[str]] = {}
    for c in chunks:
        r = await api.put_chunk(c)
        assert r.status == 201
        replicas[chunk_id_of(c)] = r.doc["replicas"]
    assert (await api.commit("repair/a", manifest_for(chunks))).status == 201
    victim = next(i for i in range(1, 5) if any(f"n{i}" in r for r in replicas.values()))
    await asyncio.to_thread(cluster.kill, victim)
    await _wait_dead(api, f"n{victim}")
    hot: dict[str, set[str]] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        plan = (await api.request("GET", "/v1/checkpoints/repair/a?plan")).doc["chunks"]
        hot = {cid: {s["node"] for s in srcs if s["tier"] != "cold"} for cid, srcs in plan.items()}
        if all(len(nodes) >= 3 for nodes in hot.values()):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"not re-replicated: {hot}")
    assert all(f"n{victim}" not in nodes for nodes in hot.values())
    for c in chunks:
        assert (await api.get_chunk(chunk_id_of(c))).raw == c


def _fragments_on_disk(cluster: LocalCluster, nodes: list[int]) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for i in nodes:
        for path in (cluster.data / f"n{i}" / "cold").rglob("*"):
            cid, dot, index = path.name.partition(".")
            if path.is_file() and dot and len(cid) == 64 and index.isdigit():
                found.setdefault(cid, set()).add(int(index))
    return found


async def test_repair_rebuilds_lost_fragments(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(5)
    api = Api(session, cluster.urls[0], TOKEN)
    chunks = [random_chunk(300_000 + i) for i in range(6)]
    await _put_all(api, chunks)
    assert (await api.commit("repair/b", manifest_for(chunks))).status == 201
    await api.wait_state("repair/b", "cold", timeout=120)
    n = (await api.request("GET", "/v1/cluster")).doc["erasure"]["n"]
    ids = {chunk_id_of(c) for c in chunks}
    before = _fragments_on_disk(cluster, list(range(5)))
    assert all(len(before[cid]) == n for cid in ids)
    # The victim holds fragments that only it has (one fragment index lives on one node),
    # so its death leaves those chunks short until repair rebuilds them elsewhere.
    on_victim = _fragments_on_disk(cluster, [3])
    assert any(on_victim.get(cid) for cid in ids), "n3 must hold fragments for the test to mean"
    await asyncio.to_thread(cluster.kill, 3)
    await _wait_dead(api, "n3")
    live = [0, 1, 2, 4]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = _fragments_on_disk(cluster, live)
        if all(len(after.get(cid, ())) == n for cid in ids):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"fragments not rebuilt: { {c: after.get(c) for c in ids} }")


async def test_gc_frees_unreferenced_and_deleted(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4, gc_grace=2.0, commit_window=2.0)
    api = Api(session, cluster.urls[0], TOKEN)
    kept, orphan, shared = random_chunk(5000), random_chunk(5001), random_chunk(5002)
    await _put_all(api, [kept, orphan, shared])
    assert (await api.commit("gc/a", manifest_for([kept, shared]))).status == 201
    assert (await api.commit("gc/b", manifest_for([shared]))).status == 201
    assert (await api.request("DELETE", "/v1/checkpoints/gc/a")).status == 204
    ids = [chunk_id_of(x) for x in (kept, orphan, shared)]
    # HEAD, not /missing: a /missing answer counts as a use of what it reports held, and
    # would keep the chunks alive for another grace period.
    deadline = time.monotonic() + 60
    missing: list[str] = []
    while time.monotonic() < deadline:
        missing = [c for c in ids if (await api.request("HEAD", f"/v1/chunks/{c}")).status == 404]
        if missing == ids[:2]:
            break
        await asyncio.sleep(0.5)
    assert missing == ids[:2], "orphan and deleted-only chunks are freed; the shared one stays"
    assert (await api.get_chunk(ids[2])).status == 200


def test_unsafe_erasure_config_refused(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=4, data=tmp_path, port=1, settings={"k": 5, "n": 6})
    config = cluster.write_config()
    proc = subprocess.run(
        [sys.executable, "-m", "storaged", "serve", "--config", str(config), "--node", "n0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "losing one node could lose cold data" in proc.stderr


def test_missing_secret_refused(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        '[[nodes]]\nid = "n0"\nurl = "http://127.0.0.1:1"\npeer = "127.0.0.1:2"\n'
        f'data = "{tmp_path}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STORAGED_")}
    proc = subprocess.run(
        [sys.executable, "-m", "storaged", "serve", "--config", str(conf), "--node", "n0",
         "--replication", "1", "--k", "1", "--n", "2"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 2 and "cluster secret" in proc.stderr


async def test_stalled_body_is_abandoned(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4, body_timeout=1.0)
    api = Api(session, cluster.urls[0], TOKEN)
    data = random_chunk(1 << 20)
    cid = chunk_id_of(data)
    head = (
        f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()

    def stall() -> bytes:
        import socket

        with socket.create_connection(("127.0.0.1", cluster.port), timeout=20) as s:
            s.sendall(head + data[:1000])  # then nothing, connection left open
            return s.recv(4096)

    answer = await asyncio.to_thread(stall)
    assert answer.startswith(b"HTTP/1.1 400") and b"truncated" in answer
    for url in cluster.urls:
        assert (await api.get_chunk(cid, url=url)).status == 404


async def test_tls(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await asyncio.to_thread(
        subprocess.run,
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    c = await cluster_factory.start(4, https=True, tls_cert=str(cert), tls_key=str(key))
    assert c.urls[0].startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    data = random_chunk(70_000)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.put(f"{c.urls[0]}/v1/chunks/{chunk_id_of(data)}", data=data, ssl=ctx) as r:
            assert r.status == 201
        async with s.get(f"{c.urls[1]}/v1/chunks/{chunk_id_of(data)}", ssl=ctx) as got:
            assert got.status == 200 and await got.read() == data
        # A client that does not trust the certificate is refused the connection.
        with pytest.raises(aiohttp.ClientError):
            async with s.get(f"{c.urls[0]}/healthz", ssl=ssl.create_default_context()):
                pass


def _nvme_copies(cluster: LocalCluster, cid: str) -> list[int]:
    return [
        i
        for i in range(cluster.nodes)
        if any(p.name == cid for p in (cluster.data / f"n{i}" / "nvme").rglob(cid))
    ]


async def test_retention_keeps_newest_on_owner_nvme_only(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4, retain_newest=1)
    api = Api(session, cluster.urls[0], TOKEN)
    old = [random_chunk(100_000 + i) for i in range(4)]
    new = [random_chunk(200_000 + i) for i in range(4)]
    await _put_all(api, old)
    assert (await api.commit("ret/step-1", manifest_for(old, created=100.0))).status == 201
    await api.wait_state("ret/step-1", "cold", timeout=120)
    await _put_all(api, new)
    assert (await api.commit("ret/step-2", manifest_for(new, created=200.0))).status == 201
    await api.wait_state("ret/step-2", "cold", timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        old_copies = {chunk_id_of(c): _nvme_copies(cluster, chunk_id_of(c)) for c in old}
        new_copies = {chunk_id_of(c): _nvme_copies(cluster, chunk_id_of(c)) for c in new}
        if all(not v for v in old_copies.values()) and all(
            len(v) == 1 for v in new_copies.values()
        ):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"retention: old {old_copies} new {new_copies}")
    # Still readable, from RAM, nvme or fragments.
    for c in old + new:
        assert (await api.get_chunk(chunk_id_of(c))).raw == c


async def test_aborted_upload_leaves_nothing(
    cluster_factory: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await cluster_factory.start(4)
    api = Api(session, cluster.urls[0], TOKEN)
    data = random_chunk(4 << 20)
    cid = chunk_id_of(data)
    head = (
        f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()

    def abort() -> None:
        import socket
        import struct

        s = socket.create_connection(("127.0.0.1", cluster.port), timeout=20)
        s.sendall(head + data[: len(data) // 3])
        time.sleep(0.3)
        # SO_LINGER 0: close with a reset, as a crashed client would.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    await asyncio.to_thread(abort)
    await asyncio.sleep(1.0)
    for url in cluster.urls:
        assert (await api.get_chunk(cid, url=url)).status == 404
    # The node is fine afterwards and the same chunk uploads whole.
    assert (await api.put_chunk(data)).status == 201
