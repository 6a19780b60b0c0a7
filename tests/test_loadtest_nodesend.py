"""Smoke test of ``python -m loadtest.nodesend``: both send paths run and are reported.

No timing is asserted: only that the benchmark ran both node send paths end to end and
printed a positive figure range for each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_LINE = re.compile(
    r"^(stream|response)\s+GB/s ([\d.]+)-([\d.]+) \(median [\d.]+\)"
    r"\s+node CPU s/GB ([\d.]+)-([\d.]+) \(median [\d.]+\)$",
    re.MULTILINE,
)


@pytest.mark.timeout(180)
def test_small_run_reports_both_send_paths() -> None:
    # The node processes and the benchmark run without asyncio debug mode (conftest sets it).
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.nodesend", "--chunks", "2", "--chunk-mib", "1",
         "--rounds", "2", "--passes", "1", "--concurrency", "4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {m[1]: [float(x) for x in m.groups()[1:]] for m in _LINE.finditer(proc.stdout)}
    assert set(found) == {"stream", "response"}, proc.stdout
    for low_gbs, high_gbs, low_cpu, high_cpu in found.values():
        assert 0 < low_gbs <= high_gbs and 0 <= low_cpu <= high_cpu, proc.stdout
    # Every round counted the bytes of all 4 connections (4 x 2 chunks x 1 MiB), not one
    # connection's: concurrent walks once overwrote each other's count.
    assert f"; {4 * 2 * 2**20} bytes counted in every round)" in proc.stdout, proc.stdout
