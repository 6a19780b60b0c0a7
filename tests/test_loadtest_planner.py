"""``python -m loadtest.planner --quick``: the manifest a sharded save commits and each
target rank's restore plan beside DCP's, on a scaled-down layout, end to end.

No timing is asserted (the machine is shared): the JSON's structure, that its summaries are
computed from the figures beside them, that the node would take the manifest, and that
every plan is exact: the bytes storaged's plan writes (and DCP's read items fill) are the
rank's target bytes, no byte twice, and over the DP-0 ranks of a layout every byte of the
model. The layout rules themselves are checked at full size without a subprocess.
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

from loadtest.planner import (
    LLAMA3_405B,
    QUICK_MODEL,
    Model,
    Parallel,
    rank_boxes,
    sample_ranks,
    tp_piece,
)

REPO = Path(__file__).resolve().parent.parent


def model_bytes(model: Model, tp: int) -> int:
    """The bytes all TP ranks of all stages hold: sharded tensors once, replicated ones
    once per TP rank."""
    return sum(
        math.prod(shape) * 2 * (1 if dim is not None else tp)
        for _, shape, dim, _ in model.tensors()
    )


def test_the_405b_layout_is_llama3_405b_on_1024_and_2048_ranks() -> None:
    assert 405e9 < LLAMA3_405B.parameters() < 406e9
    source = Parallel(8, 16, 8)
    assert source.world == 1024 and Parallel(16, 16, 8).world == 2048
    stages = [len(source.stage_layers(s, 126)) for s in range(16)]
    assert stages == [8] * 14 + [7] * 2
    assert [r.start for r in (source.stage_layers(s, 126) for s in range(16))] == [
        sum(stages[:s]) for s in range(16)
    ]
    assert [tp_piece(1001, 4, i) for i in range(4)] == [
        (0, 251),
        (251, 251),
        (502, 251),
        (753, 248),
    ]
    assert tp_piece(3, 4, 3) == (3, 0)  # torch.chunk leaves the last piece empty
    # rank = tp + TP * (dp + DP * pp)
    assert source.coords(8 * (3 + 8 * 5) + 6) == (6, 5, 3)
    # every DP replica of the saved layout holds the whole model once (norms per TP rank)
    for dp in (0, 7):
        held = sum(
            math.prod(shape) * 2
            for rank in range(source.world)
            if source.coords(rank)[2] == dp
            for _, _, _, shape in rank_boxes(LLAMA3_405B, source, rank)
        )
        assert held == model_bytes(LLAMA3_405B, 8)
    assert sample_ranks(2048, 32)[:2] == [0, 66] and sample_ranks(2048, 32)[-1] == 2047
    assert len(sample_ranks(2048, 32)) == 32 and sample_ranks(16, 32) == list(range(16))


@pytest.mark.timeout(120)
def test_quick_run_plans_every_target_byte_exactly_beside_dcp(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.planner", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "storaged / DCP" in proc.stdout and "plan < 100.0 ms" in proc.stdout
    doc = json.loads((tmp_path / "planner.json").read_text())
    assert doc["parameters"] == QUICK_MODEL.parameters() and doc["target_s"] == 0.1
    m = doc["manifest"]
    assert m["node_accepts"] is True and m["node_error"] is None
    assert m["shards"] == 4  # TP=2 x PP=2 saving ranks: DP rank 0 of each group
    assert m["keys"] == len(QUICK_MODEL.tensors())
    assert m["chunks"] > m["shards"] and m["encoded_bytes"] > 0
    assert m["bytes_saved"] == model_bytes(QUICK_MODEL, 2)  # replicated norms stay in streams
    assert m["parse_median_s"] == statistics.median(m["parse_s"]) > 0
    assert m["parse_peak_bytes"] >= m["parsed_bytes"] > 0
    assert len(m["decode_cpu_s"]) == len(m["on_read_cpu_s"]) == doc["repeat"]
    assert m["decode_cpu_median_s"] > 0 and m["on_read_cpu_median_s"] > 0
    assert [t["layout"] for t in doc["targets"]] == ["TP=4 x PP=2 x DP=2", "TP=2 x PP=4 x DP=2"]
    for target in doc["targets"]:
        par = Parallel(target["tp"], target["pp"], target["dp"])
        ranks = target["ranks"]
        assert [r["rank"] for r in ranks] == list(range(par.world))  # --quick: every rank
        for r in ranks:
            ours, dcp = r["storaged"], r["dcp"]
            assert len(ours["times_s"]) == len(ours["cpu_s"]) == doc["repeat"] == 2
            assert ours["plan_cpu_s"] == statistics.median(ours["cpu_s"])
            assert dcp["plan_s"] == statistics.median(dcp["times_s"])
            # exact: what each plan fills is the rank's target, every byte once
            expected = sum(
                math.prod(shape) * 2 for _, _, _, shape in rank_boxes(QUICK_MODEL, par, r["rank"])
            )
            assert r["target_bytes"] == expected
            assert ours["needed_bytes"] == ours["written_bytes"] == expected
            assert ours["written_union_bytes"] == expected
            assert dcp["covered_bytes"] == expected
            assert ours["fetched_bytes"] >= expected and dcp["read_bytes"] >= expected
            assert dcp["read_items"] >= r["tensors"] and ours["peak_bytes"] > 0
        # the DP-0 ranks of the target together restore the whole model
        assert sum(r["target_bytes"] for r in ranks if r["dp"] == 0) == model_bytes(
            QUICK_MODEL, par.tp
        )
        s = target["summary"]
        cpu = [r["storaged"]["plan_cpu_s"] for r in ranks]
        assert s["storaged_cpu_max_s"] == max(cpu)
        assert s["storaged_cpu_median_s"] == statistics.median(cpu)
        ratios = [r["storaged"]["plan_cpu_s"] / r["dcp"]["plan_cpu_s"] for r in ranks]
        assert math.isclose(s["ratio_median"], statistics.median(ratios))
        assert s["meets_target"] == (max(cpu) < doc["target_s"])
        # what a restore pays before its first fetch: decode, check (chunks on read), plan
        started = [r["storaged"]["start_cpu_median_s"] for r in ranks]
        assert all(len(r["storaged"]["start_cpu_s"]) == doc["repeat"] for r in ranks)
        assert s["start_cpu_max_s"] == max(started) > 0
        assert s["start_meets_target"] == (max(started) < doc["target_s"])
        assert s["every_plan_exact"] is True
    # the 4 -> 2 x TP layout cuts the row-parallel boxes across their rows: staged tiles
    resharded = doc["targets"][0]["ranks"]
    assert any(r["storaged"]["staged_tiles"] for r in resharded)
