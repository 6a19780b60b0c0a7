"""Smoke test of ``python -m loadtest.chunkcost``: it runs end to end at tiny sizes and reports
what it promises; its fits and shares come from its own rounds. No timing is asserted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from loadtest.chunkcost import AT_MIB, PARTS, SHARE, batch_ops, fit, summarize
from tests.loadtest_run import run_loadtest


def _run(*args: str, timeout: float = 55) -> subprocess.CompletedProcess[str]:
    return run_loadtest("loadtest.chunkcost", *args, timeout=timeout)


@pytest.mark.timeout(60)
def test_quick_run_reports_tables_and_json(tmp_path: Path) -> None:
    out = tmp_path / "chunkcost.json"
    proc = _run("--quick", "--sizes", "0.25,0.5,1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].split(" | ")[1:] == [
        "a ms/chunk (min-max)", "b ms/MiB (min-max)", "a share at 8 MiB", "a < 5 % above |",
    ]  # fmt: skip
    assert [r.split(" | ")[0] for r in rows[2 : 2 + len(PARTS)]] == [f"| {p}" for p in PARTS]

    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m loadtest.chunkcost --quick")
    # --quick sets the sizes (given ones are overridden), the batch and the rounds
    assert doc["settings"]["sizes"] == [1 << 20, 2 << 20]
    assert doc["settings"]["rounds"] == 2 and doc["settings"]["parts"] == list(PARTS)
    rounds = doc["rounds"]
    assert len(rounds) == 2
    for rnd in rounds:
        assert list(rnd) == list(PARTS)
        for part in PARTS:
            assert list(rnd[part]) == ["1", "2"]
            assert all(v >= 0 for v in rnd[part].values())
        # a chunk of data costs CPU: /proc's tick granularity is not what getrusage has
        assert rnd["blake3"]["2"] > 0 and rnd["peer"]["2"] > 0

    summary = doc["summary"]
    for part in PARTS:
        s = summary[part]
        fits = [fit([(1.0, r[part]["1"]), (2.0, r[part]["2"])]) for r in rounds]
        for got, (a, b) in zip(s["fits"], fits, strict=True):
            assert got["a_ms"] == pytest.approx(a, abs=1e-5)
            assert got["b_ms_per_mib"] == pytest.approx(b, abs=1e-5)
        a = statistics.median(f[0] for f in fits)
        b = statistics.median(f[1] for f in fits)
        assert s["a_ms"]["median"] == pytest.approx(a, abs=1e-5)
        assert s["b_ms_per_mib"]["median"] == pytest.approx(b, abs=1e-5)
        if a > 0 and b > 0:
            assert s["mib_where_a_is_5pct"] == pytest.approx(a / (SHARE * b), abs=0.01)
            assert s["a_share_at_8mib"] == pytest.approx(a / (a + b * AT_MIB), abs=1e-4)
        else:
            assert s["mib_where_a_is_5pct"] is None and s["a_share_at_8mib"] is None
        for label in ("1", "2"):
            values = [r[part][label] for r in rounds]
            assert s["sizes"][label]["median_ms"] == pytest.approx(
                statistics.median(values), abs=1e-5
            )
            assert s["sizes"][label]["ms_per_mib"] == pytest.approx(
                statistics.median(values) / float(label), abs=1e-5
            )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parts", "map,mystery"], "subset of"),
        (["--sizes", "8"], "two or more"),
        (["--sizes", "1,1"], "two or more"),
        (["--rounds", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    proc = _run(*args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "| part |" not in proc.stdout


def test_fit_recovers_a_fixed_and_a_per_byte_cost() -> None:
    points = [(s, 0.3 + 0.25 * s) for s in (1.0, 2.0, 4.0, 8.0, 64.0)]
    a, b = fit(points)
    assert a == pytest.approx(0.3) and b == pytest.approx(0.25)
    with pytest.raises(ValueError):
        fit([(8.0, 1.0)])


def test_summary_takes_medians_of_the_rounds_fits() -> None:
    def costs(a: float, b: float) -> dict[str, float]:
        return {label: a + b * float(label) for label in ("1", "4", "16")}

    rounds = [{"x": costs(0.1, 0.5)}, {"x": costs(0.3, 0.4)}, {"x": costs(0.2, 0.6)}]
    s = summarize(rounds, ["x"])["x"]
    assert s["a_ms"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert s["b_ms_per_mib"] == {"median": 0.5, "min": 0.4, "max": 0.6}
    assert s["mib_where_a_is_5pct"] == 8.0  # 0.2 = 5 % of 0.5 x 8
    assert s["a_share_at_8mib"] == pytest.approx(0.2 / 4.2, abs=1e-4)
    assert s["sizes"]["4"] == pytest.approx(
        {"median_ms": 2.1, "min_ms": 1.9, "max_ms": 2.6, "ms_per_mib": 0.525}
    )


def test_batches_hold_their_bytes_within_bounds() -> None:
    assert batch_ops(1 << 20, 128 << 20) == 128
    assert batch_ops(64 << 20, 128 << 20) == 16
    assert batch_ops(1 << 10, 128 << 20) == 512
