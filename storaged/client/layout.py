"""The geometry and byte layout of sharded checkpoints. Pure: no I/O, no event loop.

Terms used throughout:

- A *box* is a region of a global array: ``offsets`` and ``shape`` (one entry per
  dimension). A rank saves, for every array, the box it holds.
- A rank's *stream* is its bytes, one item after another; an item lies at
  ``[start, start + length)`` of it, in row-major (C) order of its box. The stream
  is cut into *chunks* (content addressed, ``[id, size]`` in the manifest).
- Non-array values are items of dtype ``"msgpack"`` with ``global_shape``,
  ``offsets`` and ``shape`` all ``[]`` and their msgpack encoding as bytes.

``pack_stream`` places items in a stream so that unchanged large arrays dedup
from one checkpoint to the next; ``Manifest`` parses and checks the API.md
manifest; ``plan_restore`` turns requested boxes into chunk byte-range fetches.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from storaged.manifest_schema import FORMAT as FORMAT
from storaged.manifest_schema import (
    ItemFields,
    SchemaError,
    ShardFields,
    check_chunks,
    check_item,
    check_schema,
    check_shard,
)

if TYPE_CHECKING:
    # Imported where used: ``storaged ls`` parses no manifest and starts without numpy.
    import numpy as np

#: dtype of an item holding one msgpack-encoded non-array value.
MSGPACK_DTYPE: Final = "msgpack"
#: dtype of a non-tensor value the DCP writer saved: ``torch.save``'s bytes of it
#: (``storaged.client.dcp``; numpy must not know the name, see there).
DCP_BYTES_DTYPE: Final = "dcp-bytes"
#: dtypes of items that are one value (shape ``[]``), not an array.
VALUE_DTYPES: Final = frozenset({MSGPACK_DTYPE, DCP_BYTES_DTYPE})
DEFAULT_CHUNK_SIZE: Final = 8 << 20
#: Gaps up to this size between wanted byte runs of one chunk are fetched rather than
#: split into another request: on loopback a request costs about this much transfer.
DEFAULT_COALESCE_GAP: Final = 256 << 10
#: A box that is not one contiguous run in both saved and requested layout goes
#: through a staging buffer of at most this many bytes per tile.
DEFAULT_MAX_TILE: Final = 32 << 20

Shape = tuple[int, ...]
_Fields = TypeVar("_Fields")


class LayoutError(ValueError):
    """A checkpoint and a request (or a manifest on its own) do not fit together."""


class KeyNotSaved(LayoutError, KeyError):
    """The checkpoint has no item under the requested key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "key not saved"


class ShapeMismatch(LayoutError):
    """The requested global shape (or box) differs from what was saved."""


class DtypeMismatch(LayoutError):
    """The destination's dtype differs from the saved one."""


class RegionNotCovered(LayoutError):
    """Part of a requested box was saved by no rank."""


class InvalidManifest(LayoutError):
    """A manifest breaks the schema of API.md (caught before the server sees it)."""


class ShardingError(InvalidManifest):
    """The ranks' boxes of one key do not tile its global shape exactly.

    ``key``; ``element``, the first element (row-major order) saved by no rank or by
    several; ``boxes``, ``(rank, box)`` of the ranks that saved that element, or for a
    gap of every rank that saved a box of the key.
    """

    def __init__(
        self, message: str, key: str, element: Shape, boxes: Sequence[tuple[int, Box]]
    ) -> None:
        super().__init__(message)
        self.key = key
        self.element = element
        self.boxes = tuple(boxes)


class ShardGap(ShardingError):
    """An element of a key no rank saved: a restore of it would fail."""


class ShardOverlap(ShardingError):
    """An element of a key several ranks saved, with no telling which bytes are right."""


# --------------------------------------------------------------------------- boxes


def _volume(shape: Iterable[int]) -> int:
    return math.prod(shape)


def row_major_strides(shape: Shape) -> Shape:
    """Element strides of a C-ordered array of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


@dataclass(frozen=True, slots=True)
class Box:
    """``offsets`` and ``shape`` of a region of a global array (0-d boxes have one element)."""

    offsets: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"offsets {self.offsets} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"negative offsets or shape in {self}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return _volume(self.shape)

    @property
    def stop(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.shape, strict=True))

    def within(self, global_shape: Shape) -> bool:
        return len(global_shape) == self.ndim and all(
            e <= g for e, g in zip(self.stop, global_shape, strict=True)
        )

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it has no element."""
        if other.ndim != self.ndim:
            raise ValueError(f"boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        rel = tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True))
        if any(r < 0 for r in rel) or any(
            r + s > o for r, s, o in zip(rel, self.shape, outer.shape, strict=True)
        ):
            raise ValueError(f"{self} is not inside {outer}")
        return Box(rel, self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape, strict=True))


def run_dim(outer: Shape, inner: Shape) -> int:
    """The dimension along which ``inner``'s contiguous runs in ``outer`` are cut.

    Every dimension after it is whole in ``inner``; so each run spans ``inner`` along
    it and everything after, and runs repeat over the dimensions before it.
    """
    for d in range(len(outer) - 1, -1, -1):
        if inner[d] != outer[d]:
            return d
    return 0


def run_starts(outer: Shape, rel_offsets: Shape, inner: Shape, k: int) -> np.ndarray[Any, Any]:
    """Element offsets (row-major in ``outer``) of the runs of ``inner`` cut at dimension ``k``.

    ``inner`` lies at ``rel_offsets`` in ``outer``; runs come in row-major order.
    """
    import numpy as np

    strides = row_major_strides(outer)
    base = sum(o * s for o, s in zip(rel_offsets, strides, strict=True))
    starts = np.array([base], dtype=np.int64)
    for d in range(k):
        steps = np.arange(inner[d], dtype=np.int64) * strides[d]
        starts = (starts[:, None] + steps[None, :]).ravel()
    return starts


def _promote(box: Box) -> Box:
    """0-d boxes behave as 1-d boxes of one element in the run arithmetic."""
    return Box((0,), (1,)) if box.ndim == 0 else box


# --------------------------------------------------------------------------- streams


@dataclass(frozen=True, slots=True)
class StreamLayout:
    """Where each item lies in a rank's stream, and where the stream is cut into chunks."""

    #: Start of each item, in the order the items were given.
    starts: tuple[int, ...]
    #: ``(offset, size)`` of each chunk, in stream order; they tile ``[0, size)``.
    chunks: tuple[tuple[int, int], ...]
    size: int


def pack_stream(lengths: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE) -> StreamLayout:
    """Lay out items of ``lengths`` bytes in one stream and cut it into chunks.

    Items shorter than ``chunk_size`` come first, packed back to back in the order
    given, cut every ``chunk_size`` bytes. Each larger item follows on a chunk
    boundary of its own and ends its last chunk, so its chunks depend on its bytes
    alone: an array that did not change dedups against the previous checkpoint
    wherever it sits in the state dict. Chunks are never empty and never exceed
    ``chunk_size``.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if any(n < 0 for n in lengths):
        raise ValueError("negative item length")
    starts = [0] * len(lengths)
    chunks: list[tuple[int, int]] = []

    def cut(begin: int, end: int) -> None:
        for offset in range(begin, end, chunk_size):
            chunks.append((offset, min(chunk_size, end - offset)))

    pos = 0
    for index, n in enumerate(lengths):
        if n < chunk_size:
            starts[index] = pos
            pos += n
    cut(0, pos)
    for index, n in enumerate(lengths):
        if n >= chunk_size:
            starts[index] = pos
            cut(pos, pos + n)
            pos += n
    return StreamLayout(tuple(starts), tuple(chunks), pos)


# --------------------------------------------------------------------------- manifest


def _schema_checked(check: Callable[[Any, str], _Fields], doc: Any, where: str) -> _Fields:
    """``check(doc, where)`` of the schema, its ``SchemaError`` an ``InvalidManifest``."""
    try:
        return check(doc, where)
    except SchemaError as exc:
        raise InvalidManifest(str(exc)) from exc


def numpy_dtype(name: str, dtype_map: Mapping[str, Any] | None = None) -> np.dtype[Any] | None:
    """The numpy dtype a saved dtype name stands for, None for a value (``VALUE_DTYPES``).

    ``dtype_map`` overrides or extends numpy's names (e.g. ``{"bfloat16": np.uint16}``
    for bytes a framework saved in a dtype numpy lacks). ``DtypeMismatch`` if unknown.
    """
    if name in VALUE_DTYPES:
        return None
    import numpy as np

    if dtype_map is not None and name in dtype_map:
        mapped: np.dtype[Any] = np.dtype(dtype_map[name])
        return mapped
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise DtypeMismatch(f"unknown dtype {name!r}: pass a dtype_map entry for it") from None
    if dtype.name != name or dtype.kind not in "biufc":
        raise DtypeMismatch(f"{name!r} is not a numpy numeric dtype name")
    return dtype


@dataclass(frozen=True, slots=True)
class Item(ItemFields):
    """One item of a rank's stream (API.md ``items`` entry): the schema's fields
    (``key``, ``dtype``, ``global_shape``, ``offsets``, ``shape``, ``start``, ``length``)
    with the geometry a restore is planned by."""

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.shape)

    @property
    def end(self) -> int:
        return self.start + self.length

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "start": self.start,
            "length": self.length,
        }

    @classmethod
    def from_wire(cls, doc: Any) -> Item:
        """An ``items`` entry, checked on its own (the schema's ``check_item``)."""
        return cls.from_fields(_schema_checked(check_item, doc, "item"))

    @classmethod
    def from_fields(cls, f: ItemFields) -> Item:
        """The item of checked fields (they themselves when they are an ``Item``); a value
        (``VALUE_DTYPES``) must have shape ``[]``."""
        if f.dtype in VALUE_DTYPES and f.global_shape:
            raise InvalidManifest(f"{f.key}: a {f.dtype} item has shape []")
        if isinstance(f, Item):
            return f
        return cls(f.key, f.dtype, f.global_shape, f.offsets, f.shape, f.start, f.length)


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One rank's part of a manifest: its stream's chunks and the items in it."""

    rank: int
    chunks: tuple[tuple[str, int], ...]
    items: tuple[Item, ...]

    @property
    def stream_size(self) -> int:
        return sum(size for _, size in self.chunks)

    def chunk_offsets(self) -> list[int]:
        """Start of each chunk in the stream, plus the stream size at the end."""
        offsets = [0]
        for _, size in self.chunks:
            offsets.append(offsets[-1] + size)
        return offsets

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "chunks": [[chunk, size] for chunk, size in self.chunks],
            "items": [item.to_wire() for item in self.items],
        }

    @classmethod
    def from_wire(cls, doc: Any) -> ShardEntry:
        """A ``shards`` entry, checked on its own (the schema's ``check_shard``)."""
        return cls.from_fields(_schema_checked(check_shard, doc, "shard"))

    @classmethod
    def from_fields(cls, f: ShardFields, where: str = "shard") -> ShardEntry:
        """The shard of checked fields; one whose chunks are unchecked (``check_schema``'s
        ``chunks_on_read``) checks them when they are first read (``where`` names it)."""
        items = tuple(map(Item.from_fields, f.items))
        if f.unchecked_chunks is not None:
            return _ShardCheckedOnRead(f.rank, f.unchecked_chunks, items, where)
        return cls(f.rank, f.chunks, items)


#: the dataclass's own storage of ``ShardEntry.chunks`` (a slot)
_CHUNKS_SLOT: Final = ShardEntry.__dict__["chunks"]


class _ShardCheckedOnRead(ShardEntry):
    """A shard whose chunk list is checked (the schema's ``check_chunks``) and made
    ``chunks`` the first time anything reads them: planning, ``stream_size``, equality.
    ``InvalidManifest`` then says what is wrong, before any chunk is fetched."""

    __slots__ = ("_unchecked", "_where")
    _unchecked: Sequence[Any] | None
    _where: str

    def __init__(self, rank: int, unchecked: Sequence[Any], items: tuple[Item, ...], where: str):
        object.__setattr__(self, "_unchecked", unchecked)
        object.__setattr__(self, "_where", where)
        super().__init__(rank, (), items)

    @property
    def chunks(self) -> tuple[tuple[str, int], ...]:
        unchecked = getattr(self, "_unchecked", None)  # a copy or unpickled one: the tuple
        if unchecked is not None:  # another thread checking at once makes the same tuple
            _CHUNKS_SLOT.__set__(self, _schema_checked(check_chunks, unchecked, self._where))
            object.__setattr__(self, "_unchecked", None)
        chunks: tuple[tuple[str, int], ...] = _CHUNKS_SLOT.__get__(self)
        return chunks

    @chunks.setter
    def chunks(self, value: tuple[tuple[str, int], ...]) -> None:  # the dataclass's __init__
        _CHUNKS_SLOT.__set__(self, value)


def _check_keys(shards: Sequence[ShardEntry], *, complete: bool = False) -> None:
    """Per key: one dtype, one global shape, and no two boxes sharing an element; with
    ``complete``, also no element left out (``ShardGap``)."""
    by_key: dict[str, list[tuple[int, Item]]] = {}
    for shard in shards:
        for item in shard.items:
            by_key.setdefault(item.key, []).append((shard.rank, item))
    for key, entries in by_key.items():
        _, first = entries[0]
        for rank, item in entries[1:]:
            if item.dtype != first.dtype or item.global_shape != first.global_shape:
                raise InvalidManifest(
                    f"{key}: rank {rank} saved {item.dtype}{list(item.global_shape)}, "
                    f"another rank {first.dtype}{list(first.global_shape)}"
                )
        if _tiled_at_a_glance(first.global_shape, [item for _, item in entries], complete):
            continue
        boxes = [(rank, _promote(item.box)) for rank, item in entries if item.box.size > 0]
        fault = tiling_fault(key, first.global_shape, boxes)
        if fault is None:
            continue
        if complete or isinstance(fault, ShardOverlap):
            raise fault
        # A gap is restore's to report, for the region it is asked for; an overlap
        # elsewhere is still an error.
        _check_disjoint(key, first.global_shape, boxes)


def _tiled_at_a_glance(global_shape: Shape, items: Sequence[Item], complete: bool) -> bool:
    """True when the items' boxes share no element (and, with ``complete``, hold every
    element of ``global_shape``) as the common layouts show at a glance: one box, or boxes
    alike but along one dimension whose extents there do not meet. False says nothing:
    ``tiling_fault`` then decides (and names the element). Each box lies inside the shape
    (the schema's check), so disjoint boxes whose volumes add up to the shape's tile it."""
    boxes = [(item.offsets, item.shape) for item in items if _volume(item.shape)]
    if complete and sum(_volume(shape) for _, shape in boxes) != _volume(global_shape):
        return False
    if len(boxes) < 2:
        return True
    for d in range(len(global_shape)):
        if len({(o[:d] + o[d + 1 :], s[:d] + s[d + 1 :]) for o, s in boxes}) == 1:
            runs = sorted((o[d], o[d] + s[d]) for o, s in boxes)
            return all(end <= start for (_, end), (start, _) in itertools.pairwise(runs))
    return False


def _describe(rank: int, box: Box) -> str:
    return f"rank {rank} {list(box.offsets)}+{list(box.shape)}"


def tiling_fault(
    key: str, global_shape: Shape, boxes: Sequence[tuple[int, Box]]
) -> ShardingError | None:
    """None when ``(rank, box)`` ``boxes`` hold every element of ``global_shape`` exactly
    once; else the error for the first element (row-major) held by none or by several.

    O(n 2^d) for n boxes of d dimensions: every box adds its corners to a map with sign
    (-1)^(number of upper bounds), the whole shape subtracts its own. That signed corner
    sum is the mixed difference of each element's coverage count minus one, so the
    boxes tile the shape exactly iff every point sums to zero; and the smallest point
    that does not is the first element whose count is wrong (its prefix sum is itself).
    """
    whole = _promote(Box((0,) * len(global_shape), global_shape))
    weights: defaultdict[Shape, int] = defaultdict(int)
    for sign, box in itertools.chain([(-1, whole)], ((1, b) for _, b in boxes)):
        bounds = [((o, 1), (o + n, -1)) for o, n in zip(box.offsets, box.shape, strict=True)]
        for corner in itertools.product(*bounds):
            point = tuple(c for c, _ in corner)
            weights[point] += sign * math.prod(w for _, w in corner)
    wrong = [point for point, weight in weights.items() if weight]
    if not wrong:
        return None
    element = min(wrong)  # an element of the shape: see the docstring
    holders = [
        (rank, box)
        for rank, box in boxes
        if all(o <= x < e for o, x, e in zip(box.offsets, element, box.stop, strict=True))
    ]
    at = list(element[: len(global_shape)])  # a 0-d key's one element is []
    if not holders:
        saved = ", ".join(_describe(rank, box) for rank, box in boxes[:8])
        more = f" and {len(boxes) - 8} more" if len(boxes) > 8 else ""
        return ShardGap(
            f"{key}: gap at element {at} of global shape {list(global_shape)}, saved by no "
            f"rank (boxes saved: {saved or 'none'}{more})",
            key,
            element,
            boxes,
        )
    named = " and ".join(_describe(rank, box) for rank, box in holders)
    return ShardOverlap(f"{key}: boxes overlap at element {at}: {named}", key, element, holders)


def _check_disjoint(key: str, global_shape: Shape, boxes: Sequence[tuple[int, Box]]) -> None:
    """``ShardOverlap`` if two boxes share an element (for boxes that leave gaps, where
    ``tiling_fault`` only finds the first wrong element)."""
    ordered = sorted(boxes, key=lambda entry: entry[1].offsets)
    # Sweep along dimension 0: only boxes still open there can overlap the next one.
    open_boxes: list[tuple[int, Box]] = []
    for rank, box in ordered:
        open_boxes = [(r, b) for r, b in open_boxes if b.stop[0] > box.offsets[0]]
        for other_rank, other in open_boxes:
            common = other.intersect(box)
            if common is not None:
                pair = [(other_rank, other), (rank, box)]
                raise ShardOverlap(
                    f"{key}: boxes overlap at element {list(common.offsets[: len(global_shape)])}: "
                    f"{_describe(other_rank, other)} and {_describe(rank, box)}",
                    key,
                    common.offsets,
                    pair,
                )
        open_boxes.append((rank, box))


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint's manifest (API.md), parsed and checked."""

    created: float
    meta: Mapping[str, Any]
    shards: tuple[ShardEntry, ...]
    format: int = FORMAT
    _index: dict[str, list[tuple[int, Item]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        for position, shard in enumerate(self.shards):
            for item in shard.items:
                self._index.setdefault(item.key, []).append((position, item))

    def keys(self) -> list[str]:
        return list(self._index)

    def items_of(self, key: str) -> list[tuple[int, Item]]:
        """``(shard position, item)`` for every saved piece of ``key``; ``KeyNotSaved`` if none."""
        try:
            return self._index[key]
        except KeyError:
            raise KeyNotSaved(f"the checkpoint has no item {key!r}") from None

    @property
    def chunk_ids(self) -> list[str]:
        """Distinct chunk ids, in first-use order."""
        return list(dict.fromkeys(c for shard in self.shards for c, _ in shard.chunks))

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "created": self.created,
            "meta": dict(self.meta),
            "shards": [shard.to_wire() for shard in self.shards],
        }

    @classmethod
    def from_wire(
        cls, doc: Any, *, complete: bool = False, chunks_on_read: bool = False
    ) -> Manifest:
        """Parse and check a manifest document; ``InvalidManifest`` says what is wrong:
        the schema (``storaged.manifest_schema``, the server's too), then per key one dtype
        and global shape, and boxes that share no element.

        A key whose boxes leave part of its global shape unsaved is let through (restore
        refuses to read that part, ``RegionNotCovered``) unless ``complete``.

        ``chunks_on_read`` (a restore's): each shard's chunk list is checked when it is
        first read (``plan_restore`` reads those of the shards it fetches from), not here;
        everything else is checked here all the same. A rank of a large job reads a few
        shards of many: at 405B on 1,024 ranks, 96,896 chunks of which it reads 1-2 %.
        """

        def check(d: Any, _: str) -> Any:
            return check_schema(d, item_type=Item, chunks_on_read=chunks_on_read)

        fields = _schema_checked(check, doc, "manifest")
        shards = tuple(
            ShardEntry.from_fields(s, f"shards[{i}]") for i, s in enumerate(fields.shards)
        )
        _check_keys(shards, complete=complete)
        return cls(fields.created, fields.meta, shards)


def _without_repeats(shards: Iterable[ShardEntry]) -> list[ShardEntry]:
    """By rank; where several ranks saved the same box of a key (a replicated array, or a
    non-array value every rank passed), only the lowest rank's item is kept."""
    entries = sorted(shards, key=lambda s: s.rank)
    seen: set[tuple[str, Shape, Shape]] = set()
    kept: list[ShardEntry] = []
    for shard in entries:
        items = []
        for item in shard.items:
            box_key = (item.key, item.offsets, item.shape)
            if box_key in seen and item.box.size > 0:
                continue
            seen.add(box_key)
            items.append(item)
        kept.append(ShardEntry(shard.rank, shard.chunks, tuple(items)))
    return kept


def check_layout(items: Mapping[int, Sequence[Item]]) -> None:
    """Check the ranks' items (``{rank: items}``) as ``build_manifest`` will, before any
    byte is uploaded: ``ShardGap``, ``ShardOverlap``, ``InvalidManifest``."""
    _check_keys(
        _without_repeats(ShardEntry(rank, (), tuple(its)) for rank, its in items.items()),
        complete=True,
    )


def build_manifest(
    shards: Iterable[Mapping[str, Any] | ShardEntry],
    *,
    created: float,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest document (API.md) for the ranks' shard entries, checked.

    Shards are ordered by rank. Where several ranks saved the same box of a key (a
    replicated array, or a non-array value every rank passed), only the lowest rank's
    item is kept. The other boxes of a key must tile its global shape exactly:
    ``ShardGap`` names an element no rank saved, ``ShardOverlap`` one several ranks
    saved (both ``InvalidManifest``, as is any other fault).
    """
    entries = [s if isinstance(s, ShardEntry) else ShardEntry.from_wire(s) for s in shards]
    kept = _without_repeats(entries)
    doc = Manifest(float(created), dict(meta or {}), tuple(kept)).to_wire()
    Manifest.from_wire(doc, complete=True)  # the same checks as a manifest read back, and more
    return doc


# --------------------------------------------------------------------------- restore planning


@dataclass(frozen=True, slots=True)
class Request:
    """One destination: the box of key ``key`` that an array (or a value) should receive."""

    key: str
    global_shape: Shape
    box: Box
    #: Expected element type; None asks for a msgpack value.
    dtype: np.dtype[Any] | None
    #: True when the destination's memory is one C-ordered block (direct writes allowed).
    contiguous: bool = True


BufferKind = Literal["target", "staging", "value"]


@dataclass(frozen=True, slots=True)
class Part:
    """Bytes ``[src, src + length)`` of a fetch go to ``offset`` of buffer ``(kind, index)``."""

    src: int
    length: int
    kind: BufferKind
    index: int
    offset: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """One ranged GET: bytes ``[start, end)`` of chunk ``chunk``, scattered into ``parts``."""

    chunk: str
    start: int
    end: int
    parts: tuple[Part, ...]

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def direct(self) -> bool:
        """True when the bytes land in one buffer as fetched (no bounce buffer needed)."""
        return (
            len(self.parts) == 1
            and self.parts[0].src == 0
            and self.parts[0].length == (self.end - self.start)
        )


@dataclass(frozen=True, slots=True)
class StagedCopy:
    """A tile fetched into a staging buffer, then copied into its target array.

    The staging buffer holds the saved box's bytes from the tile's first element
    to its last; the tile is the strided view ``shape`` / ``strides`` (bytes) at
    offset 0 of it, and goes to ``dest`` (in the target's own coordinates).
    """

    target: int
    size: int
    shape: Shape
    strides: Shape
    dest: Box
    fetches: tuple[Fetch, ...]


@dataclass(frozen=True, slots=True)
class ValueRead:
    """A value of ``length`` bytes for request ``request``, saved as ``dtype`` (one of
    ``VALUE_DTYPES``: how to decode the bytes)."""

    request: int
    length: int
    dtype: str = MSGPACK_DTYPE


@dataclass(frozen=True, slots=True)
class RestorePlan:
    requests: tuple[Request, ...]
    #: Fetches straight into targets or value buffers (kinds "target" and "value").
    fetches: tuple[Fetch, ...]
    #: Tiles that need a staging buffer (their fetches have kind "staging").
    staged: tuple[StagedCopy, ...]
    #: Value buffers (index = Part.index for kind "value").
    values: tuple[ValueRead, ...]
    #: Bytes the requests need, and the bytes the fetches transfer (gaps included).
    bytes_needed: int
    bytes_fetched: int
    #: The size of every chunk of the shards the fetches read (one size per id among them);
    #: None in a plan made without ``plan_restore``.
    chunk_sizes: Mapping[str, int] | None = None


def _split_stream_range(
    shard: ShardEntry, offsets: Sequence[int], begin: int, end: int
) -> Iterable[tuple[str, int, int, int]]:
    """``(chunk, start, end, position in [begin, end))`` pieces of stream bytes ``[begin, end)``."""
    index = bisect.bisect_right(offsets, begin) - 1
    pos = begin
    while pos < end:
        chunk_start = offsets[index]
        chunk_end = offsets[index + 1]
        take_end = min(end, chunk_end)
        if take_end > pos:
            yield shard.chunks[index][0], pos - chunk_start, take_end - chunk_start, pos - begin
        pos = take_end
        index += 1


@dataclass(slots=True)
class _Piece:
    chunk: str
    start: int
    end: int
    kind: BufferKind
    index: int
    offset: int


def _tiles(outer: Shape, rel: Shape, shape: Shape, itemsize: int, max_span: int) -> list[Box]:
    """Split box ``rel + shape`` of ``outer`` until each piece spans at most ``max_span`` bytes."""
    strides = row_major_strides(outer)

    def span(offsets: Shape, extent: Shape) -> int:
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        last = sum((o + e - 1) * s for o, e, s in zip(offsets, extent, strides, strict=True))
        return (last - first + 1) * itemsize

    done: list[Box] = []
    todo = [Box(rel, shape)]
    while todo:
        box = todo.pop()
        size = span(box.offsets, box.shape)
        splittable = [d for d, e in enumerate(box.shape) if e > 1]
        if size <= max_span or not splittable:
            done.append(box)
            continue
        d = splittable[0]
        parts = min(box.shape[d], -(-size // max_span))
        step = -(-box.shape[d] // parts)
        for lo in range(0, box.shape[d], step):
            offsets = list(box.offsets)
            extent = list(box.shape)
            offsets[d] += lo
            extent[d] = min(step, box.shape[d] - lo)
            todo.append(Box(tuple(offsets), tuple(extent)))
    done.sort(key=lambda b: b.offsets)
    return done


def plan_restore(
    manifest: Manifest,
    requests: Sequence[Request],
    *,
    dtype_map: Mapping[str, Any] | None = None,
    coalesce_gap: int = DEFAULT_COALESCE_GAP,
    max_tile: int = DEFAULT_MAX_TILE,
) -> RestorePlan:
    """The fetches that fill ``requests`` from the checkpoint, reading only what they need.

    Each requested box is intersected with the saved boxes of its key. An
    intersection that is contiguous in the destination run by run, with runs of at
    least ``coalesce_gap`` bytes (or a single run), is fetched straight into the
    destination. Any other goes through staging tiles of at most ``max_tile`` bytes,
    where runs of one chunk separated by at most ``coalesce_gap`` bytes are fetched
    as one range. Small direct pieces of one chunk close together are merged into
    one fetch with several parts.

    Raises ``KeyNotSaved``, ``ShapeMismatch``, ``DtypeMismatch`` or ``RegionNotCovered``;
    ``InvalidManifest`` for the chunk list of a shard it reads, when the manifest was parsed
    with ``chunks_on_read``.
    """
    planner = _Planner(manifest, dtype_map, coalesce_gap, max_tile)
    for req_index, req in enumerate(requests):
        saved = manifest.items_of(req.key)
        first = saved[0][1]
        if first.dtype in VALUE_DTYPES or req.dtype is None:
            planner.value(req_index, req, saved)
        else:
            planner.array(req_index, req, saved)
    fetches = _merge_pieces(planner.pieces, coalesce_gap)
    staged = planner.staged
    fetched = sum(f.length for f in fetches) + sum(f.length for s in staged for f in s.fetches)
    return RestorePlan(
        tuple(requests),
        tuple(fetches),
        tuple(staged),
        tuple(planner.values),
        planner.needed,
        fetched,
        planner.chunk_sizes,
    )


@dataclass(eq=False)
class _Planner:
    """What ``plan_restore`` gathers, request by request: direct pieces (merged into
    fetches at the end), staged tiles, value buffers, and the bytes the requests need."""

    manifest: Manifest
    dtype_map: Mapping[str, Any] | None
    coalesce_gap: int
    max_tile: int
    # Only the shards a request reads: a rank of a large job reads a few of many.
    chunk_offsets: dict[int, list[int]] = field(default_factory=dict, init=False)
    chunk_sizes: dict[str, int] = field(default_factory=dict, init=False)
    pieces: list[_Piece] = field(default_factory=list, init=False)
    staged: list[StagedCopy] = field(default_factory=list, init=False)
    values: list[ValueRead] = field(default_factory=list, init=False)
    needed: int = field(default=0, init=False)

    def value(self, req_index: int, req: Request, saved: list[tuple[int, Item]]) -> None:
        """A value (``VALUE_DTYPES``): its bytes go whole to a value buffer."""
        first = saved[0][1]
        if first.dtype not in VALUE_DTYPES:
            raise DtypeMismatch(f"{req.key}: saved as an array of {first.dtype}, not a value")
        if req.dtype is not None:
            raise DtypeMismatch(f"{req.key}: saved as a {first.dtype} value, not an array")
        position, item = saved[0]
        value_index = len(self.values)
        self.values.append(ValueRead(req_index, item.length, first.dtype))
        self.needed += item.length
        for chunk, start, end, at in _split_stream_range(
            self.manifest.shards[position], self.offsets(position), item.start, item.end
        ):
            self.pieces.append(_Piece(chunk, start, end, "value", value_index, at))

    def offsets(self, position: int) -> list[int]:
        """``ShardEntry.chunk_offsets`` of the shard at ``position``, computed once."""
        found = self.chunk_offsets.get(position)
        if found is None:
            shard = self.manifest.shards[position]
            found = self.chunk_offsets[position] = shard.chunk_offsets()
            for chunk, size in shard.chunks:
                if self.chunk_sizes.setdefault(chunk, size) != size:
                    raise InvalidManifest(f"chunk {chunk} is listed with two different sizes")
        return found

    def array(self, req_index: int, req: Request, saved: list[tuple[int, Item]]) -> None:
        """A box of an array: its intersection with each saved box of the key."""
        first = saved[0][1]
        saved_dtype = numpy_dtype(first.dtype, self.dtype_map)
        assert saved_dtype is not None
        if saved_dtype != req.dtype:
            raise DtypeMismatch(f"{req.key}: saved as {first.dtype}, destination is {req.dtype}")
        if tuple(first.global_shape) != tuple(req.global_shape):
            raise ShapeMismatch(
                f"{req.key}: saved global shape {list(first.global_shape)}, "
                f"requested {list(req.global_shape)}"
            )
        if not req.box.within(req.global_shape):
            raise ShapeMismatch(f"{req.key}: requested {req.box} outside {req.global_shape}")
        itemsize = saved_dtype.itemsize
        covered = 0
        for position, item in saved:
            if item.length != item.box.size * itemsize:
                raise DtypeMismatch(
                    f"{req.key}: {item.length} bytes saved for {item.box.size} elements "
                    f"of {first.dtype} as {saved_dtype}"
                )
            both = req.box.intersect(item.box)
            if both is None:
                continue
            covered += both.size
            self.needed += both.size * itemsize
            self._intersection(req_index, req, position, item, both, itemsize)
        if covered != req.box.size:
            raise RegionNotCovered(
                f"{req.key}: the saved shards cover {covered} of the {req.box.size} elements "
                f"of box offsets={list(req.box.offsets)} shape={list(req.box.shape)}"
            )

    def _intersection(
        self, req_index: int, req: Request, position: int, item: Item, both: Box, itemsize: int
    ) -> None:
        """Box ``both`` of a saved ``item``: straight into the target run by run when the
        runs allow it, else through staging tiles."""
        target_box = _promote(req.box)
        source_box = _promote(item.box)
        both = _promote(both)
        shard = self.manifest.shards[position]
        offsets = self.offsets(position)
        rel_src = both.relative_to(source_box)
        rel_dst = both.relative_to(target_box)
        k = run_dim(source_box.shape, both.shape)
        run_bytes = both.shape[k] * _volume(source_box.shape[k + 1 :]) * itemsize
        src_runs = run_starts(source_box.shape, rel_src.offsets, both.shape, k)
        direct = (
            req.contiguous
            and run_dim(target_box.shape, both.shape) <= k
            and (len(src_runs) == 1 or run_bytes >= self.coalesce_gap)
        )
        if direct:
            dst_runs = run_starts(target_box.shape, rel_dst.offsets, both.shape, k)
            for src_run, dst_run in zip(src_runs.tolist(), dst_runs.tolist(), strict=True):
                begin = item.start + src_run * itemsize
                for chunk, start, end, at in _split_stream_range(
                    shard, offsets, begin, begin + run_bytes
                ):
                    self.pieces.append(
                        _Piece(chunk, start, end, "target", req_index, dst_run * itemsize + at)
                    )
            return
        src_strides = tuple(s * itemsize for s in row_major_strides(source_box.shape))
        for tile in _tiles(source_box.shape, rel_src.offsets, both.shape, itemsize, self.max_tile):
            dest = Box(
                tuple(
                    t - s + d
                    for t, s, d in zip(tile.offsets, rel_src.offsets, rel_dst.offsets, strict=True)
                ),
                tile.shape,
            )
            self.staged.append(
                _staged_tile(
                    req_index,
                    shard,
                    offsets,
                    item.start,
                    source_box.shape,
                    src_strides,
                    tile,
                    dest,
                    itemsize,
                    self.coalesce_gap,
                    len(self.staged),
                )
            )


def _staged_tile(
    req_index: int,
    shard: ShardEntry,
    offsets: Sequence[int],
    item_start: int,
    source_shape: Shape,
    src_strides: Shape,
    tile: Box,
    dest: Box,
    itemsize: int,
    coalesce_gap: int,
    staged_index: int,
) -> StagedCopy:
    import numpy as np

    k = run_dim(source_shape, tile.shape)
    run_bytes = tile.shape[k] * _volume(source_shape[k + 1 :]) * itemsize
    starts = run_starts(source_shape, tile.offsets, tile.shape, k) * itemsize
    span_start = int(starts[0])
    span_end = int(starts[-1]) + run_bytes
    # Runs closer than coalesce_gap are fetched as one range, gap included.
    breaks = np.nonzero(starts[1:] - (starts[:-1] + run_bytes) > coalesce_gap)[0]
    range_starts = np.concatenate(([starts[0]], starts[breaks + 1]))
    range_ends = np.concatenate((starts[breaks] + run_bytes, [starts[-1] + run_bytes]))
    fetches: list[Fetch] = []
    for lo, hi in zip(range_starts.tolist(), range_ends.tolist(), strict=True):
        begin = item_start + lo
        for chunk, start, end, at in _split_stream_range(shard, offsets, begin, item_start + hi):
            part = Part(0, end - start, "staging", staged_index, lo - span_start + at)
            fetches.append(Fetch(chunk, start, end, (part,)))
    return StagedCopy(
        req_index, span_end - span_start, tile.shape, src_strides, dest, tuple(fetches)
    )


def _merge_pieces(pieces: list[_Piece], coalesce_gap: int) -> list[Fetch]:
    """Fetches for the pieces: small ones of one chunk close together share a fetch."""
    fetches: list[Fetch] = []
    small: list[_Piece] = []
    for piece in pieces:
        if piece.end - piece.start >= coalesce_gap:
            part = Part(0, piece.end - piece.start, piece.kind, piece.index, piece.offset)
            fetches.append(Fetch(piece.chunk, piece.start, piece.end, (part,)))
        else:
            small.append(piece)
    small.sort(key=lambda p: (p.chunk, p.start))
    group: list[_Piece] = []
    group_end = 0

    def flush() -> None:
        if not group:
            return
        start = group[0].start
        parts = tuple(
            Part(p.start - start, p.end - p.start, p.kind, p.index, p.offset) for p in group
        )
        fetches.append(Fetch(group[0].chunk, start, group_end, parts))
        group.clear()

    for piece in small:
        if group and (piece.chunk != group[0].chunk or piece.start - group_end > coalesce_gap):
            flush()
        group_end = max(group_end, piece.end) if group else piece.end
        group.append(piece)
    flush()
    return fetches
