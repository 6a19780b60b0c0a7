"""Checkpoint manifests: the schema of API.md, checked strictly before anything is stored."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from storaged.errors import ApiError
from storaged.ids import chunk_id_of, is_chunk_id

MANIFEST_FORMAT = 1


def bad_manifest(message: str) -> ApiError:
    return ApiError(400, "bad_manifest", message)


def unpack_limited(body: bytes, max_size: int) -> Any:
    """msgpack with every container and string length capped; raises ApiError(bad_request)."""
    if len(body) > max_size:
        raise ApiError(413, "too_large", f"body over {max_size} bytes")
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=max_size,
            max_bin_len=max_size,
            max_array_len=max_size // 2 + 16,
            max_map_len=max_size // 4 + 16,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ApiError(400, "bad_request", f"body is not valid msgpack: {exc}") from exc


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


def _int(value: object, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_manifest(f"{what} must be an integer >= {minimum}, got {value!r}")
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


def check_manifest(doc: object, max_chunk_size: int) -> CheckedManifest:
    """Validate a decoded manifest; raise ApiError(400, bad_manifest) saying what is wrong."""
    if not isinstance(doc, dict):
        raise bad_manifest("the manifest must be a map")
    unknown = set(doc) - {"format", "created", "meta", "shards"}
    if unknown:
        raise bad_manifest(f"unknown manifest field(s): {sorted(unknown)}")
    if doc.get("format") != MANIFEST_FORMAT:
        raise bad_manifest(f"format must be {MANIFEST_FORMAT}, got {doc.get('format')!r}")
    created = doc.get("created")
    if isinstance(created, bool) or not isinstance(created, int | float) or created < 0:
        raise bad_manifest("created must be a non-negative number (seconds since the epoch)")
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
    for key, key_boxes in boxes.items():
        _check_disjoint(key, key_boxes)
    encoded = msgpack.packb(doc, use_bin_type=True)
    return CheckedManifest(doc, encoded, chunk_id_of(encoded), chunks)


def _check_disjoint(key: str, key_boxes: list[tuple[list[int], list[int]]]) -> None:
    # Sort by the first offset so the inner loop stops early on the usual row-split shards.
    ordered = sorted(key_boxes, key=lambda b: b[0][:1])
    for i, (off_a, shape_a) in enumerate(ordered):
        for off_b, shape_b in ordered[i + 1 :]:
            if off_a and off_b[0] >= off_a[0] + shape_a[0] and shape_a[0] > 0:
                break
            empty = any(s == 0 for s in shape_a) or any(s == 0 for s in shape_b)
            overlap = all(
                oa < ob + sb and ob < oa + sa
                for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b, strict=True)
            )
            if overlap and not empty:
                raise bad_manifest(f"key {key!r}: boxes at {off_a} and {off_b} overlap")
