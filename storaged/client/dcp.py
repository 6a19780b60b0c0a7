"""PyTorch Distributed Checkpoint (DCP) on storaged: ``StoragedWriter`` and ``StoragedReader``.

::

    import torch.distributed.checkpoint as dcp
    from storaged.client.dcp import StoragedReader, StoragedWriter

    dcp.save(state, storage_writer=StoragedWriter(url, "job42/step-001000", token))
    dcp.load(state, storage_reader=StoragedReader(url, "job42/step-001000", token))

``dcp.async_save`` works the same way. Every rank uploads its own items as one
byte stream (cut into content-addressed chunks, so unchanged tensors dedup
against earlier checkpoints); the coordinator (rank 0) commits ONE manifest with
one shard entry per rank once every rank reported its chunks acknowledged. When
any rank fails, DCP never calls ``finish`` and nothing is committed (the
uploaded chunks are orphans, garbage-collected by the cluster).

What lands in the manifest (API.md), and nothing else (DCP's ``Metadata`` is
not pickled; the reader rebuilds it from the items):

- a tensor chunk: ``key`` = its DCP fully qualified name, ``dtype`` = the torch
  dtype's name (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``...),
  ``global_shape``, ``offsets`` and ``shape`` of the chunk, its raw row-major
  native-endian bytes at ``[start, start + length)`` of the rank's stream;
- a non-tensor value (DCP hands those over as ``torch.save``'d ``BytesIO``):
  ``dtype`` = ``"dcp-bytes"``, ``global_shape`` = ``offsets`` = ``shape`` = ``[]``,
  the bytes as DCP produced them;
- ``meta``: ``{"framework": "torch.distributed.checkpoint", "torch": version,
  "world_size": n, "dcp": {"version", "save_id", "planner_data"}}`` plus the
  caller's ``meta``. ``planner_data`` (the default planner's flattening map) is
  kept when msgpack can encode it.

Loading reads only what each rank needs: every DCP ``ReadItem`` (a box inside a
saved chunk) becomes a box request for ``storaged.client.layout.plan_restore``,
which maps it to byte ranges of the saving rank's stream and from there to
ranged chunk GETs, written straight into the destination tensor's memory when it
is contiguous. Checkpoints written by the numpy client load too, except their
``"msgpack"`` values, which DCP cannot decode (they are left out of the metadata).

Threads: each ``write_data``/``read_data`` runs the async ``Client`` with
``asyncio.run`` in a worker thread of its own and returns a ``torch.futures.Future``
completed from there. ``resolve_data`` is called in the caller's thread before
``write_data`` returns; for reads, ``planner.load_bytes`` and
``planner.commit_tensor`` run in the worker thread before the future completes.
Short calls (``read_metadata``, ``finish``, the coordinator's check that the name
is free) block the caller on such a thread, so they work even from a thread
that runs an event loop.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import bisect
import concurrent.futures
import dataclasses
import functools
import io
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgpack
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from storaged.client.checkpoint import StagedShard, cut_segments, execute_restore
from storaged.client.client import Client, ClientStats, CommitResult, RestorePlanDoc, run_all
from storaged.client.errors import CheckpointNotFound, Exists
from storaged.client.layout import (
    DCP_BYTES_DTYPE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_COALESCE_GAP,
    MSGPACK_DTYPE,
    Box,
    Item,
    Manifest,
    Request,
    ShardEntry,
    build_manifest,
    pack_stream,
    plan_restore,
)
from storaged.client.shm import usable
from storaged.ids import is_checkpoint_name
from storaged.wire import ByteRange

__all__ = [
    "BYTES_DTYPE",
    "FRAMEWORK",
    "ReadStats",
    "StoragedLocation",
    "StoragedReader",
    "StoragedWriter",
    "dtype_name",
    "torch_dtype",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Manifest dtype of a non-tensor value (DCP's ``BytesIO``). numpy must not know the
#: name: the server checks the length of items whose dtype numpy understands, and
#: numpy reads "bytes" as a zero-size type.
BYTES_DTYPE: Final = DCP_BYTES_DTYPE
#: ``meta["framework"]`` of checkpoints written here.
FRAMEWORK: Final = "torch.distributed.checkpoint"
#: ``Metadata.version`` of what is written (the version DCP's file system writer uses).
DCP_VERSION: Final = "1.0.0"

# Same-size integer types used to move the bytes of dtypes numpy lacks (bfloat16,
# float8...) through numpy arrays without converting them.
_RAW_TORCH: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name; ``ValueError`` when torch has none."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype is called {name!r}") from None


@functools.cache
def _numpy_equivalent(dtype: torch.dtype) -> np.dtype[Any] | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


@functools.cache
def _storage_numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype that carries ``dtype``'s bytes: its own, or a same-size integer."""
    equivalent = _numpy_equivalent(dtype)
    if equivalent is not None:
        return equivalent
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if itemsize not in _RAW_TORCH:
        raise TypeError(f"cannot move {dtype} ({itemsize}-byte elements) through numpy")
    return np.dtype(f"i{itemsize}")


def _numpy_view(tensor: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """A numpy array sharing ``tensor``'s memory (strides included), or None if impossible."""
    if tensor.device.type != "cpu" or tensor.is_conj() or tensor.is_neg():
        return None
    try:
        if _numpy_equivalent(tensor.dtype) is not None:
            return tensor.numpy()
        raw = _RAW_TORCH.get(tensor.element_size())
        return None if raw is None else tensor.view(raw).numpy()
    except (TypeError, RuntimeError):
        return None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (the view keeps it alive)."""
    flat: np.ndarray[Any, Any] = tensor.reshape(-1).view(torch.uint8).numpy()
    return flat.data


def _check_name(name: object) -> str:
    text = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(text, str) or not is_checkpoint_name(text):
        raise ValueError(f"invalid checkpoint name {name!r} (see API.md for the allowed form)")
    return text


# --------------------------------------------------------------------------- threads


def _spawn(work: Callable[[], T], what: str) -> concurrent.futures.Future[T]:
    """Run ``work`` in a new daemon thread; its outcome lands in the returned future."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def main() -> None:
        try:
            result = work()
        except BaseException as exc:  # handed to whoever waits, never lost in the thread
            done.set_exception(exc)
        else:
            done.set_result(result)

    # Daemon: a process that exits while a save is stuck must not hang on it.
    threading.Thread(target=main, name=f"storaged-dcp-{what}", daemon=True).start()
    return done


def _run(factory: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
    """Run a coroutine on a fresh event loop in a worker thread and wait for it.

    A thread of its own, so that a caller already running an event loop can use it.
    """
    return _spawn(lambda: asyncio.run(factory()), what).result()


class _Settling:
    """How many torch futures a worker thread is settling right now, and a wait for none.

    ``Future.set_result`` wakes the waiter first, then runs the future's callbacks and takes
    the GIL back, all inside torch's C++. A waiter that then ends the process can start
    interpreter shutdown while the (daemon) worker is still in there; the worker's next
    take of the GIL ends its thread by unwinding through C++ that must not unwind, and the
    process aborts ("terminate called without an active exception", a torchrun example in
    CI, stop 29). Exit waits for the settles in flight (``atexit`` runs before shutdown
    stops threads from taking the GIL); the uploads and reads themselves are not waited
    for, so a stuck one still cannot hang the exit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def __enter__(self) -> None:
        with self._cond:
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no settle in flight; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count == 0, timeout)


_SETTLING: Final = _Settling()
#: how long an exiting process waits for the settles in flight (their callbacks included)
SETTLE_EXIT_SECONDS: Final = 60.0
atexit.register(_SETTLING.wait, SETTLE_EXIT_SECONDS)


def _torch_future(source: concurrent.futures.Future[T]) -> Future[T]:
    """A ``torch.futures.Future`` settled with ``source``'s outcome."""
    future: Future[T] = Future()

    def settle(done: concurrent.futures.Future[T]) -> None:
        exc = done.exception()
        with _SETTLING:
            if exc is None:
                future.set_result(done.result())
            else:
                if not isinstance(exc, Exception):  # torch futures carry Exceptions only
                    exc = RuntimeError(f"interrupted: {exc!r}")
                # torch annotates set_exception's argument as the result type T: it is not.
                future.set_exception(exc)  # type: ignore[arg-type]

    source.add_done_callback(settle)
    return future


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class StoragedLocation:
    """Where an item of a checkpoint lies: bytes ``[start, start + length)`` of ``rank``'s
    stream. The values of ``Metadata.storage_data``, keyed by DCP's ``MetadataIndex``."""

    rank: int
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class _Written:
    """``WriteResult.storage_data`` of the writer: the item's location, and the rank's whole
    shard entry (the same object in every result of a rank, so it is pickled once when
    DCP gathers the results on the coordinator)."""

    location: StoragedLocation
    shard: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Source:
    """One write item, resolved: its manifest description and its bytes."""

    index: MetadataIndex
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True, slots=True)
class ReadStats:
    """What a rank's ``read_data`` asked for and what it transferred."""

    #: Bytes of the tensor boxes DCP asked for.
    tensor_bytes: int
    #: Bytes of the non-tensor values read (each read whole).
    value_bytes: int
    #: Bytes the restore plan fetches (tensor bytes plus gaps it chose to read through).
    bytes_planned: int
    #: Bytes that came over the network (client counters).
    bytes_downloaded: int
    #: Chunk GETs made.
    requests: int
    #: Of ``bytes_downloaded``, those read from the local node's RAM through shared memory.
    shm_bytes: int = 0


def _stage(rank: int, sources: Sequence[_Source], chunk_size: int) -> StagedShard:
    """Lay the items out in one stream and cut it into chunks (CPU bound: not on a loop).

    Items smaller than a chunk are copied back to back into one buffer (the chunk
    holding several of them needs contiguous bytes); larger ones are referenced where
    they are, so they must not change until the upload is done.
    """
    lengths = [len(source.data) for source in sources]
    layout = pack_stream(lengths, chunk_size)
    items = tuple(
        Item(s.key, s.dtype, s.global_shape, s.offsets, s.shape, start, len(s.data))
        for s, start in zip(sources, layout.starts, strict=True)
    )
    packed = np.empty(sum(n for n in lengths if n < chunk_size), dtype=np.uint8)
    segments: list[tuple[int, memoryview]] = [(0, packed.data)]
    for source, start in zip(sources, layout.starts, strict=True):
        size = len(source.data)
        if size >= chunk_size:
            segments.append((start, source.data))
        elif size:
            packed[start : start + size] = np.frombuffer(source.data, dtype=np.uint8)
    return StagedShard(rank, items, cut_segments(segments, layout.chunks))


async def _read_stream(
    client: Client, shard: ShardEntry, start: int, length: int, holders: RestorePlanDoc
) -> bytearray:
    """Bytes ``[start, start + length)`` of ``shard``'s stream, fetched chunk range by range."""
    out = bytearray(length)
    view = memoryview(out)
    offsets = shard.chunk_offsets()
    index = bisect.bisect_right(offsets, start) - 1
    pos, end = start, start + length
    reads = []
    while pos < end:
        chunk_start, chunk_end = offsets[index], offsets[index + 1]
        take = min(end, chunk_end)
        if take > pos:
            chunk = shard.chunks[index][0]
            whole = pos == chunk_start and take == chunk_end
            byte_range = None if whole else ByteRange(pos - chunk_start, take - chunk_start)
            reads.append(
                client.get_chunk(
                    chunk, view[pos - start : take - start], byte_range, holders=holders.get(chunk)
                )
            )
        pos = take
        index += 1
    await run_all(reads)
    return out


# --------------------------------------------------------------------------- both sides


class _ClusterCheckpoint:
    """What ``StoragedWriter`` and ``StoragedReader`` share: the nodes they talk to, the
    checkpoint they name, and how they name it to DCP (``checkpoint_id`` is the name)."""

    urls: list[str]
    name: str
    rank: int

    def _connect(
        self,
        url: str | Sequence[str],
        name: str,
        token: str | None,
        client_options: Mapping[str, Any] | None,
        shm: bool | None = None,
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise ValueError("need at least one node URL")
        self.name = _check_name(name)
        self._token = token
        self._client_options = dict(client_options or {})
        if shm is not None:
            self._client_options["shm"] = shm
        self.rank = 0

    def __repr__(self) -> str:  # never shows the token
        return f"{type(self).__name__}({self.urls!r}, {self.name!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's call before each save or load (and ours, when made): under
        ``checkpoint_id`` when given, else the name it had, with nothing of the last."""
        if checkpoint_id is not None:
            self.name = _check_name(checkpoint_id)
        self._forget_last()

    @abc.abstractmethod
    def _forget_last(self) -> None:
        """Start afresh: a new id, and nothing of the last save or load."""

    def _client(self) -> Client:
        return Client(self.urls, token=self._token, **self._client_options)

    @property
    def checkpoint_id(self) -> str:
        return self.name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_name(os.fspath(checkpoint_id))


# --------------------------------------------------------------------------- writer


class StoragedWriter(_ClusterCheckpoint, StorageWriter):
    """A DCP ``StorageWriter`` that saves into checkpoint ``name`` of a storaged cluster.

    ``url``: one node URL or several; ``token``: the client token. Every rank makes
    its own writer with the same name. ``dcp.save(..., checkpoint_id=other)`` saves
    under ``other`` instead (checkpoints are immutable: each save needs a new name,
    and the coordinator refuses a name already committed before anything is
    uploaded). ``chunk_size`` caps the chunks (the cluster's maximum caps it too);
    ``meta`` is added to the manifest's ``meta``; ``client_options`` go to ``Client``;
    ``shm`` is ``Client``'s option of that name (``False``: HTTP only, never shared memory
    with a node on this host).

    After a successful save, ``last_commit`` (coordinator) holds the commit answer
    and ``last_stats`` (every rank) the client counters of its upload.
    ``use_collectives=False`` is refused: one manifest needs one coordinator. A writer
    serves one save at a time (like DCP's file system writer).
    """

    save_id: str
    last_commit: CommitResult | None
    last_stats: ClientStats | None

    def __init__(
        self,
        url: str | Sequence[str],
        name: str,
        token: str | None = None,
        *,
        chunk_size: int | None = None,
        meta: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        shm: bool | None = None,
    ) -> None:
        super().__init__()
        if chunk_size is not None and chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self._connect(url, name, token, client_options, shm)
        self._chunk_size = chunk_size
        self._meta = dict(meta or {})
        self.is_coordinator = True
        self.reset()

    # ------------------------------------------------------------------ DCP protocol

    def _forget_last(self) -> None:
        self.save_id = uuid.uuid4().hex
        self.last_commit = None
        self.last_stats = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "StoragedWriter commits one manifest from the coordinator: "
                "dcp.save(use_collectives=False) is not supported"
            )
        rank = kwargs.get("rank")
        if rank is None:  # a DCP that does not say: ask the default group
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator fails the save before any rank uploads when the name is taken
        # (the commit would be refused anyway, after every byte had been sent).
        _run(self._check_name_free, "check")
        return plans

    async def _check_name_free(self) -> None:
        async with self._client() as client:
            try:
                await client.get_manifest(self.name)
            except CheckpointNotFound:
                return
        raise Exists(message=f"checkpoint {self.name} already exists (checkpoints are immutable)")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        sources = [self._resolve(item, planner) for item in plan.items]
        rank = self.rank
        return _torch_future(_spawn(lambda: asyncio.run(self._upload(rank, sources)), "write"))

    def _resolve(self, item: Any, planner: SavePlanner) -> _Source:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: a BYTE_IO item resolved to {type(data)}")
            # getbuffer: the BytesIO's own memory, no copy; it stays alive with the view.
            return _Source(item.index, item.index.fqn, BYTES_DTYPE, (), (), (), data.getbuffer())
        if not isinstance(data, torch.Tensor) or item.tensor_data is None:
            raise TypeError(f"{item.index.fqn}: a tensor item resolved to {type(data)}")
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        # Deliberate copies: the stream holds plain row-major bytes of the chunk.
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        chunk = item.tensor_data.chunk
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise ValueError(
                f"{item.index.fqn}: resolved a tensor of shape {list(tensor.shape)} "
                f"for a chunk of {list(chunk.sizes)}"
            )
        return _Source(
            item.index,
            item.index.fqn,
            dtype_name(tensor.dtype),
            tuple(int(s) for s in item.tensor_data.size),
            tuple(int(o) for o in chunk.offsets),
            tuple(int(s) for s in chunk.sizes),
            _tensor_bytes(tensor),
        )

    async def _upload(self, rank: int, sources: Sequence[_Source]) -> list[WriteResult]:
        async with self._client() as client:
            wanted = DEFAULT_CHUNK_SIZE if self._chunk_size is None else self._chunk_size
            chunk_size = min(wanted, client.max_chunk_size)
            staged = await asyncio.to_thread(_stage, rank, sources, chunk_size)
            ids = await self._put_chunks(client, staged)
            self.last_stats = dataclasses.replace(client.stats)
        shard = staged.entry(ids)
        return [
            WriteResult(
                index=source.index,
                size_in_bytes=item.length,
                storage_data=_Written(StoragedLocation(rank, item.start, item.length), shard),
            )
            for source, item in zip(sources, staged.items, strict=True)
        ]

    async def _put_chunks(self, client: Client, staged: StagedShard) -> list[str]:
        """Upload the rank's chunks; return their ids once all are acknowledged.

        Co-located (a shared-memory path to the node on this host), each chunk is handed
        over unhashed, as ``AsyncSaver`` does: the node hashes it (and answers "already
        stored" for a chunk the cluster holds), so a hash here would be a second pass over
        every byte for nothing. Over HTTP the chunks are hashed here and only those the
        cluster lacks are sent."""
        if usable(client.shm) is not None:
            return await run_all([client.put_chunk(chunk) for chunk in staged.chunks])
        return await client.put_chunks(staged.chunks)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        shards: dict[int, dict[str, Any]] = {}
        storage_data: dict[MetadataIndex, StoragedLocation] = {}
        for rank_results in results:
            for result in rank_results:
                written = result.storage_data
                if not isinstance(written, _Written):
                    raise TypeError(f"{result.index.fqn}: not written by a StoragedWriter")
                shards.setdefault(written.location.rank, written.shard)
                storage_data[result.index] = written.location
        saved = {item["key"] for shard in shards.values() for item in shard["items"]}
        unsaved = sorted(set(metadata.state_dict_metadata) - saved)
        if unsaved:
            raise RuntimeError(f"no rank wrote {unsaved[:5]}: not committing {self.name}")
        manifest = build_manifest(
            list(shards.values()),
            created=time.time(),
            meta=self._manifest_meta(metadata, len(results)),
        )

        async def commit() -> CommitResult:
            async with self._client() as client:
                return await client.commit(self.name, manifest)

        self.last_commit = _run(commit, "commit")
        metadata.version = DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()

    def _manifest_meta(self, metadata: Metadata, world_size: int) -> dict[str, Any]:
        dcp: dict[str, Any] = {"version": DCP_VERSION, "save_id": self.save_id}
        if metadata.planner_data is not None:
            try:
                msgpack.packb(metadata.planner_data)
            except (TypeError, ValueError, OverflowError) as exc:
                log.warning("%s: planner_data not kept (msgpack cannot encode it: %s)", self, exc)
            else:
                dcp["planner_data"] = metadata.planner_data
        return {
            **self._meta,
            "framework": FRAMEWORK,
            "torch": torch.__version__,
            "world_size": world_size,
            "dcp": dcp,
        }


# --------------------------------------------------------------------------- reader


@dataclass(slots=True)
class _TensorRead:
    request: ReadItem
    #: The planner's destination (a view into the state dict's tensor).
    target: torch.Tensor
    #: Where the bytes land: ``target`` itself, or a tensor of the saved dtype on the CPU
    #: that is copied (and cast) into ``target`` afterwards.
    landing: torch.Tensor
    array: np.ndarray[Any, Any]


def _planner_data_from_wire(value: Any) -> Any:
    """msgpack turned the default planner's tuples into lists: turn them back."""
    if isinstance(value, dict):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return value


class StoragedReader(_ClusterCheckpoint, StorageReader):
    """A DCP ``StorageReader`` that loads checkpoint ``name`` from a storaged cluster.

    Any number of ranks and any sharding may load what any number of ranks saved:
    each rank fetches only the byte ranges of the boxes it needs. ``coalesce_gap``
    (bytes): runs of one chunk closer than this are fetched as one range, the gap
    included (0 reads exactly the bytes needed). After ``read_data`` completes,
    ``last_read`` tells what was needed and what was transferred. ``shm`` is
    ``Client``'s option of that name: chunks in the RAM of the node on this host are
    read from shared memory unless it is ``False``.
    """

    load_id: str
    _manifest: Manifest | None
    #: DCP storage index -> (shard position in the manifest, item)
    _items: dict[MetadataIndex, tuple[int, Item]]
    last_read: ReadStats | None

    def __init__(
        self,
        url: str | Sequence[str],
        name: str,
        token: str | None = None,
        *,
        coalesce_gap: int = DEFAULT_COALESCE_GAP,
        client_options: Mapping[str, Any] | None = None,
        shm: bool | None = None,
    ) -> None:
        super().__init__()
        if coalesce_gap < 0:
            raise ValueError("coalesce_gap must be >= 0")
        self._connect(url, name, token, client_options, shm)
        self._coalesce_gap = coalesce_gap
        self.reset()

    def _forget_last(self) -> None:
        self.load_id = uuid.uuid4().hex
        self._manifest = None
        self._items = {}
        self.last_read = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata``, rebuilt from the manifest (``CheckpointNotFound`` if none)."""
        if kwargs.get("rank") is not None:
            # DCP asks for per-rank metadata after the global one failed: there is none.
            raise ValueError(f"{self.name}: storaged keeps one manifest, no per-rank metadata")

        async def fetch() -> dict[str, Any]:
            async with self._client() as client:
                return await client.get_manifest(self.name)

        manifest = Manifest.from_wire(_run(fetch, "manifest"))
        state: dict[str, STORAGE_TYPES] = {}
        storage_data: dict[MetadataIndex, StoragedLocation] = {}
        items: dict[MetadataIndex, tuple[int, Item]] = {}
        for position, shard in enumerate(manifest.shards):
            for item in shard.items:
                location = StoragedLocation(shard.rank, item.start, item.length)
                if item.dtype == MSGPACK_DTYPE:
                    continue  # a numpy-client value: DCP could not decode it
                if item.dtype == BYTES_DTYPE:
                    index = MetadataIndex(item.key)
                    state[item.key] = BytesStorageMetadata()
                else:
                    offsets = torch.Size(item.offsets)
                    index = MetadataIndex(item.key, offsets)
                    entry = state.get(item.key)
                    if not isinstance(entry, TensorStorageMetadata):
                        entry = TensorStorageMetadata(
                            TensorProperties(dtype=torch_dtype(item.dtype)),
                            torch.Size(item.global_shape),
                            [],
                        )
                        state[item.key] = entry
                    entry.chunks.append(ChunkStorageMetadata(offsets, torch.Size(item.shape)))
                storage_data[index] = location
                items[index] = (position, item)
        dcp_meta = manifest.meta.get("dcp")
        dcp_meta = dcp_meta if isinstance(dcp_meta, Mapping) else {}
        save_id = dcp_meta.get("save_id")
        version = dcp_meta.get("version")
        self._manifest, self._items = manifest, items
        return Metadata(
            state_dict_metadata=state,
            planner_data=_planner_data_from_wire(dcp_meta.get("planner_data")),
            storage_data=storage_data,
            storage_meta=StorageMeta(
                checkpoint_id=self.name,
                save_id=save_id if isinstance(save_id, str) else None,
                load_id=self.load_id,
            ),
            version=version if isinstance(version, str) else None,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:
            raise RuntimeError("read_metadata must come first")
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self._manifest
        if manifest is None:
            raise RuntimeError("read_metadata must come first")
        tensors: list[_TensorRead] = []
        requests: list[Request] = []
        values: list[tuple[ReadItem, int, Item]] = []
        dtype_map: dict[str, np.dtype[Any]] = {}
        for read in plan.items:
            try:
                position, item = self._items[read.storage_index]
            except KeyError:
                raise KeyError(f"{self.name} has no item {read.storage_index}") from None
            if read.type == LoadItemType.BYTE_IO:
                values.append((read, position, item))
                continue
            saved = torch_dtype(item.dtype)
            dtype_map[item.dtype] = _storage_numpy_dtype(saved)
            target = planner.resolve_tensor(read).detach()
            lengths = tuple(int(n) for n in read.lengths)
            if tuple(target.shape) != lengths:
                raise ValueError(
                    f"{read.dest_index.fqn}: destination of shape {list(target.shape)} "
                    f"for a read of {list(lengths)}"
                )
            array = _numpy_view(target) if target.dtype == saved else None
            landing = target
            if array is None:  # another dtype or device: land in the saved dtype, copy after
                landing = torch.empty(lengths, dtype=saved)
                array = _numpy_view(landing)
                assert array is not None
            box = Box(
                tuple(o + s for o, s in zip(item.offsets, read.storage_offsets, strict=True)),
                lengths,
            )
            requests.append(
                Request(
                    item.key,
                    item.global_shape,
                    box,
                    array.dtype,
                    bool(array.flags.c_contiguous),
                )
            )
            tensors.append(_TensorRead(read, target, landing, array))

        def work() -> None:
            fetched = asyncio.run(self._fetch(manifest, requests, tensors, values, dtype_map))
            # The planner gets its data here, in this worker thread, before the future
            # completes (DCP's caller waits on it; planners need no locking).
            for tensor in tensors:
                if tensor.landing is not tensor.target:
                    tensor.target.copy_(tensor.landing)
                planner.commit_tensor(tensor.request, tensor.target)
            for (read, _, _), data in zip(values, fetched, strict=True):
                planner.load_bytes(read, io.BytesIO(data))

        return _torch_future(_spawn(work, "read"))

    async def _fetch(
        self,
        manifest: Manifest,
        requests: Sequence[Request],
        tensors: Sequence[_TensorRead],
        values: Sequence[tuple[ReadItem, int, Item]],
        dtype_map: Mapping[str, np.dtype[Any]],
    ) -> list[bytearray]:
        async with self._client() as client:
            holders = await client.plan(self.name)
            restore = await asyncio.to_thread(
                plan_restore,
                manifest,
                requests,
                dtype_map=dtype_map,
                coalesce_gap=self._coalesce_gap,
            )
            value_reads = [
                _read_stream(client, manifest.shards[position], item.start, item.length, holders)
                for _, position, item in values
            ]
            tensor_reads = execute_restore(
                client, manifest, restore, [t.array for t in tensors], holders=holders
            )
            # Values and tensors together; the first failure cancels the rest.
            done: list[Any] = await run_all([tensor_reads, run_all(value_reads)])
            fetched: list[bytearray] = done[1]
            self.last_read = ReadStats(
                tensor_bytes=restore.bytes_needed,
                value_bytes=sum(item.length for _, _, item in values),
                bytes_planned=restore.bytes_fetched,
                bytes_downloaded=client.stats.bytes_downloaded,
                requests=client.stats.chunks_downloaded,
                shm_bytes=client.stats.shm_bytes_downloaded,
            )
        return fetched
