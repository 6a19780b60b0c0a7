"""What this machine does without storaged, measured in the same run as storaged: raw
loopback and peer-protocol transfers, raw zfec and the codec wrapper, raw durable file
writes (``raw_write_one``: temp file, write, fsync, rename, fsync of the directory) and
PyTorch DCP's own save and load (``DcpSave``, ``dcp_warm_up``). ``raw_baselines`` runs the
set ``restore`` and ``save`` compare against; ``complete_baselines`` checks it is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import zfec

from erasure import Codec, make_codec
from erasure.zfec_codec import block_size
from loadtest.harness.checkpoint import ROW_BYTES, Layout, chunk_pieces
from loadtest.harness.loopback import Clients, Plan, run_round, serve
from loadtest.harness.machine import GB, new_loop
from loadtest.harness.workers import Prepared
from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.ids import chunk_id_of
from tiers._durable import fsync_dir


def raw_loopback(nbytes: int, chunk: int, streams: int, loop: str = "uvloop") -> dict[str, Any]:
    """``loadtest.peer``'s raw mode: ``streams`` asyncio connections into a sink process.

    The floor of any transfer over loopback here: no framing, no copies but the kernel's.
    The bytes flow from this process to the sink (the two directions cost the same on
    loopback). Returns gbps, seconds, bytes and CPU seconds per GB of both ends.
    """
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=serve, args=("raw", loop, chunk, streams + 2, False, theirs), daemon=True
    )
    proc.start()
    theirs.close()
    try:
        if not mine.poll(60):
            raise RuntimeError("raw loopback sink did not start")
        port = int(mine.recv())
        plan = Plan(chunk, 256 << 10, max(1, nbytes // chunk // streams), streams, 1 << 20)

        async def measure() -> Any:
            clients = Clients(plan, {"raw": port}, os.urandom(chunk))
            try:
                await run_round(clients, "raw", mine, 1)  # warm-up: connections, first touch
                return await run_round(clients, "raw", mine, plan.chunks_per_stream)
            finally:
                await clients.close()

        with asyncio.Runner(loop_factory=lambda: new_loop(loop)) as runner:
            rnd = runner.run(measure())
    finally:
        with contextlib.suppress(OSError):
            mine.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        mine.close()
    gb = plan.nbytes / GB
    return {
        "concurrency": streams,
        "bytes": plan.nbytes,
        "seconds": round(rnd.seconds, 4),
        "gbps": round(gb / rnd.seconds, 4),
        "client_cpu_s_per_gb": round(rnd.client_cpu / gb, 4),
        "server_cpu_s_per_gb": round(rnd.server_cpu / gb, 4),
    }


def codec_rates(data: bytes, k: int, n: int, rounds: int = 5) -> dict[str, Any]:
    """``loadtest.codec``'s raw zfec and the ``erasure`` wrapper on one chunk, best of rounds.

    GB/s of chunk bytes, one thread: encode, and decode with fragment 0 missing (a real
    reconstruction, what a degraded cold read does); and that raw decode on every core of
    the machine at once (``decode_raw_all_cores_gbps``, ``cores`` threads, best of three times
    as many rounds).
    """
    raw = raw_zfec_ops(data, k, n)
    wrapped = wrapper_ops(make_codec("zfec", k, n), data)
    out: dict[str, Any] = {"codec": "zfec", "k": k, "n": n, "chunk_bytes": len(data)}
    for label, op in (("encode", "encode"), ("decode", "decode missing #0")):
        for side, fns in (("raw", raw), ("wrapper", wrapped)):
            fn = fns[op]
            fn()  # warm-up: first-touch page faults, lazy tables
            best = math.inf
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[f"{label}_{side}_gbps"] = round(len(data) / best / GB, 4)
    cores = os.cpu_count() or 1
    out["cores"] = cores
    # Three times the rounds: a round needs every core free at once, rarer on a shared machine.
    out["decode_raw_all_cores_gbps"] = raw_decode_on_threads(data, k, n, cores, 3 * rounds)
    return out


def raw_decode_on_threads(
    data: bytes, k: int, n: int, threads: int, rounds: int = 5, per_thread: int = 1
) -> float:
    """GB/s of chunk bytes of raw zfec decode with fragment 0 missing (``raw_zfec_ops``) on
    ``threads`` threads at once, each decoding ``per_thread`` times with its own decoder and
    blocks (zfec releases the GIL while it codes), best of ``rounds``: the machine's decode
    rate, where ``codec_rates``' ``decode_raw_gbps`` is one thread's. One decode per thread
    and round by default, as the one-thread figure is the best of single decodes: a longer
    round is likelier to meet another process on this shared machine."""
    decodes = [raw_zfec_ops(data, k, n)["decode missing #0"] for _ in range(threads)]

    def work(decode: Callable[[], object]) -> None:
        for _ in range(per_thread):
            decode()

    best = math.inf
    with ThreadPoolExecutor(threads, thread_name_prefix="raw-decode") as pool:
        list(pool.map(lambda decode: decode(), decodes))  # warm-up: threads, first touch
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(work, decodes))
            best = min(best, time.perf_counter() - t0)
    return round(threads * per_thread * len(data) / best / GB, 4)


def raw_baselines(
    layout: Layout, chunk: int, levels: Sequence[int], loop: str, k: int, n: int
) -> dict[str, Any]:
    """``raw_loopback`` of the layout's bytes at each of ``levels`` streams, and ``codec_rates``
    (zfec ``k``/``n``) of one chunk of the layout: ``{"raw_loopback": [...], "codec": {...}}``."""
    loopback = [raw_loopback(layout.nbytes, chunk, c, loop) for c in levels]
    sample = np.empty((chunk // ROW_BYTES, ROW_BYTES // 4), dtype=np.float32)
    layout.fill(0, 0, sample)
    return {"raw_loopback": loopback, "codec": codec_rates(sample.tobytes(), k, n)}


def complete_baselines(baselines: dict[str, Any], kinds: Iterable[str]) -> None:
    """Empty rows for each of ``kinds`` not measured (``--no-baselines``, no torch), and an
    empty ``codec``: ratios and tables then read every kind alike."""
    for kind in kinds:
        baselines.setdefault(kind, [])
    baselines.setdefault("codec", {})


def _zfec_primaries(data: bytes, k: int) -> tuple[memoryview | bytes, ...]:
    size = block_size(len(data), k)
    view = memoryview(data)
    blocks: list[memoryview | bytes] = [view[i * size : (i + 1) * size] for i in range(k - 1)]
    tail = bytes(view[(k - 1) * size :])
    blocks.append(tail + bytes(size - len(tail)))
    return tuple(blocks)


def raw_zfec_ops(data: bytes, k: int, n: int) -> dict[str, Callable[[], object]]:
    """Raw zfec on ``data``: ``encode``, ``decode primaries``, ``decode missing #0`` as
    callables, each doing the whole operation again when called."""
    encoder, decoder = zfec.Encoder(k, n), zfec.Decoder(k, n)
    primaries = _zfec_primaries(data, k)
    blocks = list(encoder.encode(primaries))
    length = len(data)

    def decode(numbers: Sequence[int]) -> bytes:
        # A fresh tuple per call: zfec reorders the sequence it is given (see erasure.zfec_codec).
        segments = decoder.decode(tuple(blocks[i] for i in numbers), tuple(numbers))
        # One copy, the padding cut off by a view: the least a caller can do.
        last = memoryview(segments[-1])[: length - (k - 1) * len(segments[0])]
        return b"".join([*segments[:-1], last])

    return {
        "encode": lambda: encoder.encode(primaries),
        "decode primaries": lambda: decode(range(k)),
        "decode missing #0": lambda: decode(range(1, k + 1)),
    }


def wrapper_ops(codec: Codec, data: bytes) -> dict[str, Callable[[], object]]:
    """The same three operations as ``raw_zfec_ops``, through the ``erasure`` codec."""
    chunk_id = chunk_id_of(data)
    # Whole fragments as a reader gets them back from disk or the network.
    stored = [f.to_bytes() for f in codec.encode(chunk_id, data)]
    k = codec.k

    def decode(numbers: Sequence[int]) -> bytes:
        out = codec.decode(chunk_id, [stored[i] for i in numbers])
        assert len(out) == len(data)
        return out

    return {
        "encode": lambda: codec.encode(chunk_id, data),
        "decode primaries": lambda: decode(range(k)),
        "decode missing #0": lambda: decode(range(1, k + 1)),
    }


def raw_write_one(directory: str, name: str, data: bytearray) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(directory, name))
    fsync_dir(directory)


@dataclass(frozen=True)
class DiskWrite:
    """Raw durable writes: each chunk-sized piece as a file (temp, write, fsync, rename, fsync
    of the directory: ``raw_write_one``), one after the other."""

    directory: str
    layout: Layout
    rank: int
    ranks: int
    chunk: int = DEFAULT_CHUNK_SIZE

    def prepare(self) -> Prepared:
        return _DiskWriter(self)


class _DiskWriter:
    def __init__(self, job: DiskWrite) -> None:
        self.job = job
        start, _ = job.layout.box(job.rank, job.ranks)
        self.arrays = job.layout.make(job.rank, job.ranks)
        self.pieces = []
        for i, row, view in chunk_pieces(job.layout, self.arrays, job.chunk):
            directory = Path(job.directory) / f"k{i}"
            directory.mkdir(parents=True, exist_ok=True)
            self.pieces.append((str(directory), f"{start + row:09d}", view))

    def run(self) -> dict[str, Any]:
        latencies = []
        for directory, name, view in self.pieces:
            t0 = time.monotonic()
            # raw_write_one only wraps its argument in a memoryview: a view of ours will do.
            raw_write_one(directory, name, cast(bytearray, view))
            latencies.append(time.monotonic() - t0)
        return {"bytes": sum(len(v) for _, _, v in self.pieces), "put_latencies": latencies}

    def check(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class DcpSave:
    """``torch.distributed.checkpoint.save`` of one rank's shard into its own directory."""

    directory: str
    layout: Layout
    rank: int
    ranks: int

    def prepare(self) -> Prepared:
        return _DcpSaver(self)


class _DcpSaver:
    def __init__(self, job: DcpSave) -> None:
        import torch

        self.job = job
        self.arrays = job.layout.make(job.rank, job.ranks)
        self.tensors = {key: torch.from_numpy(a) for key, a in self.arrays.items()}
        dcp_warm_up()

    def run(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        # no_dist: each rank writes its own checkpoint, as the ranks of a job write their own
        # files; the gather of the plans is all a process group would add.
        save(self.tensors, storage_writer=FileSystemWriter(self.job.directory), no_dist=True)
        return {"bytes": sum(a.nbytes for a in self.arrays.values())}

    def check(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def dcp_warm_up() -> None:
    """One tiny untimed save and load: DCP's first call in a process pays lazy imports."""
    import warnings

    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    # DCP warns that it runs in one process: that is what we ask of it (no_dist).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with tempfile.TemporaryDirectory(prefix="loadtest-dcp-warm-") as tmp:
        state = {"w": torch.ones(4, 4)}
        save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        load(state, storage_reader=FileSystemReader(tmp), no_dist=True)
