"""``AsyncSaver(staging_budget=)`` keeps host memory to its budget: a 64 MiB state saved
with an 8 MiB budget, in a child process (against real node processes) whose peak RSS
growth during the save is measured, beside the same save without a budget in the same
child, which must show the whole state's staging copy (so the measurement can see it).
Then the restored bytes are compared with the source.

Processes: what is measured is a process's peak RSS, so the saving client is a child
process with nothing else in it; its nodes are node processes (the module's ``cluster``).
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

from storaged.client import restore_checkpoint
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
STATE = 64 * MiB
BUDGET = 8 * MiB
#: Beyond the budget: the client's request buffers, hashing, the allocator's own slack.
SLACK = 12 * MiB

#: Saves the state twice (budget, then none) and prints the peak RSS growth of each:
#: VmHWM (reset through clear_refs before each save) minus VmRSS before it.
_CHILD = """
import asyncio, re, sys
import numpy as np
from storaged.client import AsyncSaver, Client

def kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

def state():
    return {f"w{i}": np.random.default_rng(i).standard_normal(STATE // 8 // 8) for i in range(8)}

async def save(client, name, budget):
    s = state()
    async with AsyncSaver(client, staging_budget=budget, chunk_size=1 << 20) as saver:
        await (await saver.save(name + "-warm", {0: {"x": np.ones(1000)}})).acked()
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS")
        await (await saver.save(name, {0: s})).acked()
        return (kib("VmHWM") - before) * 1024

async def main(urls, name, budget):
    async with Client(urls.split(","), token=TOKEN) as client:
        bounded = await save(client, name, budget)
        unbounded = await save(client, name + "-all", None)
    print(f"PEAK_GROWTH {bounded} {unbounded}")

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def source() -> dict[str, np.ndarray[Any, Any]]:
    """The state as the child makes it."""
    return {f"w{i}": np.random.default_rng(i).standard_normal(STATE // 64) for i in range(8)}


async def test_a_budgeted_save_keeps_its_peak_rss_to_the_budget(cluster: LocalCluster) -> None:
    name = f"rss/{os.getpid()}"
    code = _CHILD.replace("STATE", str(STATE)).replace("TOKEN", repr(TOKEN))
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code, ",".join(cluster.urls), name, str(BUDGET)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONASYNCIODEBUG": ""},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"PEAK_GROWTH (\d+) (\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    bounded, unbounded = int(found.group(1)), int(found.group(2))
    print(f"peak RSS growth: budget {bounded / MiB:.1f} MiB, none {unbounded / MiB:.1f} MiB")
    assert bounded <= BUDGET + SLACK
    assert unbounded >= STATE  # the control: a whole staging copy does show
    async with client_for(cluster) as client:
        for saved in (name, f"{name}-all"):
            back = await restore_checkpoint(client, saved)
            for key, value in source().items():
                assert np.array_equal(back[key], value), (saved, key)
