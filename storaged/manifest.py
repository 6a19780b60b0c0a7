"""Checkpoint manifests: the schema of API.md, checked strictly before anything is stored."""

from __future__ import annotations

import bisect
import heapq
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from storaged.errors import BadInput, TooLarge
from storaged.ids import chunk_id_of, is_chunk_id

MANIFEST_FORMAT = 1


def bad_manifest(message: str) -> BadInput:
    return BadInput("bad_manifest", message)


class _ObjectBudget:
    """A msgpack ``object_hook``/``list_hook`` that counts every container and its elements
    and gives up once ``limit`` is spent. msgpack's own limits are per container: an 8 MiB
    array of empty maps passes them and expands into ~600 MiB of dicts."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def __call__(self, obj: Any) -> Any:
        self.left -= len(obj) + 1
        if self.left < 0:
            raise _TooManyObjects
        return obj


class _TooManyObjects(Exception):
    pass


def _too_many(max_objects: int) -> TooLarge:
    return TooLarge("too_large", f"body decodes to over {max_objects} objects")


def unpack_limited(
    body: bytes, max_size: int, *, max_objects: int, code: str = "bad_request"
) -> Any:
    """msgpack with every length capped and at most ``max_objects`` objects in all.

    Raises TooLarge (``too_large``) over a bound, BadInput (``code``) for anything that does
    not decode (garbage, nesting deeper than msgpack's stack).
    """
    if len(body) > max_size:
        raise TooLarge("too_large", f"body over {max_size} bytes")
    budget = _ObjectBudget(max_objects)
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=max_size,
            max_bin_len=max_size,
            # Also bounds the list msgpack allocates up front from a stated length.
            max_array_len=min(max_size, max_objects),
            max_map_len=min(max_size, max_objects) // 2 + 1,
            max_ext_len=0,
            object_hook=budget,
            list_hook=budget,
        )
    except _TooManyObjects:
        raise _too_many(max_objects) from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        if "exceeds max_array_len" in str(exc) or "exceeds max_map_len" in str(exc):
            raise _too_many(max_objects) from exc
        raise BadInput(code, f"body is not valid msgpack: {exc}") from exc


def _json_objects_bound(body: bytes) -> int:
    """An upper bound of the objects a JSON text decodes to, without decoding it.

    Every object but the outermost is a list element or a map key or value: a non-empty
    list of n elements has n - 1 commas, a map of n entries n - 1 commas and n colons. So
    objects <= 1 + brackets + braces + commas + colons (those inside strings only raise
    the bound). ``bytes.count`` runs at memory speed."""
    return 1 + sum(body.count(c) for c in (b"[", b"{", b",", b":"))


def decode_document(
    body: bytes,
    content_type: str,
    max_size: int,
    *,
    max_objects: int,
    code: str = "bad_request",
) -> Any:
    """A msgpack or JSON request body, decoded within ``max_size`` bytes and ``max_objects``
    objects. Blocking (a large body takes long): run it in a thread.

    Raises TooLarge (``too_large``) over a bound; BadInput (``code``) when it does not decode.
    """
    if content_type != "application/json":
        return unpack_limited(body, max_size, max_objects=max_objects, code=code)
    if len(body) > max_size:
        raise TooLarge("too_large", f"body over {max_size} bytes")
    if _json_objects_bound(body) > max_objects:
        raise _too_many(max_objects)
    try:
        return json.loads(body)
    except RecursionError as exc:  # deep nesting: the input's fault, not ours
        raise BadInput(code, "body is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(code, f"body is not valid JSON: {exc}") from exc


@dataclass(frozen=True, slots=True)
class CheckedManifest:
    manifest: dict[str, Any]
    #: canonical msgpack encoding (what is stored and served)
    encoded: bytes
    digest: str
    #: distinct chunk ids in first-seen order, with their sizes
    chunks: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.chunks.values())


#: no size, offset or extent in a manifest comes near this; the overlap check works in int64
MAX_INT = 2**62


def _int(value: object, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise bad_manifest(f"{what} must be an integer in [{minimum}, 2**62], got {value!r}")
    return value


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > 64:
        raise bad_manifest(f"{what} must be a list of at most 64 integers")
    return [_int(v, f"{what}[{i}]") for i, v in enumerate(value)]


def _item_size(dtype: str, shape: list[int]) -> int | None:
    """Bytes an item of this numpy dtype and shape must span; None for non-numpy dtypes."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        return None
    if parsed.kind not in "biufc":
        return None  # flexible or object kinds ("bytes", "str", ...) carry their own length
    return math.prod(shape) * parsed.itemsize


def check_manifest(
    doc: object, max_chunk_size: int, *, max_items_per_key: int = 16384
) -> CheckedManifest:
    """Validate a decoded manifest; raise BadInput(bad_manifest) saying what is wrong.

    A key with more than ``max_items_per_key`` items is refused (bad_manifest) before its
    boxes are compared."""
    if not isinstance(doc, dict):
        raise bad_manifest("the manifest must be a map")
    unknown = set(doc) - {"format", "created", "meta", "shards"}
    if unknown:
        raise bad_manifest(f"unknown manifest field(s): {sorted(unknown)}")
    if doc.get("format") != MANIFEST_FORMAT:
        raise bad_manifest(f"format must be {MANIFEST_FORMAT}, got {doc.get('format')!r}")
    created = doc.get("created")
    if (
        isinstance(created, bool)
        or not isinstance(created, int | float)
        or not math.isfinite(created)
        or created < 0
    ):
        raise bad_manifest("created must be a finite non-negative number (seconds since the epoch)")
    if not isinstance(doc.get("meta", {}), dict):
        raise bad_manifest("meta must be a map")
    shards = doc.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad_manifest("shards must be a non-empty list")

    chunks: dict[str, int] = {}
    ranks: set[int] = set()
    boxes: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)
    key_kind: dict[str, tuple[str, list[int]]] = {}
    for s_index, shard in enumerate(shards):
        where = f"shards[{s_index}]"
        if not isinstance(shard, dict):
            raise bad_manifest(f"{where} must be a map")
        rank = _int(shard.get("rank"), f"{where}.rank")
        if rank in ranks:
            raise bad_manifest(f"rank {rank} appears twice")
        ranks.add(rank)
        stream = shard.get("chunks")
        if not isinstance(stream, list):
            raise bad_manifest(f"{where}.chunks must be a list of [id, size]")
        stream_len = 0
        for c_index, entry in enumerate(stream):
            if not (isinstance(entry, list | tuple) and len(entry) == 2):
                raise bad_manifest(f"{where}.chunks[{c_index}] must be [id, size]")
            cid, size = entry
            if not is_chunk_id(cid):
                raise bad_manifest(f"{where}.chunks[{c_index}]: {cid!r} is not a chunk id")
            size = _int(size, f"{where}.chunks[{c_index}] size")
            if size > max_chunk_size:
                raise bad_manifest(f"{where}.chunks[{c_index}]: size over the max chunk size")
            if chunks.setdefault(cid, size) != size:
                raise bad_manifest(f"chunk {cid} is listed with two different sizes")
            stream_len += size
        items = shard.get("items")
        if not isinstance(items, list):
            raise bad_manifest(f"{where}.items must be a list")
        for i_index, item in enumerate(items):
            iw = f"{where}.items[{i_index}]"
            if not isinstance(item, dict):
                raise bad_manifest(f"{iw} must be a map")
            key, dtype = item.get("key"), item.get("dtype")
            if not isinstance(key, str) or not key:
                raise bad_manifest(f"{iw}.key must be a non-empty string")
            if not isinstance(dtype, str) or not dtype:
                raise bad_manifest(f"{iw}.dtype must be a non-empty string")
            gshape = _int_list(item.get("global_shape"), f"{iw}.global_shape")
            offsets = _int_list(item.get("offsets"), f"{iw}.offsets")
            shape = _int_list(item.get("shape"), f"{iw}.shape")
            if not len(gshape) == len(offsets) == len(shape):
                raise bad_manifest(f"{iw}: global_shape, offsets and shape differ in rank")
            for d, (g, o, s) in enumerate(zip(gshape, offsets, shape, strict=True)):
                if o + s > g:
                    raise bad_manifest(f"{iw}: dimension {d} spans {o}+{s} > global {g}")
            start = _int(item.get("start"), f"{iw}.start")
            length = _int(item.get("length"), f"{iw}.length")
            if start + length > stream_len:
                raise bad_manifest(
                    f"{iw} ({key}): bytes [{start}, {start + length}) lie outside its rank's "
                    f"stream of {stream_len} bytes"
                )
            expected = _item_size(dtype, shape)
            if expected is not None and expected != length:
                raise bad_manifest(
                    f"{iw} ({key}): {dtype}{shape} needs {expected} bytes, not {length}"
                )
            kind = key_kind.setdefault(key, (dtype, gshape))
            if kind != (dtype, gshape):
                raise bad_manifest(f"key {key!r} is saved with two dtypes or global shapes")
            boxes[key].append((offsets, shape))
            if len(boxes[key]) > max_items_per_key:
                raise bad_manifest(
                    f"key {key!r} has over {max_items_per_key} items (max_items_per_key)"
                )
    for key, key_boxes in boxes.items():
        check_disjoint(key, key_boxes)
    try:
        encoded = msgpack.packb(doc, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. meta nested too deeply
        raise bad_manifest(f"the manifest cannot be stored: {exc}") from exc
    return CheckedManifest(doc, encoded, chunk_id_of(encoded), chunks)


Box = tuple[list[int], list[int]]  # (offsets, shape)


def check_disjoint(key: str, key_boxes: list[Box]) -> None:
    """Raise bad_manifest naming two boxes of ``key`` that share an element.

    A sweep over one dimension: boxes are taken in order of their start there, and each
    is compared with the *active* boxes, those not yet ended at that start. Until an
    overlap is found the active boxes are pairwise disjoint, and since all of them
    contain the sweep point, their extents in the other dimensions are disjoint too.
    With two dimensions left that makes them disjoint intervals, kept sorted: a new box
    can only meet its two neighbours there, O(n log n) in all. Dimensions where every box
    has the same extent are dropped first (a tensor split along one or two dimensions is
    such a case, whatever its rank); with three or more left, the new box is compared
    with the active ones in one numpy pass, O(n x active boxes).
    """
    boxes = [(o, s) for o, s in key_boxes if all(s)]  # an empty box holds no element
    if len(boxes) < 2:
        return
    ndim = len(boxes[0][0])
    dims = [d for d in range(ndim) if len({(o[d], s[d]) for o, s in boxes}) > 1]
    if not dims:  # all boxes alike (scalars included): the first two overlap
        raise _overlap(key, boxes[0], boxes[1])
    # Sweep along the dimension with the most distinct starts: the one the tensor is split
    # along most, so that few boxes are active at once.
    sweep = max(dims, key=lambda d: len({o[d] for o, _ in boxes}))
    rest = [d for d in dims if d != sweep]
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][sweep])
    if not rest:
        _sweep_1d(key, boxes, order, sweep)
    elif len(rest) == 1:
        _sweep_2d(key, boxes, order, sweep, rest[0])
    else:
        _sweep_nd(key, boxes, order, sweep, rest)


def _overlap(key: str, a: Box, b: Box) -> BadInput:
    return bad_manifest(f"key {key!r}: boxes at {a[0]} and {b[0]} overlap")


def _sweep_1d(key: str, boxes: list[Box], order: list[int], d: int) -> None:
    reach, last = -1, -1  # the furthest end so far, and whose
    for i in order:
        off, shape = boxes[i]
        if off[d] < reach:
            raise _overlap(key, boxes[last], boxes[i])
        reach, last = off[d] + shape[d], i


def _sweep_2d(key: str, boxes: list[Box], order: list[int], d: int, e: int) -> None:
    ending: list[tuple[int, int]] = []  # heap of (end along d, box) of the active boxes
    starts: list[int] = []  # the active boxes' starts along e, sorted...
    members: list[int] = []  # ...and which box each is (disjoint: starts are distinct)
    for i in order:
        off, shape = boxes[i]
        while ending and ending[0][0] <= off[d]:
            _, j = heapq.heappop(ending)
            pos = bisect.bisect_left(starts, boxes[j][0][e])
            del starts[pos], members[pos]
        lo, hi = off[e], off[e] + shape[e]
        pos = bisect.bisect_left(starts, lo)
        if pos > 0:
            prev = boxes[members[pos - 1]]
            if prev[0][e] + prev[1][e] > lo:
                raise _overlap(key, prev, boxes[i])
        if pos < len(starts) and starts[pos] < hi:
            raise _overlap(key, boxes[members[pos]], boxes[i])
        starts.insert(pos, lo)
        members.insert(pos, i)
        heapq.heappush(ending, (off[d] + shape[d], i))


def _sweep_nd(key: str, boxes: list[Box], order: list[int], d: int, rest: list[int]) -> None:
    lo = np.array([[boxes[i][0][r] for r in rest] for i in order], dtype=np.int64)
    hi = lo + np.array([[boxes[i][1][r] for r in rest] for i in order], dtype=np.int64)
    start = np.array([boxes[i][0][d] for i in order], dtype=np.int64)
    end = start + np.array([boxes[i][1][d] for i in order], dtype=np.int64)
    first = 0  # boxes before it in sweep order have all ended
    for k in range(1, len(order)):
        while first < k and end[first] <= start[k]:
            first += 1
        if first == k:
            continue
        # Boxes first..k-1 that are still active and meet box k in every other dimension.
        hits = (end[first:k] > start[k]) & np.all(
            (lo[first:k] < hi[k]) & (lo[k] < hi[first:k]), axis=1
        )
        if hits.any():
            j = first + int(np.argmax(hits))
            raise _overlap(key, boxes[order[j]], boxes[order[k]])
