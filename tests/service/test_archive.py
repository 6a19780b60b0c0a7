"""The archive tier end to end (docs/API.md E19, docs/OPERATIONS.md "Archive tier").

A committed checkpoint is archived by one cluster and listed and restored byte for byte by
a fresh cluster with empty data directories that shares only the archive: against a real
S3-compatible server (Swift with s3api, ``tests/s3server.py``, one for the module) with
node processes, and against a ``file://`` directory. The rest runs on in-process nodes
(``tests/service/inproc.py``): the HTTP answers, the DCP reader, a corrupt object, an
archive out of reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from storaged.cli import main as storaged_main
from storaged.client import Client
from storaged.client.checkpoint import restore_checkpoint, save_checkpoint
from storaged.client.errors import CheckpointNotFound, Conflict
from storaged.config import ConfigError, config_from_document
from storaged.errors import InsufficientStorage
from storaged.ids import chunk_id_of
from storaged.node.archive import CannotOpenArchive, ReadThroughCache
from storaged.tools.local_cluster import LocalCluster
from storaged.wire import STATES
from tests.client.test_client_checkpoint import model
from tests.conftest import TOKEN, ClusterFactory
from tests.s3server import SwiftS3Server, swift_for_tests
from tests.service.inproc import InprocFactory
from tiers.archive import ArchiveTier, S3Options

pytestmark = pytest.mark.timeout(300)

#: small chunks: a checkpoint of a few hundred KiB spans many of them
CHUNK = 16 << 10


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def swift() -> Iterator[SwiftS3Server]:
    """One Swift for the module."""
    yield from swift_for_tests()


def s3_env(server: SwiftS3Server) -> dict[str, str]:
    """The archive's credentials, as nodes take them: from the environment."""
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}


def s3_table(server: SwiftS3Server, tag: Path) -> dict[str, str]:
    """The cluster file's ``[archive]`` for a prefix of the bucket no other test uses."""
    prefix = "a-" + hashlib.sha256(str(tag).encode()).hexdigest()[:16]
    return {
        "url": f"s3://{server.bucket}/{prefix}",
        "endpoint": server.endpoint,
        "region": server.region,
    }


async def save(urls: list[str], token: str, name: str, m: Mapping[str, Any]) -> set[str]:
    """Save ``m`` as checkpoint ``name`` on one rank; its chunk ids."""
    async with Client(urls, token=token) as client:
        await save_checkpoint(client, name, {0: {**m, "step": 7}}, chunk_size=CHUNK)
        manifest = await client.get_manifest(name)
    return {c for shard in manifest["shards"] for c, _ in shard["chunks"]}


async def restored_equal(urls: list[str], token: str, name: str, m: Mapping[str, Any]) -> None:
    async with Client(urls, token=token) as client:
        values = await restore_checkpoint(client, name)
    assert values["step"] == 7
    for key, array in m.items():
        assert values[key].dtype == array.dtype and np.array_equal(values[key], array), key


async def get_raw(
    http: aiohttp.ClientSession, url: str, path: str, method: str = "GET"
) -> tuple[int, Any, Mapping[str, str]]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}
    async with http.request(method, url + path, headers=headers) as resp:
        raw = await resp.read()
        ctype = resp.headers.get("Content-Type", "")
        doc = json.loads(raw) if ctype.startswith("application/json") and raw else raw
        return resp.status, doc, resp.headers


async def archive_reads(urls: list[str]) -> float:
    """Bytes the nodes have served fetched from the archive (``/metrics``, no token)."""
    total = 0.0
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith('storaged_read_bytes_total{tier="archive"}'):
                        total += float(line.split()[-1])
    return total


def cli(*argv: str) -> tuple[int, str]:
    """``storaged ARGV`` in this process (in a thread: the nodes may be in the test's
    loop); its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = storaged_main(list(argv))
    return code, out.getvalue()


# --------------------------------------------------------------------------- configuration


def test_the_cluster_file_names_the_archive_and_never_its_secrets() -> None:
    archive = {
        "url": "s3://bucket/cluster-a",
        "endpoint": "http://10.0.0.9:8080",
        "region": "eu-west-1",
        "capacity": "1TiB",
    }
    doc: dict[str, Any] = {
        "auth": {"cluster_secret": "s"},
        "nodes": [
            {"id": "n0", "url": "http://127.0.0.1:1", "peer": "127.0.0.1:2", "data": "d0"},
            {"id": "n1", "url": "http://127.0.0.1:3", "peer": "127.0.0.1:4", "data": "d1"},
        ],
        "replication": 1,
        "erasure": {"k": 1, "n": 2},
        "archive": archive,
    }
    config = config_from_document(doc, "n0", environ={})
    assert config.archive == "s3://bucket/cluster-a"
    assert config.archive_endpoint == "http://10.0.0.9:8080"
    assert config.archive_region == "eu-west-1" and config.archive_capacity == 2**40
    # the environment and a flag override the file, as for every setting
    env = {"STORAGED_ARCHIVE": "file:///mnt/lustre/a"}
    assert config_from_document(doc, "n0", environ=env).archive == "file:///mnt/lustre/a"
    flag = {"archive": "s3://other"}
    assert config_from_document(doc, "n0", environ=env, overrides=flag).archive == "s3://other"
    secret = {**doc, "archive": {**archive, "secret_access_key": "x"}}
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        config_from_document(secret, "n0", environ={})
    bad = {**doc, "archive": {"url": "http://bucket"}}
    with pytest.raises(ConfigError, match="s3://bucket"):
        config_from_document(bad, "n0", environ={})


async def test_a_node_whose_archive_cannot_be_opened_refuses_to_start(
    inproc: InprocFactory, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    with pytest.raises(CannotOpenArchive, match="cannot open"):
        await inproc.start(3, archive=(blocker / "archive").as_uri())
    # The node process says so in one line, and exits 2 (a configuration error)
    config = tmp_path / "cluster.toml"
    config.write_text(
        'replication = 1\n[auth]\ncluster_secret = "s"\n[erasure]\nk = 1\nn = 2\n[archive]\n'
        f'url = "{(blocker / "archive").as_uri()}"\n[[nodes]]\nid = "n0"\n'
        f'url = "http://127.0.0.1:1"\npeer = "127.0.0.1:2"\ndata = "{tmp_path / "n0"}"\n'
        '[[nodes]]\nid = "n1"\nurl = "http://127.0.0.1:3"\npeer = "127.0.0.1:4"\n'
    )
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "storaged", "serve", "--config", str(config), "--node", "n0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "storaged serve: node n0: archive file://" in proc.stderr
    assert "cannot open it" in proc.stderr


def test_the_read_through_cache_keeps_to_its_budget_least_recently_used_out_first() -> None:
    cache = ReadThroughCache(10)
    a, b, c = (memoryview(bytes([i]) * 4) for i in range(3))
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now the most recently used
    cache.put("c", c)  # 12 bytes > 10: b goes
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
    assert cache.used == 8 and len(cache) == 2
    cache.put("big", memoryview(bytes(11)))  # larger than the budget: not kept, none dropped
    assert cache.get("big") is None and len(cache) == 2


# --------------------------------------------------------------------------- archiving


async def test_archiving_answers_202_then_200_and_status_says_archived(
    inproc: InprocFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    archive = (tmp_path / "archive").as_uri()
    cluster = await inproc.start(4, archive=archive)
    m = model(1)
    ids = await save(cluster.urls, TOKEN, "job/step-1", m)
    url = cluster.url(1)
    status, doc, _ = await get_raw(http, url, "/v1/checkpoints/job/step-1?status")
    assert status == 200 and doc["archived"] is False and doc["state"] in STATES
    status, doc, _ = await get_raw(http, url, "/v1/checkpoints/job/step-1?archive", "POST")
    assert status == 202 and doc == {"name": "job/step-1", "archived": False, "archiving": True}
    # --wait archived, as the command line says it
    code, out = await asyncio.to_thread(
        cli, "status", "job/step-1", "--wait", "archived", "--json", "--timeout", "60",
        "--url", ",".join(cluster.urls), "--token", TOKEN,
    )  # fmt: skip
    assert code == 0 and json.loads(out)["archived"] is True
    status, doc, _ = await get_raw(http, url, "/v1/checkpoints/job/step-1?archive", "POST")
    assert status == 200 and doc["archived"] is True
    # every chunk, then the manifest, is in the archive
    tier = await ArchiveTier.open(archive, 1 << 30)
    assert {key async for key in tier.keys()} == ids  # noqa: SIM118
    assert await tier.list_manifests("job/") == ["job/step-1"]
    async with Client(cluster.urls, token=TOKEN) as client:
        assert (await client.status("job/step-1")).archived is True
        assert await client.archive("job/step-1") is True  # idempotent
        # one not committed: 404, and nothing is put
        with pytest.raises(CheckpointNotFound):
            await client.archive("job/none")
    assert await tier.list_manifests() == ["job/step-1"]
    # a POST without ?archive is not allowed, as before E19
    status, doc, _ = await get_raw(http, url, "/v1/checkpoints/job/step-1", "POST")
    assert status == 405 and doc["error"] == "method_not_allowed"


async def test_a_cluster_without_an_archive_says_so(inproc: InprocFactory) -> None:
    cluster = await inproc.start(3)
    await save(cluster.urls, TOKEN, "plain/step-1", model(2))
    async with Client(cluster.urls, token=TOKEN) as client:
        with pytest.raises(Conflict) as info:
            await client.archive("plain/step-1")
        assert info.value.code == "no_archive"
        assert (await client.status("plain/step-1")).archived is False
    code, _ = await asyncio.to_thread(
        cli, "archive", "plain/step-1", "--url", ",".join(cluster.urls), "--token", TOKEN
    )
    assert code != 0


async def test_archiving_again_finishes_what_a_dead_node_left(
    inproc: InprocFactory, tmp_path: Path
) -> None:
    """Half the chunks archived and no manifest (a node died archiving): archiving again
    puts the rest and the manifest, and uploads nothing twice."""
    archive = (tmp_path / "archive").as_uri()
    cluster = await inproc.start(4, archive=archive)
    ids = sorted(await save(cluster.urls, TOKEN, "half/step-1", model(3)))
    tier = await ArchiveTier.open(archive, 1 << 30)
    node = cluster.node(0)
    for cid in ids[: len(ids) // 2]:
        data, _ = await node.read_chunk(cid)
        await tier.put(cid, data)
    assert await tier.list_manifests() == []  # half-archived: not listed
    done = await cluster.node(2).archive.archive("half/step-1")
    assert (done.chunks, done.put) == (len(ids), len(ids) - len(ids) // 2)
    assert await cluster.node(3).archive.archived("half/step-1")


async def test_an_archive_out_of_room_is_507_and_lists_nothing(
    inproc: InprocFactory, tmp_path: Path
) -> None:
    """An archive whose quota (``archive_capacity``) cannot take the checkpoint: archiving
    raises 507 ``archive_full``, and the checkpoint is not listed there (no manifest)."""
    archive = (tmp_path / "archive").as_uri()
    cluster = await inproc.start(4, archive=archive, archive_capacity=64 << 10)
    await save(cluster.urls, TOKEN, "full/step-1", model(4))  # a few hundred KiB
    with pytest.raises(InsufficientStorage) as refused:
        await cluster.node(1).archive.archive("full/step-1")
    assert refused.value.code == "archive_full"
    assert not await cluster.node(2).archive.archived("full/step-1")
    tier = await ArchiveTier.open(archive, 1 << 30)
    try:
        assert await tier.list_manifests() == []
    finally:
        await tier.close()


# --------------------------------------------------------------------------- a fresh cluster


async def fresh_cluster_restores(
    first: LocalCluster, second_start: Any, name: str, m: Mapping[str, Any]
) -> None:
    """``first`` holds ``name``: archive it, stop ``first``, start ``second`` (empty data
    dirs, the same archive): it lists ``name`` and restores it byte for byte, the second
    time from RAM."""
    ids = await save(first.urls, first.token, name, m)
    code, out = await asyncio.to_thread(
        cli, "archive", name, "--wait", "--json", "--timeout", "120",
        "--url", ",".join(first.urls), "--token", first.token,
    )  # fmt: skip
    assert code == 0 and json.loads(out) == {"name": name, "archived": True}
    # a cluster with an archive (and no retention policy) lists whether each one is in it
    code, out = await asyncio.to_thread(
        cli, "ls", "--no-costs", "--url", ",".join(first.urls), "--token", first.token
    )
    header, *rows = out.splitlines()
    assert code == 0 and header.split()[-2:] == ["ARCHIVE", "CREATED"]
    end = header.index("ARCHIVE") + len("ARCHIVE")  # the cell is right-aligned under it
    assert [row[end - 4 : end] for row in rows if row.split()[0] == name] == [" yes"]
    await asyncio.to_thread(first.stop)
    second: LocalCluster = await second_start()
    assert second.data != first.data
    async with Client(second.urls, token=second.token) as client:
        info = await client.cluster_document()
        held = [n[tier]["count"] for n in info["nodes"] for tier in ("memory", "nvme", "cold")]
        assert not any(held)  # empty: it shares only the archive
        listed = {c.name: c for c in await client.list()}
        assert listed[name].state == "archived" and listed[name].bytes > 0
        status = await client.status(name)
        assert status.state == "archived" and status.archived is True
    for form in (["--json"], []):
        code, out = await asyncio.to_thread(
            cli, "ls", *form, "--url", ",".join(second.urls), "--token", second.token
        )
        assert code == 0 and name in out and "archived" in out
    headers = {"Authorization": f"Bearer {second.token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for query in ("", "?plan", "?status"):
            async with http.get(f"{second.url(0)}/v1/checkpoints/{name}{query}") as resp:
                assert resp.status == 200 and resp.headers["X-Storaged-Source"] == "archive"
                doc = await resp.json()
            if query:
                assert doc["source"] == "archive"
            if query == "?plan":  # every chunk, none held by the cluster
                assert set(doc["chunks"]) == ids and not any(doc["chunks"].values())
        cid = sorted(ids)[0]
        tiers = []
        for _ in range(2):
            async with http.get(f"{second.url(0)}/v1/chunks/{cid}") as resp:
                body = await resp.read()
                assert resp.status == 200 and chunk_id_of(body) == cid
                tiers.append(resp.headers["X-Storaged-Tier"])
        assert tiers == ["archive", "memory"]  # fetched once, then from the node's RAM
    await restored_equal(second.urls, second.token, name, m)
    fetched = await archive_reads(second.urls)
    await restored_equal(second.urls, second.token, name, m)  # served from RAM now
    assert await archive_reads(second.urls) == fetched > 0  # nothing fetched again
    async with Client(second.urls, token=second.token) as client:
        assert await client.archive(name) is True  # archived already, though not catalogued


async def test_a_fresh_cluster_restores_from_the_s3_archive(
    swift: SwiftS3Server, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    table = s3_table(swift, tmp_path)
    env = s3_env(swift)
    first = await cluster_factory.start(4, archive=table, env=env)

    async def second() -> LocalCluster:
        return await cluster_factory.start(4, archive=table, env=env)

    await fresh_cluster_restores(first, second, "s3job/step-10", model(4))


async def test_a_fresh_cluster_restores_from_a_file_archive(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    archive = (tmp_path / "shared-mount").as_uri()
    first = await cluster_factory.start(4, archive=archive)

    async def second() -> LocalCluster:
        return await cluster_factory.start(4, archive=archive)

    await fresh_cluster_restores(first, second, "filejob/step-10", model(5))


def _dcp() -> tuple[Any, Any, Any, Any, Any]:
    """torch, DCP's load and save, and storaged's DCP reader and writer (skip: no torch)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    from storaged.client.dcp import StoragedReader, StoragedWriter

    return torch, load, save, StoragedReader, StoragedWriter


@pytest.mark.torch
async def test_the_dcp_reader_restores_from_a_fresh_cluster(
    inproc: InprocFactory, tmp_path: Path
) -> None:
    # Imported in a thread: torch's import takes seconds of the nodes' loop otherwise
    torch, dcp_load, dcp_save, StoragedReader, StoragedWriter = await asyncio.to_thread(_dcp)
    archive = (tmp_path / "archive").as_uri()
    first = await inproc.start(4, archive=archive)
    state = {"w": torch.randn(64, 33), "h": torch.arange(100, dtype=torch.bfloat16), "step": 3}
    writer = StoragedWriter(first.urls, "dcp/step-3", TOKEN, chunk_size=4096)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    async with Client(first.urls, token=TOKEN) as client:
        await client.archive("dcp/step-3", wait=True, timeout=60)
    await first.close()
    second = await inproc.start(4, archive=archive)
    loaded = {"w": torch.zeros(64, 33), "h": torch.zeros(100, dtype=torch.bfloat16), "step": 0}
    reader = StoragedReader(second.urls, "dcp/step-3", TOKEN)
    await asyncio.to_thread(dcp_load, loaded, storage_reader=reader, no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert torch.equal(loaded["h"].view(torch.int16), state["h"].view(torch.int16))
    # Read through, not taken in: no node holds a chunk of it (nothing to drain or count)
    for i in second.running():
        assert not second.node(i).index
    assert sum(len(second.node(i).archive.cache) for i in second.running()) > 0


async def test_a_corrupt_object_in_the_archive_is_refused_not_served(
    inproc: InprocFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    root = tmp_path / "archive"
    first = await inproc.start(4, archive=root.as_uri())
    ids = sorted(await save(first.urls, TOKEN, "bad/step-1", model(6)))
    async with Client(first.urls, token=TOKEN) as client:
        await client.archive("bad/step-1", wait=True, timeout=60)
    await first.close()
    victim = root / "chunks" / ids[0]
    flipped = bytearray(victim.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    victim.write_bytes(flipped)
    second = await inproc.start(4, archive=root.as_uri())
    status, doc, _ = await get_raw(http, second.url(0), f"/v1/chunks/{ids[0]}")
    assert status == 404 and doc["error"] == "chunk_not_found"
    assert not victim.exists() and len(list((root / "quarantine").iterdir())) == 1
    status, doc, _ = await get_raw(http, second.url(1), f"/v1/chunks/{ids[0]}")
    assert status == 404  # gone, not served from anywhere
    status, _, headers = await get_raw(http, second.url(0), f"/v1/chunks/{ids[1]}")
    assert status == 200 and headers["X-Storaged-Tier"] == "archive"  # the others still read


async def test_an_archive_out_of_reach_gives_a_clear_error_and_changes_nothing(
    swift: SwiftS3Server,
    inproc: InprocFactory,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Last in the module: it takes the Swift proxy down."""
    for key, value in s3_env(swift).items():
        monkeypatch.setenv(key, value)
    table = s3_table(swift, tmp_path)
    cluster = await inproc.start(
        4,
        archive=table["url"],
        archive_endpoint=table["endpoint"],
        archive_region=table["region"],
    )
    await save(cluster.urls, TOKEN, "down/step-1", model(7))
    # An archive that hangs (SIGSTOP: connections open, nothing answers) costs a status
    # its deadline (2 s), not the tier's 30 s a request: it answers, without "archived"
    swift.stop("proxy")
    try:
        within = aiohttp.ClientTimeout(total=20)
        async with http.get(
            f"{cluster.url(0)}/v1/checkpoints/down/step-1?status",
            headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"},
            timeout=within,
        ) as resp:
            assert resp.status == 200 and (await resp.json())["archived"] is None
    finally:
        swift.resume("proxy")
    await asyncio.to_thread(swift.kill, "proxy")
    try:
        status, doc, headers = await get_raw(
            http, cluster.url(0), "/v1/checkpoints/down/step-1?archive", "POST"
        )
        assert status == 503 and doc["error"] == "archive_unavailable", doc
        assert table["url"].split("/")[2] in doc["message"] and "Retry-After" in headers
        status, doc, _ = await get_raw(http, cluster.url(0), "/v1/checkpoints/down/step-1?status")
        assert status == 200 and doc["archived"] is None and doc["state"] in STATES
        status, doc, _ = await get_raw(http, cluster.url(0), "/v1/checkpoints")
        assert status == 200 and doc["archive_unavailable"] is True
        assert [c["name"] for c in doc["checkpoints"]] == ["down/step-1"]
        assert not cluster.node(0).archive.running
    finally:
        swift.launch("proxy")
        await asyncio.to_thread(swift.wait_serving, 120)
    options = S3Options(endpoint=swift.endpoint, region=swift.region)
    tier = await ArchiveTier.open(table["url"], 1 << 30, s3=options)
    assert await tier.list_manifests() == []
    assert [key async for key in tier.keys()] == []  # noqa: SIM118
