"""``storaged demo``: the main job of the README, end to end, with its figures.

On a local cluster started for the occasion (4 node processes in a temporary
directory, stopped and removed at the end, also on Ctrl-C or SIGTERM; or the
cluster of ``--url``), it

1. builds a synthetic checkpoint of ``--size`` bytes from 4 simulated ranks: each
   rank holds an uneven dim-0 shard of several large float32 and bfloat16 arrays,
   plus small values (step, config, per-rank RNG state);
2. saves it with ``AsyncSaver`` and shows the stall (until ``save()`` returned)
   and the upload (a progress bar) until every chunk is acknowledged;
3. follows its state memory -> nvme -> cold;
4. kills a node (SIGKILL) and restores onto 2 ranks (resharding 4 -> 2);
5. checks every byte against the source and prints stall, ack, durability and
   restore figures. The exit status is 1 if any byte differs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import numpy as np

from storaged.client.checkpoint import AsyncSaver, Shard, restore_checkpoint
from storaged.client.client import Client, run_all
from storaged.client.command import (
    ByteProgress,
    CommandError,
    UsageError,
    human_bytes,
    run_async,
    run_command,
    urls_of,
    watch_durability,
)
from storaged.client.formats import STORAGE_DTYPES
from storaged.config import ConfigError, parse_size

MiB: Final = 1 << 20
GiB: Final = 1 << 30
#: Synthetic data is a random base block XOR a per-block pattern: unique chunks, at memcpy speed.
_BLOCK_BYTES: Final = 8 * MiB
#: Relative uneven shares of the ranks (rotated per tensor, so each tensor splits differently).
_SHARES: Final = (1.3, 0.7, 1.1, 0.9)


# --------------------------------------------------------------------------- the model


def shares(rows: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """``(offset, count)`` per rank cutting ``rows`` by ``weights``; every count >= 1."""
    if rows < len(weights):
        raise ValueError(f"{rows} rows cannot be shared by {len(weights)} ranks")
    total = sum(weights)
    bounds = [0]
    for w in itertools.accumulate(weights):
        bounds.append(round(rows * w / total))
    bounds[-1] = rows
    for i in range(1, len(bounds)):  # at least one row each, keeping order
        bounds[i] = max(bounds[i], bounds[i - 1] + 1)
    for i in range(len(bounds) - 2, 0, -1):
        bounds[i] = min(bounds[i], bounds[i + 1] - 1)
    return [(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


def _f32_pattern(block: int) -> int:
    # The low 12 mantissa bits of both float32 lanes: values stay close to the base's.
    return ((block >> 12) & 0xFFF) << 32 | (block & 0xFFF)


def _bf16_pattern(block: int) -> int:
    # The low 4 mantissa bits of each of the four bfloat16 lanes.
    return sum(((block >> (4 * lane)) & 0xF) << (16 * lane) for lane in range(4))


@dataclass(frozen=True)
class Tensor:
    """A large global array, saved in dim-0 shards by every rank.

    Its content is a function of its place: 64-bit word ``i`` is word ``i % W`` of
    its kind's random base block XOR the pattern of block ``first_block + i // W``
    (``W`` words per 8 MiB block). Every 8 MiB block is distinct (no dedup), it is
    made at memcpy speed, and it can be made again to check a restore without
    keeping the source.
    """

    key: str
    #: Name in the manifest ("float32", "bfloat16").
    dtype: str
    shape: tuple[int, ...]
    first_block: int

    @property
    def storage(self) -> np.dtype[Any]:
        return np.dtype(np.uint16 if self.dtype == "bfloat16" else np.float32)

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:])) * self.storage.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


class _Content:
    """Makes the words of any tensor (see ``Tensor``)."""

    def __init__(self, seed: int) -> None:
        words = _BLOCK_BYTES // 8
        normal = np.random.default_rng(seed).standard_normal(words * 4, dtype=np.float32)
        normal *= np.float32(0.02)
        self.f32 = normal[: words * 2].view(np.uint64)
        self.bf16 = (normal.view(np.uint32) >> 16).astype(np.uint16).view(np.uint64)
        self.words = words

    def fill(self, tensor: Tensor, out: np.ndarray[Any, Any], first_word: int) -> None:
        """Write words ``first_word ...`` of ``tensor`` into the uint64 array ``out``."""
        base, pattern = (
            (self.bf16, _bf16_pattern) if tensor.dtype == "bfloat16" else (self.f32, _f32_pattern)
        )
        pos = 0
        while pos < len(out):
            word = first_word + pos
            block, within = divmod(word, self.words)
            n = min(len(out) - pos, self.words - within)
            mask = np.uint64(pattern(tensor.first_block + block))
            np.bitwise_xor(base[within : within + n], mask, out=out[pos : pos + n])
            pos += n


@dataclass
class SyntheticModel:
    """A checkpoint's worth of state: big sharded tensors, small values of rank 0 and each rank."""

    tensors: list[Tensor]
    #: Saved by rank 0 only (msgpack values and small replicated arrays).
    common: dict[str, Any]
    #: Saved by each rank under its own keys.
    per_rank: list[dict[str, Any]]
    #: Key -> ``(offset, rows)`` of each saving rank.
    splits: dict[str, list[tuple[int, int]]]
    content: _Content

    @property
    def nbytes(self) -> int:
        small = sum(
            v.nbytes
            for values in (self.common, *self.per_rank)
            for v in values.values()
            if isinstance(v, np.ndarray)
        )
        return sum(t.nbytes for t in self.tensors) + small

    def materialize(self) -> dict[str, np.ndarray[Any, Any]]:
        """The global arrays (the source of the save); CPU bound: run in a thread."""
        arrays = {}
        for tensor in self.tensors:
            array = np.empty(tensor.shape, dtype=tensor.storage)
            self.content.fill(tensor, array.reshape(-1).view(np.uint64), 0)
            arrays[tensor.key] = array
        return arrays

    def rank_states(self, arrays: dict[str, np.ndarray[Any, Any]]) -> dict[int, dict[str, Any]]:
        """What each saving rank holds: views of the global ``arrays`` (no copy)."""
        states: dict[int, dict[str, Any]] = {r: {} for r in range(len(self.per_rank))}
        for tensor in self.tensors:
            array = arrays[tensor.key]
            for rank, (offset, count) in enumerate(self.splits[tensor.key]):
                states[rank][tensor.key] = Shard(
                    array[offset : offset + count],
                    tensor.shape,
                    (offset,) + (0,) * (len(tensor.shape) - 1),
                    tensor.dtype if tensor.dtype in STORAGE_DTYPES else None,
                )
        states[0].update(self.common)
        for rank, values in enumerate(self.per_rank):
            states[rank].update(values)
        return states

    def restore_targets(self, ranks: int) -> list[dict[str, Any]]:
        """Destinations of ``ranks`` restoring ranks: even dim-0 shards; rank 0 gets the rest."""
        targets: list[dict[str, Any]] = [{} for _ in range(ranks)]
        for tensor in self.tensors:
            for rank, (offset, count) in enumerate(shares(tensor.shape[0], [1.0] * ranks)):
                targets[rank][tensor.key] = Shard(
                    np.empty((count, *tensor.shape[1:]), dtype=tensor.storage),
                    tensor.shape,
                    (offset,) + (0,) * (len(tensor.shape) - 1),
                    tensor.dtype if tensor.dtype in STORAGE_DTYPES else None,
                )
        for values in (self.common, *self.per_rank):
            targets[0].update(dict.fromkeys(values))
        return targets

    def verify(
        self, targets: Sequence[dict[str, Any]], returned: dict[str, Any]
    ) -> tuple[int, dict[str, int]]:
        """(bytes checked, {key: bytes that differ}) of restored state against the source.

        The large tensors are made again block by block: the source need not be kept.
        """
        checked = 0
        wrong: dict[str, int] = {}
        expected = np.empty(self.content.words, dtype=np.uint64)
        for tensor in self.tensors:
            for target in targets:
                shard: Shard = target[tensor.key]
                got = np.ascontiguousarray(shard.array).reshape(-1).view(np.uint64)
                first = shard.offsets[0] * tensor.row_bytes // 8
                differ = 0
                for lo in range(0, len(got), len(expected)):
                    part = got[lo : lo + len(expected)]
                    want = expected[: len(part)]
                    self.content.fill(tensor, want, first + lo)
                    differ += _differing_bytes(want, part)
                checked += got.nbytes
                if differ:
                    wrong[tensor.key] = wrong.get(tensor.key, 0) + differ
        for values in (self.common, *self.per_rank):
            for key, value in values.items():
                got_value = returned.get(key)
                if isinstance(value, np.ndarray):
                    checked += value.nbytes
                    if not isinstance(got_value, np.ndarray) or got_value.dtype != value.dtype:
                        wrong[key] = value.nbytes
                    elif differ := _differing_bytes(value, got_value):
                        wrong[key] = differ
                elif got_value != value:
                    wrong[key] = 1
        return checked, wrong


def _differing_bytes(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.nbytes, b.nbytes)
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    if x.size % 8 == 0 and np.array_equal(x.view(np.uint64), y.view(np.uint64)):
        return 0  # the common case, 8 bytes at a time
    return int(np.count_nonzero(x != y))


def build_model(size: int, ranks: int, seed: int = 0) -> SyntheticModel:
    """About ``size`` bytes of state in large float32/bfloat16 tensors, plus small values."""
    content = _Content(seed)
    rng = np.random.default_rng(seed + 1)
    layout = [  # key, dtype, columns, share of the size
        ("embed.weight", "bfloat16", 1536, 0.10),
        ("layers.0.attn.qkv.weight", "float32", 1024, 0.15),
        ("layers.0.mlp.weight", "float32", 1024, 0.20),
        ("layers.1.attn.qkv.weight", "float32", 1024, 0.15),
        ("layers.1.mlp.weight", "float32", 1024, 0.20),
        ("lm_head.weight", "bfloat16", 1536, 0.20),
    ]
    next_block = {"float32": 1, "bfloat16": 1}
    tensors = []
    splits = {}
    for index, (key, dtype, cols, share) in enumerate(layout):
        itemsize = 2 if dtype == "bfloat16" else 4
        rows = max(2 * ranks, int(size * share) // (cols * itemsize))
        tensor = Tensor(key, dtype, (rows, cols), next_block[dtype])
        next_block[dtype] += -(-tensor.nbytes // _BLOCK_BYTES)
        tensors.append(tensor)
        weights = [_SHARES[(r + index) % len(_SHARES)] for r in range(ranks)]
        splits[key] = shares(rows, weights)
    common: dict[str, Any] = {
        "step": 1000,
        "config": {"model": "synthetic", "layers": 2, "world_size": ranks},
        "layers.0.mlp.bias": rng.standard_normal(1024, dtype=np.float32),
        "layers.1.mlp.bias": rng.standard_normal(1024, dtype=np.float32),
    }
    per_rank = [
        {
            f"rng/rank{r}": rng.integers(0, 2**32, size=624, dtype=np.uint32),
            f"loss/rank{r}": float(2.5 - 0.1 * r),
        }
        for r in range(ranks)
    ]
    return SyntheticModel(tensors, common, per_rank, splits, content)


# --------------------------------------------------------------------------- running it


@dataclass
class Figures:
    size: int = 0
    stall: float = 0.0
    ack: float = 0.0
    nvme: float | None = None
    cold: float | None = None
    restore: float = 0.0
    restored_bytes: int = 0
    checked: int = 0
    wrong: dict[str, int] = field(default_factory=dict)
    killed: str | None = None


def _say(line: str = "") -> None:
    print(line, flush=True)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:6.2f} GB/s"


def cluster_settings(size: int) -> dict[str, Any]:
    """Tiers sized for the demo: three RAM copies spread over 4 nodes, with a margin."""
    memory = max(256 * MiB, size * 3 // 4 + max(256 * MiB, size // 8))
    disk = max(4 * GiB, 3 * size)
    return {
        "tiers": {
            "memory_capacity": -(-memory // MiB) * MiB,
            "nvme_capacity": disk,
            "cold_capacity": disk,
        }
    }


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_demo(args: argparse.Namespace) -> int:
    """The ``storaged demo`` command; returns its exit status."""
    outcome: list[int] = []

    def body() -> None:
        try:
            size = parse_size(args.size)
        except ConfigError as exc:
            raise UsageError(f"--size: {exc}") from None
        if size < 16 * MiB:
            raise UsageError("--size must be at least 16MiB")
        if not (1 <= args.ranks <= 64 and 1 <= args.restore_ranks <= 64):
            raise UsageError("--ranks and --restore-ranks must be between 1 and 64")
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            outcome.append(_demo(args, size))
        finally:
            signal.signal(signal.SIGTERM, previous)

    status = run_command(args, body)
    return status if status != 0 or not outcome else outcome[0]


def _demo(args: argparse.Namespace, size: int) -> int:
    from storaged.tools.local_cluster import ClusterError, LocalCluster, free_port_block

    cluster: LocalCluster | None = None
    tmp: Path | None = None
    failed = True  # until the run ends with every byte right: keeps the logs on any failure
    try:
        if args.url:
            urls, token = urls_of(args.url), args.token
            _say(f"using the cluster at {', '.join(urls)}")
        else:
            if args.nodes < 4:
                raise UsageError("--nodes must be >= 4 (3 RAM copies, and one node is killed)")
            if not 0 <= args.kill < args.nodes:
                raise UsageError(f"--kill must name a node index below {args.nodes}")
            tmp = Path(tempfile.mkdtemp(prefix="storaged-demo-", dir=args.data))
            port = free_port_block(2 * args.nodes)
            settings = cluster_settings(size)
            cluster = LocalCluster(
                nodes=args.nodes,
                data=tmp,
                port=port,
                peer_port=port + args.nodes,
                token=secrets.token_hex(16),
                settings=settings,
                # The nodes never inherit asyncio debug mode from a test run: it slows them.
                env={"PYTHONASYNCIODEBUG": ""},
                # A STORAGED_TOKEN left in the shell overrode the cluster file's token: the
                # nodes refused the demo's token and start-up failed with "do not see alive".
                clean_env=True,
                die_with_parent=True,
            )
            mem = settings["tiers"]["memory_capacity"]
            _say(
                f"starting {args.nodes} storaged nodes on 127.0.0.1:{port}-{port + args.nodes - 1}"
                f" (RAM tier {human_bytes(mem)} each, data in {tmp})"
            )
            try:
                cluster.start()
            except ClusterError as exc:
                raise CommandError(f"the local cluster did not start: {exc}") from None
            urls, token = cluster.urls, cluster.token
        figures = run_async(lambda: _run(args, size, urls, token, cluster))
        _report(figures, args)
        failed = bool(figures.wrong)
        return 1 if figures.wrong else 0
    except KeyboardInterrupt:
        failed = False  # stopped on purpose: nothing to look into
        raise
    finally:
        if cluster is not None:
            _say("stopping the cluster")
            cluster.stop()
        if tmp is not None:
            if failed and cluster is not None:
                _say(f"node logs kept in {_keep_logs_only(tmp)}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


def _keep_logs_only(data: Path) -> Path:
    """Remove the cluster's data but its node logs (for a look after a failure); returns where."""
    for entry in data.iterdir():
        if entry.is_dir() and (entry / "node.log").exists():
            for inner in entry.iterdir():
                if inner.name != "node.log":
                    if inner.is_dir() and not inner.is_symlink():
                        shutil.rmtree(inner, ignore_errors=True)
                    else:
                        inner.unlink(missing_ok=True)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)  # cluster.toml among them: it holds the secrets
    return data


async def _run(
    args: argparse.Namespace, size: int, urls: list[str], token: str | None, cluster: Any
) -> Figures:
    figures = Figures()
    async with Client(urls, token=token or None, max_concurrency=16) as client:
        info = client.cluster
        erasure = (
            f"{info.erasure.codec} k={info.erasure.k} n={info.erasure.n}" if info.erasure else ""
        )
        _say(
            f"cluster: {len(info.live)} live nodes, replication {info.replication}, "
            f"cold tier {erasure}"
        )
        model, name, began = await _build_and_save(args, size, client, figures)

        _say("\nwaiting for the drain: memory -> nvme -> cold")
        seen = await watch_durability(client, name, "cold", args.timeout, _say, began=began)
        figures.nvme = seen.reached.get("nvme")
        figures.cold = seen.reached.get("cold")

        if cluster is not None and not args.no_kill:
            victim = cluster.node_id(args.kill)
            await asyncio.to_thread(cluster.kill, args.kill, signal.SIGKILL)
            figures.killed = victim
            _say(f"\nkilled node {victim} (SIGKILL)")
        else:
            _say("\nno node is killed" + ("" if cluster is not None else " (not our cluster)"))

        await _restore_and_check(args, client, name, model, figures)
        if cluster is None and not args.keep:
            await client.delete(name)
    return figures


async def _build_and_save(
    args: argparse.Namespace, size: int, client: Client, figures: Figures
) -> tuple[SyntheticModel, str, float]:
    """Build the synthetic checkpoint and save it with ``AsyncSaver`` until acknowledged:
    the model (its arrays dropped), the checkpoint's name and when the save began."""
    replication = client.cluster.replication
    began = time.perf_counter()
    model = await asyncio.to_thread(build_model, size, args.ranks)
    arrays = await asyncio.to_thread(model.materialize)
    figures.size = model.nbytes
    _say(
        f"built a synthetic checkpoint of {human_bytes(model.nbytes)} in "
        f"{time.perf_counter() - began:.1f} s: {len(model.tensors)} large float32/bfloat16 "
        f"tensors sharded unevenly over {args.ranks} ranks, plus small values"
    )
    name = f"demo/step-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    stats = client.stats

    _say(f"\nsaving {name} with AsyncSaver")
    saver = AsyncSaver(client)
    try:
        began = time.perf_counter()
        handle = await saver.save(name, model.rank_states(arrays), meta={"step": 1000})
        figures.stall = handle.stall_seconds
        # The state may change now; the demo drops it (the check makes it again).
        del arrays
        _say(
            f"  save() returned after {figures.stall:.2f} s: {human_bytes(handle.staged_bytes)}"
            " copied to staging buffers (fresh memory on a first save, reused by later"
            " ones); training would go on from here while the upload runs"
        )
        async with ByteProgress(
            lambda: stats.bytes_uploaded + stats.bytes_skipped,
            handle.staged_bytes,
            "  upload",
            enabled=args.progress,
        ):
            result = await handle.acked()
        figures.ack = time.perf_counter() - began
    finally:
        await saver.aclose()
        del saver  # frees the staging buffers
    assert result.commit is not None
    _say(
        f"  acknowledged after {figures.ack:.2f} s: {result.commit.chunks} chunks in RAM on "
        f"{replication} nodes each, manifest committed"
    )
    return model, name, began


async def _restore_and_check(
    args: argparse.Namespace, client: Client, name: str, model: SyntheticModel, figures: Figures
) -> None:
    """Restore the checkpoint onto ``args.restore_ranks`` ranks and check every byte."""
    stats = client.stats
    targets = model.restore_targets(args.restore_ranks)
    _say(f"restoring onto {args.restore_ranks} ranks (saved by {args.ranks})")
    stats.reset()
    began = time.perf_counter()
    async with ByteProgress(
        lambda: stats.bytes_downloaded, model.nbytes, "  restore", enabled=args.progress
    ):
        returned = await run_all(
            [
                restore_checkpoint(client, name, target, dtype_map=STORAGE_DTYPES)
                for target in targets
            ]
        )
    figures.restore = time.perf_counter() - began
    figures.restored_bytes = stats.bytes_downloaded
    _say(
        f"  restored in {figures.restore:.2f} s "
        f"({human_bytes(stats.bytes_downloaded)} fetched, {stats.failovers} failovers)"
    )

    _say("checking every byte against the source")
    figures.checked, figures.wrong = await asyncio.to_thread(model.verify, targets, returned[0])


def _report(f: Figures, args: argparse.Namespace) -> None:
    _say(
        f"\nfigures for {human_bytes(f.size)} ({f.size} bytes), {args.ranks} -> "
        f"{args.restore_ranks} ranks:"
    )
    _say(f"  stall    {f.stall:7.2f} s  {_gbps(f.size, f.stall)}   until save() returned")
    _say(f"  ack      {f.ack:7.2f} s  {_gbps(f.size, f.ack)}   every chunk in RAM on 3 nodes")
    if f.nvme is not None:
        _say(f"  nvme     {f.nvme:7.2f} s               every chunk on disk on its holders")
    if f.cold is not None:
        _say(f"  cold     {f.cold:7.2f} s               erasure-coded fragments durable")
    killed = f", {f.killed} killed" if f.killed else ""
    _say(
        f"  restore  {f.restore:7.2f} s  {_gbps(f.size, f.restore)}   onto "
        f"{args.restore_ranks} ranks{killed}"
    )
    if f.wrong:
        bad = sum(f.wrong.values())
        keys = ", ".join(sorted(f.wrong)[:5])
        _say(f"FAILED: {bad} of {f.checked} bytes differ from the source (in {keys})")
    else:
        _say(f"verified: all {f.checked} bytes equal the source")
