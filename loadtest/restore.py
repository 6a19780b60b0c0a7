"""Restore bandwidth per tier and concurrency, next to same-run baselines.

``python -m loadtest restore`` saves one ``--size`` GiB checkpoint (``Layout``: float32
tensors sharded by rows) from ``--ranks`` saving processes, waits until it is cold, and
restores it with ``c`` concurrent restoring processes for each ``c`` of ``--concurrency``
(default 1, 2, 4): real separate processes, each with its own ``Client``, each restoring
its own box of every tensor with ``restore_checkpoint`` (rank ``j`` of ``c`` takes rows
``[j, j+1) * rows / c``: a job restarted on ``c`` ranks). Every byte restored is checked
against the bytes saved, outside the timed window. Per tier:

- **memory**: the RAM copies (three per chunk) serve;
- **nvme**: after ``POST /v1/admin/evict {"tier": "memory"}``; once cold, only each chunk's
  owner keeps its nvme copy (retention), so one copy per chunk serves. The page cache is
  dropped before each run (``POSIX_FADV_DONTNEED`` on every file of the nodes; with
  ``--url``, ``echo 1 > /proc/sys/vm/drop_caches`` when allowed, else the run says warm);
- **cold**: after ``evict {"tier": "nvme"}`` and SIGKILL of one node (degraded: the nodes
  rebuild every chunk from k of the n fragments left), page cache dropped likewise.

Figures per run: restore GB/s (checkpoint bytes / first start to last finish), time to
first byte (mean over the processes of start to the first chunk's response headers), p50
and p99 chunk latency (request sent to body in place, from the client's trace), bytes read
per tier (the nodes' ``storaged_read_bytes_total`` deltas, and the ``X-Storaged-Tier``
headers counted by the clients), CPU seconds per GB of the restoring processes and of the
nodes (``/proc/<pid>/stat``).

Baselines, same run, same ``c`` processes, same bytes and destinations: one aiohttp process
serving the same chunks from memory (for the memory tier), raw reads of the same bytes from
files with the page cache dropped the same way (for nvme), raw zfec decode with a fragment
missing (``loadtest.codec``, one thread: for cold; and the same decode on every core at
once, a second ratio of the cold rows), DCP ``load`` of the same state (one
directory per saving rank, page cache warm and dropped), and raw asyncio loopback transfer
(``loadtest.peer``). Every storaged figure is printed with its ratio to its baseline.

Output in ``--out`` (default ``loadtest/results/``): ``restore.json``, ``restore.md``,
``restore.png`` (bandwidth against concurrency per tier, baselines as lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.harness.baselines import (
    DcpSave,
    DiskWrite,
    complete_baselines,
    dcp_warm_up,
    raw_baselines,
)
from loadtest.harness.checkpoint import ROW_BYTES, Layout, StoragedRestore, save_checkpoint_with
from loadtest.harness.checkpoint import empty_box as _targets
from loadtest.harness.checkpoint import verify_box as _verify
from loadtest.harness.cluster import (
    ADMIN_TOKEN,
    HOST,
    TIERS,
    TOKEN,
    CpuMeter,
    read_bytes,
    read_bytes_delta,
    start_cluster,
)
from loadtest.harness.command import (
    Progress,
    add_cluster_arguments,
    add_output_arguments,
    add_workload_arguments,
    resolve_workload,
    run_and_write,
)
from loadtest.harness.loopback import serve_aiohttp, spawn_server, stop_server
from loadtest.harness.machine import (
    GB,
    NO_TORCH,
    GiB,
    MiB,
    drop_page_cache,
    git_commit,
    machine_info,
    new_loop,
    remove_tree,
    torch_available,
)
from loadtest.harness.plots import figure, finish_levels_axes, plot_baselines
from loadtest.harness.report import by_concurrency, fmt, markdown_table, ratio, run_notes
from loadtest.harness.trace import client_cpu, summarize_latencies
from loadtest.harness.workers import Prepared, WorkerPool, wall_seconds
from storaged.client import Client
from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.tools.local_cluster import LocalCluster, default_erasure

# -- jobs (one per restoring process) -------------------------------------------------------------


def serve_memory(layout: Layout, loop_name: str, control: Connection) -> None:
    """The aiohttp baseline server: every tensor in memory, ``GET /items/<i>?start=&end=``."""
    from aiohttp import web

    arrays = layout.make(0, 1)
    flat = [arrays[layout.key(i)].view(np.uint8).reshape(-1).data for i in range(layout.keys)]

    async def get_item(request: web.Request) -> web.Response:
        view = flat[int(request.match_info["key"])]
        start, end = int(request.query["start"]), int(request.query["end"])
        # A view of the stored bytes: aiohttp writes it to the socket without a copy.
        return web.Response(body=view[start:end], content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/items/{key}", get_item)
    serve_aiohttp(app, loop_name, control)


@dataclass(frozen=True)
class AiohttpRestore:
    """Baseline: GET the same bytes in chunk-sized pieces from ``serve_memory``."""

    port: int
    layout: Layout
    rank: int
    ranks: int
    inflight: int = 8
    chunk: int = DEFAULT_CHUNK_SIZE
    loop: str = "uvloop"
    verify: bool = True

    def prepare(self) -> Prepared:
        return _AiohttpRestorer(self)


class _AiohttpRestorer:
    def __init__(self, job: AiohttpRestore) -> None:
        import aiohttp

        self.job = job
        self.start, self.arrays = _targets(job.layout, job.rank, job.ranks)
        self.pieces: list[tuple[str, memoryview]] = []
        for i in range(job.layout.keys):
            flat = self.arrays[job.layout.key(i)].view(np.uint8).reshape(-1).data
            base = self.start * ROW_BYTES
            for lo in range(0, len(flat), job.chunk):
                view = flat[lo : lo + job.chunk]
                url = (f"http://{HOST}:{job.port}/items/{i}?start={base + lo}"
                       f"&end={base + lo + len(view)}")  # fmt: skip
                self.pieces.append((url, view))
        self.runner = asyncio.Runner(loop_factory=lambda: new_loop(job.loop))

        async def session() -> aiohttp.ClientSession:
            connector = aiohttp.TCPConnector(limit=job.inflight + 4)
            return aiohttp.ClientSession(connector=connector, auto_decompress=False)

        self.session = self.runner.run(session())

    def run(self) -> dict[str, Any]:
        return self.runner.run(self._run())

    async def _run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        slots = asyncio.Semaphore(self.job.inflight)
        latencies: list[float] = []
        first: list[float] = []

        async def one(url: str, view: memoryview) -> None:
            async with slots:
                sent = time.monotonic()
                async with self.session.get(url) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"baseline server answered {resp.status}")
                    first.append(time.monotonic())
                    pos = 0
                    # The read loop of storaged.client: readany() pieces into the destination.
                    while piece := await resp.content.readany():
                        view[pos : pos + len(piece)] = piece
                        pos += len(piece)
                    if pos != len(view):
                        raise RuntimeError(f"short body: {pos} of {len(view)} bytes")
                latencies.append(time.monotonic() - sent)

        await asyncio.gather(*(one(url, view) for url, view in self.pieces))
        return {
            "bytes": sum(len(v) for _, v in self.pieces),
            "ttfb": min(first) - t0,
            "latencies": latencies,
        }

    def check(self) -> dict[str, Any]:
        return {"verified": _verify(self.job.layout, self.start, self.arrays)
                if self.job.verify else None}  # fmt: skip

    def close(self) -> None:
        try:
            self.runner.run(self.session.close())
        finally:
            self.runner.close()


@dataclass(frozen=True)
class DiskRestore:
    """Baseline: read the same bytes from the files ``DiskWrite`` made, one read at a time."""

    directory: str
    layout: Layout
    rank: int
    ranks: int
    verify: bool = True

    def prepare(self) -> Prepared:
        return _DiskReader(self)


class _DiskReader:
    def __init__(self, job: DiskRestore) -> None:
        self.job = job
        self.start, self.arrays = _targets(job.layout, job.rank, job.ranks)
        _, end = job.layout.box(job.rank, job.ranks)
        # (path, offset in the file, destination view): the parts of each file in our box.
        self.reads: list[tuple[str, int, memoryview]] = []
        for i in range(job.layout.keys):
            flat = self.arrays[job.layout.key(i)].view(np.uint8).reshape(-1).data
            directory = Path(job.directory) / f"k{i}"
            for path in sorted(directory.iterdir()):
                first = int(path.name)
                last = first + path.stat().st_size // ROW_BYTES
                lo, hi = max(first, self.start), min(last, end)
                if lo < hi:
                    dest = flat[(lo - self.start) * ROW_BYTES : (hi - self.start) * ROW_BYTES]
                    self.reads.append((str(path), (lo - first) * ROW_BYTES, dest))
        covered = sum(len(v) for _, _, v in self.reads)
        if covered != sum(a.nbytes for a in self.arrays.values()):
            raise RuntimeError(f"files under {job.directory} do not cover rank {job.rank}")

    def run(self) -> dict[str, Any]:
        from tiers._durable import preadv_all

        latencies = []
        for path, offset, dest in self.reads:
            began = time.monotonic()
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if preadv_all(fd, [dest], offset) != len(dest):
                    raise OSError(f"short read of {path}")
            finally:
                os.close(fd)
            latencies.append(time.monotonic() - began)
        return {
            "bytes": sum(len(v) for _, _, v in self.reads),
            "ttfb": latencies[0] if latencies else None,
            "latencies": latencies,
        }

    def check(self) -> dict[str, Any]:
        return {"verified": _verify(self.job.layout, self.start, self.arrays)
                if self.job.verify else None}  # fmt: skip

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class DcpLoad:
    """Baseline: ``torch.distributed.checkpoint.load`` of the saving ranks in ``parts`` (each
    its own directory) into preallocated tensors."""

    directory: str
    layout: Layout
    parts: tuple[int, ...]
    saved_ranks: int
    verify: bool = True

    def prepare(self) -> Prepared:
        return _DcpLoader(self)


class _DcpLoader:
    def __init__(self, job: DcpLoad) -> None:
        import torch

        self.job = job
        dcp_warm_up()
        self.parts = []
        for part in job.parts:
            start, arrays = _targets(job.layout, part, job.saved_ranks)
            tensors = {key: torch.from_numpy(a) for key, a in arrays.items()}
            self.parts.append((part, start, arrays, tensors))

    def run(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        for part, _, _, tensors in self.parts:
            reader = FileSystemReader(str(Path(self.job.directory) / f"rank{part}"))
            load(tensors, storage_reader=reader, no_dist=True)
        return {"bytes": sum(a.nbytes for _, _, arrays, _ in self.parts for a in arrays.values())}

    def check(self) -> dict[str, Any]:
        if not self.job.verify:
            return {"verified": None}
        ok = all(_verify(self.job.layout, start, arrays) for _, start, arrays, _ in self.parts)
        return {"verified": ok}

    def close(self) -> None:
        pass


# -- the parent's part ----------------------------------------------------------------------------


def _row(kind: str, c: int, results: Sequence[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Aggregate figures of one run of ``c`` processes."""
    nbytes = sum(int(r["bytes"]) for r in results)
    seconds = wall_seconds(results)
    gb = nbytes / GB
    ttfbs = [float(r["ttfb"]) for r in results if r.get("ttfb") is not None]
    verified = [r.get("verified") for r in results]
    row: dict[str, Any] = {
        "kind": kind,
        "concurrency": c,
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "gbps": round(gb / seconds, 4),
        "ttfb_ms": round(sum(ttfbs) / len(ttfbs) * 1e3, 3) if ttfbs else None,
        **summarize_latencies([x for r in results for x in r.get("latencies", [])]),
        **client_cpu(results, nbytes),
        "verified": None if any(v is None for v in verified) else all(verified),
    }
    row.update(extra)
    return row


def _evict(url: str, admin_token: str | None, name: str, tier: str) -> dict[str, Any]:
    """The admin evict call: it needs the admin token wherever a client token is set."""
    body = json.dumps({"checkpoint": name, "tier": tier}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if admin_token:
        headers["Authorization"] = f"Bearer {admin_token}"
    request = urllib.request.Request(f"{url}/v1/admin/evict", body, headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


async def _cluster_view(urls: Sequence[str], token: str | None) -> list[tuple[str, str, bool]]:
    async with Client(list(urls), token=token) as client:
        return [(n.id, n.url, n.alive) for n in client.cluster.nodes]


def _nodes(urls: Sequence[str], token: str | None) -> list[tuple[str, str, bool]]:
    with asyncio.Runner() as runner:
        return runner.run(_cluster_view(urls, token))


def _wait_down(urls: Sequence[str], token: str | None, dead: str, timeout: float = 60.0) -> float:
    """Until the live nodes report ``dead`` down; the seconds that took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(node == dead and not alive for node, _, alive in _nodes(urls, token)):
            return time.monotonic() - t0
        time.sleep(0.25)
    raise RuntimeError(f"the cluster still reports {dead} alive after {timeout:.0f} s")


async def _wait_state(urls: Sequence[str], token: str | None, name: str, timeout: float) -> Any:
    async with Client(list(urls), token=token) as client:
        try:
            status = await client.wait(name, "cold", timeout)
        except TimeoutError:
            status = await client.status(name)
        return status


@dataclass
class Options:
    size: int
    keys: int
    ranks: int
    concurrency: list[int]
    nodes: int
    memory: str
    chunk: int
    client_concurrency: int
    cold_timeout: float
    url: str | None
    token: str | None
    loop: str
    out: Path
    tmp: Path | None
    verify: bool
    quick: bool
    command: str
    baselines: bool = True
    #: admin token of the ``--url`` cluster (the evict steps need it)
    admin_token: str | None = None


@dataclass
class _Cluster:
    """The cluster under test: local (``cluster`` set) or given by ``--url``."""

    urls: list[str]
    token: str | None
    cluster: LocalCluster | None
    #: node URL -> node id
    ids: dict[str, str] = field(default_factory=dict)
    admin_token: str | None = None

    @property
    def pids(self) -> list[int]:
        if self.cluster is None:
            return []
        return [p.pid for i, p in self.cluster.procs.items() if self.cluster.alive(i)]

    def node_dirs(self) -> list[Path]:
        return [self.cluster.data] if self.cluster is not None else []


def run(opts: Options) -> dict[str, Any]:
    conc = opts.concurrency
    layout = Layout.of_size(opts.size, opts.keys, seed=1, multiple=math.lcm(opts.ranks, *conc))
    k, n = default_erasure(opts.nodes)
    work = Path(tempfile.mkdtemp(prefix="loadtest-restore-", dir=opts.tmp))
    load_before = os.getloadavg()
    bar = Progress(3 + 6 * len(conc), "restore")
    baselines: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    events: dict[str, Any] = {}
    pool: WorkerPool | None = None
    under_test: _Cluster | None = None
    try:
        pool = WorkerPool(max(opts.ranks, *conc))
        if opts.baselines:
            _baselines(opts, pool, layout, k, n, work, baselines, bar)
        else:
            bar.skip(2 + 3 * len(conc))

        bar.begin("cluster: save, wait for cold")
        under_test = _start(opts, work)
        name = f"loadtest/restore-{os.getpid()}-{int(time.time())}"
        events["save"] = save_checkpoint_with(pool, under_test.urls, under_test.token, name,
                                              layout, opts.ranks, opts.chunk,
                                              opts.client_concurrency)  # fmt: skip
        t0 = time.monotonic()
        with asyncio.Runner() as runner:
            status = runner.run(_wait_state(under_test.urls, under_test.token, name,
                                            opts.cold_timeout))  # fmt: skip
        events["cold"] = {"seconds": round(time.monotonic() - t0, 3), "state": status.state,
                          "chunks": status.chunks, "cold_chunks": status.cold}  # fmt: skip
        bar.done()

        def measure(tier: str, cache: str | None) -> None:
            assert pool is not None and under_test is not None
            for c in conc:
                bar.begin(f"storaged {tier} c={c}")
                if cache is not None:
                    cache = drop_page_cache(under_test.node_dirs())
                runs.append(_restore(pool, under_test, name, layout, c, tier, cache, opts))
                bar.done()

        measure("memory", None)
        events["evict_memory"] = _evict(under_test.urls[0], under_test.admin_token, name, "memory")
        measure("nvme", "drop")
        events["evict_nvme"] = _evict(under_test.urls[0], under_test.admin_token, name, "nvme")
        if under_test.cluster is not None:
            dead = under_test.cluster.nodes - 1
            under_test.cluster.kill(dead)
            live = [u for i, u in enumerate(under_test.urls) if i != dead]
            events["killed"] = {
                "node": under_test.cluster.node_id(dead),
                "seen_down_after_s": round(
                    _wait_down(live, under_test.token, under_test.cluster.node_id(dead)), 3
                ),
            }
            under_test.urls = [*live, under_test.urls[dead]]  # the dead one last, as a job's
        measure("cold", "drop")
    finally:
        bar.close()
        if pool is not None:
            pool.close()
        if under_test is not None and under_test.cluster is not None:
            under_test.cluster.stop()
        remove_tree(work)

    complete_baselines(baselines, BASELINE_KINDS)
    _add_ratios(runs, baselines)
    return {
        "kind": "restore",
        "command": opts.command,
        "git": git_commit(),
        "machine": {**machine_info(), "loadavg_before": list(load_before)},
        "settings": {
            "bytes": layout.nbytes,
            "keys": layout.keys,
            "rows_per_key": layout.rows,
            "row_bytes": ROW_BYTES,
            "chunk_bytes": opts.chunk,
            "saving_ranks": opts.ranks,
            "concurrency": conc,
            "tiers": list(TIERS),
            "nodes": opts.nodes if opts.url is None else None,
            "memory_per_node": opts.memory if opts.url is None else None,
            "erasure": {"codec": "zfec", "k": k, "n": n},
            "client_concurrency": opts.client_concurrency,
            "url": opts.url,
            "loop": opts.loop,
            "verify": opts.verify,
            "quick": opts.quick,
        },
        "events": events,
        "step_seconds": bar.seconds,
        "baselines": baselines,
        "runs": runs,
    }


def _start(opts: Options, work: Path) -> _Cluster:
    if opts.url is not None:
        nodes = _nodes([opts.url], opts.token)
        urls = [url for _, url, alive in nodes if alive]
        return _Cluster(urls, opts.token, None, {url: node for node, url, _ in nodes},
                        opts.admin_token)  # fmt: skip
    cluster = start_cluster(work / "cluster", opts.nodes, memory=opts.memory,
                            max_chunk=max(opts.chunk, 16 * MiB),
                            # Repair would move fragments around after the kill: the cold
                            # figure is meant to be the degraded read alone.
                            settings={"repair_interval": 3600.0},
                            # a run killed mid-way (a test's timeout) takes its nodes along
                            die_with_parent=True)  # fmt: skip
    ids = {cluster.url(i): cluster.node_id(i) for i in range(cluster.nodes)}
    return _Cluster(cluster.urls, TOKEN, cluster, ids, ADMIN_TOKEN)


def _restore(
    pool: WorkerPool,
    under_test: _Cluster,
    name: str,
    layout: Layout,
    c: int,
    tier: str,
    cache: str | None,
    opts: Options,
) -> dict[str, Any]:
    live = under_test.urls
    jobs = [StoragedRestore(tuple(live), under_test.token, name, layout, j, c,
                            opts.client_concurrency, opts.loop, opts.verify)
            for j in range(c)]  # fmt: skip
    meter = CpuMeter(under_test.pids)
    before: dict[str, dict[str, float]] = {}

    def before_go() -> None:
        before.update(read_bytes(live))
        meter.start()

    results = pool.run(jobs, before_go)
    node_seconds = meter.seconds()
    by_tier, by_node = read_bytes_delta(before, read_bytes(live))
    served = sum(by_node.values())
    client_tiers: dict[str, int] = {}
    for r in results:
        for t, v in r["tier_bytes"].items():
            client_tiers[t] = client_tiers.get(t, 0) + int(v)
    row = _row("storaged", c, results)
    row.update(
        tier=tier,
        cache=cache,
        node_cpu_s_per_gb=round(node_seconds / (row["bytes"] / GB), 4) if under_test.pids
        else None,
        read_bytes_nodes=by_tier,
        read_bytes_client=client_tiers,
        # How evenly the nodes served: 1/nodes is even, 1.0 is one node serving it all.
        read_bytes_per_node={under_test.ids.get(u, u): v for u, v in by_node.items()},
        busiest_node_share=round(max(by_node.values()) / served, 3) if served else None,
        requests=sum(int(r["requests"]) for r in results),
        retries=sum(int(r["retries"]) for r in results),
        failovers=sum(int(r["failovers"]) for r in results),
    )  # fmt: skip
    return row


def _baselines(
    opts: Options,
    pool: WorkerPool,
    layout: Layout,
    k: int,
    n: int,
    work: Path,
    baselines: dict[str, Any],
    bar: Progress,
) -> None:
    conc = opts.concurrency
    bar.begin("raw loopback, codec")
    baselines.update(raw_baselines(layout, opts.chunk, conc, opts.loop, k, n))
    bar.done()

    bar.begin("aiohttp from memory")
    baselines["aiohttp_memory"] = []
    proc, port = spawn_server(serve_memory, layout, opts.loop)
    try:
        for c in conc:
            jobs = [AiohttpRestore(port, layout, j, c, opts.client_concurrency, opts.chunk,
                                   opts.loop, opts.verify) for j in range(c)]  # fmt: skip
            meter = CpuMeter([proc.pid or 0])
            results = pool.run(jobs, meter.start)
            row = _row("aiohttp_memory", c, results)
            row["server_cpu_s_per_gb"] = round(meter.seconds() / (row["bytes"] / GB), 4)
            baselines["aiohttp_memory"].append(row)
            bar.done()
    finally:
        stop_server(proc)

    bar.begin("files for the disk and DCP baselines")
    disk, dcp = work / "disk", work / "dcp"
    pool.run([DiskWrite(str(disk), layout, r, opts.ranks, opts.chunk) for r in range(opts.ranks)])
    with_dcp = torch_available()
    if with_dcp:
        pool.run([DcpSave(str(dcp / f"rank{r}"), layout, r, opts.ranks)
                  for r in range(opts.ranks)])  # fmt: skip
    else:
        baselines["dcp_skipped"] = NO_TORCH
        print(f"# {NO_TORCH}", file=sys.stderr)
    bar.done()
    baselines["disk_read"] = []
    baselines["dcp_load_cold"] = []
    baselines["dcp_load_warm"] = []
    for c in conc:
        bar.begin(f"disk read, DCP load c={c}")
        cache = drop_page_cache([disk])
        results = pool.run([DiskRestore(str(disk), layout, j, c, opts.verify) for j in range(c)])
        baselines["disk_read"].append(_row("disk_read", c, results, cache=cache))
        bar.done()
        if not with_dcp:
            bar.done()
            continue
        dcp_jobs = [DcpLoad(str(dcp), layout, tuple(range(j, opts.ranks, c)), opts.ranks,
                            opts.verify) for j in range(c)]  # fmt: skip
        cache = drop_page_cache([dcp])
        results = pool.run(dcp_jobs)
        baselines["dcp_load_cold"].append(_row("dcp_load_cold", c, results, cache=cache))
        results = pool.run(dcp_jobs)  # the pages the cold load brought in are still there
        baselines["dcp_load_warm"].append(_row("dcp_load_warm", c, results, cache="warm"))
        bar.done()
    remove_tree(disk)
    remove_tree(dcp)


BASELINE_KINDS = ("raw_loopback", "aiohttp_memory", "disk_read", "dcp_load_warm", "dcp_load_cold")
#: (baseline the tier's figures are divided by, the DCP load it is compared with)
BASELINE_OF = {
    "memory": ("aiohttp_memory", "dcp_load_warm"),
    "nvme": ("disk_read", "dcp_load_cold"),
    "cold": ("codec", "dcp_load_cold"),
}


def _add_ratios(runs: list[dict[str, Any]], baselines: dict[str, Any]) -> None:
    for row in runs:
        c = row["concurrency"]
        base_kind, dcp_kind = BASELINE_OF[row["tier"]]
        codec = baselines["codec"]
        if base_kind == "codec":
            # One thread of raw decode: its CPU seconds per GB are its seconds per GB.
            gbps = codec.get("decode_raw_gbps")
            base: dict[str, Any] = {
                "gbps": gbps,
                "client_cpu_s_per_gb": round(1 / gbps, 4) if gbps else None,
            }
        else:
            base = by_concurrency(baselines[base_kind], c)
        raw = by_concurrency(baselines["raw_loopback"], c)
        dcp = by_concurrency(baselines[dcp_kind], c)
        row["baseline"] = base_kind
        row["ratios"] = {
            "gbps_x_baseline": ratio(row["gbps"], base.get("gbps")),
            "gbps_x_raw_loopback": ratio(row["gbps"], raw.get("gbps")),
            "gbps_x_dcp_load": ratio(row["gbps"], dcp.get("gbps")),
            # cold: against raw decode on every core of the run's machine too
            "gbps_x_codec_all_cores": ratio(row["gbps"], codec.get("decode_raw_all_cores_gbps"))
            if base_kind == "codec"
            else None,
            "ttfb_x_baseline": ratio(row["ttfb_ms"], base.get("ttfb_ms")),
            "p50_x_baseline": ratio(row["p50_ms"], base.get("p50_ms")),
            "p99_x_baseline": ratio(row["p99_ms"], base.get("p99_ms")),
            "client_cpu_x_baseline": ratio(
                row["client_cpu_s_per_gb"], base.get("client_cpu_s_per_gb")
            ),
            "node_cpu_x_baseline_server": ratio(
                row["node_cpu_s_per_gb"], base.get("server_cpu_s_per_gb")
            ),
        }


def _mib(tiers: dict[str, int]) -> str:
    return "/".join(f"{tiers.get(t, 0) / MiB:.0f}" for t in TIERS)


def render_markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = []
    for r in doc["runs"]:
        x = r["ratios"]
        rows.append([
            r["tier"], str(r["concurrency"]), r["baseline"],
            fmt(r["gbps"], ".2f", x["gbps_x_baseline"]), fmt(x["gbps_x_raw_loopback"]),
            fmt(x["gbps_x_dcp_load"]), fmt(x.get("gbps_x_codec_all_cores")),
            fmt(r["ttfb_ms"], ".1f", x["ttfb_x_baseline"]),
            fmt(r["p50_ms"], ".1f", x["p50_x_baseline"]),
            fmt(r["p99_ms"], ".1f", x["p99_x_baseline"]),
            _mib(r["read_bytes_nodes"]), _mib(r["read_bytes_client"]),
            fmt(r.get("busiest_node_share")),
            fmt(r["client_cpu_s_per_gb"], ".2f", x["client_cpu_x_baseline"]),
            fmt(r["node_cpu_s_per_gb"], ".2f", x["node_cpu_x_baseline_server"]),
            r["cache"] or "-", "yes" if r["verified"] else str(r["verified"]),
        ])  # fmt: skip
    head = ["tier", "c", "baseline", "GB/s (x base)", "x raw loopback", "x DCP load",
            "x raw decode, all cores", "TTFB ms (x base)", "p50 ms (x base)", "p99 ms (x base)",
            "MiB read mem/nvme/cold (nodes)", "same (client headers)", "busiest node share",
            "CPU s/GB clients (x base)", "CPU s/GB nodes (x base server)", "page cache",
            "bytes checked"]  # fmt: skip
    brows = []
    for kind, label in (("raw_loopback", "raw asyncio loopback (loadtest.peer)"),
                        ("aiohttp_memory", "aiohttp, 1 process, from memory"),
                        ("disk_read", "raw file reads"),
                        ("dcp_load_warm", "DCP load, page cache warm"),
                        ("dcp_load_cold", "DCP load, page cache dropped")):  # fmt: skip
        for b in doc["baselines"][kind]:
            brows.append([
                label, str(b["concurrency"]), fmt(b["gbps"]), fmt(b.get("ttfb_ms"), ".1f"),
                fmt(b.get("p50_ms"), ".1f"), fmt(b.get("p99_ms"), ".1f"),
                fmt(b.get("client_cpu_s_per_gb")), fmt(b.get("server_cpu_s_per_gb")),
                str(b.get("cache", "-")),
            ])  # fmt: skip
    ev = doc["events"]
    lines = [
        f"# restore: {s['bytes'] / GiB:.2f} GiB as {s['keys']} tensors saved by "
        f"{s['saving_ranks']} ranks, {s['chunk_bytes'] / MiB:g} MiB chunks, erasure zfec "
        f"{s['erasure']['k']}/{s['erasure']['n']}",
        "",
        markdown_table(head, rows),
        "",
        markdown_table(
            [
                "baseline",
                "c",
                "GB/s",
                "TTFB ms",
                "p50 ms",
                "p99 ms",
                "CPU s/GB client",
                "CPU s/GB server",
                "page cache",
            ],
            brows,
        ),
        "",
        f"save from {s['saving_ranks']} ranks: {ev['save']['ack_gbps']:.2f} GB/s to the ack; "
        f"cold after {ev['cold']['seconds']:.1f} s (state {ev['cold']['state']}).",
    ]
    codec = doc["baselines"]["codec"]
    if codec:
        lines.append(
            f"raw zfec decode with fragment 0 missing {codec['decode_raw_gbps']:.2f} GB/s "
            f"(wrapper {codec['decode_wrapper_gbps']:.2f}), one thread; "
            f"{codec['decode_raw_all_cores_gbps']:.2f} GB/s on {codec['cores']} threads "
            f"(all cores), {codec['chunk_bytes'] / MiB:g} MiB chunk."
        )
    lines += run_notes(doc)
    if "killed" in ev:
        lines.append(f"cold runs: node {ev['killed']['node']} SIGKILLed, seen down after "
                     f"{ev['killed']['seen_down_after_s']:.1f} s.")  # fmt: skip
    return "\n".join(lines) + "\n"


def render_plot(doc: dict[str, Any], path: Path) -> None:
    tiers = [t for t in TIERS if any(r["tier"] == t for r in doc["runs"])]
    base = doc["baselines"]
    colors = {"aiohttp_memory": "tab:orange", "dcp_load_warm": "tab:green",
              "dcp_load_cold": "tab:green", "raw_loopback": "tab:grey",
              "disk_read": "tab:brown"}  # fmt: skip
    with figure(path, 1, len(tiers), figsize=(5 * len(tiers), 4.5), sharey=True) as (_, axes):
        for ax, tier in zip(np.atleast_1d(axes), tiers, strict=True):
            runs = [r for r in doc["runs"] if r["tier"] == tier]
            cs = [r["concurrency"] for r in runs]
            ax.plot(cs, [r["gbps"] for r in runs], "o-", lw=2, color="tab:blue",
                    label=f"storaged, {tier}")  # fmt: skip
            kinds = {
                "memory": ["aiohttp_memory", "dcp_load_warm", "raw_loopback"],
                "nvme": ["disk_read", "dcp_load_cold"],
                "cold": ["dcp_load_cold"],
            }[tier]
            plot_baselines(ax, base, [(k, k.replace("_", " "), colors[k]) for k in kinds])
            if tier == "cold" and base["codec"]:
                ax.axhline(base["codec"]["decode_raw_gbps"], color="tab:red", ls=":",
                           label="raw zfec decode, 1 thread")  # fmt: skip
                cores = base["codec"]["cores"]
                ax.axhline(base["codec"]["decode_raw_all_cores_gbps"], color="tab:red", ls="--",
                           label=f"raw zfec decode, {cores} threads")  # fmt: skip
            ax.set_title(tier + (" (one node killed)" if tier == "cold" else ""))
            finish_levels_axes(ax, "restoring processes", cs)
        np.atleast_1d(axes)[0].set_ylabel("GB/s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest restore",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser, levels="restoring processes", per="process")
    parser.add_argument("--ranks", type=int, help="saving ranks (default 4; quick 2)")
    parser.add_argument("--cold-timeout", type=float, default=300.0,
                        help="seconds to wait for the checkpoint to be cold")  # fmt: skip
    add_cluster_arguments(parser, url="use this cluster (no node is killed for the cold runs)")
    parser.add_argument("--admin-token", default=os.environ.get("STORAGED_ADMIN_TOKEN"),
                        help="admin token for --url: the evict steps need it "
                             "(default $STORAGED_ADMIN_TOKEN)")  # fmt: skip
    parser.add_argument("--no-verify", action="store_true", help="skip the byte checks")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    ranks = args.ranks if args.ranks is not None else (2 if args.quick else 4)
    if args.nodes < 4 and args.url is None:
        parser.error("--nodes must be >= 4 (three copies, and a node to kill)")
    if ranks < 1:
        parser.error("--ranks must be >= 1")
    work = resolve_workload(parser, args, argv, divides=[ranks])
    opts = Options(
        size=work.size, keys=work.keys, ranks=ranks, concurrency=work.concurrency,
        nodes=args.nodes, memory=work.memory, chunk=work.chunk,
        client_concurrency=args.client_concurrency, cold_timeout=args.cold_timeout,
        url=args.url, token=args.token, loop=args.loop, out=args.out, tmp=args.tmp,
        verify=not args.no_verify, quick=args.quick, command=work.command,
        baselines=not args.no_baselines, admin_token=args.admin_token,
    )  # fmt: skip
    doc = run_and_write(opts.command, lambda: run(opts), opts.out, "restore",
                        render_markdown, render_plot)  # fmt: skip
    if doc is None:
        return 130
    failed = [r for r in doc["runs"] if r["verified"] is False]
    for b in (b for rows in doc["baselines"].values() if isinstance(rows, list) for b in rows):
        if b.get("verified") is False:
            failed.append(b)
    if failed:
        print(f"# {len(failed)} run(s) restored wrong bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
