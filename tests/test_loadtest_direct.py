"""Smoke test of ``python -m loadtest.direct``: it runs end to end and reports what it promises.

No timing is asserted: only the structure of the output, that the ratios are computed from
the figures next to them, that the direct mode did read directly, and that every restore
was checked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_quick_run_compares_both_modes(tmp_path: Path) -> None:
    # The node processes and the benchmark run without asyncio debug mode (conftest sets it).
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.direct", "--quick", "--tmp", str(tmp_path),
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "direct / aiohttp per round" in proc.stdout
    doc = json.loads((out / "direct.json").read_text())
    assert doc["verified"] is True and doc["rounds"] == 2
    assert doc["ram"]["chunks"] == doc["ram"]["chunks_in_memory"] > 0
    direct, plain = doc["modes"]["direct"], doc["modes"]["aiohttp"]
    for figures in (direct, plain):
        assert len(figures["gb_s"]) == 2 and all(v > 0 for v in figures["gb_s"])
    for got, d, a in zip(doc["ratios"]["gb_s"], direct["gb_s"], plain["gb_s"], strict=True):
        assert math.isclose(got, d / a)
    # Every GET of the direct client went the direct way: 3 restores of every chunk at least.
    assert doc["direct_pool"]["requests"] >= 3 * doc["ram"]["chunks"]
    assert 0 < doc["direct_pool"]["connections"] < doc["direct_pool"]["requests"]
    assert not list(tmp_path.glob("storaged-direct-*")), "scratch directory left behind"
