"""The manifest's schema (API.md), checked once for server and client.

A manifest is a map ``{format, created, meta, shards}``; each shard a rank's stream, its
chunks (``[id, size]``) and its items (a box of an array, or a value, at
``[start, start + length)`` of the stream). ``check_schema`` checks a decoded document
against that shape, item by item, and returns it parsed. What is checked across items of
one key (one dtype and global shape; boxes that do not overlap, or that tile the shape)
is each side's: the server's is ``storaged.manifest``, the client's
``storaged.client.layout``. The server's bounds come on top, as ``ManifestLimits``.

A leaf the client may import: stdlib and ``storaged.ids`` only (numpy where a dtype's
size is wanted, imported there: ``storaged ls`` starts without it).

Every restoring rank checks the whole manifest (at 405B on 1,024 ranks: 96,896 chunks and
7,325 items), so a shard is checked first in whole-list passes that run in C (types, lengths
and bounds of each column, the ids' hex in one pass over their bytes); only when one of them
fails is it checked again entry by entry, which says where and how. The passes accept
nothing the entry-by-entry check refuses (they want exact types where it takes subclasses:
those fall through to it), so both give the same verdict and the same message.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import add, itemgetter, le
from typing import Any, Final

from storaged.ids import is_chunk_id

FORMAT: Final = 1
#: no size, offset or extent in a manifest comes near this; the overlap check works in int64
MAX_INT: Final = 2**62
#: the fields of a manifest document
FIELDS: Final = frozenset({"format", "created", "meta", "shards"})
#: the characters of a chunk id (``storaged.ids.CHUNK_ID_RE``: 64 of them)
_HEX_DIGITS: Final = b"0123456789abcdef"
_CHUNK_ID_LEN: Final = 64
_FIRST: Final = itemgetter(0)
_SECOND: Final = itemgetter(1)
_ITEM_FIELDS: Final = itemgetter(
    "key", "dtype", "global_shape", "offsets", "shape", "start", "length"
)

Shape = tuple[int, ...]


class SchemaError(ValueError):
    """A manifest breaks the schema; the message says where and how (the server answers
    it as 400 ``bad_manifest``, the client raises ``InvalidManifest``)."""


@dataclass(frozen=True, slots=True)
class ManifestLimits:
    """The server's bounds on top of the schema: a manifest is refused over any of them,
    as it is for an unknown field, a ``created`` that is not a finite non-negative number,
    or no shard at all."""

    max_chunk_size: int
    #: dimensions of an array (entries of ``global_shape``, ``offsets``, ``shape``)
    max_dims: int = 64


@dataclass(frozen=True, slots=True)
class ItemFields:
    """One checked item: its box lies inside its global shape and, for a numpy dtype,
    ``length`` is the bytes of its elements (``start``/``length`` against the stream are
    the shard's to check)."""

    key: str
    dtype: str
    global_shape: Shape
    offsets: Shape
    shape: Shape
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardFields:
    """One checked shard: every item lies inside its stream (the chunks, in order).

    ``unchecked_chunks``: with ``check_schema(chunks_on_read=True)``, the chunk list as the
    document has it, its sizes summed for the items' bounds but nothing more checked yet
    (``check_chunks`` does it when the shard is read); ``chunks`` is then empty."""

    rank: int
    chunks: tuple[tuple[str, int], ...]
    items: tuple[ItemFields, ...]
    unchecked_chunks: Sequence[Any] | None = None


@dataclass(frozen=True, slots=True)
class ManifestFields:
    """A checked document; ``chunks``: the distinct chunk ids in first-seen order, with
    their sizes (one size per id; of the shards whose chunks were checked)."""

    created: float
    meta: Mapping[str, Any]
    shards: tuple[ShardFields, ...]
    chunks: dict[str, int]


def _a_map(doc: object, where: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise SchemaError(f"{where} must be a map")
    return doc


def check_int(value: object, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise SchemaError(f"{what} must be an integer in [{minimum}, 2**62], got {value!r}")
    return value


def check_int_list(value: object, what: str, max_len: int | None = None) -> Shape:
    if not isinstance(value, list | tuple) or (max_len is not None and len(value) > max_len):
        if max_len is None:
            raise SchemaError(f"{what} must be a list of integers")
        raise SchemaError(f"{what} must be a list of at most {max_len} integers")
    return tuple(check_int(v, f"{what}[{i}]") for i, v in enumerate(value))


def numeric_item_size(dtype: str, shape: Shape) -> int | None:
    """Bytes an item of this numpy dtype and shape must span; None for other dtypes (values,
    or an array dtype numpy lacks, such as ``bfloat16``: its length cannot be checked)."""
    itemsize = _numeric_itemsize(dtype)
    return None if itemsize is None else math.prod(shape) * itemsize


@functools.lru_cache(maxsize=256)
def _numeric_itemsize(dtype: str) -> int | None:
    """A numeric numpy dtype's element size; None for any other name (a manifest names a
    handful of dtypes thousands of times: numpy parses each name once)."""
    import numpy as np

    try:
        parsed = np.dtype(dtype)
    except TypeError:
        return None
    if parsed.kind not in "biufc":
        return None  # flexible or object kinds ("bytes", "str", ...) carry their own length
    return parsed.itemsize


def check_item(
    doc: object,
    where: str,
    limits: ManifestLimits | None = None,
    stream_len: int | None = None,
    item_type: type[ItemFields] = ItemFields,
) -> ItemFields:
    """One ``items`` entry; ``where`` names it in messages. With ``stream_len``, the
    item must lie inside its rank's stream of that many bytes. ``item_type``: what to
    make of it (the client's ``Item``, built once)."""
    doc = _a_map(doc, where)
    key, dtype = doc.get("key"), doc.get("dtype")
    if not isinstance(key, str) or not key:
        raise SchemaError(f"{where}.key must be a non-empty string")
    if not isinstance(dtype, str) or not dtype:
        raise SchemaError(f"{where}.dtype must be a non-empty string")
    dims = None if limits is None else limits.max_dims
    gshape = check_int_list(doc.get("global_shape"), f"{where}.global_shape", dims)
    offsets = check_int_list(doc.get("offsets"), f"{where}.offsets", dims)
    shape = check_int_list(doc.get("shape"), f"{where}.shape", dims)
    if not len(gshape) == len(offsets) == len(shape):
        raise SchemaError(f"{where}: global_shape, offsets and shape differ in rank")
    for d, (g, o, s) in enumerate(zip(gshape, offsets, shape, strict=True)):
        if o + s > g:
            raise SchemaError(f"{where}: dimension {d} spans {o}+{s} > global {g}")
    start = check_int(doc.get("start"), f"{where}.start")
    length = check_int(doc.get("length"), f"{where}.length")
    if stream_len is not None and start + length > stream_len:
        raise SchemaError(
            f"{where} ({key}): bytes [{start}, {start + length}) lie outside its rank's "
            f"stream of {stream_len} bytes"
        )
    expected = numeric_item_size(dtype, shape)
    if expected is not None and expected != length:
        raise SchemaError(
            f"{where} ({key}): {dtype}{list(shape)} needs {expected} bytes, not {length}"
        )
    return item_type(key, dtype, gshape, offsets, shape, start, length)


@dataclass(slots=True)
class _Seen:
    """What the shards checked so far hold: a rank is one shard's, a chunk has one size."""

    ranks: set[int] = field(default_factory=set)
    sizes: dict[str, int] = field(default_factory=dict)


def check_shard(
    doc: object,
    where: str,
    limits: ManifestLimits | None = None,
    seen: _Seen | None = None,
    item_type: type[ItemFields] = ItemFields,
    chunks_on_read: bool = False,
) -> ShardFields:
    """One ``shards`` entry; ``seen``, the shards before it in the document; its items
    made ``item_type``. ``chunks_on_read``: see ``check_schema``."""
    doc = _a_map(doc, where)
    rank = check_int(doc.get("rank"), f"{where}.rank")
    seen = _Seen() if seen is None else seen
    if rank in seen.ranks:
        raise SchemaError(f"rank {rank} appears twice")
    seen.ranks.add(rank)
    stream = doc.get("chunks")
    if not isinstance(stream, list | tuple):
        raise SchemaError(f"{where}.chunks must be a list of [id, size]")
    summed = _stream_length(stream) if chunks_on_read else None
    if summed is None:
        checked = _chunks_at_once(stream, limits, seen)
        if checked is None:
            chunks = _chunks_one_by_one(stream, where, limits, seen)
            stream_len = sum(size for _, size in chunks)
        else:
            chunks, stream_len = checked
    else:
        chunks, stream_len = (), summed
    raw_items = doc.get("items")
    if not isinstance(raw_items, list | tuple):
        raise SchemaError(f"{where}.items must be a list")
    items = _items_at_once(raw_items, limits, stream_len, item_type)
    if items is None:
        if summed is not None:  # a fault in the chunk list comes first, as without summing
            check_chunks(stream, where, limits)
        items = tuple(
            check_item(raw, f"{where}.items[{i}]", limits, stream_len, item_type)
            for i, raw in enumerate(raw_items)
        )
    if summed is not None:
        return ShardFields(rank, (), items, stream)
    return ShardFields(rank, chunks, items)


def check_chunks(
    stream: object, where: str = "shard", limits: ManifestLimits | None = None
) -> tuple[tuple[str, int], ...]:
    """A shard's ``chunks`` on their own (an id listed twice keeps one size), as
    ``check_schema`` checks them; ``where`` names the shard in messages."""
    if not isinstance(stream, list | tuple):
        raise SchemaError(f"{where}.chunks must be a list of [id, size]")
    seen = _Seen()
    checked = _chunks_at_once(stream, limits, seen)
    if checked is not None:
        return checked[0]
    return _chunks_one_by_one(stream, where, limits, seen)


def _stream_length(stream: Sequence[Any]) -> int | None:
    """The sum of a chunk list's sizes in one pass, checking nothing else; None when the
    entries or sizes are not what a sum needs (the full check then says what is wrong)."""
    try:
        total = sum(map(_SECOND, stream))
    except (TypeError, KeyError, IndexError):
        return None
    return total if type(total) is int else None


def _chunks_one_by_one(
    stream: Sequence[Any], where: str, limits: ManifestLimits | None, seen: _Seen
) -> tuple[tuple[str, int], ...]:
    """A shard's ``chunks``, entry by entry: the first fault raises, saying where."""
    chunks: list[tuple[str, int]] = []
    for c_index, entry in enumerate(stream):
        cw = f"{where}.chunks[{c_index}]"
        if not (isinstance(entry, list | tuple) and len(entry) == 2):
            raise SchemaError(f"{cw} must be [id, size]")
        cid, size = entry
        if not is_chunk_id(cid):
            raise SchemaError(f"{cw}: {cid!r} is not a chunk id")
        size = check_int(size, f"{cw} size")
        if limits is not None and size > limits.max_chunk_size:
            raise SchemaError(f"{cw}: size over the max chunk size")
        if seen.sizes.setdefault(cid, size) != size:
            raise SchemaError(f"chunk {cid} is listed with two different sizes")
        chunks.append((cid, size))
    return tuple(chunks)


def _ints_in_range(values: Sequence[Any], maximum: int = MAX_INT) -> bool:
    """Every value an ``int`` (not a ``bool``, nor a subclass) in ``[0, maximum]``."""
    return not values or (
        set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= maximum
    )


def _chunks_at_once(
    stream: Sequence[Any], limits: ManifestLimits | None, seen: _Seen
) -> tuple[tuple[tuple[str, int], ...], int] | None:
    """A shard's ``chunks`` checked in whole-list passes, with the stream's length; None
    when one fails (then ``_chunks_one_by_one`` says where). ``seen`` is changed only when
    all pass."""
    if not stream:
        return (), 0
    if not set(map(type, stream)) <= {list, tuple} or set(map(len, stream)) != {2}:
        return None
    ids, sizes = list(map(_FIRST, stream)), list(map(_SECOND, stream))
    if set(map(type, ids)) != {str} or set(map(len, ids)) != {_CHUNK_ID_LEN}:
        return None
    joined = "".join(ids)
    # 64 characters each, all ASCII: no byte left once the hex digits are deleted
    if not joined.isascii() or joined.encode("ascii").translate(None, _HEX_DIGITS):
        return None
    cap = MAX_INT if limits is None else min(MAX_INT, limits.max_chunk_size)
    if not _ints_in_range(sizes, cap):
        return None
    mine = dict(zip(ids, sizes, strict=True))
    if len(mine) != len(ids) and len(set(zip(ids, sizes, strict=True))) != len(mine):
        return None  # an id repeated in the stream with another size
    # ids of earlier shards again (dedup across ranks): rare, and each must keep its size
    if not seen.sizes.keys().isdisjoint(mine) and any(
        seen.sizes.get(cid, size) != size for cid, size in mine.items()
    ):
        return None
    seen.sizes.update(mine)  # first-seen order kept: known ids keep their place
    return tuple(zip(ids, sizes, strict=True)), sum(sizes)


def _items_at_once(
    raw_items: Sequence[Any],
    limits: ManifestLimits | None,
    stream_len: int,
    item_type: type[ItemFields],
) -> tuple[ItemFields, ...] | None:
    """A shard's ``items`` checked field by field over all of them (``check_item``'s
    checks, column-wise), or None when one fails (then ``check_item`` says where)."""
    if not raw_items:
        return ()
    if set(map(type, raw_items)) != {dict}:
        return None
    try:
        columns = tuple(zip(*map(_ITEM_FIELDS, raw_items), strict=True))
    except KeyError:
        return None
    keys, dtypes, gshapes, offsets, shapes, starts, lengths = columns
    for names in (keys, dtypes):
        if set(map(type, names)) != {str} or not all(names):
            return None
    for lists in (gshapes, offsets, shapes):
        if not set(map(type, lists)) <= {list, tuple}:
            return None
    ndims = list(map(len, gshapes))
    if ndims != list(map(len, offsets)) or ndims != list(map(len, shapes)):
        return None
    if limits is not None and max(ndims) > limits.max_dims:
        return None
    flat_g, flat_o, flat_s = (list(chain.from_iterable(c)) for c in (gshapes, offsets, shapes))
    if not (_ints_in_range(flat_g) and _ints_in_range(flat_o) and _ints_in_range(flat_s)):
        return None
    if not all(map(le, map(add, flat_o, flat_s), flat_g)):
        return None  # a box reaches past its global shape
    if not (_ints_in_range(starts) and _ints_in_range(lengths)):
        return None
    if max(map(add, starts, lengths)) > stream_len:
        return None
    itemsizes = {dtype: _numeric_itemsize(dtype) for dtype in set(dtypes)}
    expected = [
        n if itemsizes[dtype] is None else math.prod(shape) * (itemsizes[dtype] or 0)
        for dtype, shape, n in zip(dtypes, shapes, lengths, strict=True)
    ]
    if expected != list(lengths):
        return None
    return tuple(
        map(
            item_type,
            keys,
            dtypes,
            map(tuple, gshapes),
            map(tuple, offsets),
            map(tuple, shapes),
            starts,
            lengths,
        )
    )


def check_schema(
    doc: object,
    limits: ManifestLimits | None = None,
    *,
    item_type: type[ItemFields] = ItemFields,
    chunks_on_read: bool = False,
) -> ManifestFields:
    """A decoded manifest document, checked shard by shard and item by item; with the
    server's ``limits``, also against those. ``SchemaError`` says what is wrong. Its
    items are made ``item_type`` (a subclass of ``ItemFields`` with the same fields).

    ``chunks_on_read``: each shard's chunk list is only summed, for its items' bounds, and
    left in ``ShardFields.unchecked_chunks`` for ``check_chunks`` when the shard is read
    (a restoring rank reads a few shards of many); an id listed by two shards with two
    sizes is then not looked for (the node refused that at commit; a reader's fetches
    follow the sizes of the shards it reads, each checked on its own)."""
    if not isinstance(doc, Mapping):
        raise SchemaError("the manifest must be a map")
    if limits is not None and set(doc) - FIELDS:
        raise SchemaError(f"unknown manifest field(s): {sorted(set(doc) - FIELDS)}")
    if doc.get("format") != FORMAT:
        raise SchemaError(f"format must be {FORMAT}, got {doc.get('format')!r}")
    created = doc.get("created")
    if (
        isinstance(created, bool)
        or not isinstance(created, int | float)
        or (limits is not None and (not math.isfinite(created) or created < 0))
    ):
        raise SchemaError("created must be a finite non-negative number (seconds since the epoch)")
    meta = doc.get("meta", {})
    if not isinstance(meta, Mapping):
        raise SchemaError("meta must be a map")
    raw_shards = doc.get("shards")
    if not isinstance(raw_shards, list | tuple) or (limits is not None and not raw_shards):
        raise SchemaError("shards must be a non-empty list")
    seen = _Seen()
    shards = tuple(
        check_shard(raw, f"shards[{i}]", limits, seen, item_type, chunks_on_read)
        for i, raw in enumerate(raw_shards)
    )
    return ManifestFields(float(created), meta, shards, seen.sizes)
