"""Pure tests of the checkpoint layout: boxes, stream packing, manifests, restore plans.

The restore plans are executed here by a few lines of synchronous code over a dict of
chunk bytes, so that what is checked is the plan itself: saving a random global
array on N ranks (uneven splits along random axes) and restoring it on M ranks
(any other split, contiguous or strided destinations) gives back every element.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storaged.client import layout
from storaged.client.checkpoint import Shard, StagedShard, stage_shard
from storaged.client.layout import (
    FORMAT,
    MSGPACK_DTYPE,
    Box,
    DtypeMismatch,
    InvalidManifest,
    Item,
    KeyNotSaved,
    Manifest,
    RegionNotCovered,
    Request,
    RestorePlan,
    ShapeMismatch,
    ShardEntry,
    ShardGap,
    ShardingError,
    ShardOverlap,
    build_manifest,
    check_layout,
    pack_stream,
    plan_restore,
    run_dim,
    run_starts,
    tiling_fault,
)
from storaged.ids import chunk_id_of

Shape = tuple[int, ...]
DTYPES = ["uint8", "int16", "float32", "float64", "complex64", "bool", "int64"]


# --------------------------------------------------------------------------- helpers


def commit_local(
    staged: list[StagedShard], meta: dict[str, Any] | None = None, *, partial: bool = False
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Manifest document and chunk store for staged shards, as a cluster would hold them.

    ``partial``: the document as written without ``build_manifest``'s save-time checks
    (as a foreign or older client may have committed it), so that it may leave gaps."""
    store: dict[str, bytes] = {}
    entries = []
    for shard in staged:
        ids = []
        for chunk in shard.chunks:
            cid = chunk_id_of(chunk)
            store[cid] = bytes(chunk)
            ids.append(cid)
        entries.append(shard.entry(ids))
    if partial:
        shards = tuple(ShardEntry.from_wire(e) for e in entries)
        return Manifest(1764403200.0, meta or {}, shards).to_wire(), store
    return build_manifest(entries, created=1764403200.0, meta=meta or {}), store


def run_plan(
    plan: RestorePlan, store: dict[str, bytes], arrays: list[np.ndarray[Any, Any] | None]
) -> list[Any]:
    """Execute a plan synchronously; return the decoded values per value read."""
    flat = [
        a.reshape(-1).view(np.uint8) if a is not None and a.flags.c_contiguous else None
        for a in arrays
    ]
    values = [np.zeros(v.length, np.uint8) for v in plan.values]

    def into(kind: str, index: int, staging: np.ndarray[Any, Any] | None) -> Any:
        if kind == "target":
            target = flat[index]
            assert target is not None, "direct write into a strided destination"
            return target
        if kind == "value":
            return values[index]
        assert staging is not None
        return staging

    def fetch(f: Any, staging: np.ndarray[Any, Any] | None) -> None:
        data = store[f.chunk]
        assert 0 <= f.start < f.end <= len(data), (f, len(data))
        got = np.frombuffer(data[f.start : f.end], np.uint8)
        for p in f.parts:
            assert p.src + p.length <= f.length
            into(p.kind, p.index, staging)[p.offset : p.offset + p.length] = got[
                p.src : p.src + p.length
            ]

    for f in plan.fetches:
        assert f.parts and all(p.kind != "staging" for p in f.parts)
        fetch(f, None)
    for s in plan.staged:
        buffer = np.full(s.size, 0xEE, np.uint8)  # garbage where gaps were not fetched
        for f in s.fetches:
            fetch(f, buffer)
        array = arrays[s.target]
        assert array is not None
        src: np.ndarray[Any, Any] = np.ndarray(
            s.shape, dtype=array.dtype, buffer=buffer, offset=0, strides=s.strides
        )
        dest = array.reshape(1) if array.ndim == 0 else array
        dest[s.dest.slices()] = src
    return [msgpack.unpackb(bytes(v)) for v in values]


@st.composite
def splits(draw: st.DrawFn, shape: Shape) -> list[Box]:
    """Boxes tiling ``shape``: uneven cuts along one or more random axes (empty pieces allowed)."""
    ndim = len(shape)
    axes = draw(st.sets(st.integers(0, ndim - 1), min_size=1, max_size=min(2, ndim)))
    cuts: list[list[tuple[int, int]]] = []
    for d in range(ndim):
        if d in axes:
            pieces = draw(st.integers(1, 4))
            points = sorted(
                draw(st.lists(st.integers(0, shape[d]), min_size=pieces - 1, max_size=pieces - 1))
            )
            bounds = [0, *points, shape[d]]
            cuts.append(list(itertools.pairwise(bounds)))
        else:
            cuts.append([(0, shape[d])])
    return [
        Box(tuple(lo for lo, _ in combo), tuple(hi - lo for lo, hi in combo))
        for combo in itertools.product(*cuts)
    ]


def global_array(shape: Shape, dtype: str, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw = raw % 2
    return raw.view(dtype).reshape(shape).copy()


def destination(shape: Shape, dtype: str, strided: bool) -> np.ndarray[Any, Any]:
    """A zeroed destination; when ``strided`` a non-contiguous view (every other element)."""
    if not strided or not shape:
        return np.zeros(shape, dtype)
    bigger = np.zeros((*shape[:-1], shape[-1] * 2), dtype)
    return bigger[..., ::2]


# --------------------------------------------------------------------------- boxes


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            *[
                st.tuples(
                    st.tuples(*[st.integers(0, s) for s in shape]),
                    st.tuples(*[st.integers(0, s) for s in shape]),
                )
                for _ in range(2)
            ],
        )
    )
)
def test_intersection_matches_brute_force(case: Any) -> None:
    shape, (a0, a1), (b0, b1) = case
    a = Box(tuple(map(min, a0, a1)), tuple(abs(x - y) for x, y in zip(a0, a1, strict=True)))
    b = Box(tuple(map(min, b0, b1)), tuple(abs(x - y) for x, y in zip(b0, b1, strict=True)))
    mask_a = np.zeros(shape, bool)
    mask_a[a.slices()] = True
    mask_b = np.zeros(shape, bool)
    mask_b[b.slices()] = True
    both = a.intersect(b)
    expected = mask_a & mask_b
    if both is None:
        assert not expected.any()
    else:
        got = np.zeros(shape, bool)
        got[both.slices()] = True
        assert np.array_equal(got, expected)
        assert both == b.intersect(a)
        rel = both.relative_to(a)
        assert all(o >= 0 for o in rel.offsets)


def test_box_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        Box((0,), (1, 2))
    with pytest.raises(ValueError):
        Box((-1,), (2,))
    with pytest.raises(ValueError):
        Box((0, 0), (2, 2)).intersect(Box((0,), (1,)))
    with pytest.raises(ValueError):
        Box((1, 1), (2, 2)).relative_to(Box((0, 0), (2, 2)))
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    assert Box((0,), (0,)).intersect(Box((0,), (3,))) is None


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.tuples(*[st.integers(0, s - 1) for s in shape]),
            st.data(),
        )
    )
)
def test_runs_cover_exactly_the_inner_box(case: Any) -> None:
    outer, lo, data = case
    inner = tuple(data.draw(st.integers(1, o - low)) for o, low in zip(outer, lo, strict=True))
    k = run_dim(outer, inner)
    run = inner[k] * int(np.prod(outer[k + 1 :]))
    mask = np.zeros(int(np.prod(outer)), bool)
    for start in run_starts(outer, lo, inner, k).tolist():
        assert not mask[start : start + run].any()
        mask[start : start + run] = True
    expected = np.zeros(outer, bool)
    expected[tuple(slice(a, a + n) for a, n in zip(lo, inner, strict=True))] = True
    assert np.array_equal(mask, expected.ravel())


# --------------------------------------------------------------------------- streams


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 100))
def test_pack_stream_layout(lengths: list[int], chunk_size: int) -> None:
    layout = pack_stream(lengths, chunk_size)
    assert layout.size == sum(lengths)
    pos = 0
    for offset, size in layout.chunks:
        assert offset == pos and 0 < size <= chunk_size
        pos += size
    assert pos == layout.size
    bounds = {offset for offset, _ in layout.chunks} | {layout.size}
    taken = np.zeros(layout.size, bool)
    small_end = 0
    for n, start in zip(lengths, layout.starts, strict=True):
        assert not taken[start : start + n].any()
        taken[start : start + n] = True
        if n >= chunk_size:
            # Large items start and end on chunk boundaries: their chunks are theirs alone.
            assert start in bounds and start + n in bounds
        else:
            assert start == small_end
            small_end += n
    assert taken.all()
    assert all(
        start >= small_end
        for n, start in zip(lengths, layout.starts, strict=True)
        if n >= chunk_size
    )


def test_pack_stream_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        pack_stream([1], 0)
    with pytest.raises(ValueError):
        pack_stream([-1], 8)


def chunk_ids_of_key(staged: StagedShard, key: str) -> list[str]:
    item = next(i for i in staged.items if i.key == key)
    ids, pos = [], 0
    for chunk in staged.chunks:
        if item.start <= pos < item.end:
            ids.append(chunk_id_of(chunk))
        pos += len(chunk)
    return ids


def test_unchanged_large_array_keeps_its_chunks() -> None:
    big = np.arange(1000, dtype=np.float32)  # 4000 bytes: 4 chunks of 1000
    first = stage_shard(0, {"a": np.ones(3), "big": big, "step": 1}, chunk_size=1000)
    second = stage_shard(
        0, {"step": 2, "b": np.zeros(7), "a": np.ones(5), "big": big}, chunk_size=1000
    )
    assert chunk_ids_of_key(first, "big") == chunk_ids_of_key(second, "big")
    assert len(chunk_ids_of_key(first, "big")) == 4


# --------------------------------------------------------------------------- manifests


ITEM_KEYS = {"key", "dtype", "global_shape", "offsets", "shape", "start", "length"}


def test_manifest_follows_api_schema() -> None:
    g = np.arange(24, dtype=np.float32).reshape(4, 6)
    staged = [
        stage_shard(0, {"w": Shard(g[:1], (4, 6), (0, 0)), "step": 7, "b": np.ones(3)}, 64),
        stage_shard(1, {"w": Shard(g[1:], (4, 6), (1, 0)), "step": 7, "b": np.ones(3)}, 64),
    ]
    doc, _ = commit_local(staged, meta={"step": 7})
    assert set(doc) == {"format", "created", "meta", "shards"}
    assert doc["format"] == FORMAT == 1 and isinstance(doc["created"], float)
    assert doc["meta"] == {"step": 7}
    assert [s["rank"] for s in doc["shards"]] == [0, 1]
    for shard in doc["shards"]:
        assert set(shard) == {"rank", "chunks", "items"}
        stream = 0
        for cid, size in shard["chunks"]:
            assert isinstance(cid, str) and len(cid) == 64 and isinstance(size, int)
            stream += size
        for item in shard["items"]:
            assert set(item) == ITEM_KEYS
            assert item["start"] + item["length"] <= stream
            assert all(isinstance(item[k], list) for k in ("global_shape", "offsets", "shape"))
    # Replicated values and arrays are kept once, from the lowest rank.
    keys = [(s["rank"], i["key"]) for s in doc["shards"] for i in s["items"]]
    assert sorted(keys) == [(0, "b"), (0, "step"), (0, "w"), (1, "w")]
    step = next(i for i in doc["shards"][0]["items"] if i["key"] == "step")
    assert step["dtype"] == MSGPACK_DTYPE and step["shape"] == step["global_shape"] == []
    # The document survives msgpack and parses back to the same thing.
    assert Manifest.from_wire(msgpack.unpackb(msgpack.packb(doc))).to_wire() == doc


def _one_item_manifest(**item: Any) -> dict[str, Any]:
    base = {
        "key": "x",
        "dtype": "float32",
        "global_shape": [4],
        "offsets": [0],
        "shape": [4],
        "start": 0,
        "length": 16,
    }
    base.update(item)
    return {
        "format": 1,
        "created": 1.0,
        "meta": {},
        "shards": [{"rank": 0, "chunks": [["a" * 64, 16]], "items": [base]}],
    }


@pytest.mark.parametrize(
    "change",
    [
        {"start": 4},  # runs past the stream
        {"length": 12},  # not 4 float32
        {"offsets": [1]},  # outside the global shape
        {"shape": [4, 1]},  # rank differs
        {"global_shape": [-4]},
        {"key": ""},
        {"dtype": 3},
        {"dtype": "msgpack"},  # a value with a shape
    ],
)
def test_manifest_rejects_bad_items(change: dict[str, Any]) -> None:
    with pytest.raises(InvalidManifest):
        Manifest.from_wire(_one_item_manifest(**change))


def test_manifest_rejects_bad_documents() -> None:
    good = _one_item_manifest()
    Manifest.from_wire(good)
    for broken in (
        {**good, "format": 2},
        {**good, "created": "now"},
        {**good, "shards": {}},
        {**good, "shards": [{**good["shards"][0], "chunks": [["nothex", 16]]}]},
        {**good, "shards": [good["shards"][0], good["shards"][0]]},  # duplicate rank
    ):
        with pytest.raises(InvalidManifest):
            Manifest.from_wire(broken)
    with pytest.raises(InvalidManifest):
        Manifest.from_wire([good])


def test_a_restore_checks_the_chunk_lists_of_the_shards_it_reads() -> None:
    """``chunks_on_read``: everything but the shards' chunk lists is checked at once; a
    shard's list when a plan first reads it, refused then with the full check's words."""
    g = np.arange(32, dtype=np.float32).reshape(4, 8)
    halves = [Shard(g[2 * r : 2 * r + 2], (4, 8), (2 * r, 0)) for r in (0, 1)]
    doc, _ = commit_local([stage_shard(r, {"w": half}, 48) for r, half in enumerate(halves)])
    first, second = (Request("w", (4, 8), Box(h.offsets, h.array.shape), g.dtype) for h in halves)
    broken = copy.deepcopy(doc)
    broken["shards"][1]["chunks"][0][0] = "zz"
    with pytest.raises(InvalidManifest) as whole:
        Manifest.from_wire(broken)
    assert str(whole.value) == "shards[1].chunks[0]: 'zz' is not a chunk id"
    manifest = Manifest.from_wire(broken, chunks_on_read=True)
    plan = plan_restore(manifest, [first])
    assert plan.chunk_sizes == dict(doc["shards"][0]["chunks"])  # shard 0's alone
    with pytest.raises(InvalidManifest) as on_read:
        plan_restore(manifest, [second])
    assert str(on_read.value) == str(whole.value)
    # An item outside its stream is refused at once, as without it.
    short = copy.deepcopy(doc)
    short["shards"][1]["chunks"].pop()
    with pytest.raises(InvalidManifest, match="lie outside its rank's stream"):
        Manifest.from_wire(short, chunks_on_read=True)
    # An id two shards list with two sizes: refused when a plan reads both.
    twice = copy.deepcopy(doc)
    twice["shards"][1]["chunks"][0][0] = doc["shards"][0]["chunks"][1][0]  # 48 and 16 bytes
    manifest = Manifest.from_wire(twice, chunks_on_read=True)
    plan_restore(manifest, [first])
    with pytest.raises(InvalidManifest, match="listed with two different sizes"):
        plan_restore(manifest, [first, second])
    # Unbroken, both ways give the same manifest, also copied or pickled before any read.
    assert Manifest.from_wire(doc, chunks_on_read=True).to_wire() == doc
    fresh = Manifest.from_wire(doc, chunks_on_read=True)
    assert pickle.loads(pickle.dumps(fresh)).to_wire() == doc
    assert copy.deepcopy(Manifest.from_wire(doc, chunks_on_read=True)).to_wire() == doc


def test_overlapping_boxes_are_refused() -> None:
    g = np.zeros((4, 4), np.float32)
    staged = [
        stage_shard(0, {"w": Shard(g[:3], (4, 4), (0, 0))}, 64),
        stage_shard(1, {"w": Shard(g[2:], (4, 4), (2, 0))}, 64),
    ]
    with pytest.raises(InvalidManifest, match="overlap"):
        commit_local(staged)
    mismatch = [
        stage_shard(0, {"w": Shard(g[:2], (4, 4), (0, 0))}, 64),
        stage_shard(1, {"w": Shard(g[2:].astype(np.float64), (4, 4), (2, 0))}, 64),
    ]
    with pytest.raises(InvalidManifest, match="float64"):
        commit_local(mismatch)


# --------------------------------------------------------------------------- tiling


@st.composite
def box_sets(draw: st.DrawFn) -> tuple[Shape, list[Box]]:
    """A small shape and boxes in it: often an exact tiling, often one spoiled a little
    (a piece dropped, repeated, moved, grown or shrunk), sometimes boxes at random."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))

    def any_box() -> Box:
        lo = [draw(st.integers(0, s)) for s in shape]
        extent = [draw(st.integers(0, s - o)) for o, s in zip(lo, shape, strict=True)]
        return Box(tuple(lo), tuple(extent))

    boxes = draw(splits(shape))
    spoil = draw(st.sampled_from(["none", "drop", "repeat", "move", "resize", "add", "random"]))
    if spoil == "random":
        return shape, [any_box() for _ in range(draw(st.integers(0, 6)))]
    if spoil == "add":
        boxes.append(any_box())
    elif boxes and spoil != "none":
        index = draw(st.integers(0, len(boxes) - 1))
        box = boxes[index]
        if spoil == "drop":
            del boxes[index]
        elif spoil == "repeat":
            boxes.append(box)
        else:
            d = draw(st.integers(0, len(shape) - 1))
            offsets, extent = list(box.offsets), list(box.shape)
            if spoil == "move":
                offsets[d] = draw(st.integers(0, shape[d] - extent[d]))
            else:
                extent[d] = draw(st.integers(0, shape[d] - offsets[d]))
            boxes[index] = Box(tuple(offsets), tuple(extent))
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(box_sets())
def test_tiling_fault_matches_a_brute_force_cell_count(case: tuple[Shape, list[Box]]) -> None:
    shape, boxes = case
    counts = np.zeros(shape, np.int64)
    for box in boxes:
        counts[box.slices()] += 1
    ranked = [(rank, box) for rank, box in enumerate(boxes) if box.size > 0]
    fault = tiling_fault("k", shape, ranked)
    wrong = np.argwhere(counts != 1)
    if not len(wrong):
        assert fault is None
        return
    assert fault is not None and fault.key == "k"
    element = tuple(int(x) for x in wrong[0])  # the first wrong element in row-major order
    assert fault.element == element and str(list(element)) in str(fault)
    if counts[element] == 0:
        assert isinstance(fault, ShardGap) and fault.boxes == tuple(ranked)
    else:
        assert isinstance(fault, ShardOverlap)
        holders = [(r, b) for r, b in ranked if _holds(b, element)]
        assert list(fault.boxes) == holders and len(holders) == counts[element]


@settings(max_examples=400, deadline=None)
@given(box_sets(), st.booleans())
def test_the_glance_at_a_common_layout_agrees_with_the_full_tiling_check(
    case: tuple[Shape, list[Box]], complete: bool
) -> None:
    """A key's boxes that differ along one dimension are judged by a sort; whatever the
    boxes, the verdict (none, or the error and its message) is the full check's."""
    shape, boxes = case
    items = tuple(Item("k", "uint8", shape, box.offsets, box.shape, 0, box.size) for box in boxes)
    shards = [ShardEntry(rank, (), (item,)) for rank, item in enumerate(items)]

    def verdict() -> tuple[type, str] | None:
        try:
            layout._check_keys(shards, complete=complete)
        except InvalidManifest as exc:
            return type(exc), str(exc)
        return None

    fast = verdict()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "_tiled_at_a_glance", lambda *_: False)
        assert verdict() == fast


def _holds(box: Box, element: Shape) -> bool:
    return all(o <= x < e for o, x, e in zip(box.offsets, element, box.stop, strict=True))


def test_scalars_tile_with_one_box() -> None:
    assert tiling_fault("s", (), [(0, Box((0,), (1,)))]) is None
    gap = tiling_fault("s", (), [])
    assert isinstance(gap, ShardGap) and "element []" in str(gap)
    two = tiling_fault("s", (), [(0, Box((0,), (1,))), (3, Box((0,), (1,)))])
    assert isinstance(two, ShardOverlap) and [r for r, _ in two.boxes] == [0, 3]
    assert tiling_fault("e", (0, 3), []) is None  # nothing to save


def test_save_time_layout_check_names_the_key_and_the_boxes() -> None:
    g = np.zeros((6, 4), np.float32)
    gap = [
        stage_shard(0, {"w": Shard(g[:2], (6, 4), (0, 0)), "b": g[0]}, 64),
        stage_shard(1, {"w": Shard(g[3:], (6, 4), (3, 0)), "b": g[0]}, 64),  # row 2 lost
    ]
    with pytest.raises(ShardGap) as missing:
        commit_local(gap)
    assert missing.value.key == "w" and missing.value.element == (2, 0)
    assert "rank 0 [0, 0]+[2, 4]" in str(missing.value) and "rank 1 [3, 0]+[3, 4]" in str(
        missing.value
    )
    with pytest.raises(ShardGap, match="w: gap at element"):
        check_layout({shard.rank: shard.items for shard in gap})
    overlap = [
        stage_shard(0, {"w": Shard(g[:, :3], (6, 4), (0, 0))}, 64),
        stage_shard(1, {"w": Shard(g[:, 2:], (6, 4), (0, 2))}, 64),
    ]
    with pytest.raises(ShardOverlap) as twice:
        check_layout({shard.rank: shard.items for shard in overlap})
    assert twice.value.element == (0, 2) and [r for r, _ in twice.value.boxes] == [0, 1]
    assert isinstance(twice.value, ShardingError) and isinstance(twice.value, InvalidManifest)
    # Replicated boxes (the same box on every rank) are one save, not an overlap.
    replicated = [stage_shard(r, {"w": g, "step": 3}, 64) for r in range(3)]
    check_layout({shard.rank: shard.items for shard in replicated})
    commit_local(replicated)


def test_manifest_read_back_may_leave_gaps_but_not_overlaps() -> None:
    g = np.zeros((6, 4), np.float32)
    gap = [
        stage_shard(0, {"w": Shard(g[:2], (6, 4), (0, 0))}, 64),
        stage_shard(1, {"w": Shard(g[4:], (6, 4), (4, 0))}, 64),
    ]
    doc, _ = commit_local(gap, partial=True)
    manifest = Manifest.from_wire(doc)  # restore reports what a request cannot get
    with pytest.raises(RegionNotCovered):
        plan_restore(manifest, [Request("w", (6, 4), Box((0, 0), (6, 4)), g.dtype)])
    with pytest.raises(ShardGap):
        Manifest.from_wire(doc, complete=True)
    # A gap first in row-major order, and an overlap further on: still refused.
    both = [
        stage_shard(0, {"w": Shard(g[1:4], (6, 4), (1, 0))}, 64),
        stage_shard(1, {"w": Shard(g[3:5], (6, 4), (3, 0))}, 64),
    ]
    doc, _ = commit_local(both, partial=True)
    with pytest.raises(ShardOverlap, match=r"element \[3, 0\]"):
        Manifest.from_wire(doc)


# --------------------------------------------------------------------------- resharding


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            splits(tuple(shape)),
            splits(tuple(shape)),
            st.sampled_from(DTYPES),
            st.integers(1, 96),  # chunk size: many boundaries inside items
            st.integers(0, 64),  # coalesce gap
            st.integers(1, 200),  # max tile bytes
            st.lists(st.booleans(), min_size=16, max_size=16),  # strided destinations
            st.integers(0, 2**32 - 1),
        )
    )
)
def test_reshard_n_to_m_reconstructs_exactly(case: Any) -> None:
    shape, saved, wanted, dtype, chunk_size, gap, tile, strided, seed = case
    g = global_array(shape, dtype, seed)
    staged = [
        stage_shard(
            rank,
            {"g": Shard(g[box.slices()], shape, box.offsets), "rank": {"r": rank}},
            chunk_size,
        )
        for rank, box in enumerate(saved)
    ]
    doc, store = commit_local(staged)
    manifest = Manifest.from_wire(doc)
    arrays: list[np.ndarray[Any, Any] | None] = []
    requests = []
    for index, box in enumerate(wanted):
        dst = destination(box.shape, dtype, strided[index % len(strided)])
        arrays.append(dst)
        requests.append(Request("g", shape, box, dst.dtype, bool(dst.flags.c_contiguous)))
    requests.append(Request("rank", (), Box((), ()), None))
    arrays.append(None)
    plan = plan_restore(manifest, requests, coalesce_gap=gap, max_tile=tile)
    (value,) = run_plan(plan, store, arrays)
    assert value == {"r": 0}
    for box, restored in zip(wanted, arrays, strict=False):
        assert restored is not None
        dst = restored
        # Bitwise: random float bits include NaNs.
        assert dst.tobytes() == g[box.slices()].tobytes()
    assert plan.bytes_needed == g.nbytes + len(msgpack.packb({"r": 0}))
    if gap == 0:
        # Nothing but the needed bytes crosses the wire (less if chunks repeat).
        assert plan.bytes_fetched <= plan.bytes_needed


def test_axis0_restore_reads_straight_into_the_destination() -> None:
    g = np.arange(64 * 8, dtype=np.float64).reshape(64, 8)
    staged = [
        stage_shard(r, {"g": Shard(g[r * 16 : (r + 1) * 16], g.shape, (r * 16, 0))}, 1024)
        for r in range(4)
    ]
    doc, store = commit_local(staged)
    dst = np.zeros((40, 8))
    plan = plan_restore(
        Manifest.from_wire(doc), [Request("g", g.shape, Box((10, 0), (40, 8)), dst.dtype)]
    )
    assert not plan.staged and all(f.direct for f in plan.fetches)
    assert plan.bytes_fetched == plan.bytes_needed == dst.nbytes
    run_plan(plan, store, [dst])
    assert np.array_equal(dst, g[10:50])


def test_column_restore_coalesces_rows() -> None:
    g = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    doc, store = commit_local([stage_shard(0, {"g": g}, 1 << 20)])
    dst = np.zeros((256, 32), np.float32)
    manifest = Manifest.from_wire(doc)
    request = Request("g", g.shape, Box((0, 32), (256, 32)), dst.dtype)
    coalesced = plan_restore(manifest, [request], coalesce_gap=4096)
    exact = plan_restore(manifest, [request], coalesce_gap=0)
    # One range per tile instead of one per row; the price is the skipped half rows.
    assert not coalesced.fetches and sum(len(s.fetches) for s in coalesced.staged) < 4
    assert coalesced.bytes_fetched < 2 * dst.nbytes
    # When requests cost nothing (gap 0) each half row goes straight into place.
    assert not exact.staged and len(exact.fetches) == 256
    assert exact.bytes_fetched == dst.nbytes
    for plan in (coalesced, exact):
        dst[:] = 0
        run_plan(plan, store, [dst])
        assert np.array_equal(dst, g[:, 32:])


def test_small_items_of_one_chunk_share_a_fetch() -> None:
    state = {f"b{i}": np.full(10, i, np.int32) for i in range(20)}
    doc, store = commit_local([stage_shard(0, state, 1 << 20)])
    arrays: list[np.ndarray[Any, Any] | None] = [np.zeros(10, np.int32) for _ in range(20)]
    requests = [Request(f"b{i}", (10,), Box((0,), (10,)), np.dtype(np.int32)) for i in range(20)]
    plan = plan_restore(Manifest.from_wire(doc), requests)
    assert len(plan.fetches) == 1 and len(plan.fetches[0].parts) == 20
    run_plan(plan, store, arrays)
    for i, array in enumerate(arrays):
        assert array is not None and np.array_equal(array, state[f"b{i}"])


# --------------------------------------------------------------------------- restore errors


def _manifest_of(state: dict[str, Any], rank: int = 0) -> Manifest:
    doc, _ = commit_local([stage_shard(rank, state, 64)], partial=True)
    return Manifest.from_wire(doc)


def test_restore_errors_are_clear() -> None:
    g = np.zeros((6, 4), np.float32)
    manifest = _manifest_of({"w": Shard(g[:3], (6, 4), (0, 0)), "v": 1})
    whole = Box((0, 0), (6, 4))
    with pytest.raises(KeyNotSaved) as missing:
        plan_restore(manifest, [Request("nope", (6, 4), whole, np.dtype(np.float32))])
    assert isinstance(missing.value, KeyError) and "nope" in str(missing.value)
    with pytest.raises(ShapeMismatch, match=r"\[6, 4\]"):
        plan_restore(manifest, [Request("w", (6, 5), Box((0, 0), (6, 5)), np.dtype(np.float32))])
    with pytest.raises(DtypeMismatch, match="float32"):
        plan_restore(manifest, [Request("w", (6, 4), whole, np.dtype(np.float64))])
    with pytest.raises(RegionNotCovered, match="12 of the 24"):
        plan_restore(manifest, [Request("w", (6, 4), whole, np.dtype(np.float32))])
    # The saved half alone is fine.
    plan_restore(manifest, [Request("w", (6, 4), Box((0, 0), (3, 4)), np.dtype(np.float32))])
    with pytest.raises(DtypeMismatch, match="value"):
        plan_restore(manifest, [Request("v", (), Box((), ()), np.dtype(np.float32))])
    with pytest.raises(DtypeMismatch):
        plan_restore(manifest, [Request("w", (6, 4), whole, None)])
    with pytest.raises(ShapeMismatch):
        plan_restore(manifest, [Request("w", (6, 4), Box((4, 0), (3, 4)), np.dtype(np.float32))])


def test_foreign_dtype_needs_a_mapping() -> None:
    bits = np.arange(12, dtype=np.uint16)
    doc, store = commit_local([stage_shard(0, {"w": Shard(bits, (12,), (0,), "bfloat16")}, 64)])
    manifest = Manifest.from_wire(doc)
    assert manifest.items_of("w")[0][1].dtype == "bfloat16"
    request = Request("w", (12,), Box((0,), (12,)), np.dtype(np.uint16))
    with pytest.raises(DtypeMismatch, match="bfloat16"):
        plan_restore(manifest, [request])
    dst = np.zeros(12, np.uint16)
    run_plan(plan_restore(manifest, [request], dtype_map={"bfloat16": np.uint16}), store, [dst])
    assert np.array_equal(dst, bits)


def test_scalars_and_zero_sized_arrays() -> None:
    state = {"s": np.float64(2.5), "e": np.zeros((0, 3), np.int8), "z": np.array(7, np.int32)}
    doc, store = commit_local([stage_shard(0, state, 8)])
    manifest = Manifest.from_wire(doc)
    s, e, z = np.zeros((), np.float64), np.ones((0, 3), np.int8), np.zeros((), np.int32)
    requests = [
        Request("s", (), Box((), ()), s.dtype),
        Request("e", (0, 3), Box((0, 0), (0, 3)), e.dtype),
        Request("z", (), Box((), ()), z.dtype),
    ]
    run_plan(plan_restore(manifest, requests), store, [s, e, z])
    assert s == 2.5 and z == 7 and e.shape == (0, 3)


def test_stage_shard_refuses_what_it_cannot_save() -> None:
    with pytest.raises(TypeError, match="obj"):
        stage_shard(0, {"obj": object()}, 64)
    with pytest.raises(TypeError, match="dtype"):
        stage_shard(0, {"s": np.array(["a", "b"])}, 64)
    with pytest.raises(TypeError):
        stage_shard(0, {3: np.zeros(2)}, 64)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="outside"):
        Shard(np.zeros((3, 3)), (4, 4), (2, 0))
    with pytest.raises(ValueError, match="ranks differ"):
        Shard(np.zeros((3, 3)), (4,), (0,))


def test_staging_copies_strided_and_big_endian_sources() -> None:
    g = np.arange(40, dtype=">i4").reshape(5, 8)
    view = g[:, ::2]  # strided and big-endian
    doc, store = commit_local([stage_shard(0, {"v": view}, 16)])
    dst = np.zeros((5, 4), np.int32)
    manifest = Manifest.from_wire(doc)
    assert manifest.items_of("v")[0][1].dtype == "int32"
    run_plan(
        plan_restore(manifest, [Request("v", (5, 4), Box((0, 0), (5, 4)), dst.dtype)]), store, [dst]
    )
    assert np.array_equal(dst, view)


# --------------------------------------------------------------------------- file sources


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([0, 0, 1, 7, 63, 64, 65, 200]), min_size=1, max_size=12),
    chunk_size=st.sampled_from([1, 8, 64, 100]),
)
def test_a_file_source_streams_every_byte_in_place_empty_items_included(
    lengths: list[int], chunk_size: int
) -> None:
    """What ``storaged save`` uploads of a file (``_stream_reader``) is the packed stream,
    byte for byte, whatever the items: an empty one (an empty file of a model directory)
    shares its start with the next, and once let the chunk of a large item start there go
    out unfilled (uninitialised bytes committed as the tensor's)."""
    from storaged.client.formats import Source, SourceItem
    from storaged.client.streaming import _stream_reader

    rng = np.random.default_rng(len(lengths) * 1000 + chunk_size)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]

    def reader(blob: bytes) -> Any:
        def read(offset: int, into: memoryview) -> None:
            into[:] = blob[offset : offset + len(into)]

        return read

    items = [
        SourceItem(f"k{i}", "uint8", (len(b),), len(b), reader(b)) for i, b in enumerate(blobs)
    ]
    fill, starts = _stream_reader(Source(items, {}), chunk_size)
    layout = pack_stream(lengths, chunk_size)
    want = bytearray(layout.size)
    for blob, start in zip(blobs, layout.starts, strict=True):
        want[start : start + len(blob)] = blob
    assert tuple(starts) == layout.starts
    got = bytearray()
    buffer = bytearray(chunk_size)
    for offset, size in layout.chunks:
        buffer[:] = b"\xee" * chunk_size  # what an unfilled buffer would show
        assert fill(memoryview(buffer)) == size
        got += buffer[:size]
        assert bytes(got[offset : offset + size]) == bytes(want[offset : offset + size]), offset
    assert fill(memoryview(buffer)) == 0
    assert bytes(got) == bytes(want)
