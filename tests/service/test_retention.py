"""Retention policies on real node processes (issue 19 §3, docs/OPERATIONS.md "Retention").

The leader's passes run every half second; the tests save under prefixes with a policy and
wait (bounded) for the listing to settle, then check it stays so for a few more passes:
exactly what the policy keeps remains, the rest is tombstoned (the manifest 404s, a restore
fails), the kept ones restore byte for byte, the newest stays even with ``keep_last = 0``,
and a checkpoint whose manifest a client just read is kept while the hold lasts. On etcd,
``storaged retention set`` stores the cluster's policy there and ``show`` reads it back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from storaged.client import CheckpointNotFound, Client
from storaged.client.policies import retention_policy, set_retention_policy
from storaged.ids import chunk_id_of
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import ADMIN_TOKEN, TOKEN, ClusterFactory, healthy_rig
from tests.service.drain_workload import storaged_cli
from tests.service.http import Api, manifest_for, random_chunk

#: seconds between the leader's passes in these tests
PASS = 0.5

POLICY = [
    {"prefix": "job/", "keep_last": 3, "keep_every": 4},
    {"prefix": "newest/", "keep_last": 0},
    {"prefix": "held/", "keep_last": 0},
]


@pytest.fixture
async def api() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _save(api: Api, name: str, shared: bytes) -> list[bytes]:
    """A checkpoint of one chunk it shares with the others of its job and one of its own."""
    chunks = [shared, random_chunk(64 << 10)]
    for data in chunks:
        assert (await api.put_chunk(data)).status in (200, 201)
    reply = await api.commit(name, manifest_for(chunks, created=time.time()))
    assert reply.status == 201, reply.raw
    return chunks


async def _restore(api: Api, name: str) -> bytes | None:
    """The checkpoint's bytes read back through its manifest (None: 404)."""
    got = await api.request("GET", f"/v1/checkpoints/{name}")
    if got.status == 404:
        return None
    assert got.status == 200
    out = []
    for cid, _size in got.doc["shards"][0]["chunks"]:
        chunk = await api.get_chunk(cid)
        assert chunk.status == 200
        out.append(chunk.raw)
    return b"".join(out)


async def _settled(client: Client, prefix: str, want: set[str]) -> None:
    """Until the listing of ``prefix`` is ``want`` (bounded), then that it stays so for a
    few more passes (nothing kept is deleted later)."""
    deadline = time.monotonic() + 60.0
    while (names := {c.name for c in await client.list(prefix)}) != want:
        assert time.monotonic() < deadline, f"{prefix}: {sorted(names)}, expected {sorted(want)}"
        await asyncio.sleep(0.2)
    await asyncio.sleep(4 * PASS)
    assert {c.name for c in await client.list(prefix)} == want


def _start(factory: ClusterFactory) -> LocalCluster:
    return factory(4, retention=POLICY, retention_interval=PASS)


async def test_the_leader_applies_the_policy_through_rm(
    cluster_factory: ClusterFactory, api: aiohttp.ClientSession
) -> None:
    cluster = await asyncio.to_thread(_start, cluster_factory)
    http = Api(api, cluster.url(0), TOKEN)
    shared = random_chunk(64 << 10)
    saved = {}
    async with Client(cluster.urls, token=TOKEN) as client:
        # keep_last = 0 on newest/: its newest stays, whatever else goes
        for s in range(1, 4):
            await _save(http, f"newest/step-{s}", shared)
        # held/step-1's manifest is read before step-2 is committed: the hold keeps it
        await _save(http, "held/step-1", shared)
        assert await _restore(http, "held/step-1") is not None
        await _save(http, "held/step-2", shared)
        for s in range(1, 9):
            saved[f"job/step-{s}"] = b"".join(await _save(http, f"job/step-{s}", shared))

        kept = {f"job/step-{s}" for s in (4, 6, 7, 8)}  # the last 3, and every 4th
        await _settled(client, "job/", kept)
        await _settled(client, "newest/", {"newest/step-3"})
        await _settled(client, "held/", {"held/step-1", "held/step-2"})

        listed = {
            c.name: (c.retention.rule, c.retention.kept_by)
            for c in await client.list("", retention=True)
            if c.retention is not None
        }
        assert listed["job/step-8"] == ("job/", "newest, last 3, every 4th")
        assert listed["job/step-4"] == ("job/", "every 4th")
        assert listed["job/step-7"] == ("job/", "last 3")
        assert listed["held/step-1"] == ("held/", "being read")
        assert listed["newest/step-3"] == ("newest/", "newest")

        # (restores hold what they read: the listing above is from before them)
        for name, data in saved.items():
            if name in kept:
                assert await _restore(http, name) == data, name
            else:
                # tombstoned: the manifest 404s on every node, the client's restore too
                for url in cluster.urls:
                    got = await http.request("GET", f"/v1/checkpoints/{name}", url=url)
                    assert got.status == 404, (name, url, got.status)
                with pytest.raises(CheckpointNotFound):
                    await client.status(name)
        # the chunk the deleted ones shared with the kept ones is still served
        assert (await http.get_chunk(chunk_id_of(shared))).status == 200

    code, out, err = await storaged_cli("ls", "--url", cluster.urls[0], "job/")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[-4:] == ["ARCHIVE", "CREATED", "KEPT", "BY"]
    row = next(line for line in lines if line.startswith("job/step-4 "))
    assert row.endswith("  every 4th, being read") and "  -  " in row  # restored above
    code, out, err = await storaged_cli("ls", "--url", cluster.urls[0], "--json", "job/")
    assert code == 0, err
    entries = json.loads(out)["checkpoints"]
    assert entries[0]["retention"] == {
        "rule": "job/",
        "kept_by": "every 4th, being read",
        "archived": None,
    }


async def test_show_and_set_on_the_embedded_coordination(
    cluster_factory: ClusterFactory, coordinator: object
) -> None:
    if coordinator is not None:
        pytest.skip("the embedded coordination's answer (the etcd one is tested below)")
    cluster = await asyncio.to_thread(_start, cluster_factory)
    code, out, err = await storaged_cli("retention", "show", "--url", cluster.urls[0])
    assert code == 0, err
    assert out.startswith("# retention policy from cluster file\n")
    assert '[[retention]]\nprefix = "job/"\nkeep_last = 3\nkeep_every = 4\n' in out
    policy = Path(cluster.data) / "policy.toml"
    policy.write_text('[[retention]]\nprefix = "a/"\nkeep_last = 1\n')
    code, out, err = await storaged_cli("retention", "set", str(policy), "--url", cluster.urls[0])
    assert code != 0
    assert "cluster file" in err


@pytest.fixture
def on_etcd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ClusterFactory]:
    """Clusters on the session's etcd, whatever ``--coordinator`` says (a sync fixture: the
    rig starts off the test's event loop)."""
    factory = ClusterFactory(tmp_path, healthy_rig(request).fresh_prefix)
    try:
        yield factory
    finally:
        factory.stop_all()


async def test_set_and_show_on_etcd(on_etcd: ClusterFactory, tmp_path: Path) -> None:
    """``retention set FILE`` stores the policy in etcd, for every node: ``show`` through
    another node reads it back; a bad file is refused whole and changes nothing."""
    factory = on_etcd
    cluster = await asyncio.to_thread(factory, 3, retention_interval=PASS)
    url0, url2 = cluster.urls[0], cluster.urls[2]
    code, out, err = await storaged_cli("retention", "show", "--url", url0)
    assert (code, out) == (0, "# retention policy from none\n"), err

    good = tmp_path / "good.toml"
    good.write_text(
        '[[retention]]\nprefix = "job/"\nkeep_last = 2\nkeep_every = 3\nkeep_every_for = "7d"\n'
    )
    code, out, err = await storaged_cli("retention", "set", str(good), "--url", url0)
    assert code == 0, err
    assert out == "retention policy stored in etcd: 1 rule(s)\n"
    code, out, err = await storaged_cli("retention", "show", "--url", url2)
    assert code == 0, err
    assert out == (
        '# retention policy from etcd\n[[retention]]\nprefix = "job/"\nkeep_last = 2\n'
        'keep_every = 3\nkeep_every_for = "7d"\n'
    )

    bad = tmp_path / "bad.toml"
    bad.write_text('[[retention]]\nprefix = "job/"\nkeep_last = -1\n')
    code, out, err = await storaged_cli("retention", "set", str(bad), "--url", url0)
    assert code != 0 and "keep_last = -1" in err
    # refused by the node too, not only by the command's own check
    async with Client(cluster.urls, token=TOKEN) as client:
        with pytest.raises(Exception, match="archive"):
            await set_retention_policy(
                client,
                [{"prefix": "job/", "keep_last": 1, "archive_every": 2}],
                admin_token=ADMIN_TOKEN,
            )
        assert (await retention_policy(client))["rules"][0]["keep_last"] == 2

        # and the policy in etcd is applied: keep_last 2 and every 3rd of 1..5
        async with aiohttp.ClientSession() as session:
            http = Api(session, url0, TOKEN)
            shared = random_chunk(64 << 10)
            for s in range(1, 6):
                await _save(http, f"job/step-{s}", shared)
        await _settled(client, "job/", {"job/step-3", "job/step-4", "job/step-5"})
