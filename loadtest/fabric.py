"""storaged on a fabric of capped links, as on real hosts: ``python -m loadtest.fabric``.

Every node runs in its own network namespace with its own address, joined to a bridge by
a veth link capped with ``tc tbf`` at ``--rate`` (500mbit: see ``DEFAULT_RATE``) in each
direction; the saver and the readers run in client namespaces whose links are capped at
``--client-rate`` (default: the same, every host having the same NIC; ``none``: uncapped).
The namespaces are made for the run and removed after it, even when it fails
(``loadtest.harness.netns``); stale ones of a killed run are swept at the start. Root,
``ip`` and ``tc`` are needed.

Measured, each as a ratio to the ideal the link caps allow:

- ``raw``: one TCP stream between client 0 and node 0 with plain sockets, one direction,
  then both at once: what a capped link carries (the baseline of everything else).
- ``ack``: a checkpoint saved from client 0 (one ``AsyncSaver``), timed until acked (three
  copies in RAM). Ideal: min(the client's cap, nodes x cap / replication): every byte
  enters some node three times (once from the client, twice from the entry node's
  fan-out), and leaves an entry node twice, so a node's ingress binds before its egress.
- ``restore xK``: K readers (clients 0..K-1) restore the whole checkpoint at once (the
  data-parallel case: every rank reads the same shards). Ideal aggregate: min(K x the
  client cap, nodes x cap): every node holds 3/nodes of the chunks and serves from its
  RAM tier, so the holders' links, not three holders per chunk, bound it.

Every step also gives ``busiest``: the ideal from the bytes each link really carried
(``ip -s link`` on the bridge's ends): the busiest link's bytes over its cap, which shows
uneven placement apart from the protocol's own overhead. Node CPU seconds per GB and the
load average show whether the links or the CPU bound: pick a cap under what the CPU can
move. Restores also give the share of chunk bytes fetched twice (hedged reads).

Results: ``loadtest/results/fabric.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.harness import netns
from loadtest.harness.checkpoint import Layout, StoragedRestore, StoragedSave, commit_entries
from loadtest.harness.cluster import (
    CpuMeter,
    MetricsSampler,
    errors_of,
    scrape,
    start_cluster,
    wait_prefaulted,
)
from loadtest.harness.command import run_and_write
from loadtest.harness.machine import GB, GiB, MiB, git_commit, machine_info, remove_tree
from loadtest.harness.plots import figure
from loadtest.harness.report import RESULTS, fmt, markdown_table, parse_levels, percentile
from loadtest.harness.workers import WorkerPool, wall_seconds
from storaged.client.layout import DEFAULT_CHUNK_SIZE

#: The node link cap per direction. At 1gbit, on two cores shared by four nodes, four
#: readers and the rest of the machine, the CPU bound before the links did (restore by 4
#: readers: the busiest link at 0.69 of its cap at 1gbit, 0.88 at 500mbit; the ack at 0.44
#: of the client's cap at 1gbit, 0.72 at 500mbit): 500mbit keeps the links the limit.
DEFAULT_RATE = "500mbit"
#: port of the raw TCP measurement (namespaces are the run's own: nothing else listens)
RAW_PORT = 5201
REPLICATION = 3


@dataclass(frozen=True)
class Options:
    rate: str
    client_rate: str | None
    nodes: int
    readers: list[int]
    size: int
    keys: int
    chunk: int
    raw_bytes: int
    client_concurrency: int
    tmp: Path | None
    out: Path
    command: str


# -- raw links ------------------------------------------------------------------------------------


def _sink(ns: str, addr: str, port: int, ready: threading.Event, got: list[int]) -> None:
    """In ``ns``: accept one connection on ``addr:port``, count what it sends until EOF."""
    netns.enter(ns)
    with socket.create_server((addr, port)) as listener:
        ready.set()
        conn, _ = listener.accept()
    buf = memoryview(bytearray(MiB))
    total = 0
    with conn:
        while n := conn.recv_into(buf):
            total += n
    got.append(total)


def _source(ns: str, addr: str, port: int, nbytes: int) -> None:
    netns.enter(ns)
    block = memoryview(bytearray(MiB))
    with socket.create_connection((addr, port), timeout=60) as conn:
        for _ in range(nbytes // MiB):
            conn.sendall(block)


def raw_streams(fabric: netns.Fabric, flows: Sequence[tuple[str, str, str]], nbytes: int) -> float:
    """Run TCP streams (from namespace, to namespace, to address) at once, ``nbytes`` each
    (whole MiB); the seconds until the last receiver saw EOF."""
    got: list[int] = []
    sinks, sources = [], []
    for k, (src, dst, addr) in enumerate(flows):
        ready = threading.Event()
        sink = threading.Thread(target=_sink, args=(dst, addr, RAW_PORT + k, ready, got))
        sink.start()
        if not ready.wait(10):
            raise RuntimeError(f"raw sink in {dst} did not listen")
        sinks.append(sink)
        sources.append(threading.Thread(target=_source, args=(src, addr, RAW_PORT + k, nbytes)))
    t0 = time.monotonic()
    for source in sources:
        source.start()
    for thread in sources + sinks:
        thread.join(120)
    seconds = time.monotonic() - t0
    if len(got) != len(flows) or any(g != nbytes // MiB * MiB for g in got):
        raise RuntimeError(f"raw streams moved {got}, not {nbytes // MiB * MiB} bytes each")
    return seconds


def measure_raw(fabric: netns.Fabric, nbytes: int) -> dict[str, Any]:
    """Client 0 to node 0 alone, then both ways at once: MB/s per stream and ratio to cap."""
    c0, n0 = fabric.client_ns(0), fabric.node_ns(0)
    one = raw_streams(fabric, [(c0, n0, fabric.node_addr(0))], nbytes)
    both = raw_streams(
        fabric, [(c0, n0, fabric.node_addr(0)), (n0, c0, fabric.client_addr(0))], nbytes
    )
    cap = fabric.rate_bytes
    moved = nbytes // MiB * MiB
    return {
        "bytes": moved,
        "one_way_mbps": round(moved / one / 1e6, 1),
        "one_way_ratio": round(moved / one / cap, 3),
        "both_ways_mbps": round(moved / both / 1e6, 1),
        "both_ways_ratio": round(moved / both / cap, 3),
    }


# -- storaged steps -------------------------------------------------------------------------------


@dataclass
class Step:
    """What the nodes' links and CPU did over one timed step."""

    fabric: netns.Fabric
    meter: CpuMeter
    before: dict[str, tuple[int, int]]

    @classmethod
    def begin(cls, fabric: netns.Fabric, meter: CpuMeter) -> Step:
        meter.start()
        return cls(fabric, meter, fabric.link_bytes())

    def end(self, nbytes: int, seconds: float, ideal_bps: float) -> dict[str, Any]:
        after = self.fabric.link_bytes()
        links = {
            name: (after[name][0] - sent, after[name][1] - recv)
            for name, (sent, recv) in self.before.items()
        }
        caps = {
            name: self.fabric.rate_bytes if name.startswith("n") else client_cap(self.fabric)
            for name in links
        }
        busiest = max(max(s, r) / caps[name] for name, (s, r) in links.items())
        load1, _, _ = os.getloadavg()
        return {
            "bytes": nbytes,
            "seconds": round(seconds, 3),
            "gbps": round(nbytes / seconds / GB, 4),
            "ideal_gbps": round(ideal_bps / GB, 4),
            "ratio": round(nbytes / seconds / ideal_bps, 3),
            # the ideal of the traffic as it was: the busiest link at its cap all along
            "busiest_ratio": round(busiest / seconds, 3),
            "links_mb": {n: [round(s / 1e6, 1), round(r / 1e6, 1)] for n, (s, r) in links.items()},
            "node_cpu_s_per_gb": round(self.meter.seconds() / (nbytes / GB), 2),
            "load1": round(load1, 2),
        }


def _client_cpu(results: Sequence[Mapping[str, Any]], nbytes: int) -> float:
    """CPU seconds of the client processes (all threads) per GB they moved."""
    return round(sum(float(r["cpu"]) for r in results) / (nbytes / GB), 2)


def client_cap(fabric: netns.Fabric) -> float:
    return netns.rate_bytes(fabric.client_rate) if fabric.client_rate else float("inf")


def measure_ack(
    fabric: netns.Fabric,
    pool: WorkerPool,
    urls: Sequence[str],
    token: str,
    meter: CpuMeter,
    layout: Layout,
    opts: Options,
) -> dict[str, Any]:
    """One saver in client 0 saves ``layout`` (timed until acked), then commits it."""
    job = StoragedSave(
        tuple(urls),
        token,
        "fabric",
        layout,
        0,
        1,
        opts.client_concurrency,
        opts.chunk,
        warm_stall=False,
    )
    step: list[Step] = []
    results = pool.run(
        [netns.InNetns(fabric.client_ns(0), job)],
        lambda: step.append(Step.begin(fabric, meter)),
    )
    seconds = float(results[0]["acked_at"]) - float(results[0]["t0"])
    ideal = min(client_cap(fabric), fabric.nodes * fabric.rate_bytes / REPLICATION)
    row = step[0].end(int(results[0]["bytes"]), seconds, ideal)
    commit_entries(urls, token, "fabric", results)
    row["client_cpu_s_per_gb"] = _client_cpu(results, row["bytes"])
    puts = results[0]["put_latencies"]
    row["put_p50_ms"] = round(percentile(puts, 50) * 1e3, 1) if puts else None
    row["put_p99_ms"] = round(percentile(puts, 99) * 1e3, 1) if puts else None
    # A body slower than the nodes' body_min_rate is refused (408) and sent again.
    row["put_retries"] = int(results[0]["retries"])
    row["body_too_slow"] = errors_of(urls, "body_too_slow")
    sent = row["links_mb"]
    from_client = sent["c0"][0]
    by_nodes = sum(v[0] for k, v in sent.items() if k.startswith("n"))
    # fan-out: an entry node sends each of its chunks twice; a chain would send it once
    row["node_copies_per_client_byte"] = round(by_nodes / from_client, 2) if from_client else None
    return row


def wait_settled(urls: Sequence[str], timeout: float = 600.0) -> float:
    """Wait until no node has a drain or encode backlog; the seconds that took."""
    t0 = time.monotonic()
    gauges = MetricsSampler.GAUGES
    while time.monotonic() - t0 < timeout:
        left = 0.0
        for url in urls:
            samples = scrape(url)
            left += sum(sum(samples.get(g, {}).values()) for g in gauges)
        if not left:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.5)
    raise TimeoutError(f"the nodes' drain and encode backlogs not clear after {timeout:.0f} s")


def measure_restore(
    fabric: netns.Fabric,
    pool: WorkerPool,
    urls: Sequence[str],
    token: str,
    meter: CpuMeter,
    layout: Layout,
    readers: int,
    opts: Options,
) -> dict[str, Any]:
    """``readers`` clients restore the whole checkpoint at once (each rank 0 of 1)."""
    jobs = [
        netns.InNetns(
            fabric.client_ns(j),
            StoragedRestore(tuple(urls), token, "fabric", layout, 0, 1, opts.client_concurrency),
        )
        for j in range(readers)
    ]
    step: list[Step] = []
    results = pool.run(jobs, lambda: step.append(Step.begin(fabric, meter)))
    if not all(r.get("verified") for r in results):
        raise RuntimeError(f"a restore by {readers} reader(s) read wrong bytes")
    nbytes = sum(int(r["bytes"]) for r in results)
    ideal = min(readers * client_cap(fabric), fabric.nodes * fabric.rate_bytes)
    row = step[0].end(nbytes, wall_seconds(results), ideal)
    row["readers"] = readers
    row["client_cpu_s_per_gb"] = _client_cpu(results, nbytes)
    row["retries"] = sum(int(r["retries"]) for r in results)
    tiers: dict[str, int] = {}
    for r in results:
        for tier, n in r["tier_bytes"].items():
            tiers[tier] = tiers.get(tier, 0) + int(n)
    row["tier_bytes"] = tiers
    # Bytes beyond the checkpoint's that reached the readers (HTTP, TCP and IP headers, and
    # hedged reads: a GET past its deadline is asked of another holder too, and the loser's
    # body is cut off part-way, so the client's own count of chunk bytes says more).
    received = sum(row["links_mb"][f"c{j}"][1] for j in range(readers)) * 1e6
    row["extra_read_share"] = round(received / nbytes - 1, 3)
    row["client_counted_extra_share"] = round(sum(tiers.values()) / nbytes - 1, 3)
    row["per_reader_gbps"] = round(row["gbps"] / readers, 4)
    return row


def run(opts: Options) -> dict[str, Any]:
    """Sweep stale namespaces, build the fabric, measure, remove everything."""
    swept = netns.sweep()
    fabric = netns.Fabric(opts.nodes, max(opts.readers), opts.rate, opts.client_rate)
    work = Path(tempfile.mkdtemp(prefix="loadtest-fabric-", dir=opts.tmp))
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        fabric.build()
        doc = _measure(fabric, opts, work)
    finally:
        try:
            netns.enter(Path(f"/proc/self/fd/{home}"))  # out of the hub before it goes
        finally:
            os.close(home)
            fabric.close()
            remove_tree(work)
    doc["swept_stale"] = swept
    return doc


def _measure(fabric: netns.Fabric, opts: Options, work: Path) -> dict[str, Any]:
    raw = measure_raw(fabric, opts.raw_bytes)
    # From here this thread (and what it starts) is in the hub, on the bridge: it reaches
    # every namespace without crossing a capped link but a node's own.
    netns.enter(fabric.hub)
    memory = f"{max(256, int(opts.size * REPLICATION / opts.nodes * 1.5 / MiB))}MiB"
    layout = Layout.of_size(opts.size, opts.keys)
    make = functools.partial(netns.NetnsCluster, fabric=fabric)
    # Repair off (nothing fails here); the RAM pool mapped before anything is timed.
    settings = {"repair_interval": 3600.0, "log_level": "INFO", "prefault_fraction": 1.0}
    cluster = start_cluster(
        work / "cluster",
        opts.nodes,
        memory=memory,
        max_chunk=max(opts.chunk, 16 * MiB),
        settings=settings,
        die_with_parent=True,
        make=make,
    )
    try:
        wait_prefaulted(cluster)
        meter = CpuMeter([p.pid for p in cluster.procs.values()])
        token = cluster.token
        with WorkerPool(max(opts.readers)) as pool:
            ack = measure_ack(fabric, pool, cluster.urls, token, meter, layout, opts)
            # The drain to nvme and the encode to cold (fragments cross the links) run
            # after the ack: let them finish before the restores are timed.
            ack["settled_seconds"] = wait_settled(cluster.urls)
            restores = [
                measure_restore(fabric, pool, cluster.urls, token, meter, layout, k, opts)
                for k in opts.readers
            ]
    finally:
        cluster.stop()
    return {
        "benchmark": "fabric",
        "command": opts.command,
        "commit": git_commit(),
        "machine": machine_info(),
        "caps": {
            "node": opts.rate,
            "client": opts.client_rate or "uncapped",
            "node_bytes_per_s": fabric.rate_bytes,
        },
        "nodes": opts.nodes,
        "size": opts.size,
        "chunk": opts.chunk,
        "memory_per_node": memory,
        "raw": raw,
        "ack": ack,
        "restores": restores,
    }


# -- output ---------------------------------------------------------------------------------------


def _step_row(label: str, row: Mapping[str, Any]) -> list[str]:
    return [
        label,
        fmt(row["bytes"] / MiB, ".0f"),
        fmt(row["seconds"], ".2f"),
        fmt(row["gbps"] * 1e3, ".0f"),
        fmt(row["ideal_gbps"] * 1e3, ".0f"),
        fmt(row["ratio"], ".2f"),
        fmt(row["busiest_ratio"], ".2f"),
        fmt(row["node_cpu_s_per_gb"], ".1f"),
        fmt(row.get("client_cpu_s_per_gb"), ".1f"),
        fmt(row["load1"], ".1f"),
        fmt(row.get("extra_read_share"), ".2f"),
    ]


def render_markdown(doc: dict[str, Any]) -> str:
    caps, raw = doc["caps"], doc["raw"]
    lines = [
        "# storaged on capped links (loadtest.fabric)",
        "",
        f"`{doc['command']}` at {doc.get('commit')}: {doc['nodes']} nodes, each in its own "
        f"network namespace, links capped at {caps['node']} per direction (tc tbf), "
        f"clients at {caps['client']}; checkpoint {doc['size'] / MiB:.0f} MiB in "
        f"{doc['chunk'] / MiB:.0f} MiB chunks.",
        "",
        f"raw TCP, client to node: {raw['one_way_mbps']} MB/s one way "
        f"({raw['one_way_ratio']:.2f}x the cap), {raw['both_ways_mbps']} MB/s each way at "
        f"once ({raw['both_ways_ratio']:.2f}x).",
        "",
    ]
    head = [
        "step",
        "MiB",
        "s",
        "MB/s",
        "ideal MB/s",
        "ratio",
        "vs busiest link",
        "node CPU s/GB",
        "client CPU s/GB",
        "load",
        "extra read",
    ]
    rows = [_step_row("ack (3 copies in RAM)", doc["ack"])]
    rows += [_step_row(f"restore x{r['readers']} (aggregate)", r) for r in doc["restores"]]
    lines.append(markdown_table(head, rows))
    lines += [
        "",
        "ratio: MB/s over the ideal the caps allow (ack: min(client cap, nodes x cap / 3); "
        "restore xK: min(K x client cap, nodes x cap)); vs busiest link: the busiest link's "
        "bytes at its cap over the time taken; extra read: bytes the readers' links carried "
        "beyond the checkpoint's (headers, hedged reads), over its bytes.",
        f"node copies sent per byte from the client (fan-out 2.0): "
        f"{doc['ack'].get('node_copies_per_client_byte')}; chunk PUT to ack p50 "
        f"{doc['ack'].get('put_p50_ms')} ms, p99 {doc['ack'].get('put_p99_ms')} ms "
        f"(408 body_too_slow {doc['ack'].get('body_too_slow')}, the client's retries "
        f"{doc['ack'].get('put_retries')}); the "
        f"drain and encode after the ack took {doc['ack'].get('settled_seconds')} s more.",
    ]
    return "\n".join(lines) + "\n"


def render_plot(doc: dict[str, Any], path: Path) -> None:
    rows = doc["restores"]
    readers = [r["readers"] for r in rows]
    with figure(path, figsize=(6, 4)) as (_, ax):
        ax.plot(readers, [r["gbps"] * 1e3 for r in rows], "o-", label="restore, aggregate")
        ax.plot(readers, [r["ideal_gbps"] * 1e3 for r in rows], "k--", label="ideal (caps)")
        ax.set_xlabel("readers at once")
        ax.set_ylabel("MB/s")
        ax.set_xticks(readers)
        ax.set_title(f"{doc['nodes']} nodes, links at {doc['caps']['node']}")
        ax.legend()


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.fabric", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB, readers 1,2: smoke test")
    parser.add_argument("--rate", default=DEFAULT_RATE, help=f"node link cap ({DEFAULT_RATE})")
    parser.add_argument("--client-rate", help="client link cap (default --rate; none: uncapped)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--readers", type=parse_levels, help="readers at once (1,2,4; quick 1,2)")
    parser.add_argument("--size", type=float, help="checkpoint GiB (default 1; quick 1/16)")
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_SIZE / MiB)
    parser.add_argument("--client-concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--tmp", type=Path, help="scratch directory (default: system temp)")
    args = parser.parse_args(argv)
    for rate in (args.rate, args.client_rate):
        if rate not in (None, "none"):
            try:
                netns.rate_bytes(rate)
            except ValueError as exc:
                parser.error(str(exc))
    size = args.size if args.size is not None else (1 / 16 if args.quick else 1.0)
    client_rate = None if args.client_rate == "none" else (args.client_rate or args.rate)
    return Options(
        rate=args.rate,
        client_rate=client_rate,
        nodes=args.nodes,
        readers=args.readers or ([1, 2] if args.quick else [1, 2, 4]),
        size=int(size * GiB),
        keys=args.keys,
        chunk=int(args.chunk_mib * MiB),
        raw_bytes=(64 if args.quick else 512) * MiB,
        client_concurrency=args.client_concurrency,
        tmp=args.tmp,
        out=args.out,
        command=" ".join([parser.prog, *(sys.argv[1:] if argv is None else argv)]),
    )


def main(argv: Sequence[str] | None = None) -> int:
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"loadtest.fabric: {reason}", file=sys.stderr)
        return 2
    opts = parse_args(argv)
    try:
        doc = run_and_write(
            opts.command, lambda: run(opts), opts.out, "fabric", render_markdown, render_plot
        )
    except netns.FabricUnavailable as exc:
        print(f"loadtest.fabric: the test bed cannot be built here: {exc}", file=sys.stderr)
        return 2
    return 0 if doc is not None else 130


if __name__ == "__main__":
    raise SystemExit(main())
