"""Smoke test of ``python -m loadtest.cli_start``: it runs end to end and reports what it
promises. No time is asserted (that is the benchmark's job, on an idle machine): only that
every command ran every round, that the derived columns come from the figures next to them,
and that the cluster and the scratch directory are gone afterwards."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_quick_run_reports_every_command_against_the_baselines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.cli_start", "--quick", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "cli_start.json").read_text())
    assert doc["rounds"] == 1 and doc["target_s"] == 0.3
    rows = {r["command"]: r for r in doc["rows"]}
    for label in ("python -c pass", 'python -c "import aiohttp"', "storaged --version",
                  "storaged ls", "storaged nodes"):  # fmt: skip
        assert label in rows, label
    assert any(label.startswith("storaged status ") for label in rows)
    floor, aiohttp = rows["python -c pass"]["best_s"], rows['python -c "import aiohttp"']["best_s"]
    for row in rows.values():
        assert 0 < row["best_s"] <= row["median_s"]
        assert math.isclose(row["over_python_s"], row["best_s"] - floor, abs_tol=2e-4)
        assert math.isclose(row["x_import_aiohttp"], row["best_s"] / aiohttp, rel_tol=0.02)
    assert "`storaged ls`" in proc.stdout and "x import aiohttp" in proc.stdout
    assert not list(tmp_path.glob("cli-start-*")), "scratch directory left behind"
