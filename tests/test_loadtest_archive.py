"""Smoke test of ``python -m loadtest.archive``: it runs end to end, on the Swift it starts
and on a ``file://`` directory, the tier's modes and the archive and restores through
node processes, and reports what it promises. No throughput is asserted
(that is the benchmark's job, on an idle machine): only that every mode ran every round,
that the ratios come from the figures next to them, and that nothing is left behind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.s3server import swift_missing

REPO = Path(__file__).resolve().parent.parent


def run_quick(tmp_path: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.archive", "--quick", "--out", str(out), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| tier put |" in proc.stdout and "ratio: tier / raw" in proc.stdout
    doc: dict[str, Any] = json.loads((out / "archive.json").read_text())
    assert doc["rounds"] == 2 and doc["count"] == 4 and doc["size"] == 8 << 20
    modes = doc["modes"]
    assert isinstance(modes, dict)
    assert set(modes) == {"raw put", "tier put", "raw get", "tier get"}
    for row in modes.values():
        assert len(row["seconds"]) == 2 and all(s > 0 for s in row["seconds"])
        # both rounded in the JSON (the seconds to the microsecond)
        best_gbps = 4 * (8 << 20) / min(row["seconds"]) / 1e9
        assert math.isclose(row["best_gbps"], best_gbps, rel_tol=0.01, abs_tol=0.002)
    for mode, base in (("tier put", "raw put"), ("tier get", "raw get")):
        best = min(modes[base]["seconds"]) / min(modes[mode]["seconds"])
        assert math.isclose(modes[mode]["ratio_best"], best, rel_tol=0.01, abs_tol=0.002)
    # through a cluster: archived by one, restored twice by a fresh one, as ratios to the
    # store's raw modes of the same run
    cluster = doc["cluster"]
    assert isinstance(cluster, dict)
    assert set(cluster) == {"archive", "restore from archive", "restore again"}
    assert "| cluster: restore from archive |" in proc.stdout
    for step, row in cluster.items():
        base = "raw put" if step == "archive" else "raw get"
        assert row["baseline"] == base and row["seconds"] > 0
        gbps = 4 * (8 << 20) / row["seconds"] / 1e9
        assert math.isclose(row["gbps"], gbps, rel_tol=0.01, abs_tol=0.002)
        expected = row["gbps"] / modes[base]["best_gbps"]
        assert math.isclose(row["ratio"], expected, rel_tol=0.01, abs_tol=0.002)
    assert not list(tmp_path.glob("storaged-archive-bench-*")), "scratch directory left behind"
    return doc


@pytest.mark.timeout(300)
def test_quick_run_on_the_swift_it_starts(tmp_path: Path) -> None:
    why = swift_missing()
    if why is not None:
        pytest.skip(why)
    doc = run_quick(tmp_path)
    assert doc["store"] == "swift s3api"
    start = doc["swift_start_s"]
    assert isinstance(start, float) and start > 0


@pytest.mark.timeout(120)
def test_quick_run_on_a_file_archive(tmp_path: Path) -> None:
    (tmp_path / "archive").mkdir()
    doc = run_quick(tmp_path, "--file", str(tmp_path / "archive"))
    assert str(doc["store"]).startswith("file:// ")
    assert list((tmp_path / "archive").iterdir()) == []  # the run's directory is removed
