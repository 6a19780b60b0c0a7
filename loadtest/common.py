"""Harness shared by ``python -m loadtest restore`` and ``python -m loadtest save``.

What a caller may rely on:

- ``Layout``: a checkpoint of ``keys`` float32 tensors of ``rows`` x 64 KiB rows, sharded by
  rows over ranks. Its bytes are a function of (seed, key, global offset) alone, so any
  process can make or check any box of it without the others (``fill``, ``check``); every
  64 KiB block starts with a distinct stamp, so no two chunks of it are equal (no dedup).
- ``WorkerPool``: real separate processes (spawn), each running one ``Job`` at a time. All
  jobs of a run are prepared first (allocation, imports, connections), then released at
  once; each reports its own start and end on ``time.monotonic`` (CLOCK_MONOTONIC, the
  same clock in every process of the machine) and its CPU seconds (all its threads).
- ``start_cluster``: a ``LocalCluster`` of node processes, stopped again if start-up fails.
- ``MetricsSampler`` / ``read_bytes``: the nodes' ``/metrics``, sampled in a thread.
- ``drop_page_cache``: what it could do about the page cache, said in its return value.
- ``TracedClient``: a ``Client`` that times every chunk request (first byte, whole body,
  ack) and counts bytes by the ``X-Storaged-Tier`` header.
- ``markdown_table``, ``write_json``, ``progress``, ``interrupt_on_sigterm``.
- The command line of both: ``add_workload_arguments``, ``add_cluster_arguments``,
  ``add_output_arguments`` (the flags they share), ``resolve_workload`` (their ``--quick``
  defaults and checks) and ``run_and_write`` (run, then write ``<name>.json/.md/.png``;
  without matplotlib the JSON and markdown, and how to get the plot).
- Their plots: ``figure`` (one PNG, closed on errors too), ``plot_baselines``,
  ``finish_levels_axes``.
- Their shared steps: ``traced_runner``, ``complete_baselines``, ``run_notes``
  (``raw_baselines``, which runs the peer and codec benchmarks, is ``loadtest.baselines``).
- For every load test (``ack``, ``peer`` and ``vs_dcp`` too, so this module imports none of
  them, at load time or later): ``new_loop``, ``prefaulted``, ``serve_aiohttp``,
  ``proc_cpu_times``, ``proc_cpu_seconds``, ``percentile``.

Every process started here is stopped by its owner's ``close``/``stop`` in a ``finally``,
on errors and on Ctrl-C alike (workers ignore SIGINT: the parent decides when they stop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any, Protocol

import aiohttp
import blake3
import numpy as np
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from storaged.client import Client
from storaged.client.client import Holder, WritableBuffer
from storaged.client.direct import ResponseHead
from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.cluster import LocalCluster, free_port_block
from tiers.base import ByteRange

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
HOST = "127.0.0.1"
TOKEN = "loadtest-token"
#: admin token of the clusters the load tests start (POST /v1/admin/evict)
ADMIN_TOKEN = "loadtest-admin-token"
RESULTS = Path(__file__).resolve().parent / "results"
TIERS = ("memory", "nvme", "cold")


def new_loop(name: str = "uvloop") -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop (what a node runs) when asked and installed."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop()
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def prefaulted(size: int) -> bytearray:
    """``size`` bytes, every page already touched (so not during a measured transfer)."""
    # bytearray * n fills with memset: every page is touched now, not during a transfer.
    return bytearray(b"\x01") * size


def serve_aiohttp(app: web.Application, loop_name: str, control: Connection) -> None:
    """Serve ``app`` on an ephemeral port of ``HOST`` (on a fresh ``loop_name`` loop) and send
    the port on ``control``; returns once SIGTERM stops the loop. For baseline servers run
    with ``loadtest.ack.spawn_server``."""

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, 0, backlog=1024).start()
        return runner

    loop = new_loop(loop_name)
    asyncio.set_event_loop(loop)
    runner = loop.run_until_complete(start())
    control.send(runner.addresses[0][1])
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.run_forever()


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    return sum(proc_cpu_times(pid))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# -- the checkpoint's bytes -----------------------------------------------------------------------

ROW_BYTES = 64 << 10
#: float32 elements per row
COLS = ROW_BYTES // 4
#: rows of the repeated random pattern (1 MiB): stamps make every block distinct
_PATTERN_ROWS = 16
_patterns: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}


def _pattern(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if seed not in _patterns:
        raw = blake3.blake3(b"loadtest.pattern" + seed.to_bytes(8, "big")).digest(
            length=_PATTERN_ROWS * ROW_BYTES
        )
        _patterns[seed] = np.frombuffer(raw, dtype=np.uint8).reshape(_PATTERN_ROWS, ROW_BYTES)
    return _patterns[seed]


@dataclass(frozen=True)
class Layout:
    """``keys`` tensors ``layers.<i>.weight`` of shape (rows, COLS) float32, made from ``seed``."""

    keys: int
    rows: int
    seed: int = 1

    @classmethod
    def of_size(cls, nbytes: int, keys: int, seed: int = 1, multiple: int = 1) -> Layout:
        """About ``nbytes`` in ``keys`` tensors whose row count is a multiple of ``multiple``."""
        rows = nbytes // (keys * ROW_BYTES)
        rows -= rows % multiple
        if keys < 1 or rows < 1:
            raise ValueError(f"{nbytes} bytes do not make {keys} tensors of {multiple}+ rows")
        return cls(keys, rows, seed)

    def with_seed(self, seed: int) -> Layout:
        return Layout(self.keys, self.rows, seed)

    @property
    def key_bytes(self) -> int:
        return self.rows * ROW_BYTES

    @property
    def nbytes(self) -> int:
        return self.keys * self.key_bytes

    @property
    def global_shape(self) -> tuple[int, int]:
        return (self.rows, COLS)

    def key(self, index: int) -> str:
        return f"layers.{index}.weight"

    def box(self, rank: int, ranks: int) -> tuple[int, int]:
        """Rows [start, end) that ``rank`` of ``ranks`` holds of every tensor."""
        return self.rows * rank // ranks, self.rows * (rank + 1) // ranks

    def empty(self, rank: int, ranks: int) -> dict[str, np.ndarray[Any, Any]]:
        """Pre-faulted (written once) destination arrays of ``rank``'s boxes."""
        start, end = self.box(rank, ranks)
        out = {}
        for i in range(self.keys):
            array = np.empty((end - start, COLS), dtype=np.float32)
            array.view(np.uint8).fill(0)  # touch every page now, not inside a timed window
            out[self.key(i)] = array
        return out

    def fill(self, key: int, start_row: int, out: np.ndarray[Any, Any]) -> None:
        """Write the rows of tensor ``key`` from ``start_row`` on into ``out`` (len(out) rows)."""
        rows = out.view(np.uint8).reshape(-1, ROW_BYTES)
        pattern = _pattern(self.seed)
        for phase in range(min(_PATTERN_ROWS, len(rows))):
            rows[phase::_PATTERN_ROWS] = pattern[(start_row + phase) % _PATTERN_ROWS]
        stamps = np.empty((len(rows), 2), dtype=">u8")
        stamps[:, 0] = (self.seed << 32) | key
        stamps[:, 1] = (start_row + np.arange(len(rows), dtype=np.uint64)) * ROW_BYTES
        rows[:, :16] = stamps.view(np.uint8).reshape(-1, 16)

    def make(self, rank: int, ranks: int) -> dict[str, np.ndarray[Any, Any]]:
        """``rank``'s boxes of every tensor, filled."""
        start, _ = self.box(rank, ranks)
        arrays = self.empty(rank, ranks)
        for i in range(self.keys):
            self.fill(i, start, arrays[self.key(i)])
        return arrays

    def check(self, key: int, start_row: int, got: np.ndarray[Any, Any], step: int = 256) -> bool:
        """Whether ``got`` holds exactly the rows of tensor ``key`` from ``start_row`` on."""
        rows = got.view(np.uint8).reshape(-1, ROW_BYTES)
        want = np.empty((min(step, len(rows)), COLS), dtype=np.float32)
        for lo in range(0, len(rows), step):
            part = rows[lo : lo + step]
            expected = want[: len(part)]
            self.fill(key, start_row + lo, expected)
            if not np.array_equal(part, expected.view(np.uint8).reshape(-1, ROW_BYTES)):
                return False
        return True


# -- worker processes -----------------------------------------------------------------------------


class Prepared(Protocol):
    """A job ready to go: ``run`` is timed, ``check`` and ``close`` are not."""

    def run(self) -> dict[str, Any]: ...

    def check(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Job(Protocol):
    """Picklable description of one process' share of a run (its class importable by path)."""

    def prepare(self) -> Prepared: ...


class WorkerError(RuntimeError):
    """A worker failed or went away; the message holds its traceback when it sent one."""


def _worker_main(conn: Connection) -> None:
    # The parent stops us (Ctrl-C reaches the whole process group; one decision is enough).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message == "stop":
            return
        try:
            reply = _work(conn, message)
        except (EOFError, OSError):
            return
        except BaseException:
            reply = ("error", traceback.format_exc())
        if reply is None:
            return
        # Nothing of the job is referenced any more: its buffers are freed before the next.
        try:
            conn.send(reply)
        except OSError:
            return


def _work(conn: Connection, job: Job) -> tuple[str, Any] | None:
    """Prepare, wait for "go", run, check, close; the reply (None: told to stop)."""
    prepared = job.prepare()
    try:
        conn.send(("ready", None))
        if conn.recv() != "go":
            return None
        times0, t0 = os.times(), time.monotonic()
        result = prepared.run()
        t1, times1 = time.monotonic(), os.times()
        # All threads of this process; system time shows page faults and reclaim.
        user, system = times1.user - times0.user, times1.system - times0.system
        result.update(t0=t0, t1=t1, cpu=user + system, cpu_sys=system)
        result.update(prepared.check())
        return ("done", result)
    finally:
        prepared.close()


class WorkerPool:
    """``size`` worker processes kept for a whole benchmark (imports and pools paid once)."""

    def __init__(self, size: int, ready_timeout: float = 600.0, run_timeout: float = 900.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready_timeout = ready_timeout
        self.run_timeout = run_timeout
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        try:
            for i in range(size):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(theirs,), daemon=True, name=f"loadtest-w{i}"
                )
                proc.start()
                theirs.close()
                self._workers.append((proc, mine))
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid or 0 for proc, _ in self._workers]

    def _gather(self, count: int, deadline: float, stage: str) -> list[Any]:
        """One message from each of the first ``count`` workers, in worker order.

        Fails as soon as any of them sends an error or dies, not when its turn comes.
        """
        pending = {conn: i for i, (_, conn) in enumerate(self._workers[:count])}
        out: list[Any] = [None] * count
        while pending:
            for conn in wait(list(pending), timeout=0.2):
                assert isinstance(conn, Connection)
                index = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError) as exc:
                    proc = self._workers[index][0]
                    proc.join(2)  # its pipe closes as it exits: say how it ended
                    raise WorkerError(
                        f"worker {index} exited with {proc.exitcode} while {stage}"
                    ) from exc
                if kind == "error":
                    raise WorkerError(f"worker {index} failed while {stage}:\n{payload}")
                out[index] = payload
            for conn, index in pending.items():
                proc = self._workers[index][0]
                if not proc.is_alive() and not conn.poll():
                    raise WorkerError(f"worker {index} exited with {proc.exitcode} while {stage}")
            if pending and time.monotonic() > deadline:
                raise WorkerError(f"{len(pending)} worker(s) not done {stage} in time")
        return out

    def run(self, jobs: Sequence[Job], before_go: Callable[[], None] | None = None) -> list[Any]:
        """Prepare every job (one per worker), start them together, return their results.

        ``before_go`` runs once all are ready, right before the start (e.g. to read the
        nodes' CPU counters). A failure anywhere stops every worker of this pool.
        """
        if len(jobs) > len(self._workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self._workers)} workers")
        try:
            for (_, conn), job in zip(self._workers, jobs, strict=False):
                conn.send(job)
            self._gather(len(jobs), time.monotonic() + self.ready_timeout, "preparing")
            if before_go is not None:
                before_go()
            for _, conn in self._workers[: len(jobs)]:
                conn.send("go")
            return self._gather(len(jobs), time.monotonic() + self.run_timeout, "running")
        except BaseException:
            self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: ask, then (or at once, without ``graceful``) terminate, kill."""
        for _, conn in self._workers:
            with contextlib.suppress(OSError):
                conn.send("stop")
        deadline = time.monotonic() + (5 if graceful else 0)
        for proc, conn in self._workers:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wall_seconds(results: Sequence[Mapping[str, Any]]) -> float:
    """From the first worker's start to the last one's end."""
    return max(float(r["t1"]) for r in results) - min(float(r["t0"]) for r in results)


# -- the cluster ----------------------------------------------------------------------------------


def start_cluster(
    root: Path,
    nodes: int = 4,
    *,
    memory: str = "2GiB",
    max_chunk: int = 16 * MiB,
    settings: Mapping[str, Any] | None = None,
) -> LocalCluster:
    """A ``LocalCluster`` with token ``TOKEN`` under ``root``, healthy; stopped if start fails."""
    merged: dict[str, Any] = {
        "max_chunk_size": max_chunk,
        "tiers": {"memory_capacity": memory, "nvme_capacity": "256GiB",
                  "cold_capacity": "256GiB"},
        "log_level": "WARNING",
        "admin_token": ADMIN_TOKEN,
        # Every rank of a load test comes from 127.0.0.1: the per-client PUT cap (a guard
        # against one greedy client) would throttle the measured load itself.
        "max_client_puts": 4096,
    }  # fmt: skip
    merged.update(settings or {})
    port = free_port_block(nodes * 2 + 1)
    cluster = LocalCluster(
        nodes=nodes,
        data=root,
        port=port,
        peer_port=port + nodes,
        token=TOKEN,
        settings=merged,
        env={"PYTHONASYNCIODEBUG": ""},
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_prefaulted(cluster: LocalCluster, timeout: float = 120.0) -> float:
    """Wait until every node has mapped its RAM pool (its "pre-faulted" log line, which the
    nodes write at INFO); the seconds that took. ``TimeoutError`` after ``timeout``."""
    t0 = time.monotonic()
    logs = [cluster.data / cluster.node_id(i) / "node.log" for i in range(cluster.nodes)]
    while True:
        done = 0
        for log in logs:
            with contextlib.suppress(OSError):
                done += "pre-faulted" in log.read_text(errors="replace")
        if done == len(logs):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{len(logs) - done} node(s) still mapping their RAM pool")
        time.sleep(0.2)


def scrape(url: str, timeout: float = 2.0) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A node's ``/metrics``: sample name -> {sorted label pairs: value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = float(sample.value)
    return out


def read_bytes(urls: Iterable[str]) -> dict[str, dict[str, float]]:
    """``storaged_read_bytes_total`` of each node that answers: {url: {tier: bytes}}."""
    out: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            samples = scrape(url).get("storaged_read_bytes_total", {})
        except (urllib.error.URLError, OSError, ValueError):
            continue  # a dead node: its counters died with it
        tiers = out.setdefault(url, dict.fromkeys(TIERS, 0.0))
        for labels, value in samples.items():
            tier = dict(labels).get("tier", "?")
            tiers[tier] = tiers.get(tier, 0.0) + value
    return out


def read_bytes_delta(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes read between two ``read_bytes``: (by tier, by node url)."""
    by_tier = dict.fromkeys(TIERS, 0)
    by_node: dict[str, int] = {}
    for url, tiers in after.items():
        old = before.get(url, {})
        for tier, value in tiers.items():
            delta = int(value - old.get(tier, 0.0))
            by_tier[tier] = by_tier.get(tier, 0) + delta
            by_node[url] = by_node.get(url, 0) + delta
    return by_tier, by_node


class MetricsSampler:
    """Samples the nodes' backlog gauges every ``period`` seconds in a thread.

    ``samples``: (seconds since start, {node url: {gauge: value}}) per round.
    """

    GAUGES = ("storaged_drain_backlog", "storaged_encode_backlog")

    def __init__(self, urls: Sequence[str], period: float = 0.1) -> None:
        self.urls = list(urls)
        self.period = period
        self.samples: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)

    def start(self) -> MetricsSampler:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            nodes: dict[str, dict[str, float]] = {}
            for url in self.urls:
                try:
                    samples = scrape(url, timeout=1.0)
                except (urllib.error.URLError, OSError, ValueError):
                    continue
                nodes[url] = {g: sum(samples.get(g, {}).values()) for g in self.GAUGES}
            self.samples.append((t - self.started, nodes))
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t)))

    def nodes_answering(self) -> int:
        """The most nodes that answered in one round (0 before the first)."""
        return max((len(nodes) for _, nodes in self.samples), default=0)

    def totals(self) -> list[tuple[float, float, float]]:
        """(t, drain backlog, encode backlog) summed over nodes, per sample."""
        return [
            (
                round(t, 3),
                sum(n.get(self.GAUGES[0], 0.0) for n in nodes.values()),
                sum(n.get(self.GAUGES[1], 0.0) for n in nodes.values()),
            )
            for t, nodes in self.samples
        ]

    def __enter__(self) -> MetricsSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def node_cpu(pids: Sequence[int]) -> float:
    """CPU seconds so far of the processes that still exist (a killed node counts no more)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += proc_cpu_seconds(pid)
    return total


class CpuMeter:
    """CPU seconds of the processes ``pids`` (all threads) since ``start``."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._at = 0.0

    def start(self) -> None:
        self._at = node_cpu(self.pids)

    def seconds(self) -> float:
        return node_cpu(self.pids) - self._at


# -- baselines shared by both directions ----------------------------------------------------------


def complete_baselines(baselines: dict[str, Any], kinds: Iterable[str]) -> None:
    """Empty rows for each of ``kinds`` not measured (``--no-baselines``, no torch), and an
    empty ``codec``: ratios and tables then read every kind alike."""
    for kind in kinds:
        baselines.setdefault(kind, [])
    baselines.setdefault("codec", {})


def drop_page_cache(paths: Iterable[Path] = ()) -> str:
    """Evict file pages so that reads hit the disk; returns what was done.

    ``"fadvise"``: the pages of every file under ``paths`` (``POSIX_FADV_DONTNEED``; the
    files are fsynced, so no page stays dirty). Targeted, so that other work on this
    shared machine keeps its cache. ``"drop_caches"``: no file was given (a cluster seen
    only by its URL), so the whole page cache (``sync``, then ``echo 1 >
    /proc/sys/vm/drop_caches``, which needs root). ``"warm"``: neither was possible;
    reads may come from RAM.
    """
    done = False
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if not path.is_file():
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done = True
            finally:
                os.close(fd)
    if done:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "warm"


# -- a client that times its chunk requests -------------------------------------------------------


@dataclass
class _Fetch:
    start: float = 0.0
    headers: float = 0.0


_current_fetch: contextvars.ContextVar[_Fetch | None] = contextvars.ContextVar(
    "loadtest_fetch", default=None
)


@dataclass
class RequestLog:
    """What a ``TracedClient`` saw, on ``time.monotonic``."""

    #: first response headers of any chunk GET (the restore's first byte)
    first_byte: float | None = None
    #: seconds from sending a chunk GET (its last attempt) to the body in place
    get_latencies: list[float] = field(default_factory=list)
    #: seconds from sending a chunk PUT to its 200/201 (the ack)
    put_latencies: list[float] = field(default_factory=list)
    #: body bytes of chunk GETs by X-Storaged-Tier
    tier_bytes: dict[str, int] = field(default_factory=dict)


def _chunk_request(method: str, url: Any) -> bool:
    return "/v1/chunks/" in str(url.path) and method in ("GET", "PUT")


class TracedClient(Client):
    """A ``Client`` whose session records every chunk request in ``self.log``.

    Open it with ``open_traced`` (it makes the session with the trace hooks and the
    headers ``Client.open`` would use). Chunk GETs read directly, as with ``Client``'s
    own session (``direct_reads=False`` to measure aiohttp's), are traced by the
    client's ``_direct_*`` hooks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("direct_reads", True)
        super().__init__(*args, **kwargs)
        self.log = RequestLog()
        self._own_session: aiohttp.ClientSession | None = None

    async def open_traced(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_start)
        trace.on_request_end.append(self._on_end)
        headers = {"Accept": "application/msgpack", "Accept-Encoding": "identity"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        self._own_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_concurrency + 8),
            headers=headers,
            timeout=self._timeout,
            auto_decompress=False,
            trace_configs=[trace],
        )
        await self.open(self._own_session)

    async def close(self) -> None:
        await super().close()
        if self._own_session is not None:
            await self._own_session.close()
            self._own_session = None

    async def _on_start(
        self, session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any
    ) -> None:
        ctx.start = time.monotonic()
        fetch = _current_fetch.get()
        if fetch is not None:
            fetch.start = ctx.start  # a retry or failover restarts the clock

    async def _on_end(
        self, session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any
    ) -> None:
        now = time.monotonic()
        resp = params.response
        if not _chunk_request(params.method, params.url) or resp.status >= 300:
            return
        if params.method == "PUT":
            self.log.put_latencies.append(now - ctx.start)
            return
        if self.log.first_byte is None or now < self.log.first_byte:
            self.log.first_byte = now
        tier = resp.headers.get("X-Storaged-Tier", "?")
        size = resp.content_length or 0
        self.log.tier_bytes[tier] = self.log.tier_bytes.get(tier, 0) + size

    def _direct_sent(self, node: str) -> None:
        fetch = _current_fetch.get()
        if fetch is not None:
            fetch.start = time.monotonic()  # a retry or failover restarts the clock

    def _direct_answered(self, head: ResponseHead) -> None:
        now = time.monotonic()
        if self.log.first_byte is None or now < self.log.first_byte:
            self.log.first_byte = now
        tier = head.headers.get("x-storaged-tier", "?")
        self.log.tier_bytes[tier] = self.log.tier_bytes.get(tier, 0) + head.content_length

    async def get_chunk(
        self,
        chunk_id: str,
        out: WritableBuffer | None = None,
        byte_range: ByteRange | None = None,
        *,
        holders: Sequence[Holder | str] | None = None,
    ) -> memoryview:
        fetch = _Fetch()
        token = _current_fetch.set(fetch)
        try:
            view = await super().get_chunk(chunk_id, out, byte_range, holders=holders)
        finally:
            _current_fetch.reset(token)
        self.log.get_latencies.append(time.monotonic() - fetch.start)
        return view


def traced_runner(
    urls: Sequence[str], token: str | None, max_concurrency: int, loop: str
) -> tuple[asyncio.Runner, TracedClient]:
    """A runner on a fresh ``loop`` and a ``TracedClient`` already opened in it (the runner is
    closed again if the client does not open). The caller closes the client, then the runner."""
    runner = asyncio.Runner(loop_factory=lambda: new_loop(loop))
    client = TracedClient(list(urls), token=token, max_concurrency=max_concurrency)
    try:
        runner.run(client.open_traced())
    except BaseException:
        runner.close()
        raise
    return runner, client


def client_cpu(results: Sequence[Mapping[str, Any]], nbytes: int) -> dict[str, float | None]:
    """CPU seconds per GB of the workers' timed windows, and the share spent in the kernel."""
    total = sum(float(r["cpu"]) for r in results)
    system = sum(float(r.get("cpu_sys", 0.0)) for r in results)
    return {
        "client_cpu_s_per_gb": round(total / (nbytes / GB), 4) if nbytes else None,
        "client_cpu_sys_share": round(system / total, 3) if total > 0 else None,
    }


def summarize_latencies(latencies: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 in ms (nearest rank), None when there is none."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
    }


# -- output ---------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; argparse's error for anything but positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive integers like 1,2,4, not {text!r}")
    return values


def by_concurrency(rows: Sequence[Mapping[str, Any]], c: int) -> dict[str, Any]:
    """The row of ``rows`` measured at concurrency ``c`` ({} if none)."""
    return next((dict(r) for r in rows if r["concurrency"] == c), {})


def fmt(value: float | None, spec: str = ".2f", ratio: float | None = None) -> str:
    """``1.23`` or ``1.23 (0.45x)``; ``-`` for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = format(value, spec)
    return text if ratio is None else f"{text} ({ratio:.2f}x)"


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run_notes(doc: Mapping[str, Any]) -> list[str]:
    """The markdown lines on how the run went: seconds per step, and why the DCP baselines are
    missing if they are."""
    lines = []
    steps = doc.get("step_seconds", {})
    if steps:
        lines.append(
            f"run time {sum(steps.values()):.0f} s: "
            + ", ".join(f"{label} {sec:.0f} s" for label, sec in steps.items())
        )
    if doc["baselines"].get("dcp_skipped"):
        lines.append(doc["baselines"]["dcp_skipped"] + ".")
    return lines


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


#: What a run without matplotlib says instead of drawing its plot.
NO_MATPLOTLIB = (
    "no plot: matplotlib is not installed; install the plots extra "
    "(pip install -e '.[plots]', or .venv/bin/pip install 'matplotlib>=3.8') and run again"
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the ``plots`` extra): the figures are written, not the plot."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); ``PlotUnavailable`` when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(NO_MATPLOTLIB) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(path: Path, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*args, **kwargs)`` as (figure, axes); written to ``path`` (PNG, 110 dpi,
    parent directories made) when the block ends without an error, closed either way."""
    plt = pyplot()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_baselines(
    ax: Any, baselines: Mapping[str, Any], lines: Iterable[tuple[str, str, str]]
) -> None:
    """A dashed line of GB/s against concurrency for each (kind, label, colour) of ``lines``:
    the rows of ``baselines[kind]``."""
    for kind, label, color in lines:
        rows = baselines[kind]
        xs = [b["concurrency"] for b in rows]
        ax.plot(xs, [b["gbps"] for b in rows], "--", color=color, label=label)


def finish_levels_axes(ax: Any, xlabel: str, levels: Sequence[int]) -> None:
    """Concurrency levels on x, GB/s on a log scale, and the legend (after every line)."""
    ax.set_xlabel(xlabel)
    ax.set_xticks(levels)
    ax.set_yscale("log")
    ax.legend(fontsize=7)


# -- command line of restore and save -------------------------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser, *, levels: str, per: str) -> None:
    """``--size --keys --concurrency --nodes --memory --chunk-mib --client-concurrency``;
    ``levels`` says what ``--concurrency`` counts, ``per`` what one ``Client`` serves."""
    parser.add_argument("--size", type=float, help="checkpoint GiB (default 2; --quick 1/16)")
    parser.add_argument("--keys", type=int, help="tensors in the checkpoint (default 16; quick 4)")
    parser.add_argument("--concurrency", type=parse_levels, help=f"{levels} (1,2,4)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--memory", help="memory tier capacity per node (2GiB; quick 256MiB)")
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_SIZE / MiB)
    parser.add_argument("--client-concurrency", type=int, default=8,
                        help=f"requests in flight per {per} (Client max_concurrency)")  # fmt: skip


def add_cluster_arguments(parser: argparse.ArgumentParser, *, url: str) -> None:
    """``--url`` (its help: ``url``), ``--token`` (default ``$STORAGED_TOKEN``), ``--loop``."""
    parser.add_argument("--url", help=url)
    parser.add_argument("--token", default=os.environ.get("STORAGED_TOKEN"),
                        help="client token for --url (default $STORAGED_TOKEN)")  # fmt: skip
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-baselines --out --tmp --quick``."""
    parser.add_argument(
        "--no-baselines", action="store_true", help="storaged only: no baseline, no ratio"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--tmp", type=Path, help="scratch directory (default: system temp)")
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB, concurrency 1,2: the CI smoke test"
    )


@dataclass(frozen=True)
class Workload:
    """What ``add_workload_arguments`` asked for, with the ``--quick`` defaults filled in."""

    #: checkpoint bytes
    size: int
    keys: int
    concurrency: list[int]
    #: chunk bytes, a whole number of ``ROW_BYTES``
    chunk: int
    #: memory tier capacity per node, as the node takes it ("2GiB")
    memory: str
    #: the command line, as a reader of the results would type it
    command: str


def resolve_workload(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    *,
    divides: Sequence[int] = (),
) -> Workload:
    """The workload of ``args`` (``parser.error`` if it cannot be laid out): the rows of
    every tensor split evenly over each concurrency level and over each of ``divides``."""
    size = args.size if args.size is not None else (1 / 16 if args.quick else 2.0)
    keys = args.keys if args.keys is not None else (4 if args.quick else 16)
    conc = args.concurrency or ([1, 2] if args.quick else [1, 2, 4])
    chunk = int(args.chunk_mib * MiB)
    if chunk < ROW_BYTES or chunk % ROW_BYTES:
        parser.error(f"--chunk-mib must be a multiple of {ROW_BYTES >> 10} KiB")
    try:
        Layout.of_size(int(size * GiB), keys, multiple=math.lcm(*divides, *conc))
    except ValueError as exc:
        parser.error(f"--size {size} GiB is too small: {exc}")
    command = f"{parser.prog} " + " ".join(sys.argv[1:] if argv is None else argv)
    return Workload(
        size=int(size * GiB),
        keys=keys,
        concurrency=conc,
        chunk=chunk,
        memory=args.memory or ("256MiB" if args.quick else "2GiB"),
        command=command.rstrip(),
    )


def run_and_write(
    command: str,
    run: Callable[[], dict[str, Any]],
    out: Path,
    stem: str,
    render_markdown: Callable[[dict[str, Any]], str],
    render_plot: Callable[[dict[str, Any], Path], None],
) -> dict[str, Any] | None:
    """Print ``command``, ``run()`` (SIGTERM interrupts it like Ctrl-C), then write
    ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` in ``out`` (the doc records their paths
    under ``files``) and print the markdown. The doc; None if interrupted (said on stderr)."""
    print(f"# {command}", flush=True)
    try:
        with interrupt_on_sigterm():
            doc = run()
    except KeyboardInterrupt:
        print("# interrupted: every process this run started is stopped", file=sys.stderr)
        return None
    md = render_markdown(doc)
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md",
             "png": out / f"{stem}.png"}  # fmt: skip
    no_plot = None
    try:
        render_plot(doc, paths["png"])
    except PlotUnavailable as exc:
        # The figures are the result; the plot is a view of them, for those who have it.
        no_plot = str(exc)
        del paths["png"]
        doc["plot"] = no_plot
    doc["files"] = {k: str(v) for k, v in paths.items()}
    write_json(paths["json"], doc)
    paths["markdown"].write_text(md)
    print(md)
    print(f"# results: {', '.join(str(p) for p in paths.values())}")
    if no_plot is not None:
        print(f"# {no_plot}")
    return doc


class Progress:
    """A tqdm bar (stderr) over the steps of a run, and the seconds each step took."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{desc}: {n}/{total} |{bar}| {elapsed}<{remaining} {postfix}",
        )
        #: label -> seconds, in the order the steps ran
        self.seconds: dict[str, float] = {}
        self._label = ""
        self._since = time.monotonic()

    def begin(self, label: str) -> None:
        self._label = label
        self._since = time.monotonic()
        self.bar.set_postfix_str(label)

    def done(self, steps: int = 1) -> None:
        now = time.monotonic()
        spent = self.seconds.get(self._label, 0.0) + now - self._since
        self.seconds[self._label] = round(spent, 2)
        self._since = now
        self.bar.update(steps)

    def skip(self, steps: int) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()


#: why the DCP baselines are missing, when they are
NO_TORCH = "torch is not installed (pip install 'storaged[torch]'): no DCP baseline"


def torch_available() -> bool:
    """Whether the DCP baselines can run (torch is an optional extra)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "numpy": np.__version__,
        "loadavg": list(os.getloadavg()),
        "mem_available_gib": _mem_available_gib(),
    }


def _mem_available_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) * 1024 / GiB, 1)
    return None


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, so ``finally`` blocks clean up."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return None
