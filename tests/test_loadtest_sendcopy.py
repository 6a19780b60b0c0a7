"""Smoke test of ``python -m loadtest.sendcopy``: it runs end to end at a tiny size and reports
what it promises; its summary and ratios come from its own rounds. No timing is asserted.
The copy check is checked on both loops: uvloop sends what it defers from the caller's
memory, the standard library's loop (Python 3.11) copies it (the check's positive control).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.sendcopy import (
    FIGURES,
    MODES,
    RATIOS,
    _cpu_between,
    copy_check,
    summarize,
    summarize_perf_report,
)
from tests.loadtest_run import run_loadtest


def _run(*args: str, timeout: float = 55) -> subprocess.CompletedProcess[str]:
    return run_loadtest("loadtest.sendcopy", *args, timeout=timeout)


@pytest.mark.timeout(60)
def test_quick_run_reports_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "sendcopy.json"
    proc = _run("--quick", "--mib", "8", "--chunk-mib", "2", "--chunks", "2", "--rounds", "2",
                "--slice-kib", "512", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].split(" | ")[1:] == [
        "sender CPU s/GB", "x send", "user / sys", "receiver CPU s/GB", "x send", "GB/s",
        "deferred |",
    ]  # fmt: skip
    assert [r.split(" | ")[0] for r in rows[2:]] == [f"| {m}" for m in MODES]

    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m loadtest.sendcopy --quick")
    settings = doc["settings"]
    assert settings["chunk_bytes"] == 2 << 20 and settings["transfer_bytes"] == 8 << 20
    assert settings["slice_bytes"] == 512 << 10 and settings["rounds"] == 2
    assert settings["modes"] == list(MODES) and settings["baseline"] == "send"
    assert doc["perf"] == {}  # not asked for
    assert len(doc["machine"]["loadavg_before"]) == 3

    rounds = doc["rounds"]
    assert len(rounds) == 2
    for rnd in rounds:
        assert set(rnd) == set(MODES)
        for mode, figs in rnd.items():
            assert set(figs) == set(FIGURES)
            assert figs["gbps"] > 0 and figs["send_cpu_s_per_gb"] > 0
            assert figs["recv_cpu_s_per_gb"] > 0
            assert figs["send_cpu_s_per_gb"] == pytest.approx(
                figs["send_user_s_per_gb"] + figs["send_sys_s_per_gb"], abs=2e-4
            )
            # only a loop's write can leave bytes queued; a blocking send never does
            assert 0 <= figs["deferred_share"] <= 1
            if mode in ("send", "sendfile"):
                assert figs["deferred_share"] == 0

    summary = doc["summary"]
    for mode in MODES:
        for fig in FIGURES:
            values = [r[mode][fig] for r in rounds]
            assert summary[mode][fig]["median"] == pytest.approx(
                statistics.median(values), abs=1e-4
            )
            assert summary[mode][fig]["min"] == min(values)
            assert summary[mode][fig]["max"] == max(values)
        for fig in RATIOS:
            ratio = statistics.median(r[mode][fig] / r["send"][fig] for r in rounds)
            assert summary[mode]["x_send"][fig] == pytest.approx(ratio, abs=1e-3)
    assert summary["send"]["x_send"] == {fig: 1.0 for fig in RATIOS}

    for loop in ("uvloop", "asyncio"):
        check = doc["copy_check"][loop]
        assert check["received"] == check["bytes"]
        assert 0 <= check["deferred"] <= check["bytes"]
        assert check["arrived_as_written"] == check["bytes"] - check["deferred"] + check["copied"]
    assert doc["copy_check"]["uvloop"]["copied"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--modes", "send,splice"], "subset of"),
        (["--modes", "send,send"], "subset of"),
        (["--mib", "1", "--chunk-mib", "2"], "at least one chunk"),
        (["--rounds", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    proc = _run("--quick", *args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "| mode |" not in proc.stdout


def test_summary_is_the_rounds_medians_and_paired_ratios() -> None:
    def figs(gbps: float, cpu: float) -> dict[str, float]:
        return {"gbps": gbps, "send_cpu_s_per_gb": cpu, "send_user_s_per_gb": 0.0,
                "send_sys_s_per_gb": cpu, "recv_cpu_s_per_gb": 0.2,
                "deferred_share": 0.0}  # fmt: skip

    rounds = [
        {"send": figs(1.0, 0.2), "uvloop": figs(1.0, 0.3)},
        {"send": figs(2.0, 0.4), "uvloop": figs(1.0, 0.5)},
        {"send": figs(4.0, 0.1), "uvloop": figs(2.0, 0.3)},
    ]
    summary = summarize(rounds, ["send", "uvloop"])
    assert summary["uvloop"]["send_cpu_s_per_gb"] == {"median": 0.3, "min": 0.3, "max": 0.5}
    # the median of each round's ratio (1.5, 1.25, 3.0), not the ratio of the medians (1.5)
    assert summary["uvloop"]["x_send"]["send_cpu_s_per_gb"] == 1.5
    assert summary["uvloop"]["x_send"]["gbps"] == 0.5
    assert summary["send"]["x_send"]["recv_cpu_s_per_gb"] == 1.0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's loop keeps memoryviews too")
def test_copy_check_sees_the_standard_loops_copy() -> None:
    # The positive control: Python 3.11's selector transport copies what the socket did
    # not take into its own bytearray, so every deferred byte arrives as first written.
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        check = runner.run(copy_check(8 << 20))
    assert check["received"] == 8 << 20
    assert check["deferred"] > 0  # else the check shows nothing
    assert check["copied"] == check["deferred"]


PERF_REPORT = """# Samples: 6K of event 'cpu-clock:ppp'
#
# Overhead  Symbol
# ........  ......
#
    30.00%  [k] _copy_from_iter
    20.00%  [.] __memmove_avx512_unaligned_erms
     5.50%  [k] rep_movs_alternative
     4.50%  [.] _PyEval_EvalFrameDefault
    40.00%  [k] tcp_sendmsg_locked
not a line of the table
"""


def test_perf_report_sorts_the_senders_samples_into_copies() -> None:
    summary = summarize_perf_report(PERF_REPORT, top=2)
    assert summary["shares"] == {
        "kernel copy from the caller's pages into socket buffers": 0.355,
        "user-space copies (memcpy, memmove)": 0.2,
        "other": 0.445,
    }
    assert summary["top"] == [["[k] _copy_from_iter", 0.3],
                              ["[.] __memmove_avx512_unaligned_erms", 0.2]]  # fmt: skip
    assert summarize_perf_report("")["shares"]["other"] == 0.0


def test_cpu_seconds_are_the_thread_clocks_split_as_getrusage_splits_them() -> None:
    # (user, system, thread clock) at the start and the end of a transfer
    assert _cpu_between((1.0, 2.0, 10.0), (1.1, 2.3, 10.8)) == pytest.approx((0.2, 0.6))
    # getrusage had not yet counted the running stretch (a CI run read 0 s): the clock did
    assert _cpu_between((1.0, 2.0, 10.0), (1.0, 2.0, 10.004)) == pytest.approx((0.0, 0.004))
    assert _cpu_between((1.0, 2.0, 10.0), (1.0, 2.0, 10.0)) == (0.0, 0.0)
