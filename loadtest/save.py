"""Checkpoint saves to storaged next to same-run baselines: ``python -m loadtest save``.

For each concurrency ``c`` (default 1, 2, 4), ``c`` saving ranks, each a real process with
its own ``Client``, save their shards of one ``--size`` GiB checkpoint (``Layout``: float32
tensors sharded by rows) with ``AsyncSaver`` (``commit=False``); this process then commits
the gathered shard entries, the way a job's coordinator does. Each level runs on a fresh
local cluster (or, with ``--url``, on the given one), so that one level's background work
does not spill into the next. Measured per level:

- **stall**: what ``AsyncSaver.save`` held the rank for (the copy into staging buffers),
  the first save (staging memory touched for the first time) and a second save of the same
  state (warm buffers; every chunk already held, so nothing more is uploaded);
- **ack throughput**: checkpoint bytes / (first rank's start to last rank's ack); p50 and
  p99 **ack latency** of the chunk PUTs (request sent to 201, from the client's trace);
- **drain and encode**: the nodes' ``storaged_drain_backlog`` and ``storaged_encode_backlog``
  gauges sampled every 100 ms from the start until the checkpoint is cold (or
  ``--cold-timeout``), and the times at which its status reached ``nvme`` and ``cold``;
- CPU seconds per GB of the ranks (ack window) and of the nodes (ack window, and until cold).

Baselines, in the same run and with the same ``c`` processes and bytes: one-copy upload to
one aiohttp process (``loadtest.ack``'s receiver: the least a store must do), raw write +
fsync of the chunks as files (``loadtest.nvme``'s durable-write loop), DCP ``save`` of each
rank's shard (``torch.distributed.checkpoint``, FileSystemWriter, one directory per rank),
raw loopback transfer (``loadtest.peer``'s raw mode) and raw zfec encode (``loadtest.codec``).
Every storaged figure is printed with its ratio to its baseline.

Output in ``--out`` (default ``loadtest/results/``): ``save.json``, ``save.md``, ``save.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.harness.baselines import DcpSave, DiskWrite, complete_baselines, raw_baselines
from loadtest.harness.checkpoint import (
    ROW_BYTES,
    Layout,
    StoragedSave,
    chunk_pieces,
    commit_entries,
)
from loadtest.harness.cluster import (
    HOST,
    TOKEN,
    CpuMeter,
    MetricsSampler,
    node_cpu,
    start_cluster,
    wait_prefaulted,
)
from loadtest.harness.command import (
    Progress,
    add_cluster_arguments,
    add_output_arguments,
    add_workload_arguments,
    resolve_workload,
    run_and_write,
)
from loadtest.harness.loopback import (
    STAMP,
    Upload,
    serve_baseline,
    spawn_server,
    stop_server,
    upload_all,
)
from loadtest.harness.machine import (
    GB,
    NO_TORCH,
    GiB,
    MiB,
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

# -- jobs (one per saving process) ----------------------------------------------------------------


@dataclass(frozen=True)
class AiohttpSave:
    """One-copy baseline: PUT the same chunks to ``loadtest.ack``'s aiohttp receiver."""

    port: int
    layout: Layout
    rank: int
    ranks: int
    inflight: int = 8
    chunk: int = DEFAULT_CHUNK_SIZE
    loop: str = "uvloop"

    def prepare(self) -> Prepared:
        return _AiohttpSaver(self)


class _AiohttpSaver:
    def __init__(self, job: AiohttpSave) -> None:
        self.job = job
        arrays = job.layout.make(job.rank, job.ranks)
        self.uploads = []
        for n, (i, row, view) in enumerate(chunk_pieces(job.layout, arrays, job.chunk)):
            # The receiver does not check ids; an Upload sends ``stamp`` then the rest.
            fake_id = f"{job.rank:016x}{i:016x}{row:016x}{n:016x}"
            self.uploads.append(Upload(fake_id, bytes(view[: STAMP.size]), view))
        self.arrays = arrays
        self.runner = asyncio.Runner(loop_factory=lambda: new_loop(job.loop))

    def run(self) -> dict[str, Any]:
        import aiohttp

        base = f"http://{HOST}:{self.job.port}/v1/chunks/"

        async def go() -> tuple[float, list[float]]:
            connector = aiohttp.TCPConnector(limit=self.job.inflight + 4)
            async with aiohttp.ClientSession(connector=connector) as session:
                return await upload_all(
                    session, self.uploads, lambda up: base + up.chunk_id, self.job.inflight
                )

        _, latencies = self.runner.run(go())
        return {"bytes": sum(u.size for u in self.uploads), "put_latencies": latencies}

    def check(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.runner.close()


# -- the parent's part ----------------------------------------------------------------------------


async def _follow(
    urls: Sequence[str], token: str | None, name: str, timeout: float, period: float = 0.1
) -> dict[str, Any]:
    """Poll the checkpoint's status until cold; the times (monotonic) it reached each state."""
    reached: dict[str, float] = {}
    last: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    async with Client(list(urls), token=token) as client:
        while time.monotonic() < deadline:
            status = await client.status(name)
            now = time.monotonic()
            last = {"state": status.state, "chunks": status.chunks, "memory": status.memory,
                    "nvme": status.nvme, "cold": status.cold}  # fmt: skip
            for level in ("memory", "nvme", "cold"):
                if status.reached(level):
                    reached.setdefault(level, now)
            if "cold" in reached:
                break
            await asyncio.sleep(period)
    return {"reached": reached, "last_status": last}


def _rate_row(kind: str, c: int, results: Sequence[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    nbytes = sum(int(r["bytes"]) for r in results)
    seconds = wall_seconds(results)
    lats = [x for r in results for x in r.get("put_latencies", [])]
    row: dict[str, Any] = {
        "kind": kind,
        "concurrency": c,
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "gbps": round(nbytes / GB / seconds, 4),
        **summarize_latencies(lats),
        **client_cpu(results, nbytes),
    }
    row.update(extra)
    return row


@dataclass
class Options:
    size: int
    keys: int
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
    quick: bool
    command: str
    baselines: bool = True
    cold_pool: bool = False


def run(opts: Options) -> dict[str, Any]:
    conc = opts.concurrency
    multiple = math.lcm(*conc)
    layout = Layout.of_size(opts.size, opts.keys, seed=100, multiple=multiple)
    k, n = default_erasure(opts.nodes)
    work = Path(tempfile.mkdtemp(prefix="loadtest-save-", dir=opts.tmp))
    load_before = os.getloadavg()
    steps = 1 + 4 * len(conc)
    bar = Progress(steps, "save")
    baselines: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    pool: WorkerPool | None = None
    try:
        pool = WorkerPool(max(conc))
        if opts.baselines:
            _baselines(opts, pool, layout, k, n, work, baselines, bar)
        else:
            bar.skip(1 + 3 * len(conc))
        for level, c in enumerate(conc):
            bar.begin(f"storaged c={c}")
            runs.append(_storaged_level(opts, pool, layout.with_seed(200 + level), c, work))
            bar.done()
    finally:
        bar.close()
        if pool is not None:
            pool.close()
        remove_tree(work)

    complete_baselines(baselines, BASELINE_KINDS)
    _add_ratios(runs, baselines)
    return {
        "kind": "save",
        "command": opts.command,
        "git": git_commit(),
        "machine": {**machine_info(), "loadavg_before": list(load_before)},
        "settings": {
            "bytes": layout.nbytes,
            "keys": layout.keys,
            "rows_per_key": layout.rows,
            "row_bytes": ROW_BYTES,
            "chunk_bytes": opts.chunk,
            "concurrency": conc,
            "nodes": opts.nodes if opts.url is None else None,
            "memory_per_node": opts.memory if opts.url is None else None,
            "erasure": {"codec": "zfec", "k": k, "n": n},
            "client_concurrency": opts.client_concurrency,
            "cold_timeout": opts.cold_timeout,
            "node_ram_pool": "unknown" if opts.url else ("cold" if opts.cold_pool else "warm"),
            "url": opts.url,
            "loop": opts.loop,
            "quick": opts.quick,
        },
        "step_seconds": bar.seconds,
        "baselines": baselines,
        "runs": runs,
    }


BASELINE_KINDS = ("raw_loopback", "aiohttp_upload", "disk_write", "dcp_save")


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
    bar.begin("raw loopback, raw encode")
    baselines.update(raw_baselines(layout, opts.chunk, conc, opts.loop, k, n))
    bar.done()

    baselines["aiohttp_upload"] = []
    baselines["disk_write"] = []
    baselines["dcp_save"] = []

    for c in conc:
        bar.begin(f"aiohttp 1-copy upload c={c}")
        proc, port = spawn_server(serve_baseline, opts.chunk, c * opts.client_concurrency + 4,
                            opts.loop)  # fmt: skip
        try:
            jobs = [AiohttpSave(port, layout, r, c, opts.client_concurrency, opts.chunk,
                                opts.loop) for r in range(c)]  # fmt: skip
            meter = CpuMeter([proc.pid or 0])
            results = pool.run(jobs, meter.start)
            server = meter.seconds()
        finally:
            stop_server(proc)
        row = _rate_row("aiohttp_upload", c, results)
        row["server_cpu_s_per_gb"] = round(server / (row["bytes"] / GB), 4)
        baselines["aiohttp_upload"].append(row)
        bar.done()

        bar.begin(f"raw write+fsync c={c}")
        target = work / f"disk-c{c}"
        try:
            results = pool.run([DiskWrite(str(target), layout, r, c, opts.chunk)
                                for r in range(c)])  # fmt: skip
        finally:
            remove_tree(target)
        baselines["disk_write"].append(_rate_row("disk_write", c, results))
        bar.done()

        bar.begin(f"DCP save c={c}")
        if not torch_available():
            baselines["dcp_skipped"] = NO_TORCH
            bar.done()
            continue
        target = work / f"dcp-c{c}"
        try:
            results = pool.run([DcpSave(str(target / f"rank{r}"), layout, r, c)
                                for r in range(c)])  # fmt: skip
        finally:
            remove_tree(target)
        baselines["dcp_save"].append(_rate_row("dcp_save", c, results))
        bar.done()


def _storaged_level(
    opts: Options, pool: WorkerPool, layout: Layout, c: int, work: Path
) -> dict[str, Any]:
    """Save ``layout`` from ``c`` ranks on a fresh cluster; follow it until cold."""
    cluster: LocalCluster | None = None
    root = work / f"cluster-c{c}"
    try:
        if opts.url is None:
            # A long-running node has its RAM pool mapped; a fresh one maps it in the
            # background from start-up: map all of it, wait, then measure (--cold-pool: none).
            settings: dict[str, Any] = {
                "repair_interval": 3600.0,
                "log_level": "INFO",
                "prefault_fraction": 0.0 if opts.cold_pool else 1.0,
            }
            cluster = start_cluster(root, opts.nodes, memory=opts.memory,
                                    max_chunk=max(opts.chunk, 16 * MiB),
                                    settings=settings,
                                    # a run killed mid-way takes its nodes along
                                    die_with_parent=True)  # fmt: skip
            pool_ready = None if opts.cold_pool else round(wait_prefaulted(cluster), 2)
            urls = cluster.urls
            token: str | None = TOKEN
            pids = [cluster.procs[i].pid for i in range(cluster.nodes)]
        else:
            urls = [opts.url]
            token = opts.token
            pids = []
            pool_ready = None
        with asyncio.Runner() as runner:
            urls = runner.run(_node_urls(urls, token))
        name = f"loadtest/save-{os.getpid()}-{int(time.time())}-c{c}"
        jobs = [
            StoragedSave(tuple(urls), token, name, layout, r, c, opts.client_concurrency,
                         opts.chunk, opts.loop)
            for r in range(c)
        ]  # fmt: skip
        cpu: dict[str, float] = {}
        sampler = MetricsSampler(urls, period=0.1)

        def before_go() -> None:
            sampler.start()
            cpu["start"] = node_cpu(pids)

        try:
            results = pool.run(jobs, before_go)
            cpu["acked"] = node_cpu(pids)
            commit_s = commit_entries(urls, token, name, results)
            with asyncio.Runner() as runner:
                follow = runner.run(_follow(urls, token, name, opts.cold_timeout))
            cpu["end"] = node_cpu(pids)
        finally:
            sampler.stop()
        start = min(r["t0"] for r in results)
        nbytes = sum(int(r["bytes"]) for r in results)
        gb = nbytes / GB
        ack_s = max(r["acked_at"] for r in results) - start
        reached = {k: round(v - start, 3) for k, v in follow["reached"].items()}
        lats = [x for r in results for x in r["put_latencies"]]
        backlog = sampler.totals()
        drained = backlog_cleared(backlog, 1)
        row: dict[str, Any] = {
            "kind": "storaged",
            "concurrency": c,
            "pool_mapped_s": pool_ready,
            "bytes": nbytes,
            "uploaded_bytes": sum(int(r["uploaded"]) for r in results),
            "retries": sum(int(r["retries"]) for r in results),
            "stall_s": round(max(r["stall"] for r in results), 4),
            "stall_warm_s": round(max(r.get("stall_warm", math.nan) for r in results), 4),
            "ack_seconds": round(ack_s, 4),
            "gbps": round(gb / ack_s, 4),
            **summarize_latencies(lats),
            "commit_s": round(commit_s, 4),
            # Every copy drained (the nodes' drain backlogs back to 0 for good) ...
            "drained_s": drained,
            "nvme_gbps": round(gb / drained, 4) if drained else None,
            # ... while the status says nvme only once a chunk's owner starts its encode.
            "nvme_s": reached.get("nvme"),
            "encoded_s": backlog_cleared(backlog, 2),
            "cold_s": reached.get("cold"),
            "cold_gbps": round(gb / reached["cold"], 4) if reached.get("cold") else None,
            "last_status": follow["last_status"],
            **client_cpu(results, nbytes),
            "node_cpu_s_per_gb": round((cpu["acked"] - cpu["start"]) / gb, 4) if pids else None,
            "node_cpu_to_cold_s_per_gb": round((cpu["end"] - cpu["start"]) / gb, 4)
            if pids
            else None,
            "backlog_nodes": sampler.nodes_answering(),
            "backlog": [[t, d, e] for t, d, e in backlog],
        }
        return row
    finally:
        if cluster is not None:
            cluster.stop()
        remove_tree(root)


def backlog_cleared(series: Sequence[tuple[float, float, float]], column: int) -> float | None:
    """When ``column`` of the (t, drain, encode) samples went back to 0 for good: the time of
    the first zero after the last non-zero sample. None if it never rose or never cleared."""
    last = max((i for i, sample in enumerate(series) if sample[column] > 0), default=None)
    if last is None or last + 1 >= len(series):
        return None
    return series[last + 1][0]


async def _node_urls(urls: Sequence[str], token: str | None) -> list[str]:
    async with Client(list(urls), token=token) as client:
        return [node.url for node in client.cluster.nodes]


def _add_ratios(runs: list[dict[str, Any]], baselines: dict[str, Any]) -> None:
    encode = baselines["codec"].get("encode_raw_gbps")
    for row in runs:
        c = row["concurrency"]
        up = by_concurrency(baselines["aiohttp_upload"], c)
        disk = by_concurrency(baselines["disk_write"], c)
        dcp = by_concurrency(baselines["dcp_save"], c)
        raw = by_concurrency(baselines["raw_loopback"], c)
        row["ratios"] = {
            "gbps_x_aiohttp_upload": ratio(row["gbps"], up.get("gbps")),
            "gbps_x_raw_loopback": ratio(row["gbps"], raw.get("gbps")),
            "gbps_x_dcp_save": ratio(row["gbps"], dcp.get("gbps")),
            "p50_x_aiohttp_upload": ratio(row["p50_ms"], up.get("p50_ms")),
            "p99_x_aiohttp_upload": ratio(row["p99_ms"], up.get("p99_ms")),
            "stall_x_dcp_save": ratio(row["stall_s"], dcp.get("seconds")),
            "nvme_gbps_x_disk_write": ratio(row["nvme_gbps"], disk.get("gbps")),
            "cold_gbps_x_raw_encode": ratio(row["cold_gbps"], encode),
            "client_cpu_x_aiohttp_upload": ratio(
                row["client_cpu_s_per_gb"], up.get("client_cpu_s_per_gb")
            ),
            "node_cpu_x_aiohttp_server": ratio(
                row["node_cpu_s_per_gb"], up.get("server_cpu_s_per_gb")
            ),
        }


def render_markdown(doc: dict[str, Any]) -> str:
    base = doc["baselines"]
    rows = []
    for r in doc["runs"]:
        x = r["ratios"]
        rows.append([
            str(r["concurrency"]),
            fmt(r["gbps"], ".2f", x["gbps_x_aiohttp_upload"]),
            fmt(x["gbps_x_raw_loopback"]),
            fmt(x["gbps_x_dcp_save"]),
            fmt(r["p50_ms"], ".1f", x["p50_x_aiohttp_upload"]),
            fmt(r["p99_ms"], ".1f", x["p99_x_aiohttp_upload"]),
            fmt(r["stall_s"], ".3f", x["stall_x_dcp_save"]),
            fmt(r["stall_warm_s"], ".3f"),
            fmt(r["nvme_gbps"], ".2f", x["nvme_gbps_x_disk_write"]),
            fmt(r["cold_gbps"], ".2f", x["cold_gbps_x_raw_encode"]),
            fmt(r["client_cpu_s_per_gb"], ".2f", x["client_cpu_x_aiohttp_upload"]),
            fmt(r["node_cpu_s_per_gb"], ".2f", x["node_cpu_x_aiohttp_server"]),
        ])  # fmt: skip
    head = ["c", "ack GB/s (x aiohttp 1-copy)", "x raw loopback", "x DCP save",
            "ack p50 ms (x base)", "ack p99 ms (x base)", "stall s (x DCP save time)",
            "stall s, warm", "to nvme GB/s (x raw write+fsync)", "to cold GB/s (x raw encode)",
            "CPU s/GB ranks (x base)", "CPU s/GB nodes (x base server)"]  # fmt: skip
    brow = []
    for kind, label in (("raw_loopback", "raw loopback (asyncio, loadtest.peer)"),
                        ("aiohttp_upload", "aiohttp 1-copy upload"),
                        ("disk_write", "raw write+fsync, 1 copy"),
                        ("dcp_save", "DCP save (FileSystemWriter)")):  # fmt: skip
        for b in base[kind]:
            brow.append([
                label, str(b["concurrency"]), fmt(b["gbps"]),
                fmt(b.get("seconds"), ".2f"), fmt(b.get("p50_ms"), ".1f"),
                fmt(b.get("p99_ms"), ".1f"), fmt(b.get("client_cpu_s_per_gb")),
                fmt(b.get("server_cpu_s_per_gb")),
            ])  # fmt: skip
    s = doc["settings"]
    lines = [
        f"# save: {s['bytes'] / GiB:.2f} GiB as {s['keys']} tensors, "
        f"{s['chunk_bytes'] / MiB:g} MiB chunks, erasure zfec {s['erasure']['k']}/"
        f"{s['erasure']['n']}",
        "",
        markdown_table(head, rows),
        "",
        markdown_table(
            [
                "baseline",
                "c",
                "GB/s",
                "s",
                "p50 ms",
                "p99 ms",
                "CPU s/GB client",
                "CPU s/GB server",
            ],
            brow,
        ),
    ]
    codec = base["codec"]
    if codec:
        lines += [
            "",
            f"raw zfec encode {codec['encode_raw_gbps']:.2f} GB/s (wrapper "
            f"{codec['encode_wrapper_gbps']:.2f}), one thread, {codec['chunk_bytes'] / MiB:g} "
            "MiB.",
        ]
    lines += run_notes(doc)
    for r in doc["runs"]:
        if r["cold_s"] is None:
            lines.append(
                f"c={r['concurrency']}: not cold within {s['cold_timeout']:g} s "
                f"(last status {r['last_status']})"
            )
    return "\n".join(lines) + "\n"


def render_plot(doc: dict[str, Any], path: Path) -> None:
    runs = doc["runs"]
    base = doc["baselines"]
    cs = [r["concurrency"] for r in runs]
    with figure(path, 1, 2, figsize=(13, 5)) as (_, (left, right)):
        left.plot(cs, [r["gbps"] for r in runs], "o-", lw=2, label="storaged ack (3 RAM copies)")
        left.plot(cs, [r["nvme_gbps"] or 0 for r in runs], "s-", label="storaged to nvme")
        left.plot(cs, [r["cold_gbps"] or 0 for r in runs], "^-", label="storaged to cold")
        plot_baselines(left, base, [("aiohttp_upload", "aiohttp 1-copy upload", "tab:purple"),
                                    ("disk_write", "raw write+fsync, 1 copy", "tab:brown"),
                                    ("dcp_save", "DCP save", "tab:olive"),
                                    ("raw_loopback", "raw loopback", "tab:grey")])  # fmt: skip
        if base["codec"]:
            left.axhline(base["codec"]["encode_raw_gbps"], color="tab:red", lw=0.8, ls="--",
                         label="raw zfec encode, 1 thread")  # fmt: skip
        left.set_ylabel("GB/s")
        left.set_title("save throughput")
        finish_levels_axes(left, "saving ranks (processes)", cs)
        for r in runs:
            series = r["backlog"]
            ts = [p[0] for p in series]
            line = right.plot(ts, [p[1] for p in series],
                              label=f"drain backlog, c={r['concurrency']}")  # fmt: skip
            right.plot(ts, [p[2] for p in series], ls="--", color=line[0].get_color(),
                       label=f"encode backlog, c={r['concurrency']}")  # fmt: skip
        right.set_xlabel("seconds since the save started")
        right.set_ylabel("chunks (sum over nodes)")
        right.set_title("background backlogs")
        right.legend(fontsize=7)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest save",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser, levels="saving ranks per level", per="rank")
    parser.add_argument("--cold-timeout", type=float, help="seconds to wait for cold (120)")
    add_cluster_arguments(parser, url="use this cluster instead of starting local ones")
    parser.add_argument(
        "--cold-pool", action="store_true",
        help="nodes map no RAM ahead (a fresh node's first save); default: pool mapped first",
    )  # fmt: skip
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.nodes < 3:
        parser.error("--nodes must be >= 3 (three RAM copies)")
    work = resolve_workload(parser, args, argv)
    opts = Options(
        size=work.size, keys=work.keys, concurrency=work.concurrency, nodes=args.nodes,
        memory=work.memory, chunk=work.chunk, client_concurrency=args.client_concurrency,
        cold_timeout=args.cold_timeout or (60.0 if args.quick else 120.0), url=args.url,
        token=args.token, loop=args.loop, out=args.out, tmp=args.tmp, quick=args.quick,
        command=work.command, baselines=not args.no_baselines, cold_pool=args.cold_pool,
    )  # fmt: skip
    doc = run_and_write(opts.command, lambda: run(opts), opts.out, "save",
                        render_markdown, render_plot)  # fmt: skip
    return 130 if doc is None else 0


if __name__ == "__main__":
    sys.exit(main())
