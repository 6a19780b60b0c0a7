"""Smoke test of ``python -m loadtest.lazy_save --quick``: it runs end to end against a real
cluster and reports what it promises.

No timing is asserted (the machine is shared): only the structure of the output, that the
ratios are computed from the figures beside them, that every mode's last checkpoint was
restored equal to the parameters of its step, and that the budgeted modes name their budget.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
def test_quick_run_reports_every_mode_against_a_memcpy(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.lazy_save", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lazy / memcpy" in proc.stdout and "target <= 0.1" in proc.stdout
    doc = json.loads((tmp_path / "lazy_save.json").read_text())
    assert doc["memcpy_s"] > 0 and doc["forward_backward_s"] >= 0.05
    assert set(doc["modes"]) == {"save", "lazy", "save, budget", "lazy, budget"}
    for mode, figures in doc["modes"].items():
        assert figures["verified"] is True, mode
        assert len(figures["stalls_s"]) == 2 and all(s > 0 for s in figures["stalls_s"])
        median = statistics.median(figures["stalls_s"])
        assert math.isclose(doc["ratios"][mode], median / doc["memcpy_s"])
        assert (figures["budget"] is not None) == mode.endswith("budget")
        # a stall is its save() call plus what the next step's hook held it (lazy only)
        for stall, call, held in zip(
            figures["stalls_s"], figures["calls_s"], figures["held_s"], strict=True
        ):
            assert 0 < call <= stall and math.isclose(call + held, stall)
            assert held >= 0 and (held == 0 or mode.startswith("lazy"))
        calls = zip(figures["in_loop_s"], figures["calls_s"], strict=True)
        assert all(0 < inside <= call for inside, call in calls)  # the rest: thread hops
        # each lazy copy's end is seen, after its call began
        assert len(figures["copy_s"]) == (2 if mode.startswith("lazy") else 0)
    assert doc["modes"]["lazy, budget"]["budget"] == doc["size"] // 4
