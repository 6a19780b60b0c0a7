"""storaged against PyTorch Distributed Checkpoint on local disk: ``python -m loadtest.vs_dcp``.

One run, one state dict of float32 tensors totalling ``--size`` (a few large, many
medium, some small: the mix of a model plus its optimizer state), saved and restored
both ways from this one process:

- **DCP**, what users run today: ``dcp.save`` with ``FileSystemWriter(dir,
  thread_count=2, sync_files=True)`` into a temp dir on local disk (timed whole);
  ``dcp.async_save`` with the same writer (timed until it hands back its future: the
  training loop's stall; the write then finishes untimed); ``dcp.load`` into
  preallocated tensors with a warm page cache (one untimed load first). No process
  group: ``no_dist=True``.
- **storaged**: a ``LocalCluster`` of ``--nodes`` node processes, its RAM tier sized
  for three copies plus a margin, and the numpy client on the same bytes (numpy views
  of the same tensors). ``AsyncSaver.save`` is timed until it returns (the stall: the
  copy into staging buffers), then until ``acked()`` (every chunk in RAM on three
  nodes and the manifest committed). The first save finds no staging buffer and no
  pooled node memory (reported as "first save"); each later save follows a training
  step that changed every byte, after the previous checkpoint went cold, as in steady
  state. Restore is ``restore_checkpoint`` into preallocated arrays from the RAM tier
  (one untimed restore first, like DCP's warm page cache), by one process, then by
  ``--restore-procs`` processes each restoring a share of the keys at once.

Targets (from the issue): stall <= 0.5 x DCP ``async_save``'s blocking time; ack <= 1.0
x DCP ``save`` of one copy; restore >= 2 x as fast as DCP ``load``. Short operations
are repeated (``--repeat``) and the median is reported. CPU seconds are measured for
this process (``time.process_time``: all its threads) and for every node
(``/proc/<pid>/stat``) over each timed window, so each figure can say whether the two
cores were the limit. With ``--profile`` (and py-spy beside the interpreter) one more
save and one more restore run with ``py-spy record --native`` on this process and on
node n0; their samples are summed by where the CPU goes.

Then the targets of issue 10 (section 3), each a ratio to a baseline measured in this
same run, printed as their own table with pass/MISS and each process's CPU s/GB:

- P1: the stall of ``AsyncSaver.save`` (above) and of DCP ``async_save`` with
  ``StoragedWriter`` (a fresh writer, then the same one again), first save and steady,
  against one thread copying the same bytes into reused, faulted-in buffers (<= 1.5 x)
  and against DCP ``async_save`` to disk (<= 0.3 x).
- P2 / P2r: ``dcp.save`` with ``StoragedWriter`` until acked, co-located / remote, against
  DCP ``save`` with ``FileSystemWriter`` (<= 1.0 x / <= 1.5 x).
- P3 / P3r: ``dcp.load`` with ``StoragedReader`` from the RAM tier, co-located / remote,
  against DCP ``load`` (>= 5 x / >= 2 x) and, remote, raw loopback (>= 0.6 x).
- P4: ``dcp.load`` with every chunk cold only and one node killed (timed once repair has
  rebuilt its fragments elsewhere: the restore, not the repair beside it), against one
  thread of raw zfec decode of a chunk of the same bytes (>= 0.8 x), and (a second row)
  against that decode on every core of the machine at once.

"Co-located" and "remote" differ by the client option ``shm`` (see ``shm_options``).
Every save changes every byte first. The node killed for P4 stays dead: it is last.

Results go to ``loadtest/results/vs_dcp.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from loadtest.harness.baselines import codec_rates, raw_loopback
from loadtest.harness.cluster import ADMIN_TOKEN, TOKEN
from loadtest.harness.floor import FloorRates, RoleFloor, floor_table, measure_rates, role_floors
from loadtest.harness.profile import summarize_profile
from loadtest.harness.state_dict import (
    DEFAULT_SMALL,
    F32,
    Array,
    TensorSpec,
    digest_arrays,
    memory_per_node,
    node_pids,
    ram_tier_check,
    state_layout,
)
from loadtest.harness.state_dict import prefaulted_arrays as prefaulted
from loadtest.harness.state_dict import start_sized_cluster as start_cluster
from loadtest.harness.stopwatch import CORES, Stopwatch, Window
from storaged.client import AsyncSaver, Client, WaitTimeout, restore_checkpoint
from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.manifest_schema import check_schema
from storaged.tools.local_cluster import LocalCluster

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9

RESULTS = Path(__file__).resolve().parent / "results"
#: py-spy samples per second (--native stops the process for each sample)
PROFILE_HZ = 50

T = TypeVar("T")


# -- the state dict -------------------------------------------------------------------------------


def make_state(specs: Sequence[TensorSpec], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors of these shapes (every chunk of their bytes distinct)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {s.key: torch.rand(s.shape, generator=gen, dtype=torch.float32) for s in specs}


def training_step(state: Mapping[str, torch.Tensor]) -> None:
    """Change every byte in place, as an optimizer step does (no save may dedup the last)."""
    for tensor in state.values():
        tensor.add_(1.0)


def split_keys(specs: Sequence[TensorSpec], parts: int) -> list[list[TensorSpec]]:
    """``parts`` groups of tensors with bytes as even as greedy largest-first makes them."""
    groups: list[list[TensorSpec]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for s in sorted(specs, key=lambda s: s.nbytes, reverse=True):
        i = loads.index(min(loads))
        groups[i].append(s)
        loads[i] += s.nbytes
    return groups


# -- measuring ------------------------------------------------------------------------------------


def median_window(windows: Sequence[Window]) -> Window:
    """The median by wall time; of an even count, the slower middle one (no flattering)."""
    ordered = sorted(windows, key=lambda w: w.seconds)
    return ordered[len(ordered) // 2]


def memcpy_reference(nbytes: int) -> dict[str, float]:
    """One-thread copy speed into warm and into fresh memory: the ceiling of a staging copy."""
    source = np.ones(nbytes, dtype=np.uint8)
    warm = np.empty_like(source)
    warm.fill(0)
    best_warm = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(warm, source)
        best_warm = min(best_warm, time.perf_counter() - t0)
    del warm
    t0 = time.perf_counter()
    fresh = np.empty_like(source)
    np.copyto(fresh, source)  # page faults on first touch, as a freshly allocated buffer has
    fresh_s = time.perf_counter() - t0
    del fresh, source
    return {"warm_gbps": round(nbytes / GB / best_warm, 3),
            "fresh_gbps": round(nbytes / GB / fresh_s, 3)}  # fmt: skip


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when unknown)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def release_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the kernel.

    glibc keeps freed heap memory (its mmap threshold grows as large blocks are freed):
    after the DCP phase about 0.6 x the state's size stays resident otherwise, which the
    node processes then lack.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def sync_disks() -> None:
    # Dirty pages of an earlier step must not be written back inside the next timed one.
    os.sync()


# -- DCP ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    # DCP warns that it runs without a process group: that is the point here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def dcp_writer(path: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter(path, thread_count=2, sync_files=True)


def dcp_save(state: Mapping[str, torch.Tensor], path: Path) -> Window:
    return timed_save(state, dcp_writer(path))


def timed_save(
    state: Mapping[str, torch.Tensor],
    writer: Any,
    pids: Sequence[int] = (),
    checkpoint_id: str | None = None,
) -> Window:
    """``dcp.save`` into ``writer`` (a file system or a storaged writer), timed whole."""
    from torch.distributed.checkpoint.state_dict_saver import save

    sync_disks()
    with _quiet_dcp():
        watch = Stopwatch(pids)
        save(dict(state), storage_writer=writer, checkpoint_id=checkpoint_id, no_dist=True)
        return watch.lap()


def dcp_async_save(state: Mapping[str, torch.Tensor], path: Path) -> tuple[Window, Window]:
    return timed_async_save(state, dcp_writer(path))


def timed_async_save(
    state: Mapping[str, torch.Tensor],
    writer: Any,
    pids: Sequence[int] = (),
    checkpoint_id: str | None = None,
) -> tuple[Window, Window]:
    """(until the state may change again, until the checkpoint is written).

    With ``FileSystemWriter`` (its own stager) ``async_save`` copies the state before it
    returns a future; should it return an ``AsyncSaveResponse`` instead, the state is free
    only once its staging future is done, so that wait counts as blocking too.
    """
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    sync_disks()
    with _quiet_dcp():
        watch = Stopwatch(pids)
        future = async_save(
            dict(state), storage_writer=writer, checkpoint_id=checkpoint_id, no_dist=True
        )
        if isinstance(future, AsyncSaveResponse):
            future.staging_completion.result()
            blocking = watch.lap()
            future.upload_completion.result()
        else:
            blocking = watch.lap()
            future.result()
        return blocking, watch.lap()


def dcp_load(dst: Mapping[str, torch.Tensor], path: Path) -> Window:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return timed_load(dst, FileSystemReader(path))


def timed_load(dst: Mapping[str, torch.Tensor], reader: Any, pids: Sequence[int] = ()) -> Window:
    """``dcp.load`` from ``reader`` into the tensors of ``dst``, timed whole."""
    from torch.distributed.checkpoint.state_dict_loader import load

    with _quiet_dcp():
        watch = Stopwatch(pids)
        load(dict(dst), storage_reader=reader, no_dist=True)
        return watch.lap()


@dataclass
class DcpResult:
    save: list[Window]
    async_blocking: list[Window]
    async_total: list[Window]
    load: list[Window]
    files_bytes: int


def run_dcp(
    state: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec], root: Path, repeat: int
) -> DcpResult:
    import torch

    saves: list[Window] = []
    blocking: list[Window] = []
    totals: list[Window] = []
    for i in range(repeat):
        # Interleaved so that drift on a shared machine hits both kinds of save.
        shutil.rmtree(root / "save", ignore_errors=True)
        saves.append(dcp_save(state, root / "save"))
        path = root / f"async-{i}"
        b, t = dcp_async_save(state, path)
        blocking.append(b)
        totals.append(t)
        shutil.rmtree(path, ignore_errors=True)
        print(f"# DCP round {i + 1}: save {saves[-1].seconds:.2f} s, async_save blocks "
              f"{b.seconds:.2f} s (done after {t.seconds:.2f} s)", flush=True)  # fmt: skip
    files = sum(p.stat().st_size for p in (root / "save").iterdir())
    dst = {s.key: torch.zeros(s.shape, dtype=torch.float32) for s in specs}
    for tensor in dst.values():
        tensor.fill_(0.5)  # touch every page before the timed loads
    dcp_load(dst, root / "save")  # warms the page cache
    if not all(torch.equal(dst[k], v) for k, v in state.items()):
        raise RuntimeError("DCP load gave other bytes than were saved")
    loads = [dcp_load(dst, root / "save") for _ in range(repeat)]
    print(f"# DCP load (warm page cache): {', '.join(f'{w.seconds:.2f}' for w in loads)} s",
          flush=True)  # fmt: skip
    del dst
    shutil.rmtree(root / "save", ignore_errors=True)
    release_freed_memory()
    return DcpResult(saves, blocking, totals, loads, files)


# -- storaged -------------------------------------------------------------------------------------


def node_log_tails(data: Path, nodes: int, lines: int = 20) -> str:
    """The last lines of each node's log (the data dir goes away with the run)."""
    out = []
    for i in range(nodes):
        log = data / f"n{i}" / "node.log"
        with contextlib.suppress(OSError):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log}\n" + "\n".join(tail))
    return "\n".join(out)


def yield_to_oom_killer(pids: Sequence[int], score: int) -> None:
    """Make these processes (ours) the first the kernel kills when the machine runs out of RAM.

    On a shared machine a benchmark holding 10 GiB should be what dies, not someone
    else's work; the nodes get the higher score so that this process survives to stop
    the others and remove their data.
    """
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/oom_score_adj").write_text(f"{score}\n")


@dataclass
class SaveRound:
    name: str
    first: bool
    stall: Window
    ack: Window
    #: from the start of the save until every chunk is on nvme on all its holders (None:
    #: not within the wait limit)
    nvme: Window | None
    #: ... until every chunk is erasure-coded into the cold tier
    cold: Window | None
    uploaded_bytes: int
    skipped_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "first": self.first,
            "stall": self.stall.to_json(),
            "ack": self.ack.to_json(),
            "nvme": None if self.nvme is None else self.nvme.to_json(),
            "cold": None if self.cold is None else self.cold.to_json(),
            "uploaded_bytes": self.uploaded_bytes,
            "skipped_bytes": self.skipped_bytes,
        }


async def _settle(client: Client, name: str, watch: Stopwatch, limit: float) -> tuple[
    Window | None, Window | None
]:  # fmt: skip
    """Wait for ``name`` to reach nvme, then cold: a Window at each (None past ``limit``)."""
    deadline = time.monotonic() + limit
    out: list[Window | None] = []
    for state in ("nvme", "cold"):
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise WaitTimeout("no time left", None)
            await client.wait(name, state, timeout=left)
            out.append(watch.lap())
        except WaitTimeout:
            out.append(None)
    return out[0], out[1]


async def save_round(
    client: Client,
    saver: AsyncSaver,
    name: str,
    state: Mapping[str, Array],
    pids: Sequence[int],
    first: bool,
    settle_limit: float,
) -> SaveRound:
    await asyncio.to_thread(sync_disks)
    up0, skip0 = client.stats.bytes_uploaded, client.stats.bytes_skipped
    watch = Stopwatch(pids)
    handle = await saver.save(name, {0: state})
    stall = watch.lap()
    await handle.acked()
    ack = watch.lap()
    uploaded = client.stats.bytes_uploaded - up0
    skipped = client.stats.bytes_skipped - skip0
    # The next save starts once this one is cold, as one a few minutes of training later
    # would: the background work of one checkpoint is not charged to the next.
    nvme, cold = await _settle(client, name, watch, settle_limit)
    return SaveRound(name, first, stall, ack, nvme, cold, uploaded, skipped)


async def restore_rounds(
    client: Client,
    name: str,
    dst: Mapping[str, Array],
    repeat: int,
    pids: Sequence[int],
) -> list[Window]:
    await restore_checkpoint(client, name, dst)  # untimed: connections, node-side leases
    windows = []
    for _ in range(repeat):
        watch = Stopwatch(pids)
        await restore_checkpoint(client, name, dst)
        windows.append(watch.lap())
    return windows


# -- restore by several processes -----------------------------------------------------------------


def _restore_worker(
    urls: list[str],
    name: str,
    shapes: list[tuple[str, tuple[int, ...]]],
    barrier: Any,
    conn: Connection,
) -> None:
    """Child: preallocate, restore once untimed, wait at the barrier, restore timed, report."""
    arrays: dict[str, Array] = {}
    for key, shape in shapes:
        array: Array = np.empty(shape, dtype=F32)
        array.fill(0)
        arrays[key] = array

    async def run() -> tuple[float, float, float]:
        async with Client(urls, token=TOKEN) as client:
            await restore_checkpoint(client, name, arrays)
            conn.send(("ready",))
            await asyncio.to_thread(barrier.wait, 300)
            cpu0, t0 = time.process_time(), time.perf_counter()
            await restore_checkpoint(client, name, arrays)
            return t0, time.perf_counter(), time.process_time() - cpu0

    try:
        t0, t1, cpu = asyncio.run(run())
        conn.send(("done", t0, t1, cpu, digest_arrays([arrays[k] for k, _ in shapes])))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
        raise


@dataclass
class MultiRestore:
    procs: int
    window: Window
    per_process_seconds: list[float]
    verified: bool


def restore_by_processes(
    urls: list[str],
    name: str,
    groups: Sequence[Sequence[TensorSpec]],
    state: Mapping[str, Array],
    pids: Sequence[int],
    timeout: float = 300.0,
) -> MultiRestore:
    """Each group restored by a process of its own, all at once; wall from first start to
    last end (CLOCK_MONOTONIC is the same clock in every process)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(groups) + 1)
    children = []
    for group in groups:
        mine, theirs = ctx.Pipe()
        shapes = [(s.key, s.shape) for s in group]
        proc = ctx.Process(target=_restore_worker, args=(urls, name, shapes, barrier, theirs),
                           daemon=True)  # fmt: skip
        proc.start()
        children.append((proc, mine))
    try:
        for _, conn in children:
            _expect(conn, "ready", timeout)
        watch = Stopwatch(
            pids
        )  # for the nodes' CPU and the machine's; wall comes from the children
        barrier.wait(timeout)
        replies = [_expect(conn, "done", timeout) for _, conn in children]
        nodes_and_machine = watch.lap()
    finally:
        barrier.abort()  # frees any child still waiting if this side failed
        for proc, _ in children:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    start = min(r[1] for r in replies)
    end = max(r[2] for r in replies)
    verified = all(
        r[4] == digest_arrays([state[s.key] for s in group])
        for r, group in zip(replies, groups, strict=True)
    )
    window = nodes_and_machine
    window.seconds = end - start
    window.client_cpu = sum(r[3] for r in replies)
    return MultiRestore(
        len(groups),
        window,
        [round(r[2] - r[1], 4) for r in replies],
        verified,
    )


def _expect(conn: Connection, what: str, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"restore process sent no {what!r} within {timeout:.0f} s")
    msg: tuple[Any, ...] = conn.recv()
    if msg[0] != what:
        raise RuntimeError(f"restore process failed: {msg[1:]}")
    return msg


# -- the profile ----------------------------------------------------------------------------------


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextlib.contextmanager
def profiled(targets: Mapping[str, int], out_dir: Path, label: str) -> Iterator[dict[str, Path]]:
    """py-spy --native on each ``{name: pid}`` for the body; yields the raw output paths."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy not found (pip install py-spy)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"vs_dcp-profile-{label}-{name}.txt" for name in targets}
    spies = []
    for name, pid in targets.items():
        cmd = [exe, "record", "-p", str(pid), "-o", str(paths[name]), "--format", "raw",
               "-r", str(PROFILE_HZ), "--native"]  # fmt: skip
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        time.sleep(1.0)  # let them attach
        for spy in spies:
            if spy.poll() is not None:
                err = spy.stderr.read().decode(errors="replace") if spy.stderr else ""
                raise RuntimeError(f"py-spy could not attach: {err.strip()[:300]}")
        yield paths
    finally:
        for spy in spies:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for spy in spies:
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10)


def summarize(paths: Mapping[str, Path]) -> dict[str, Any]:
    return {name: {"raw": str(path), **summarize_profile(path)}
            for name, path in paths.items() if path.exists()}  # fmt: skip


# -- the targets (issue 10, section 3): P1-P4 against baselines measured in this run ---------------


def shm_options(colocated: bool) -> dict[str, Any]:
    """``Client`` options of a client on the nodes' host (``colocated``: the shared-memory
    hand-over, ``storaged.client.shm``) or of a remote one (``shm=False``: HTTP only)."""
    return {"shm": colocated}


def memcpy_state(state: Mapping[str, Array], dst: Mapping[str, Array]) -> Window:
    """One thread copying every tensor into buffers that already exist (``dst``, faulted in)."""
    watch = Stopwatch()
    for key, array in state.items():
        np.copyto(dst[key], array)
    return watch.lap()


@dataclass
class Target:
    """One row of the targets table: a storaged figure against a baseline of this run."""

    target: str  # P1, P2, P2r, P3, P3r, P4
    what: str
    seconds: float
    baseline: str
    baseline_s: float
    #: "time": ratio = seconds / baseline_s, must be <= bound; "speed": the inverse, >= bound
    kind: str
    bound: float
    client_cpu_s_per_gb: float
    node_cpu_s_per_gb: list[float]
    #: what the path cannot avoid (copies, hashes, socket hops): the floor its CPU is seen against
    floor: str
    ratio: float = 0.0
    passed: bool = False

    def __post_init__(self) -> None:
        if self.kind == "time":
            self.ratio = self.seconds / self.baseline_s
            self.passed = self.ratio <= self.bound
        else:
            self.ratio = self.baseline_s / self.seconds
            self.passed = self.ratio >= self.bound


def target_row(
    target: str,
    what: str,
    window: Window,
    baseline: str,
    baseline_s: float,
    kind: str,
    bound: float,
    nbytes: int,
    floor: str,
) -> Target:
    gb = nbytes / GB
    return Target(target, what, window.seconds, baseline, baseline_s, kind, bound,
                  window.client_cpu / gb, [c / gb for c in window.node_cpu], floor)  # fmt: skip


def targets_table(rows: Sequence[Target]) -> str:
    head = ("target", "what", "storaged s", "baseline", "baseline s", "ratio", "bound", "verdict",
            "client CPU s/GB", "nodes CPU s/GB")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | --- | ---: | --- |"]  # fmt: skip
    for r in rows:
        bound = f"{'<=' if r.kind == 'time' else '>='} {r.bound:g} x"
        nodes = "/".join(f"{c:.2f}" for c in r.node_cpu_s_per_gb)
        lines.append(
            f"| {r.target} | {r.what} | {r.seconds:.3f} | {r.baseline} | {r.baseline_s:.3f} "
            f"| {r.ratio:.2f} | {bound} | {'pass' if r.passed else 'MISS'} "
            f"| {r.client_cpu_s_per_gb:.2f} | {nodes} |"
        )
    return "\n".join(lines)


@dataclass
class TargetRuns:
    """What the targets need beyond ``run_dcp`` and ``run_storaged``, measured in one run."""

    memcpy: list[Window]
    #: DCP ``async_save`` into storaged (co-located): (stall, until acked) of the first and
    #: of a later save with the same writer
    dcp_async: list[tuple[Window, Window]]
    #: ``dcp.save`` into storaged until acked: co-located, remote
    dcp_save: dict[str, Window]
    #: ``dcp.load`` from the RAM tier: co-located, remote (median of ``repeat``)
    dcp_load: dict[str, Window]
    loopback: dict[str, Any]
    #: ``dcp.load`` with one node killed, every chunk cold only (median of ``repeat``), timed
    #: once repair has rebuilt the dead node's fragments (``repair_s`` after the kill)
    degraded: Window
    repair_s: float
    codec: dict[str, Any]
    verified: bool
    dead_node: int
    ram_tier: dict[str, int]
    #: the parts of the ack's floor measured in this run, and each dcp.save's floor per role
    floor_rates: FloorRates
    floors: dict[str, RoleFloor]


async def _settle_and_check(urls: Sequence[str], name: str, limit: float) -> dict[str, int]:
    async with Client(list(urls), token=TOKEN) as client:
        await _settle(client, name, Stopwatch(), limit)
        return await ram_tier_check(client, name)


async def _save_floor(
    urls: Sequence[str], name: str, rates: FloorRates, *, colocated: bool, nodes: int
) -> RoleFloor:
    """The floor per role of the save of ``name``: each chunk's hot holders are its first
    ``replication`` placement nodes (rendezvous over the live nodes, as the write path placed
    them: no node drained or died since), each chunk handed to n0 in shared memory (the
    client's first seed, on this host) or PUT to its first placement node over HTTP
    (``storaged.client.writes``). Not ``?plan``: by the time this runs, RAM holds a newer
    checkpoint and the older one's hot copies may have gone."""
    async with Client(list(urls), token=TOKEN) as client:
        sizes = check_schema(await client.get_manifest(name)).chunks
        copies = client.cluster.replication
        holders = {cid: client.placement(cid)[:copies] for cid in sizes}

        def entry(cid: str, held: Sequence[str]) -> str:
            return "n0" if colocated else held[0]

        return role_floors(holders, sizes, entry, rates, colocated=colocated,
                           nodes=[f"n{i}" for i in range(nodes)])  # fmt: skip


async def _make_cold_only(urls: Sequence[str], name: str) -> tuple[int, int]:
    """Evict ``name``'s hot copies (it is cold already); the cluster's erasure (k, n)."""
    async with Client(list(urls), token=TOKEN) as client:
        erasure = client.cluster.erasure
        if erasure is None:
            raise RuntimeError("the cluster reports no erasure code")
        await client.wait(name, "cold", timeout=600)
        for level in ("memory", "nvme"):
            await client.evict(name, level, admin_token=ADMIN_TOKEN)
        plan = await client.plan(name)
    hot = [cid for cid, holders in plan.items() if any(h.tier != "cold" for h in holders)]
    if hot:
        raise RuntimeError(f"{len(hot)} chunk(s) of {name} still hot after eviction")
    return erasure.k, erasure.n


async def _wait_repaired(urls: Sequence[str], name: str, limit: float) -> float:
    """Seconds until checkpoint ``name`` has every chunk's ``n`` fragments again on the live
    nodes (``?status``: ``under_replicated`` and ``lost`` both 0, extension E7) and no live
    node has repair or rebalance work left (``/v1/cluster`` backlogs 0), twice in a row: P4
    times the restore, not the repair or the moves of the dead node's fragments beside it.
    ``TimeoutError`` after ``limit`` seconds."""
    import aiohttp

    started = time.monotonic()
    calm = 0
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        while time.monotonic() - started < limit:
            url = f"{urls[calm % len(urls)]}/v1/checkpoints/{name}?status"
            async with session.get(url) as resp:
                doc = await resp.json() if resp.status == 200 else {}
            repaired = doc.get("under_replicated") == 0 and doc.get("lost") == 0
            if repaired:
                # Placement changed with the death: the live nodes also move fragments to
                # where the new membership puts them (rebalance, paced). Those moves read,
                # send and write fragments, so a restore timed beside them measures them too.
                async with session.get(f"{urls[calm % len(urls)]}/v1/cluster") as resp:
                    cdoc = await resp.json() if resp.status == 200 else {}
                live = [e for e in cdoc.get("nodes", []) if e.get("alive")]
                repaired = bool(live) and all(
                    not e.get("repair_backlog") and not e.get("misplaced_backlog") for e in live
                )
            calm = calm + 1 if repaired else 0
            if calm >= 2:
                return time.monotonic() - started
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{name} not repaired within {limit:.0f} s of the node's death")


def run_targets(
    cluster: LocalCluster,
    torch_state: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    args: argparse.Namespace,
    tag: str,
) -> TargetRuns:
    """DCP's own front end into storaged (``StoragedWriter``/``StoragedReader``), the
    baselines the targets name, and last a degraded restore: this kills a node."""
    import torch

    from storaged.client.dcp import StoragedReader, StoragedWriter

    pids = node_pids(cluster)
    urls = cluster.urls
    nbytes = sum(s.nbytes for s in specs)
    state = {k: v.numpy() for k, v in torch_state.items()}
    dst_np = prefaulted(specs)
    memcpy = [memcpy_state(state, dst_np) for _ in range(args.repeat)]
    del dst_np
    print(f"# memcpy into reused buffers: {', '.join(f'{w.seconds:.3f}' for w in memcpy)} s",
          flush=True)  # fmt: skip

    def settle(name: str) -> dict[str, int]:
        return _run_async(_settle_and_check(urls, name, args.settle_limit))

    # P1: DCP async_save into storaged, a fresh writer and then the same one again.
    writer = StoragedWriter(urls, f"{tag}/dcp-async-0", TOKEN, client_options=shm_options(True))
    dcp_async = []
    for r in range(2):
        training_step(torch_state)
        name = f"{tag}/dcp-async-{r}"
        dcp_async.append(timed_async_save(torch_state, writer, pids, checkpoint_id=name))
        settle(name)
        print(f"# DCP async_save into storaged ({'first' if r == 0 else 'again'}): stall "
              f"{dcp_async[-1][0].seconds:.2f} s, acked after {dcp_async[-1][1].seconds:.2f} s",
              flush=True)  # fmt: skip
    # P2, P2r: dcp.save until acked. The co-located one saves last: its checkpoint is the
    # one loaded below (both are fresh bytes; RAM holds the newest checkpoint), as a job
    # restarted in place loads what it saved through its own host's node.
    dcp_save: dict[str, Window] = {}
    saved: dict[str, str] = {}
    name = ""
    for variant in ("remote", "co-located"):
        training_step(torch_state)
        name = f"{tag}/dcp-save-{variant}"
        options = shm_options(variant == "co-located")
        dcp_save[variant] = timed_save(
            torch_state, StoragedWriter(urls, name, TOKEN, client_options=options), pids
        )
        ram = settle(name)
        saved[variant] = name
        print(f"# dcp.save into storaged ({variant}): {dcp_save[variant].seconds:.2f} s",
              flush=True)  # fmt: skip
    # P3, P3r: dcp.load from RAM, one untimed load first (as DCP's warm page cache).
    dst = {s.key: torch.zeros(s.shape, dtype=torch.float32) for s in specs}
    for tensor in dst.values():
        tensor.fill_(0.5)
    dcp_load: dict[str, Window] = {}
    verified = True
    for variant in ("co-located", "remote"):
        options = shm_options(variant == "co-located")
        reader = StoragedReader(urls, name, TOKEN, client_options=options)
        timed_load(dst, reader)
        loads = [timed_load(dst, reader, pids) for _ in range(args.repeat)]
        dcp_load[variant] = median_window(loads)
        verified = verified and all(torch.equal(dst[k], v) for k, v in torch_state.items())
        print(f"# dcp.load from RAM ({variant}): {', '.join(f'{w.seconds:.2f}' for w in loads)}"
              " s", flush=True)  # fmt: skip
    loopback = raw_loopback(nbytes, DEFAULT_CHUNK_SIZE, 4)
    print(f"# raw loopback, 4 streams: {loopback['gbps']:.2f} GB/s", flush=True)
    sample = state[specs[0].key].reshape(-1).view(np.uint8)[:DEFAULT_CHUNK_SIZE].tobytes()
    copy_s_per_gb = median_window(memcpy).seconds / (nbytes / GB)
    rates = measure_rates(sample, copy_s_per_gb, loopback)
    floors = {
        variant: _run_async(_save_floor(urls, saved_name, rates,
                                        colocated=variant == "co-located", nodes=cluster.nodes))
        for variant, saved_name in saved.items()
    }  # fmt: skip
    # P4: every chunk cold only, one node killed, dcp.load through the survivors.
    k, n = _run_async(_make_cold_only(urls, name))
    dead = cluster.nodes - 1
    cluster.kill(dead)
    live = [url for i, url in enumerate(urls) if i != dead]
    live_pids = [pid for i, pid in enumerate(pids) if i != dead]
    repaired = _run_async(_wait_repaired(live, name, args.settle_limit))
    print(f"# n{dead} killed; its fragments rebuilt elsewhere after {repaired:.1f} s", flush=True)
    for tensor in dst.values():
        tensor.fill_(0.5)
    reader = StoragedReader(live, name, TOKEN, client_options=shm_options(False))
    degraded = [timed_load(dst, reader, live_pids) for _ in range(args.repeat)]
    verified = verified and all(torch.equal(dst[k], v) for k, v in torch_state.items())
    print(f"# dcp.load, node n{dead} dead, cold only: "
          f"{', '.join(f'{w.seconds:.2f}' for w in degraded)} s", flush=True)  # fmt: skip
    codec = codec_rates(sample, k, n)
    return TargetRuns(memcpy, dcp_async, dcp_save, dcp_load, loopback,
                      median_window(degraded), repaired, codec, verified, dead, ram,
                      rates, floors)  # fmt: skip


def build_targets(
    nbytes: int, dcp: DcpResult, store: StoragedResult, runs: TargetRuns
) -> list[Target]:
    """The six targets of issue 10, each against its baseline from this run (P4 twice: one
    thread of raw decode, and every core)."""
    steady = [s for s in store.saves if not s.first] or store.saves
    memcpy = median_window(runs.memcpy).seconds
    disk_async = median_window(dcp.async_blocking).seconds
    disk_save = median_window(dcp.save).seconds
    disk_load = median_window(dcp.load).seconds
    loopback_s = nbytes / GB / runs.loopback["gbps"]
    decode_s = nbytes / GB / runs.codec["decode_raw_gbps"]
    decode_all_s = nbytes / GB / runs.codec["decode_raw_all_cores_gbps"]
    stage = "1 copy into staging (the memcpy itself)"
    ack = "BLAKE3 once, 3 socket hops (client->node, node->2 peers), 3 RAM copies"
    ack_shm = "1 copy into leased node memory, BLAKE3 once, 2 socket hops (node->2 peers)"
    degraded = "k fragments over 1 socket hop each, CRC-32C, decode, BLAKE3, 1 copy"
    rows: list[Target] = []
    stalls = [
        ("AsyncSaver.save stall, first save", store.saves[0].stall),
        *(
            [("AsyncSaver.save stall, first after prepare()", store.prepared.stall)]
            if store.prepared is not None
            else []
        ),
        ("AsyncSaver.save stall, steady", median_window([s.stall for s in steady])),
        ("DCP async_save into storaged stall, first", runs.dcp_async[0][0]),
        ("DCP async_save into storaged stall, again", runs.dcp_async[-1][0]),
    ]
    for what, window in stalls:
        rows.append(target_row("P1", what, window, "memcpy into reused buffers", memcpy,
                               "time", 1.5, nbytes, stage))  # fmt: skip
        rows.append(target_row("P1", what, window, "DCP async_save to disk", disk_async,
                               "time", 0.3, nbytes, stage))  # fmt: skip
    rows += [
        target_row("P2", "dcp.save until acked, co-located", runs.dcp_save["co-located"],
                   "DCP save, FileSystemWriter", disk_save, "time", 1.0, nbytes, ack_shm),
        target_row("P2r", "dcp.save until acked, remote (HTTP)", runs.dcp_save["remote"],
                   "DCP save, FileSystemWriter", disk_save, "time", 1.5, nbytes, ack),
        target_row("P3", "dcp.load from RAM, co-located", runs.dcp_load["co-located"],
                   "DCP load, warm page cache", disk_load, "speed", 5.0, nbytes,
                   "1 copy out of node memory"),
        target_row("P3r", "dcp.load from RAM, remote (HTTP)", runs.dcp_load["remote"],
                   "DCP load, warm page cache", disk_load, "speed", 2.0, nbytes,
                   "1 socket hop (node->client), 1 copy into the tensors"),
        target_row("P3r", "dcp.load from RAM, remote (HTTP)", runs.dcp_load["remote"],
                   "raw loopback, 4 streams", loopback_s, "speed", 0.6, nbytes,
                   "1 socket hop (node->client), 1 copy into the tensors"),
        target_row("P4", f"dcp.load, node n{runs.dead_node} dead, cold only", runs.degraded,
                   "raw zfec decode, 1 thread", decode_s, "speed", 0.8, nbytes, degraded),
        # The same restore against the decode on every core: what decoding several chunks
        # at once on threads could reach, the nodes' share of the cores aside.
        target_row("P4", f"dcp.load, node n{runs.dead_node} dead, cold only", runs.degraded,
                   f"raw zfec decode, {runs.codec['cores']} threads (all cores)", decode_all_s,
                   "speed", 0.8, nbytes, degraded),
    ]  # fmt: skip
    return rows


def floor_summary(nbytes: int, runs: TargetRuns) -> str:
    """P2 and P2r: the CPU each role spent per acked GB against its floor (issue 20 §1)."""
    gb = nbytes / GB
    rows = []
    for target, variant in (("P2", "co-located"), ("P2r", "remote")):
        if variant not in runs.floors:
            continue
        window = runs.dcp_save[variant]
        node_cpu = {f"n{i}": c for i, c in enumerate(window.node_cpu)}
        rows.append((f"{target} {variant}", gb, runs.floors[variant], window.client_cpu, node_cpu))
    rates = ", ".join(f"{k} {v:.3f}" for k, v in runs.floor_rates.to_json().items())
    return (f"# the ack's CPU per role against its floor (parts measured in this run, CPU s/GB "
            f"on one thread: {rates}):\n{floor_table(rows)}")  # fmt: skip


# -- the run --------------------------------------------------------------------------------------


@dataclass
class StoragedResult:
    memory_per_node: int
    saves: list[SaveRound]
    ram_tier: dict[str, int]
    restores: list[Window]
    restore_verified: bool
    multi: MultiRestore | None
    profile: dict[str, Any]
    #: the first save of a new saver whose buffers ``AsyncSaver.prepare`` faulted in
    prepared: SaveRound | None = None


async def run_storaged(
    cluster: LocalCluster,
    torch_state: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    args: argparse.Namespace,
    memory: int,
) -> StoragedResult:
    pids = node_pids(cluster)
    state: dict[str, Array] = {k: v.numpy() for k, v in torch_state.items()}
    tag = f"vsdcp-{os.getpid()}"
    saves: list[SaveRound] = []
    async with Client(cluster.urls, token=TOKEN, **shm_options(True)) as client:
        saver = AsyncSaver(client)
        for r in range(args.rounds + 1):
            if r:
                await asyncio.to_thread(training_step, torch_state)
            done = await save_round(client, saver, f"{tag}/step-{r}", state, pids, r == 0,
                                    args.settle_limit)  # fmt: skip
            saves.append(done)
            print(f"# storaged save {r} ({'first' if r == 0 else 'steady'}): stall "
                  f"{done.stall.seconds:.2f} s, ack {done.ack.seconds:.2f} s, nvme "
                  f"{_fmt(done.nvme)}, cold {_fmt(done.cold)}", flush=True)  # fmt: skip
        await saver.aclose()
        del saver  # its staging buffers: memory the restores below need
        # A new saver prepared at "start-up" (untimed), then its first save.
        fresh = AsyncSaver(client)
        await fresh.prepare({0: state})
        await asyncio.to_thread(training_step, torch_state)
        prepared = await save_round(client, fresh, f"{tag}/prepared", state, pids, True,
                                    args.settle_limit)  # fmt: skip
        print(
            f"# storaged save after prepare() (first of a new saver): stall "
            f"{prepared.stall.seconds:.2f} s, ack {prepared.ack.seconds:.2f} s",
            flush=True,
        )
        await fresh.aclose()
        del fresh
        name = prepared.name
        ram = await ram_tier_check(client, name)
        dst = prefaulted(specs)
        restores = await restore_rounds(client, name, dst, args.repeat, pids)
        verified = all(np.array_equal(dst[k], v) for k, v in state.items())
        print(f"# storaged restore, 1 process: {', '.join(f'{w.seconds:.2f}' for w in restores)}"
              f" s (bytes {'match' if verified else 'DIFFER'})", flush=True)  # fmt: skip
        del dst
        multi = None
        if args.restore_procs > 1:
            groups = [g for g in split_keys(specs, args.restore_procs) if g]
            multi = await asyncio.to_thread(
                restore_by_processes, cluster.urls, name, groups, state, pids
            )
            print(f"# storaged restore, {multi.procs} processes: {multi.window.seconds:.2f} s "
                  f"(bytes {'match' if multi.verified else 'DIFFER'})", flush=True)  # fmt: skip
        profile: dict[str, Any] = {"ran": False, "available": py_spy() is not None}
        if args.profile and profile["available"]:
            profile.update(await profile_rounds(client, cluster, torch_state, state, specs,
                                                tag, args))  # fmt: skip
    return StoragedResult(memory, saves, ram, restores, verified, multi, profile, prepared)


async def profile_rounds(
    client: Client,
    cluster: LocalCluster,
    torch_state: Mapping[str, torch.Tensor],
    state: Mapping[str, Array],
    specs: Sequence[TensorSpec],
    tag: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One more save (to the ack) and one more restore under py-spy: where the time goes."""
    pids = node_pids(cluster)
    targets = {"client": os.getpid(), "n0": pids[0]}
    out_dir = args.out.parent
    await asyncio.to_thread(training_step, torch_state)
    name = f"{tag}/profiled"
    async with AsyncSaver(client) as saver:
        await saver.save(f"{tag}/profile-warmup", {0: state})  # staging buffers exist
        await saver.aclose()
        await _settle(client, f"{tag}/profile-warmup", Stopwatch(), args.settle_limit)
        await asyncio.to_thread(training_step, torch_state)
        with profiled(targets, out_dir, "save") as save_paths:
            watch = Stopwatch(pids)
            handle = await saver.save(name, {0: state})
            await handle.acked()
            save_window = watch.lap()
    await _settle(client, name, Stopwatch(), args.settle_limit)
    dst = prefaulted(specs)
    await restore_checkpoint(client, name, dst)
    with profiled(targets, out_dir, "restore") as restore_paths:
        watch = Stopwatch(pids)
        await restore_checkpoint(client, name, dst)
        restore_window = watch.lap()
    return {
        "ran": True,
        "hz": PROFILE_HZ,
        "save_to_ack": {"window": save_window.to_json(), **summarize(save_paths)},
        "restore": {"window": restore_window.to_json(), **summarize(restore_paths)},
    }


def _fmt(window: Window | None) -> str:
    return "not reached" if window is None else f"{window.seconds:.1f} s"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass
class Metric:
    metric: str
    storaged_s: float
    dcp_s: float
    #: time ratio (storaged / DCP) or speed ratio (DCP / storaged), as ``better`` says
    ratio: float
    target: str
    passed: bool | None
    storaged_gbps: float
    dcp_gbps: float
    #: CPU seconds per GB moved, all our processes (client and nodes; DCP: this process)
    storaged_cpu_s_per_gb: float
    dcp_cpu_s_per_gb: float
    limit: str


def _limit_text(window: Window, what: str) -> str:
    nodes = sum(window.node_cpu)
    return (f"{what}; CPU {window.client_cpu:.2f} s client + {nodes:.2f} s nodes over "
            f"{window.seconds:.2f} s = {window.busy() * 100:.0f} % of {CORES} cores; machine "
            f"{window.machine_busy * 100:.0f} % busy, {window.machine_iowait * 100:.0f} % "
            "iowait")  # fmt: skip


def build_metrics(
    nbytes: int, dcp: DcpResult, store: StoragedResult, copy: Mapping[str, float]
) -> list[Metric]:
    gb = nbytes / GB
    steady = [s for s in store.saves if not s.first] or store.saves
    first = store.saves[0]
    stall = median_window([s.stall for s in steady])
    ack = median_window([s.ack for s in steady])
    d_save = median_window(dcp.save)
    d_block = median_window(dcp.async_blocking)
    d_load = median_window(dcp.load)
    restore = median_window(store.restores)

    def time_metric(name: str, mine: Window, theirs: Window, target: float | None,
                    limit: str) -> Metric:  # fmt: skip
        ratio = mine.seconds / theirs.seconds
        return Metric(name, mine.seconds, theirs.seconds, ratio,
                      "-" if target is None else f"time <= {target:g} x",
                      None if target is None else ratio <= target,
                      gb / mine.seconds, gb / theirs.seconds, mine.cpu / gb, theirs.cpu / gb,
                      limit)  # fmt: skip

    def speed_metric(name: str, mine: Window, theirs: Window, target: float | None,
                     limit: str) -> Metric:  # fmt: skip
        ratio = theirs.seconds / mine.seconds
        return Metric(name, mine.seconds, theirs.seconds, ratio,
                      "-" if target is None else f"speed >= {target:g} x",
                      None if target is None else ratio >= target,
                      gb / mine.seconds, gb / theirs.seconds, mine.cpu / gb, theirs.cpu / gb,
                      limit)  # fmt: skip

    copy_note = (f"one thread copying into staging at {gb / stall.seconds:.2f} GB/s "
                 f"(memcpy here: {copy['warm_gbps']:.2f} GB/s warm, "
                 f"{copy['fresh_gbps']:.2f} GB/s into fresh pages)")  # fmt: skip
    metrics = [
        time_metric("stall (save returns, steady)", stall, d_block, 0.5,
                    _limit_text(stall, copy_note)),
        time_metric("ack (RAM x3 + commit, steady)", ack, d_save, 1.0,
                    _limit_text(ack, "hash + 3 copies over loopback + drain starting")),
        speed_metric("restore from RAM, 1 process", restore, d_load, 2.0,
                     _limit_text(restore, "HTTP GETs into the arrays")),
        time_metric("stall, first save (no buffers yet)", first.stall, d_block, None,
                    _limit_text(first.stall, "staging buffer allocated and faulted in")),
        time_metric("ack, first save", first.ack, d_save, None,
                    _limit_text(first.ack, "node buffers mapped fresh")),
    ]  # fmt: skip
    if store.multi is not None:
        multi = store.multi.window
        label = f"restore from RAM, {store.multi.procs} processes"
        note = _limit_text(multi, "HTTP GETs, one client per process")
        metrics.append(speed_metric(label, multi, d_load, None, note))
    durable = [s.nvme for s in steady if s.nvme is not None]
    if durable:
        drained = median_window(durable)
        metrics.append(time_metric("durable: nvme x3 fsynced (steady)", drained, d_save, None,
                                   _limit_text(drained, "drain: disk writes + fsync")))  # fmt: skip
    limits_dcp = {
        "save": _limit_text(d_save, "DCP save: disk write + fsync"),
        "async_save": _limit_text(d_block, "DCP async_save: fresh CPU copy + plan"),
        "load": _limit_text(d_load, "DCP load: page cache read + deserialize + copy"),
    }
    for m in metrics:
        kind = ("async_save" if m.metric.startswith("stall") else
                "load" if m.metric.startswith("restore") else "save")  # fmt: skip
        m.limit += f" | {limits_dcp[kind]}"
    return metrics


def table(metrics: Sequence[Metric]) -> str:
    head = ("metric", "storaged s", "DCP s", "ratio", "target", "pass", "storaged GB/s",
            "DCP GB/s", "storaged CPU s/GB", "DCP CPU s/GB")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * 3 + " --- | --- |"
             + " ---: |" * 4]  # fmt: skip
    for m in metrics:
        verdict = "-" if m.passed is None else ("pass" if m.passed else "FAIL")
        lines.append(
            f"| {m.metric} | {m.storaged_s:.3f} | {m.dcp_s:.3f} | {m.ratio:.2f} | {m.target} "
            f"| {verdict} | {m.storaged_gbps:.2f} | {m.dcp_gbps:.2f} "
            f"| {m.storaged_cpu_s_per_gb:.2f} | {m.dcp_cpu_s_per_gb:.2f} |"
        )
    return "\n".join(lines)


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def parse_size(text: str) -> int:
    """``2GiB``, ``64MiB``, ``512k`` or a bare number of GiB -> bytes, rounded down to a
    multiple of 4; argparse's error below 1 MiB or for anything else."""
    units = {"k": 1 << 10, "m": MiB, "g": GiB}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t) * GiB
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a size like 2GiB or 64MiB, not {text!r}") from None
    nbytes = int(value) // 4 * 4
    if nbytes < 1 * MiB:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 MiB")
    return nbytes


def _kib_list(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(float(v) * 1024) // 4 * 4 for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"want KiB sizes like 64,256,1024, not {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.vs_dcp", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--size", type=parse_size,
                        help="state dict size, e.g. 2GiB (default; a bare number is GiB), "
                        "64MiB with --quick")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 64 MiB, 1 repeat, 1 steady save, no profile")  # fmt: skip
    parser.add_argument("--repeat", type=int, help="timed repeats of DCP runs and of restores "
                        "(median reported; default 3, 1 with --quick)")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        help="steady storaged saves after the first (default 3, 1 with --quick)",
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument(
        "--small-kib",
        type=_kib_list,
        default=DEFAULT_SMALL,
        help="KiB sizes of the small tensors (default 64,256,1024,4096)",
    )
    parser.add_argument("--restore-procs", type=int, default=4,
                        help="processes restoring a share of the keys each (0: skip)")  # fmt: skip
    parser.add_argument(
        "--settle-limit",
        type=float,
        default=600.0,
        help="seconds to wait for a checkpoint to go cold before the next step",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more save and restore under py-spy (client and node n0)",
    )
    parser.add_argument("--dir", type=Path, default=None,
                        help="where DCP files and the cluster's data go (local disk; default "
                        "the system temp dir)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="run even if RAM looks too short")
    parser.add_argument("--out", type=Path, default=RESULTS / "vs_dcp.json")
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = 64 * MiB if args.quick else 2 * GiB
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.quick:
        args.profile = False
    if args.repeat < 1 or args.rounds < 1 or args.nodes < 3 or args.restore_procs < 0:
        parser.error("--repeat and --rounds must be >= 1, --nodes >= 3, --restore-procs >= 0")
    try:
        import torch
    except ImportError:
        print("loadtest.vs_dcp needs torch (pip install -e '.[torch]')", file=sys.stderr)
        return 2

    specs = state_layout(args.size, args.small_kib)
    nbytes = sum(s.nbytes for s in specs)
    memory = memory_per_node(nbytes, args.nodes)
    # source + staging (or DCP's copy, or restore arrays) + the nodes' RAM tiers, at most
    need = 2 * nbytes + args.nodes * memory + 512 * MiB
    available = mem_available()
    if available and available < need and not args.force:
        print(
            f"# not enough free RAM: about {need / GiB:.1f} GiB needed, "
            f"{available / GiB:.1f} GiB available (--force to run anyway)",
            file=sys.stderr,
        )
        return 3
    command = "python -m loadtest.vs_dcp " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}".rstrip(), flush=True)
    load_before = os.getloadavg()
    torch.set_num_threads(CORES)
    yield_to_oom_killer([os.getpid()], 500)

    t_gen = time.perf_counter()
    torch_state = make_state(specs)
    counts = {
        kind: sum(1 for s in specs if s.kind == kind) for kind in ("large", "medium", "small")
    }
    print(f"# state dict: {len(specs)} float32 tensors, {nbytes / GiB:.3f} GiB ({counts}), made "
          f"in {time.perf_counter() - t_gen:.1f} s; {CORES} CPUs, load {load_before[0]:.1f}",
          flush=True)  # fmt: skip
    copy = memcpy_reference(min(nbytes, 256 * MiB))

    root = Path(tempfile.mkdtemp(prefix="storaged-vs-dcp-", dir=args.dir))
    cluster: LocalCluster | None = None
    try:
        dcp = run_dcp(torch_state, specs, root / "dcp", args.repeat)
        load_between = os.getloadavg()
        # The nodes fill their RAM tiers and the client adds a staging copy: check again,
        # other work on the machine may have grown meanwhile.
        need = args.nodes * memory + nbytes + 256 * MiB
        if not args.force and 0 < mem_available() < need:
            raise SystemExit(
                f"not enough free RAM for the cluster: {need / GiB:.1f} GiB needed, "
                f"{mem_available() / GiB:.1f} GiB available (--force to run anyway)"
            )
        # P4 kills a node and times the restore once its fragments are rebuilt elsewhere: a
        # node down for less than gone_after (600 s by default) would be waited for instead.
        # Started from the main thread: if this process is killed (a test's timeout), its
        # nodes go with it.
        cluster = start_cluster(
            root / "cluster", args.nodes, memory, {"gone_after": 2.0}, die_with_parent=True
        )
        yield_to_oom_killer(node_pids(cluster), 900)
        store = _run_async(run_storaged(cluster, torch_state, specs, args, memory))
        # Last: its degraded restore kills a node.
        runs = run_targets(cluster, torch_state, specs, args, f"vsdcp-{os.getpid()}")
    except BaseException:
        print(node_log_tails(root / "cluster", args.nodes), file=sys.stderr)
        raise
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

    metrics = build_metrics(nbytes, dcp, store, copy)
    print(table(metrics))
    for m in metrics:
        print(f"# {m.metric}: {m.limit}")
    if store.profile.get("ran"):
        for step in ("save_to_ack", "restore"):
            for proc in ("client", "n0"):
                summary = store.profile[step].get(proc)
                if not summary:
                    continue
                print(f"# py-spy {step}, {proc} ({summary['samples']} busy samples):")
                for name, share in list(summary["categories"].items())[:6]:
                    print(f"#   {share * 100:5.1f} %  {name}")
    elif args.profile:
        print("# no profile: py-spy not found (pip install py-spy)")
    targets = build_targets(nbytes, dcp, store, runs)
    print(f"# targets (issue 10), load average {os.getloadavg()[0]:.1f} "
          f"(before the run {load_before[0]:.1f}); nodes' CPU s/GB as n0/n1/...:")  # fmt: skip
    print(targets_table(targets))
    for t in targets:
        if not t.passed:
            print(f"# {t.target} missed ({t.what} vs {t.baseline}): floor is {t.floor}")
    print(floor_summary(nbytes, runs))

    result = {
        "command": command,
        "machine": {"cpus": CORES, "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__,
                    "loadavg_before": load_before, "loadavg_between": load_between,
                    "loadavg_after": os.getloadavg(),
                    "mem_available_gib": round(available / GiB, 1)},
        "settings": {"bytes": nbytes, "tensors": len(specs), "mix": counts,
                     "small_tensor_bytes": list(args.small_kib),
                     "nodes": args.nodes, "memory_per_node": store.memory_per_node,
                     "chunk_size": DEFAULT_CHUNK_SIZE, "repeat": args.repeat,
                     "rounds": args.rounds, "restore_procs": args.restore_procs,
                     "dcp_writer": {"thread_count": 2, "sync_files": True}},
        "reference": {"memcpy": copy},
        "dcp": {"save": [w.to_json() for w in dcp.save],
                "async_save_blocking": [w.to_json() for w in dcp.async_blocking],
                "async_save_total": [w.to_json() for w in dcp.async_total],
                "load_warm": [w.to_json() for w in dcp.load],
                "files_bytes": dcp.files_bytes},
        "storaged": {"saves": [s.to_json() for s in store.saves],
                     "prepared": None if store.prepared is None else store.prepared.to_json(),
                     "ram_tier": store.ram_tier,
                     "restore": [w.to_json() for w in store.restores],
                     "restore_verified": store.restore_verified,
                     "restore_procs": None if store.multi is None else {
                         "procs": store.multi.procs, "window": store.multi.window.to_json(),
                         "per_process_seconds": store.multi.per_process_seconds,
                         "verified": store.multi.verified}},
        "metrics": [asdict(m) for m in metrics],
        "targets": [asdict(t) for t in targets],
        "target_runs": {
            "memcpy": [w.to_json() for w in runs.memcpy],
            "dcp_async_save": [{"stall": b.to_json(), "acked": t.to_json()}
                               for b, t in runs.dcp_async],
            "dcp_save": {k: w.to_json() for k, w in runs.dcp_save.items()},
            "dcp_load": {k: w.to_json() for k, w in runs.dcp_load.items()},
            "loopback": runs.loopback,
            "degraded": {"window": runs.degraded.to_json(), "dead_node": runs.dead_node,
                         "repair_s": round(runs.repair_s, 1)},
            "codec": runs.codec,
            "floor_rates_cpu_s_per_gb": runs.floor_rates.to_json(),
            "floors": {k: f.to_json() for k, f in runs.floors.items()},
            "ram_tier": runs.ram_tier,
            "verified": runs.verified,
            "client_options": {"co-located": shm_options(True), "remote": shm_options(False)},
        },
        "profile": store.profile,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"# results: {args.out}")
    ok = store.restore_verified and (store.multi is None or store.multi.verified) and runs.verified
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
