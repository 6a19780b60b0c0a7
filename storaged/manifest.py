"""Checkpoint manifests: the schema of API.md (``storaged.manifest_schema``), checked
strictly before anything is stored, with the server's limits and the per-key overlap check."""

from __future__ import annotations

import bisect
import heapq
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from storaged.errors import BadInput, TooLarge
from storaged.ids import chunk_id_of

# The schema is one for server and client (MAX_INT stays importable from here).
from storaged.manifest_schema import MAX_INT as MAX_INT
from storaged.manifest_schema import (
    ManifestLimits,
    SchemaError,
    Shape,
    ShardFields,
    check_schema,
)


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


def check_manifest(
    doc: object, max_chunk_size: int, *, max_items_per_key: int = 16384
) -> CheckedManifest:
    """Validate a decoded manifest; raise BadInput(bad_manifest) saying what is wrong.

    The schema (``storaged.manifest_schema``, the client's too) with the server's limits,
    then per key: one dtype and global shape, and boxes that share no element. A key with
    more than ``max_items_per_key`` items is refused (bad_manifest) before its boxes are
    compared."""
    if not isinstance(doc, dict):
        raise bad_manifest("the manifest must be a map")
    try:
        fields = check_schema(doc, ManifestLimits(max_chunk_size))
    except SchemaError as exc:
        raise bad_manifest(str(exc)) from exc
    for key, key_boxes in _boxes_by_key(fields.shards, max_items_per_key).items():
        check_disjoint(key, key_boxes)
    try:
        encoded = msgpack.packb(doc, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. meta nested too deeply
        raise bad_manifest(f"the manifest cannot be stored: {exc}") from exc
    return CheckedManifest(doc, encoded, chunk_id_of(encoded), fields.chunks)


def _boxes_by_key(shards: Iterable[ShardFields], max_items_per_key: int) -> dict[str, list[Box]]:
    """Each key's boxes, once every item of a key has its one dtype and global shape."""
    boxes: dict[str, list[Box]] = defaultdict(list)
    kinds: dict[str, tuple[str, Shape]] = {}
    for shard in shards:
        for item in shard.items:
            key, kind = item.key, (item.dtype, item.global_shape)
            if kinds.setdefault(key, kind) != kind:
                raise bad_manifest(f"key {key!r} is saved with two dtypes or global shapes")
            boxes[key].append((list(item.offsets), list(item.shape)))
            if len(boxes[key]) > max_items_per_key:
                raise bad_manifest(
                    f"key {key!r} has over {max_items_per_key} items (max_items_per_key)"
                )
    return boxes


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
