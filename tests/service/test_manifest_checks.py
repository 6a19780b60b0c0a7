"""The manifest's overlap check against a brute-force one, and its cost on large splits."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storaged.errors import BadInput
from storaged.manifest import Box, check_disjoint


def _brute_force_overlap(boxes: list[Box]) -> bool:
    for (oa, sa), (ob, sb) in itertools.combinations(boxes, 2):
        if any(s == 0 for s in sa) or any(s == 0 for s in sb):
            continue
        if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb, strict=True)):
            return True
    return False


def _overlaps(boxes: list[Box]) -> bool:
    try:
        check_disjoint("k", boxes)
    except BadInput as exc:
        assert exc.code == "bad_manifest"
        return True
    return False


@st.composite
def _box_sets(draw: st.DrawFn) -> list[Box]:
    ndim = draw(st.integers(0, 4))
    extent = 6
    box = st.tuples(
        st.lists(st.integers(0, extent - 1), min_size=ndim, max_size=ndim),
        st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim),
    )
    return [(list(o), list(s)) for o, s in draw(st.lists(box, max_size=12))]


@st.composite
def _grid_splits(draw: st.DrawFn) -> list[Box]:
    """A tensor cut into a grid of disjoint boxes (what a real sharding gives), possibly
    with one box moved or grown by a step (an overlap, or a gap, or still disjoint)."""
    ndim = draw(st.integers(1, 4))
    cuts = [sorted(set(draw(st.lists(st.integers(1, 9), max_size=3))) | {0, 10})
            for _ in range(ndim)]  # fmt: skip
    boxes: list[Box] = []
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        off = [cuts[d][i] for d, i in enumerate(cell)]
        shape = [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]
        boxes.append((off, shape))
    if draw(st.booleans()):
        which = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, ndim - 1))
        off, shape = boxes[which]
        if draw(st.booleans()):
            shape = [s + (1 if i == d else 0) for i, s in enumerate(shape)]
        else:
            off = [max(0, o - (1 if i == d else 0)) for i, o in enumerate(off)]
        boxes[which] = (off, shape)
    return draw(st.permutations(boxes))


@settings(max_examples=600, deadline=None)
@given(_box_sets())
def test_overlap_check_agrees_with_brute_force(boxes: list[Box]) -> None:
    assert _overlaps(boxes) == _brute_force_overlap(boxes), boxes


@settings(max_examples=400, deadline=None)
@given(_grid_splits())
def test_overlap_check_agrees_with_brute_force_on_grids(boxes: list[Box]) -> None:
    assert _overlaps(boxes) == _brute_force_overlap(boxes), boxes


def _cpu(fn: object, *args: object) -> float:
    assert callable(fn)
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


def _split(n: int, dim: int, ndim: int) -> list[Box]:
    """``n`` disjoint boxes of a [n, n, ...] tensor, cut along ``dim``."""
    return [
        ([i if d == dim else 0 for d in range(ndim)], [1 if d == dim else n for d in range(ndim)])
        for i in range(n)
    ]


@pytest.mark.parametrize(("dim", "ndim"), [(0, 2), (1, 2), (2, 3), (1, 4)])
def test_large_split_is_checked_in_near_linear_time(dim: int, ndim: int) -> None:
    # 4,000 boxes along dim 1 took 28 s of CPU with the pairwise check. Compare against a
    # same-run baseline (sorting the boxes, which any check must at least do), not a clock:
    # the quadratic check costs thousands of times the baseline, a sweep a few dozen.
    boxes = _split(4000, dim, ndim)
    baseline = min(_cpu(sorted, boxes) for _ in range(5))
    cost = min(_cpu(check_disjoint, "k", boxes) for _ in range(3))
    assert cost < 400 * max(baseline, 1e-4), (cost, baseline)
    moved = [*boxes[:-1], ([1 if d == dim else 0 for d in range(ndim)], boxes[-1][1])]
    with pytest.raises(BadInput, match="overlap"):
        check_disjoint("k", moved)


def test_grid_split_of_a_matrix_is_fast() -> None:
    boxes = [([r * 10, c * 10], [10, 10]) for r in range(64) for c in range(64)]
    baseline = min(_cpu(sorted, boxes) for _ in range(5))
    cost = min(_cpu(check_disjoint, "k", boxes) for _ in range(3))
    assert cost < 400 * max(baseline, 1e-4), (cost, baseline)
