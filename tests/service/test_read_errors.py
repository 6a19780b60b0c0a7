"""What a chunk read answers when the node's own disk or tiers fail under it: every
exception the read path can meet maps to its documented answer (docs/API.md), never to
500 ``internal``.

- An nvme or cold directory that cannot be read (here replaced by a file: ENOTDIR, as an
  unmounted or wiped disk gives) is a source that cannot serve now: the read goes on to
  the next one, and answers 200 from there (fragment reads of that node: 404).
- A node that is stopping gracefully closes its tiers and peer links while its HTTP site
  still answers: 503 ``shutting_down`` with ``Retry-After`` (ask another node), not 500
  (a closed tier) nor a false 404 (peers it can no longer reach).
- A chunk that goes (collected, a wiped disk) between a HEAD's check and its read: 404.
"""

from __future__ import annotations

import logging

import aiohttp
import pytest

from erasure import fragment_key
from storaged.ids import chunk_id_of
from tests.conftest import TOKEN
from tests.service.http import Api, manifest_for, random_chunk
from tests.service.inproc import InprocFactory, wait_until
from tests.service.test_durability import broken_dir

pytestmark = pytest.mark.timeout(120)


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if rec.exc_info]


async def test_a_read_goes_past_an_unreadable_nvme_dir(
    inproc: InprocFactory, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The code before let the ``NotADirectoryError`` of the holder's nvme read escape:
    500 ``internal`` for a GET entering there, and a traceback on that node for a GET
    entering elsewhere."""
    caplog.set_level(logging.INFO)
    cluster = await inproc.start(4, drain_defer=0.0, encode_workers=0)
    data = random_chunk(200_000)
    cid = chunk_id_of(data)
    first, *_ = order = cluster.order(cid)
    assert (await Api(http, cluster.url(order[3]), TOKEN).put_chunk(data)).status == 201
    await wait_until("on nvme", lambda: all(cluster.node(i).nvme_has(cid) for i in order[:3]))
    holder = cluster.node(first)
    await holder.memory.delete(cid)  # evicted: its copy is the nvme file
    with broken_dir(holder.nvme.root):
        for entry in (first, order[3]):
            got = await Api(http, cluster.url(entry), TOKEN).get_chunk(cid)
            assert got.status == 200 and got.raw == data, (entry, got.status, got.raw[:200])
    assert holder.nvme_has(cid)  # not proof it is gone: kept for when the disk is back
    got = await Api(http, cluster.url(first), TOKEN).get_chunk(cid)
    assert got.status == 200 and got.headers["X-Storaged-Tier"] == "nvme"
    assert not _tracebacks(caplog), _tracebacks(caplog)


async def test_a_cold_read_goes_past_an_unreadable_cold_dir(
    inproc: InprocFactory, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A cold chunk (fragments only) read through a node whose cold dir cannot be read:
    the rebuild takes ``k`` other fragments (200); that node's own fragment read is 404
    ``fragment_not_found``. The code before answered 500 for both (the local fragment
    read's ``NotADirectoryError`` escaped the rebuild)."""
    caplog.set_level(logging.INFO)
    cluster = await inproc.start(4, drain_defer=0.0, encode_defer=0.0)
    data = random_chunk(300_000)
    cid = chunk_id_of(data)
    api = Api(http, cluster.url(0), TOKEN)
    assert (await api.put_chunk(data)).status == 201
    assert (await api.commit("reads/cold", manifest_for([data]))).status == 201
    n = cluster.node(0).config.n
    await wait_until("cold", lambda: cluster.fragments(cid) == set(range(n)), timeout=60)
    await cluster.node(0).evict("reads/cold", nvme=True)
    await wait_until("no hot copy", lambda: not cluster.hot_holders(cid), timeout=60)
    broken = next(i for i in cluster.running() if cluster.node(i).fragments.get(cid))
    index = min(cluster.node(broken).fragments[cid])
    with broken_dir(cluster.node(broken).cold.root):
        got = await api.get_chunk(cid, url=cluster.url(broken))
        assert got.status == 200 and got.raw == data, (got.status, got.raw[:200])
        path = f"/v1/chunks/{cid}/fragments/{index}"
        got = await api.request("GET", path, url=cluster.url(broken))
        assert (got.status, got.error) == (404, "fragment_not_found"), got.raw
    assert index in cluster.node(broken).fragments[cid]  # kept: the disk may come back
    assert not _tracebacks(caplog), _tracebacks(caplog)


async def test_a_read_on_a_node_that_is_stopping_is_503_shutting_down(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """The window of a graceful stop (SIGTERM) after the node closed its tiers and peer
    links and before the HTTP site stops: the code before answered a GET of a chunk it
    held 500 (``TierError``: the tier is closed) and one of a chunk held elsewhere a false
    404 ``chunk_not_found``."""
    cluster = await inproc.start(4, drain_defer=0.0)
    data = random_chunk(100_000)
    cid = chunk_id_of(data)
    order = cluster.order(cid)
    holder, other = order[0], order[3]
    assert (await Api(http, cluster.url(holder), TOKEN).put_chunk(data)).status == 201
    for i in (holder, other):
        # as serve() runs a SIGTERM: the node stops (drained, closed), its site stays up
        assert await cluster.node(i).shutdown(timeout=10)
    for i in (holder, other):
        got = await Api(http, cluster.url(i), TOKEN).get_chunk(cid)
        assert (got.status, got.error) == (503, "shutting_down"), (i, got.raw)
        assert got.headers.get("Retry-After") == "1"
    # HEAD reads no bytes: the holder still describes its own copy truly; the other node,
    # cut off from the holders, does not say "not held"
    got = await Api(http, cluster.url(other), TOKEN).request("HEAD", f"/v1/chunks/{cid}")
    assert got.status == 503 and got.headers.get("Retry-After") == "1"
    live = next(i for i in range(4) if i not in (holder, other))
    got = await Api(http, cluster.url(live), TOKEN).get_chunk(cid)
    assert got.status == 200 and got.raw == data


async def test_head_of_a_chunk_gone_between_its_check_and_its_read_is_404(
    inproc: InprocFactory, http: aiohttp.ClientSession
) -> None:
    """HEAD reads the chunk when no holder knows its size. Fragments whose files went from
    the disks behind the nodes' backs (a wiped data dir) are still indexed when HEAD asks,
    gone when it reads: 404 ``chunk_not_found``. The code before let the read's
    ``ChunkNotFound`` escape: 500."""
    cluster = await inproc.start(4, repair_interval=3600.0, gc_interval=3600.0)
    data = random_chunk(100_000)
    cid = chunk_id_of(data)
    sender = cluster.node(0)
    fragments = await sender.codec.encode_async(cid, data)
    targets = sender.placement().fragment_targets(cid)
    for index, target in enumerate(targets):
        # no size: as a rebalance move from a leader that has no index entry of the chunk
        key = fragment_key(cid, index)
        await sender.call(target, "put_fragment", {"key": key}, fragments[index].to_bytes())
    api = Api(http, cluster.url(0), TOKEN)
    got = await api.request("HEAD", f"/v1/chunks/{cid}")
    assert got.status == 200 and got.headers["Content-Length"] == str(len(data))
    for i in cluster.running():
        for path in cluster.node(i).cold.root.rglob(f"{cid}.*"):
            path.unlink()
    got = await api.request("HEAD", f"/v1/chunks/{cid}")
    assert got.status == 404, got.status
    got = await api.get_chunk(cid)
    assert (got.status, got.error) == (404, "chunk_not_found")
