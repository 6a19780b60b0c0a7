"""``restore_checkpoint(staging_budget=)`` keeps a restore's memory beyond its destination
buffers to its budget (issue 20 §5): a 256 MiB state saved by 2 ranks as column halves
(row-parallel shards: each saved box's rows are 16 KiB runs, too short to read straight
into a whole-array destination, so every byte goes through staging tiles), restored whole
into preallocated, already touched arrays in a child process against real node processes.

The child's peak RSS growth during each restore (VmHWM, reset through clear_refs, minus
VmRSS before it: the destinations are resident by then, so what grows is what the restore
holds beyond them), and tracemalloc's peak of the Python allocations (numpy's staging
buffers among them) in the same run, with a 64 MiB and a 32 MiB budget, beside the same
restore with a budget larger than the state, which must show the staging of the whole
state at once (so the measurement can see it). Every restore's bytes are compared with
the source.

Measured (2026-12-06, a loaded 2-core machine, hedges off): the traced peak is the budget
to the client's small buffers in most runs (64.4 / 32.4 MiB), one tile (32 MiB) more in 2
of 7 at 64 MiB (not a staging buffer: a probe of every staging buffer's life never saw
more than the budget alive; some read's buffer of its own, not found yet); RSS adds what
tracemalloc does not see (the allocator's, the threads', aiohttp's), 16-50 MiB: growth
86-110 MiB at 64 MiB, 48-64 MiB at 32 MiB, 310-406 MiB unbounded (256 MiB traced);
with the freed heap handed back before each restore (below), 96-112, 56-58 and 373-435
MiB in 3 runs.
Before ``_copy_letting_go`` (checkpoint.py) the traced peak was the budget plus one tile
in every run: the executor's work item of a tile's copy kept its staging buffer past the
release of the budget, and the next tile was allocated beside it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.planner import RESTORE_CHILD
from storaged.client import Shard, save_checkpoint
from storaged.tools.local_cluster import LocalCluster
from tests.client.helpers import client_for
from tests.conftest import TOKEN

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not Path("/proc/self/clear_refs").exists(),
        reason="needs Linux's /proc/self/clear_refs to reset the peak RSS",
    ),
]

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
#: 4 float32 arrays of 2048 x 8192 (64 MiB each), each saved as two column halves
ARRAYS, ROWS, COLS = 4, 2048, 8192
STATE = ARRAYS * ROWS * COLS * 4
BUDGETS = (64 * MiB, 32 * MiB)
#: the control: more than the whole state, every tile staged at once
UNBOUNDED = 2 * STATE
#: RSS beyond the budget: what the traced allowance covers, and the threads', the event
#: loop's and the allocator's slack (the save's test allows 12 MiB for less; up to 50 MiB
#: was measured here, see above).
ALLOWANCE = 80 * MiB
#: the control's RSS growth at least (see the test's end)
CONTROL_RSS = 3 * STATE // 4
#: A read that misses its deadline on a loaded machine is hedged into a buffer of the
#: hedge's own (up to a chunk each, outside the budget): off in the child, so that what is
#: measured is the staging the budget bounds.
NO_HEDGES = {"STORAGED_MAX_HEDGES": "0"}
#: Python allocations beyond the budget: the client's documents, plans and small buffers
#: (under 1 MiB), and the 32 MiB seen in 2 runs of 7 (see above).
TRACED_ALLOWANCE = 40 * MiB


def source(i: int) -> np.ndarray[Any, Any]:
    """Array ``w{i}`` as the child makes it."""
    return np.random.default_rng(i).standard_normal((ROWS, COLS), dtype=np.float32)


def column_halves() -> dict[int, dict[str, Any]]:
    """The state of 2 ranks, each holding the left or right half of every array's columns."""
    half = COLS // 2
    states: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    for i in range(ARRAYS):
        array = source(i)
        for rank in (0, 1):
            cols = array[:, rank * half : (rank + 1) * half].copy()
            states[rank][f"w{i}"] = Shard(cols, (ROWS, COLS), (0, rank * half))
    return states


async def test_a_restore_keeps_its_memory_beyond_the_destinations_to_its_budget(
    cluster: LocalCluster,
) -> None:
    name = f"restore-rss/{os.getpid()}"
    states = await asyncio.to_thread(column_halves)
    async with client_for(cluster) as client:
        await save_checkpoint(client, name, states)
        del states
        await save_checkpoint(client, f"{name}-warm", {0: {"x": np.ones(1000)}})
    budgets = [*BUDGETS, UNBOUNDED]
    # The load test's child (loadtest/planner.py): the same arrays, restored once per budget.
    argv = [",".join(cluster.urls), TOKEN, name, str(ARRAYS), str(ROWS), str(COLS)]
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", RESTORE_CHILD, *argv, ",".join(map(str, budgets))],
        capture_output=True,
        text=True,
        timeout=240,
        # no hedged reads: a hedge reads into a buffer of its own, outside the budget
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONASYNCIODEBUG": "", **NO_HEDGES},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    found = {
        int(b): (int(g), int(t), e == "True")
        for b, g, t, e in re.findall(r"PEAK_GROWTH (\d+) (\d+) (\d+) (\w+)", proc.stdout)
    }
    assert set(found) == set(budgets), proc.stdout + proc.stderr
    for budget, (growth, traced, equal) in found.items():
        print(f"peak beyond the destinations, budget {budget / MiB:.0f} MiB: RSS growth "
              f"{growth / MiB:.1f} MiB, traced {traced / MiB:.1f} MiB "
              f"(state {STATE / MiB:.0f} MiB)")  # fmt: skip
        assert equal, f"budget {budget}: restored bytes differ from the source"
    for budget in BUDGETS:
        growth, traced, _ = found[budget]
        assert traced <= budget + TRACED_ALLOWANCE, (budget, traced)
        assert growth <= budget + ALLOWANCE, (budget, growth)
    # The control: without a bound the whole state is staged at once, and it shows. The
    # traced peak sees every byte of it. RSS saw less once (255.0 MiB in a full run,
    # 310-406 MiB in others): the child restores once per budget, and pages the allocator
    # kept from the earlier restores were resident before the control and reused by it.
    # The child now hands them back (malloc_trim) before each restore (373-435 MiB in 3
    # runs since); three quarters of the state is the floor kept, above what any bounded
    # restore is allowed, so the RSS check still tells a bound from none.
    assert found[UNBOUNDED][1] >= STATE
    assert found[UNBOUNDED][0] >= CONTROL_RSS > max(BUDGETS) + ALLOWANCE
