"""3-copy ack throughput next to a one-copy aiohttp upload: ``python -m loadtest.ack``.

This process is the client. It uploads ``--size`` GiB as distinct random chunks of
``--chunk-mib`` MiB with ``--concurrency`` uploads in flight, and times each PUT from
its first byte to its answer (the ack). The same upload code (aiohttp, one session,
the body sent as 1 MiB memoryview slices with a ``Content-Length``, as
``storaged.client`` sends it) runs against two servers:

- ``baseline``: one aiohttp process on 127.0.0.1 that reads the body with
  ``readchunk()`` into a reused, pre-faulted buffer and answers 201: the best
  one-copy receive aiohttp allows, and all a single-copy store would have to do.
- ``storaged``: a fresh ``LocalCluster`` of ``--nodes`` node processes per round; each
  chunk goes to its first placement node (``rendezvous_order`` over the node ids, as
  the real client does), which answers 201 once three nodes hold it in RAM.

Before any of it, a raw loopback socket figure (one blocking TCP stream into a reused
buffer) gives the ceiling of this machine for context.

Reported per configuration: GB/s (10^9 acked body bytes per second of wall time), p50
and p99 ack latency, the ratio of GB/s to the baseline at the same concurrency (the
issue's target is >= 0.6), and CPU seconds per acked GB of the server processes
(utime + stime from ``/proc/<pid>/stat``, all threads; for storaged the sum over all
nodes, background drain and encode included while they run in the timed window) and of
this client process. Rounds alternate baseline and storaged so drift on a shared
machine hits both; the median round (by GB/s) is reported.

With ``py-spy`` next to the interpreter (``pip install py-spy``), one more storaged
round runs with ``py-spy record --native`` attached to one node, and its samples are
summed by where the CPU goes (hashing, copies, aiohttp, peer protocol, ...).

The results go to ``loadtest/results/ack.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import blake3

from loadtest.harness.loopback import (
    STAMP,
    Upload,
    serve_baseline,
    spawn_server,
    stop_server,
    upload_all,
)
from loadtest.harness.machine import (
    new_loop,
    prefaulted,
    proc_cpu_seconds,
    proc_cpu_times,
    run_machine,
)
from loadtest.harness.profile import summarize_profile
from loadtest.harness.report import finish, percentile
from storaged.placement import rendezvous_order
from storaged.tools.local_cluster import ClusterError, LocalCluster, free_port_block

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
HOST = "127.0.0.1"
TOKEN = "loadtest-ack-token"
RESULTS = Path(__file__).resolve().parent / "results"
CORES = os.cpu_count() or 1
#: py-spy samples per second: each sample stops the node briefly (--native needs that)
PROFILE_HZ = 100


# -- the chunks -----------------------------------------------------------------------------------


class Corpus:
    """``count`` random chunks of ``chunk`` bytes, made once (BLAKE3 XOF: faster than urandom).

    ``uploads(tag)`` gives them with the first 16 bytes replaced by (tag, index), so each
    round uploads chunks no node has seen: no dedup, every PUT is a real 3-copy write.
    """

    def __init__(self, chunk: int, count: int, seed: bytes = b"loadtest.ack") -> None:
        if chunk <= STAMP.size:
            raise ValueError(f"chunk of {chunk} bytes is too small")
        self.chunk = chunk
        self.data = [
            memoryview(blake3.blake3(seed + i.to_bytes(8, "big")).digest(length=chunk))
            for i in range(count)
        ]

    def split(self, chunk: int) -> Corpus:
        """The same bytes as chunks of ``chunk`` bytes, which must divide this corpus' chunk
        (views, no copy: a sweep over chunk sizes holds its data once)."""
        if chunk <= STAMP.size or self.chunk % chunk:
            raise ValueError(f"{chunk} bytes does not divide the corpus' {self.chunk}-byte chunks")
        out = Corpus(chunk, 0)
        out.data = [view[i : i + chunk] for view in self.data for i in range(0, self.chunk, chunk)]
        return out

    def uploads(self, tag: int, count: int | None = None) -> list[Upload]:
        out = []
        for i, view in enumerate(self.data[:count]):
            stamp = STAMP.pack(tag, i)
            hasher = blake3.blake3(stamp)
            hasher.update(view[STAMP.size :])
            out.append(Upload(hasher.hexdigest(), stamp, view))
        return out


# -- servers for the baseline and the raw figure (child processes) --------------------------------


def _serve_raw(chunk: int, control: Connection) -> None:
    """One connection: an 8-byte length, that many bytes into a reused buffer, then b"k"."""
    listener = socket.create_server((HOST, 0))
    control.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    with conn, listener:
        head = b""
        while len(head) < 8:
            head += conn.recv(8 - len(head))
        (left,) = struct.unpack("!Q", head)
        view = memoryview(prefaulted(chunk))
        while left:
            n = conn.recv_into(view[: min(left, len(view))])
            if not n:
                raise ConnectionError("raw sender went away")
            left -= n
        conn.sendall(b"k")


@dataclass
class Measure:
    """One timed upload of a set of chunks."""

    config: str
    kind: str  # raw | baseline | storaged
    concurrency: int
    chunks: int
    nbytes: int
    seconds: float
    server_cpu: float
    client_cpu: float
    #: the part of server_cpu spent in the kernel (sockets, page faults, file writes)
    server_sys: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)
    #: server processes sharing server_cpu
    servers: int = 1
    #: what the servers spend idle (heartbeats, timers) per second, measured before the
    #: warm-up (0.0 when not measured): a sweep takes it off, times the window's seconds
    server_idle_rate: float = 0.0

    def cpu_bound_gbps(self, cores: int) -> float:
        """GB/s if CPU were the only limit on ``cores`` otherwise idle cores.

        Each process runs mostly on one core (one event loop, the GIL); all of them share
        the cores. A load-independent figure, since other work on a shared machine skews
        the measured one (it takes more from 2 processes than from 5).
        """
        gb = self.nbytes / GB
        # /proc counts in clock ticks: a tiny run may show none at all
        per_server = max(self.server_cpu / gb / self.servers, 1e-9)
        client = max(self.client_cpu / gb, 1e-9)
        return min(1 / per_server, 1 / client, cores / (per_server * self.servers + client))

    @property
    def gbps(self) -> float:
        return self.nbytes / GB / self.seconds

    def summary(self, base: Measure | None) -> dict[str, Any]:
        gb = self.nbytes / GB
        out: dict[str, Any] = {
            "config": self.config,
            "kind": self.kind,
            "concurrency": self.concurrency,
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 4),
            "gbps": round(self.gbps, 4),
            "p50_ms": None,
            "p99_ms": None,
            "ratio": None,
            "p50_ratio": None,
            "server_cpu_s_per_gb": round(self.server_cpu / gb, 4),
            "server_sys_s_per_gb": round(self.server_sys / gb, 4),
            "client_cpu_s_per_gb": round(self.client_cpu / gb, 4),
            "cpu_bound_gbps": round(self.cpu_bound_gbps(CORES), 4),
            "cpu_bound_ratio": None,
        }
        if self.latencies:
            out["p50_ms"] = round(percentile(self.latencies, 50) * 1e3, 2)
            out["p99_ms"] = round(percentile(self.latencies, 99) * 1e3, 2)
        if base is not None:
            out["ratio"] = _significant(self.gbps / base.gbps)
            out["cpu_bound_ratio"] = _significant(
                self.cpu_bound_gbps(CORES) / base.cpu_bound_gbps(CORES)
            )
            if self.latencies and base.latencies:
                # > 1: the ack takes that many times as long as the one-copy upload
                out["p50_ratio"] = _significant(
                    percentile(self.latencies, 50) / percentile(base.latencies, 50)
                )
        return out


def _significant(ratio: float) -> float:
    """``ratio`` to 4 significant digits: a fixed 3 decimals lost over 1 % of a small
    ratio (0.037 for 0.0366), more than the JSON's own figures can explain."""
    return float(f"{ratio:.4g}")


def raw_socket(corpus: Corpus, nbytes: int) -> Measure:
    """One blocking TCP stream over loopback into a reused buffer: the machine's ceiling."""
    proc, port = spawn_server(_serve_raw, corpus.chunk)
    try:
        chunks = max(1, nbytes // corpus.chunk)
        with socket.create_connection((HOST, port)) as sock:
            cpu0, srv0, t0 = (
                time.process_time(),
                proc_cpu_seconds(proc.pid or 0),
                time.perf_counter(),
            )
            sock.sendall(struct.pack("!Q", chunks * corpus.chunk))
            for i in range(chunks):
                sock.sendall(corpus.data[i % len(corpus.data)])
            if sock.recv(1) != b"k":
                raise ConnectionError("raw receiver did not confirm")
            seconds = time.perf_counter() - t0
            client = time.process_time() - cpu0
            server = proc_cpu_seconds(proc.pid or 0) - srv0
    finally:
        stop_server(proc)
    return Measure("raw loopback socket, 1 stream", "raw", 1, chunks,
                   chunks * corpus.chunk, seconds, server, client)  # fmt: skip


# -- the client -----------------------------------------------------------------------------------


async def timed_uploads(
    kind: str,
    config: str,
    uploads: Sequence[Upload],
    warmup: Sequence[Upload],
    url_of: Callable[[Upload], str],
    concurrency: int,
    server_pids: Sequence[int],
    max_seconds: float,
    prepare: Callable[[aiohttp.ClientSession], Awaitable[None]] | None = None,
    started: Callable[[], None] | None = None,
    idle_seconds: float = 0.0,
) -> Measure:
    """Warm up, ``prepare``, then time ``uploads``; ``started`` is called just before. With
    ``idle_seconds``, the servers' CPU rate while idle is measured first, that long."""
    idle_rate = 0.0
    if idle_seconds > 0:
        idle0 = sum(proc_cpu_seconds(p) for p in server_pids)
        await asyncio.sleep(idle_seconds)
        idle_rate = (sum(proc_cpu_seconds(p) for p in server_pids) - idle0) / idle_seconds
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(connector=connector, headers=auth) as session:
        # Untimed: opens the client's connections and the nodes' peer connections.
        await upload_all(session, warmup, url_of, concurrency)
        if prepare is not None:
            await prepare(session)
        if started is not None:
            started()
        srv0 = [proc_cpu_times(p) for p in server_pids]
        cpu0 = time.process_time()
        seconds, latencies = await upload_all(session, uploads, url_of, concurrency, max_seconds)
        client = time.process_time() - cpu0
        srv1 = [proc_cpu_times(p) for p in server_pids]
    user = sum(b[0] - a[0] for a, b in zip(srv0, srv1, strict=True))
    system = sum(b[1] - a[1] for a, b in zip(srv0, srv1, strict=True))
    # Every upload has the same size: the acked bytes are the count of acks times it.
    nbytes = len(latencies) * uploads[0].size
    return Measure(config, kind, concurrency, len(latencies), nbytes, seconds, user + system,
                   client, system, latencies, len(server_pids), idle_rate)  # fmt: skip


# -- storaged -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    memory: str
    chunk: int
    background: bool
    loop: str
    #: the nodes map part of their RAM ahead as 8 MiB buffers (``prefault_fraction``); a
    #: sweep turns it off, since it favours 8 MiB chunks over the others
    prefault: bool = True


#: with a warm pool, GC frees the (never committed) chunks this long after their ack
WARM_GC_GRACE = 2.0


def start_cluster(spec: ClusterSpec, root: Path, *, warm_pool: bool = False) -> LocalCluster:
    settings: dict[str, Any] = {
        "max_chunk_size": max(spec.chunk, 16 * MiB),
        "tiers": {"memory_capacity": spec.memory, "nvme_capacity": "256GiB",
                  "cold_capacity": "256GiB"},
        "log_level": "WARNING",
    }  # fmt: skip
    if not spec.prefault:
        settings["prefault_fraction"] = 0.0
    if not spec.background:
        settings["drain_workers"] = 0
        settings["encode_workers"] = 0
    if warm_pool:
        settings["gc_grace"] = WARM_GC_GRACE
        settings["gc_interval"] = 0.5
    for attempt in range(3):
        port = free_port_block(spec.nodes * 2 + 1)
        cluster = LocalCluster(
            nodes=spec.nodes,
            data=root / f"try{attempt}",
            port=port,
            peer_port=port + spec.nodes,
            token=TOKEN,
            settings=settings,
            env={"PYTHONASYNCIODEBUG": ""},
        )
        try:
            cluster.start()
            _wait_all_alive(cluster)
            return cluster
        except ClusterError as exc:
            # Other clusters on this machine may take a port between the pick and the bind.
            cluster.stop()
            logs = [cluster.data / cluster.node_id(i) / "node.log" for i in range(spec.nodes)]
            tails = [log.read_text(errors="replace")[-400:] for log in logs if log.exists()]
            if attempt == 2 or not any("address already in use" in t for t in tails):
                raise ClusterError(f"{exc}\n" + "\n".join(tails)) from exc
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")


def _wait_all_alive(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Wait until every node sees every node alive (heartbeats are late on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = []
        for i in range(cluster.nodes):
            req = urllib.request.Request(
                cluster.url(i) + "/v1/cluster",
                headers={"Accept": "application/json", "Authorization": f"Bearer {TOKEN}"},
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                doc = json.load(resp)
            seen.append(all(n["alive"] for n in doc["nodes"]))
        if all(seen):
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"nodes do not all see each other alive after {timeout:.0f} s")
        time.sleep(0.2)


def _first_placement(cluster: LocalCluster) -> Callable[[Upload], str]:
    ids = [cluster.node_id(i) for i in range(cluster.nodes)]
    urls = {cluster.node_id(i): cluster.url(i) for i in range(cluster.nodes)}

    def url_of(up: Upload) -> str:
        return f"{urls[rendezvous_order(up.chunk_id, ids)[0]]}/v1/chunks/{up.chunk_id}"

    return url_of


async def wait_memory_free(
    session: aiohttp.ClientSession, cluster: LocalCluster, timeout: float = 30.0
) -> None:
    """Wait until no node's memory tier holds anything (its buffers are back in its pool)."""
    deadline = time.monotonic() + timeout
    used: dict[str, int] = {}
    while time.monotonic() < deadline:
        for i in range(cluster.nodes):
            url = cluster.url(i) + "/v1/cluster"
            async with session.get(url, headers={"Accept": "application/json"}) as resp:
                doc = await resp.json()
            mine = [n for n in doc["nodes"] if n["id"] == cluster.node_id(i)]
            used[cluster.node_id(i)] = int(mine[0]["memory"]["used"])
        if not any(used.values()):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"memory tiers still hold data after {timeout:.0f} s: {used}")


def run_storaged(
    spec: ClusterSpec,
    uploads: Sequence[Upload],
    warmup: Sequence[Upload],
    concurrency: int,
    max_seconds: float,
    *,
    fill: Sequence[Upload] = (),
    profilers: Sequence[Profiler] = (),
    idle_seconds: float = 0.0,
) -> Measure:
    """One timed round on a fresh cluster.

    With ``fill`` (a warm pool), the cluster's GC frees unreferenced chunks ``WARM_GC_GRACE``
    seconds after their ack; ``fill`` is uploaded untimed and the round starts once every
    memory tier is empty again, so its buffers come from the pool instead of fresh pages:
    the state of a long-running node after its first checkpoints. ``profilers`` run during
    the timed uploads; ``idle_seconds``: see ``timed_uploads``.
    """
    root = Path(tempfile.mkdtemp(prefix="storaged-ack-"))
    cluster: LocalCluster | None = None
    try:
        cluster = start_cluster(spec, root, warm_pool=bool(fill))
        pids = [cluster.procs[i].pid for i in range(cluster.nodes)]
        url_of = _first_placement(cluster)
        pool = ", warm pool" if fill else ""
        config = f"storaged {spec.nodes} nodes x3, c={concurrency}{pool}"
        prepare = None
        if fill:
            ready = cluster

            async def prepare(session: aiohttp.ClientSession) -> None:
                await upload_all(session, fill, url_of, concurrency, max_seconds)
                await wait_memory_free(session, ready)

        def started() -> None:
            for profiler in profilers:
                profiler.start(pids)

        try:
            return _run(
                timed_uploads("storaged", config, uploads, warmup, url_of, concurrency, pids,
                              max_seconds, prepare, started, idle_seconds),
                spec.loop,
            )  # fmt: skip
        finally:
            for profiler in profilers:
                profiler.stop()
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run(coro: Any, loop_name: str) -> Measure:
    with asyncio.Runner(loop_factory=lambda: new_loop(loop_name)) as runner:
        result: Measure = runner.run(coro)
        return result


# -- the chunk-size sweep -------------------------------------------------------------------------

#: the figures of one sweep run, and those whose ratio to the reference size is reported
SWEEP_FIGURES = ("gbps", "nodes_cpu_s_per_gb", "nodes_idle_s_per_gb", "nodes_net_s_per_gb",
                 "client_cpu_s_per_gb", "cpu_s_per_gb")  # fmt: skip
SWEEP_RATIOS = ("nodes_net_s_per_gb", "client_cpu_s_per_gb", "cpu_s_per_gb")
#: seconds each sweep run measures its idle nodes' CPU for, before its warm-up
SWEEP_IDLE_SECONDS = 2.0


def _mib_label(chunk: int) -> str:
    return f"{chunk / MiB:g}"


def sweep_figures(m: Measure) -> dict[str, float]:
    """One sweep run's figures: GB/s, and CPU seconds per acked GB of the nodes (all of
    them together: as measured, what they would have spent idle over the same window, and
    the difference, ``net``), of the client, and of the nodes' net and the client together.
    Taking the idle part off keeps a slower window (a busier machine) from charging the
    chunk size with more heartbeats."""
    gb = m.nbytes / GB
    nodes, client = round(m.server_cpu / gb, 4), round(m.client_cpu / gb, 4)
    idle = round(m.server_idle_rate * m.seconds / gb, 4)
    net = round(nodes - idle, 4)
    return {"gbps": round(m.gbps, 4), "nodes_cpu_s_per_gb": nodes, "nodes_idle_s_per_gb": idle,
            "nodes_net_s_per_gb": net, "client_cpu_s_per_gb": client,
            "cpu_s_per_gb": round(net + client, 4), "chunks": m.chunks}  # fmt: skip


def summarize_sweep(rounds: list[dict[str, dict[str, float]]], reference: str) -> dict[str, Any]:
    """Per chunk size (MiB, as text): each figure's median, min and max over ``rounds``
    (each {size: figures}), and ``x_ref``: per figure of ``SWEEP_RATIOS`` the median over
    rounds of the round's ratio to the ``reference`` size in the same round."""
    out: dict[str, Any] = {}
    for label in rounds[0]:
        figs: dict[str, Any] = {}
        for fig in SWEEP_FIGURES:
            values = [r[label][fig] for r in rounds]
            figs[fig] = {"median": round(statistics.median(values), 4), "min": min(values),
                         "max": max(values)}  # fmt: skip
        figs["x_ref"] = {
            fig: round(statistics.median(r[label][fig] / r[reference][fig] for r in rounds), 3)
            for fig in SWEEP_RATIOS
        }
        out[label] = figs
    return out


def run_sweep(
    spec: ClusterSpec, corpus: Corpus, sizes: Sequence[int], concurrency: int, repeat: int,
    max_seconds: float,
) -> list[dict[str, dict[str, float]]]:  # fmt: skip
    """``repeat`` rounds of one storaged run per chunk size of ``sizes`` (each dividing
    ``corpus.chunk``; the same bytes every time, freshly stamped), the sizes' order rotated
    each round; per round {size in MiB: ``sweep_figures``}. The nodes map no RAM ahead
    (a node's pre-faulted buffers are 8 MiB ones: other sizes would map theirs in the
    window and unmap those), so every size pays for its buffers alike."""
    tags = iter(range(1, 1 << 30))
    rounds: list[dict[str, dict[str, float]]] = []
    for rnd in range(repeat):
        k = rnd % len(sizes)
        row: dict[str, dict[str, float]] = {}
        for chunk in [*sizes[k:], *sizes[:k]]:
            part = corpus.split(chunk)
            sized = ClusterSpec(spec.nodes, spec.memory, chunk, spec.background, spec.loop,
                                prefault=False)  # fmt: skip
            m = run_storaged(sized, part.uploads(next(tags)),
                             part.uploads(next(tags), concurrency), concurrency,
                             max_seconds, idle_seconds=SWEEP_IDLE_SECONDS)  # fmt: skip
            figs = row[_mib_label(chunk)] = sweep_figures(m)
            print(f"# round {rnd + 1}, {chunk / MiB:g} MiB: {m.gbps:.2f} GB/s, nodes "
                  f"{figs['nodes_cpu_s_per_gb']:.2f} CPU s/GB ({figs['nodes_idle_s_per_gb']:.2f} "
                  f"of it idle), client {figs['client_cpu_s_per_gb']:.2f}", flush=True)  # fmt: skip
        rounds.append({_mib_label(c): row[_mib_label(c)] for c in sizes})
    return rounds


def _sweep_table(summary: dict[str, Any], reference: str) -> str:
    head = ("chunk MiB", "nodes CPU s/GB", "idle part", "client CPU s/GB",
            "nodes net + client", f"x {reference} MiB", "GB/s")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| ---: |" + " ---: |" * (len(head) - 1)]
    for label, s in summary.items():

        def span(fig: str, s: dict[str, Any] = s) -> str:
            f = s[fig]
            return f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})"

        lines.append(f"| {label} | {span('nodes_cpu_s_per_gb')} "
                     f"| {s['nodes_idle_s_per_gb']['median']:.2f} "
                     f"| {span('client_cpu_s_per_gb')} | {span('cpu_s_per_gb')} "
                     f"| {s['x_ref']['cpu_s_per_gb']:.3f} | {span('gbps')} |")  # fmt: skip
    return "\n".join(lines)


def _parse_mib_sizes(text: str) -> list[int]:
    try:
        values = sorted(int(float(v) * MiB) for v in text.split(",") if v.strip())
    except ValueError:
        values = []
    if len(values) < 2 or values[0] <= STAMP.size or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(
            f"want two or more distinct MiB sizes like 4,8, not {text!r}"
        )
    return values


# -- the profile ----------------------------------------------------------------------------------


def py_spy_path() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Profiler:
    """Samples node processes during a timed round; ``summary()`` says where the CPU went."""

    name = ""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self, pids: Sequence[int]) -> list[str]:
        raise NotImplementedError

    def start(self, pids: Sequence[int]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self.command(pids), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        time.sleep(1.0)  # let it attach before the uploads start
        if self._proc.poll() is not None:
            err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
            self._proc = None
            raise RuntimeError(f"{self.name} could not attach: {err.strip()[:300]}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # both write their output on SIGINT
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def summary(self) -> dict[str, Any]:
        raise NotImplementedError


class PySpy(Profiler):
    """py-spy on node n0: which Python code (and C extension) the node's threads run."""

    name = "py-spy"

    def command(self, pids: Sequence[int]) -> list[str]:
        exe = py_spy_path()
        assert exe is not None
        # --native shows time inside C extensions (BLAKE3, memcpy, uvloop, the HTTP parser).
        return [exe, "record", "-p", str(pids[0]), "-o", str(self.out), "--format", "raw",
                "-r", str(PROFILE_HZ), "--native"]  # fmt: skip

    def summary(self) -> dict[str, Any]:
        return {"node": "n0", "hz": PROFILE_HZ, "raw": str(self.out),
                **summarize_profile(self.out)}  # fmt: skip


class Perf(Profiler):
    """perf (cpu-clock) on every node: kernel included, which py-spy cannot see."""

    name = "perf"
    hz = 499

    def command(self, pids: Sequence[int]) -> list[str]:
        return ["perf", "record", "-F", str(self.hz), "-g", "-o", str(self.out),
                "-p", ",".join(str(p) for p in pids)]  # fmt: skip

    def summary(self) -> dict[str, Any]:
        script = subprocess.run(
            ["perf", "script", "-i", str(self.out), "-F", "ip,sym,dso"],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        return {"nodes": "all", "hz": self.hz, "data": str(self.out),
                **summarize_perf(script.stdout)}  # fmt: skip


#: (category, pattern searched in a whole perf stack, kernel and leaf symbols), first match wins
PERF_CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("new RAM buffers: mmap + zeroing fresh pages", re.compile(r"__mm_populate|vm_mmap_pgoff")),
    ("page faults elsewhere (malloc, bytes objects)", re.compile(r"exc_page_fault")),
    ("BLAKE3 hash (id checks)", re.compile(r"blake3", re.I)),
    ("erasure code + CRC-32C", re.compile(r"fec_|zfec|crc32c", re.I)),
    ("file writes, fsync (drain, fragments)", re.compile(
        r"ext4|xfs|btrfs|filemap|generic_perform_write|iomap|do_fsync|blk_|submit_bio|"
        r"do_unlinkat|do_renameat|jbd2")),
    ("kernel TCP over loopback (send/recv, socket copies)", re.compile(
        r"tcp_|sock_|skb|inet_|ip_rcv|ip_output|__sys_recv|__sys_send|net_rx|loopback")),
    ("wakeups, scheduling, futex (threads, GIL, epoll)", re.compile(
        r"futex|schedule|finish_task_switch|try_to_wake_up|epoll|eventfd|sched_")),
    ("other kernel (syscalls, memory management)", re.compile(r"\[kernel\.kallsyms\]")),
    ("user-space copies (memcpy/memmove)", re.compile(r"^(__memmove|__memcpy|memcpy)")),
    ("event loop (uvloop/libuv), HTTP parser", re.compile(r"uvloop|libuv|_http_parser|llhttp")),
    ("Python interpreter, objects, allocator", re.compile(
        r"libpython|_Py|Py[A-Z]|python3|cpython|libc\.so")),
]  # fmt: skip


def summarize_perf(script: str, top: int = 15) -> dict[str, Any]:
    """``perf script -F ip,sym,dso`` output summed by category and by leaf symbol (shares)."""
    categories: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for sample in script.split("\n\n"):
        frames = []
        for line in sample.splitlines():
            parts = line.split(None, 1)  # address, "symbol (dso)"
            if len(parts) == 2 and re.fullmatch(r"[0-9a-f]+", parts[0]):
                frames.append(parts[1])
        if not frames:
            continue
        total += 1
        leaves[frames[0]] += 1
        # Leaf first (perf prints the sampled frame first), so "^" patterns test the leaf.
        stack = "\n".join(frames)
        for name, pattern in PERF_CATEGORIES:
            if (
                pattern.search(stack)
                if not pattern.pattern.startswith("^")
                else pattern.match(frames[0])
            ):
                categories[name] += 1
                break
        else:
            categories["other"] += 1
    if not total:
        return {"samples": 0, "categories": {}, "top_symbols": []}
    return {
        "samples": total,
        "categories": {k: round(v / total, 3) for k, v in categories.most_common()},
        "top_symbols": [[_short_dso(k), round(v / total, 3)] for k, v in leaves.most_common(top)],
    }


def _short_dso(frame: str) -> str:
    return re.sub(r"\((?:.*/)?([^/)]+)\)$", r"(\1)", frame)


# -- the run --------------------------------------------------------------------------------------


def _median(measures: list[Measure]) -> Measure:
    ordered = sorted(measures, key=lambda m: m.gbps)
    return ordered[(len(ordered) - 1) // 2]


def _table(rows: list[dict[str, Any]]) -> str:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    head = ("config", "GB/s", "p50 ms", "p99 ms", "ratio", "p50 x base",
            "CPU s/GB nodes", "CPU s/GB client", "ratio if CPU-bound")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['gbps']:.2f} | {num(r['p50_ms'], '.1f')} "
            f"| {num(r['p99_ms'], '.1f')} | {num(r['ratio'], '.2f')} "
            f"| {num(r['p50_ratio'], '.2f')} | {r['server_cpu_s_per_gb']:.2f} "
            f"| {r['client_cpu_s_per_gb']:.2f} | {num(r['cpu_bound_ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def _print_profile(profile: dict[str, Any], skipped: bool) -> None:
    if not profile["ran"]:
        if not skipped:
            print("# no profile: neither perf nor py-spy found (pip install py-spy)")
        return
    print(f"# profiled round: c={profile['concurrency']}, "
          f"{profile['gbps_while_profiled']:.2f} GB/s while profiled")  # fmt: skip
    if "perf" in profile:
        perf = profile["perf"]
        print(f"# perf, all nodes ({perf['samples']} samples at {perf['hz']} Hz): "
              "where the CPU goes")  # fmt: skip
        _print_shares(perf["categories"], "# perf top symbols:", perf["top_symbols"])
    if "py-spy" in profile:
        spy = profile["py-spy"]
        print(f"# py-spy, node n0 ({spy['samples']} busy samples at {spy['hz']} Hz; "
              f"{spy['idle_samples']} idle, {spy['gil_wait_samples']} waiting for the GIL): "
              "where its threads work")  # fmt: skip
        _print_shares(spy["categories"], "# py-spy top Python lines:", spy["top_python_lines"])


def _print_shares(categories: dict[str, float], heading: str, top: Sequence[Sequence[Any]]) -> None:
    """Each category's share of the samples, then ``heading`` and the first 10 of ``top``."""
    for name, share in categories.items():
        print(f"#   {share * 100:5.1f} %  {name}")
    print(heading)
    for name, share in top[:10]:
        print(f"#   {share * 100:5.1f} %  {name}")


def _parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive integers like 4,8, not {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.ack", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--size", type=float, help="GiB uploaded per round (default 2)")
    parser.add_argument("--chunk-mib", type=float, default=8.0)
    parser.add_argument(
        "--concurrency",
        type=_parse_concurrency,
        help="uploads in flight, e.g. 4,8 (default; one configuration each)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=10.0,
        help="no new PUT after this long in a timed window or a fill (bounds run time)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the median is reported")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--memory", default="3GiB", help="memory tier capacity per node")
    parser.add_argument(
        "--no-background",
        action="store_true",
        help="nodes run no drain or encode workers: the ack path alone",
    )
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled round")
    parser.add_argument("--no-warm-pool", action="store_true", help="skip the warm-pool row")
    parser.add_argument(
        "--quick", action="store_true", help="a few seconds: 128 MiB, concurrency 4, no profile"
    )
    parser.add_argument(
        "--sweep",
        type=_parse_mib_sizes,
        help="chunk sizes in MiB, e.g. 2,4,8,16,32 (each dividing the largest): instead of the "
        "comparison, storaged alone at each size, --repeat rounds in rotated order, CPU per GB "
        "(median, min-max, and each round's ratio to 8 MiB, or to the smallest size)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "ack.json")
    args = parser.parse_args(argv)  # fmt: skip
    if args.quick:
        args.no_profile = args.no_warm_pool = True
    if args.size is None:
        args.size = 0.125 if args.quick else 2.0
    if args.concurrency is None:
        args.concurrency = [4] if args.quick else [4, 8]
    chunk = int(args.chunk_mib * MiB) if args.sweep is None else args.sweep[-1]
    count = int(args.size * GiB) // chunk if chunk > 0 else 0
    if chunk <= STAMP.size:
        parser.error(f"--chunk-mib {args.chunk_mib} is too small")
    if count < 1:
        parser.error(f"--size {args.size} GiB holds no chunk of {args.chunk_mib} MiB")
    if args.repeat < 1 or args.nodes < 3:
        parser.error("--repeat must be >= 1 and --nodes >= 3 (three copies)")
    if args.sweep is not None and any(chunk % c for c in args.sweep):
        parser.error(f"--sweep: every size must divide the largest ({chunk / MiB:g} MiB)")
    spec = ClusterSpec(args.nodes, args.memory, chunk, not args.no_background, args.loop)
    command = "python -m loadtest.ack " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}".rstrip(), flush=True)

    load_before = os.getloadavg()
    t_gen = time.perf_counter()
    corpus = Corpus(chunk, count)
    warm = max(args.concurrency)
    print(f"# {count} chunks of {chunk / MiB:g} MiB ({count * chunk / GiB:.2f} GiB) made in "
          f"{time.perf_counter() - t_gen:.1f} s; {os.cpu_count()} CPUs, {args.loop}, "
          f"{args.nodes} nodes x {args.memory} RAM, background "
          f"{'on' if spec.background else 'off'}", flush=True)  # fmt: skip

    if args.sweep is not None:
        return _main_sweep(args, spec, corpus, command, load_before)

    raw = raw_socket(corpus, min(count * chunk, GiB))
    rows: list[dict[str, Any]] = [raw.summary(None)]
    print(f"# raw loopback socket: {raw.gbps:.2f} GB/s", flush=True)

    proc, port = spawn_server(serve_baseline, chunk, warm + 4, args.loop)
    tags = iter(range(1, 1 << 30))
    measures: dict[tuple[str, int], list[Measure]] = {}
    top = max(args.concurrency)
    try:
        base_pid = proc.pid or 0

        def base_url(up: Upload) -> str:
            return f"http://{HOST}:{port}/v1/chunks/{up.chunk_id}"

        for rnd in range(args.repeat):
            for conc in args.concurrency:
                base = _run(
                    timed_uploads("baseline", f"baseline aiohttp 1 copy, c={conc}",
                                  corpus.uploads(next(tags)), corpus.uploads(next(tags), warm),
                                  base_url, conc, [base_pid], args.max_seconds),
                    args.loop,
                )  # fmt: skip
                measures.setdefault(("baseline", conc), []).append(base)
                store = run_storaged(
                    spec, corpus.uploads(next(tags)), corpus.uploads(next(tags), warm), conc,
                    args.max_seconds,
                )  # fmt: skip
                measures.setdefault(("storaged", conc), []).append(store)
                print(f"# round {rnd + 1}, c={conc}: baseline {base.gbps:.2f} GB/s, "
                      f"storaged {store.gbps:.2f} GB/s", flush=True)  # fmt: skip
            if not args.no_warm_pool:
                fill = corpus.uploads(next(tags), max(top, count // 2))
                store = run_storaged(spec, corpus.uploads(next(tags)),
                                     corpus.uploads(next(tags), warm), top, args.max_seconds,
                                     fill=fill)  # fmt: skip
                measures.setdefault(("warm", top), []).append(store)
                print(f"# round {rnd + 1}, c={top}, warm pool: storaged {store.gbps:.2f} GB/s",
                      flush=True)  # fmt: skip
    finally:
        stop_server(proc)

    for conc in args.concurrency:
        base = _median(measures[("baseline", conc)])
        rows.append(base.summary(None))
        rows.append(_median(measures[("storaged", conc)]).summary(base))
        if ("warm", conc) in measures:
            rows.append(_median(measures[("warm", conc)]).summary(base))

    profilers: list[Profiler] = []
    tools = {"py-spy": py_spy_path(), "perf": shutil.which("perf")}
    if not args.no_profile:
        if tools["perf"]:
            profilers.append(Perf(args.out.parent / "ack-perf.data"))
        if tools["py-spy"]:
            profilers.append(PySpy(args.out.parent / "ack-py-spy-n0.txt"))
    profile: dict[str, Any] = {"tools": tools, "ran": False}
    if profilers:
        store = run_storaged(spec, corpus.uploads(next(tags)), corpus.uploads(next(tags), warm),
                             top, args.max_seconds, profilers=profilers)  # fmt: skip
        profile.update(ran=True, concurrency=top, gbps_while_profiled=round(store.gbps, 3))
        for profiler in profilers:
            profile[profiler.name] = profiler.summary()

    print(_table(rows))
    _print_profile(profile, args.no_profile)

    result = {
        "command": command,
        "machine": run_machine(load_before, aiohttp=aiohttp.__version__, loop=args.loop),
        "settings": {"chunk_bytes": chunk, "chunks": count, "nodes": args.nodes,
                     "memory_per_node": args.memory, "background": spec.background,
                     "repeat": args.repeat, "concurrency": args.concurrency,
                     "max_seconds": args.max_seconds, "warm_gc_grace": WARM_GC_GRACE},
        "results": rows,
        "profile": profile,
    }  # fmt: skip
    return finish(args.out, result)


def _main_sweep(
    args: argparse.Namespace, spec: ClusterSpec, corpus: Corpus, command: str,
    load_before: tuple[float, float, float],
) -> int:  # fmt: skip
    sizes: list[int] = args.sweep
    conc = max(args.concurrency)
    reference = _mib_label(8 * MiB if 8 * MiB in sizes else sizes[0])
    rounds = run_sweep(spec, corpus, sizes, conc, args.repeat, args.max_seconds)
    summary = summarize_sweep(rounds, reference)
    print(f"# sweep at c={conc}, {args.nodes} nodes, background "
          f"{'on' if spec.background else 'off'}: median (min-max) of {args.repeat} "
          f"round(s); x {reference} MiB: median of each round's ratio; load "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(_sweep_table(summary, reference))
    result = {
        "command": command,
        "machine": run_machine(load_before, aiohttp=aiohttp.__version__, loop=args.loop),
        "settings": {"sweep_bytes": sizes, "reference_mib": reference,
                     "bytes_per_run": len(corpus.data) * corpus.chunk, "nodes": args.nodes,
                     "memory_per_node": args.memory, "background": spec.background,
                     "repeat": args.repeat, "concurrency": conc,
                     "max_seconds": args.max_seconds},
        "rounds": rounds,
        "summary": summary,
    }  # fmt: skip
    return finish(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
