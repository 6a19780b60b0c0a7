"""The scale model (``storaged.tools.model``, printed by ``loadtest.model``) and the
checkpoint-interval advice (``storaged.tools.advise``).

Formulas against values worked out by hand, the model's shape (monotone in the node
count, the filesystem constant, the bounding resource moving where it should), result
files read or defaulted, and the command lines' error paths. The live ``--url`` path runs
a quick save and restore on a real 4-node cluster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from loadtest.model import NODE_COUNTS, markdown, override_rates, run
from storaged.tools.advise import (
    AdviceError,
    advise,
    at_interval,
    daly_interval,
    register,
    young_interval,
)
from storaged.tools.model import Assumptions, Rates, load_rates, phase, pipelined, project
from tests.conftest import ClusterFactory
from tests.loadtest_run import run_loadtest

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0

# --------------------------------------------------------------------------- formulas


def test_young_interval_known_value() -> None:
    # sqrt(2 x 60 x 86400) = sqrt(10,368,000) = 3219.94
    assert young_interval(60, 24 * HOUR) == pytest.approx(3219.94, abs=0.01)
    assert young_interval(1, 0.5) == pytest.approx(1.0)


def test_daly_interval_known_values() -> None:
    # C/2M = 60/172800; sqrt(2CM) (1 + sqrt(x)/3 + x/9) - C = 3219.94 x 1.006250 - 60
    assert daly_interval(60, 24 * HOUR) == pytest.approx(3180.06, abs=0.05)
    # Daly's correction shortens the interval by about 2C/3 when C << M
    # (- C + sqrt(2CM) sqrt(C/2M) / 3)...
    assert young_interval(1, 1e6) - daly_interval(1, 1e6) == pytest.approx(2 / 3, rel=0.01)
    # ...and stops at M once a checkpoint costs as much as two MTBFs.
    assert daly_interval(200, 100) == 100
    assert daly_interval(10_000, 100) == 100


def test_costs_at_an_interval() -> None:
    got = at_interval(interval=1000, cost=10, restore=50, mtbf=10_000)
    assert got.lost_per_failure == 1000 / 2 + 50
    assert got.checkpointing == pytest.approx(0.01)
    assert got.overhead == pytest.approx(10 / 1000 + 550 / 10_000)


@pytest.mark.parametrize(("cost", "restore", "mtbf"), [(60, 30, 86400), (0.2, 5, 3 * HOUR)])
def test_young_interval_minimises_the_first_order_overhead(
    cost: float, restore: float, mtbf: float
) -> None:
    best = advise(cost, restore, mtbf).young
    for factor in (0.25, 0.5, 0.9, 1.1, 2, 4):
        other = at_interval(best.interval * factor, cost, restore, mtbf)
        assert other.overhead > best.overhead


def test_advice_has_both_intervals() -> None:
    a = advise(60, 30, 24 * HOUR)
    assert a.young.interval == pytest.approx(3219.94, abs=0.01)
    assert a.daly.interval == pytest.approx(3180.06, abs=0.05)
    assert a.young.lost_per_failure == pytest.approx(3219.94 / 2 + 30, abs=0.01)
    doc = a.as_dict()
    assert set(doc) == {"cost", "restore", "mtbf", "young", "daly"}
    assert doc["daly"]["checkpointing"] == pytest.approx(60 / 3180.06, rel=1e-4)


@pytest.mark.parametrize(
    ("cost", "restore", "mtbf", "word"),
    [
        (0, 1, 100, "cost"),
        (-1, 1, 100, "cost"),
        (math.nan, 1, 100, "cost"),
        (math.inf, 1, 100, "cost"),
        (1, -1, 100, "restore"),
        (1, math.nan, 100, "restore"),
        (1, 1, 0, "mtbf"),
        (1, 1, -5, "mtbf"),
        (1, 1, math.inf, "mtbf"),
    ],
)
def test_bad_inputs_are_refused(cost: float, restore: float, mtbf: float, word: str) -> None:
    with pytest.raises(AdviceError, match=word):
        advise(cost, restore, mtbf)
    assert issubclass(AdviceError, ValueError)


def test_zero_restore_is_allowed() -> None:
    assert advise(1, 0, 100).young.lost_per_failure == pytest.approx(math.sqrt(200) / 2)


# --------------------------------------------------------------------------- model


def rates(**changes: float) -> Rates:
    """Fixed rates, so that these tests do not depend on what the load tests measured."""
    values: dict[str, Any] = {**Rates().values(), **changes}
    return Rates(**values)


def test_model_is_monotone_in_nodes() -> None:
    a, r = Assumptions(), rates()
    rows = [(n, project(n, a, r)) for n in NODE_COUNTS]
    for (n1, p1), (n2, p2) in itertools.pairwise(rows):
        assert n2 > n1
        for name in ("stall", "ack", "drain", "encode", "restore_ram", "restore_cold"):
            assert p2[name].seconds < p1[name].seconds, name
        # The central filesystem does not get faster with more clients.
        assert p2["fs_save"].seconds == p1["fs_save"].seconds
        assert p2["fs_restore"].seconds == p1["fs_restore"].seconds
        assert p2["fs_save"].bound == "FS"
    doc = run(NODE_COUNTS, a, r)
    per_node = [row["gb_per_node"] for row in doc["rows"]]
    assert per_node == sorted(per_node, reverse=True)
    assert per_node[0] == pytest.approx(6480 / 1000)
    # 6.48 TB through 100 GB/s
    assert doc["rows"][0]["phases"]["fs_save"]["seconds"] == pytest.approx(64.8)


def test_the_figures_follow_the_stated_formulas() -> None:
    a = Assumptions(model_bytes=1000e9, nic_gbps=10, cores=4, nvme_drives=2, k=4, n=6)
    r = rates(
        ack_node_cpu_s_per_gb=3.0,
        ack_client_cpu_s_per_gb=1.0,
        restore_cpu_s_per_gb=2.0,
        memcpy_gbps=1.0,
        nvme_write_gbps=1.0,
        nvme_read_gbps=2.0,
        encode_gbps=0.5,
    )
    p = project(10, a, r)  # 100 GB per node
    assert p["stall"].demands == {"memcpy": 100 / 8, "PCIe": 100 / 200}
    assert p["ack"].demands["NIC"] == pytest.approx(2 * 100 / 10)
    # 3 RAM copies of 100 GB at 1 CPU-s per stored GB, plus the client's 1 s/GB, on 4 cores
    assert p["ack"].demands["CPU"] == pytest.approx((300 + 100) / 4)
    assert p["ack"].demands["RAM"] == pytest.approx((300 - 256) / 2)
    assert p["drain"].seconds == pytest.approx(300 / 2)
    assert p["encode"].demands == pytest.approx(
        {"CPU": 100 / 2, "NIC": 150 * 5 / 6 / 10, "disk": 150 / 2}
    )
    assert p["restore_ram"].demands["CPU"] == pytest.approx(100 * 2 / 4)
    assert p["restore_nvme"].demands["disk"] == pytest.approx(100 / 4)
    # Ack and drain overlap: each resource's demands add up (waiting for RAM is not disk
    # time of its own: the drain is what frees the RAM).
    assert p["durable_nvme"].demands == pytest.approx({**p["ack"].demands, "disk": 150})
    assert (p["durable_nvme"].seconds, p["durable_nvme"].bound) == (150, "disk")


def test_bounding_resource_moves_where_expected() -> None:
    a, r = Assumptions(), rates()
    default = project(1000, a, r)
    # The ack path measured here costs far more CPU per byte than the NIC needs.
    assert default["ack"].bound == "CPU"
    assert default["stall"].bound == "memcpy"
    assert default["fs_save"].bound == "FS"
    # A cheap ack path leaves the NIC as the limit...
    cheap = project(1000, a, rates(ack_node_cpu_s_per_gb=0.1, ack_client_cpu_s_per_gb=0.01))
    assert cheap["ack"].bound == "NIC"
    # Today's socket path sends all three copies over the NIC: 3/2 of the NIC time.
    socket = project(1000, replace(a, local_copy=False), rates(ack_node_cpu_s_per_gb=0.1))
    assert socket["ack"].demands["NIC"] == pytest.approx(1.5 * cheap["ack"].demands["NIC"])
    # Few nodes: three copies of the state overflow the memory tier, and the ack waits for
    # the drain (unless the CPU is slower still, as measured here).
    cheap_rates = rates(ack_node_cpu_s_per_gb=0.1, ack_client_cpu_s_per_gb=0.01)
    labels = [project(n, a, cheap_rates)["ack"].bound for n in (20, 1000)]
    assert labels == ["RAM", "NIC"]
    assert project(20, a, r)["ack"].bound == "CPU"
    # A fast host copy leaves PCIe as the stall's limit.
    assert project(1000, a, rates(memcpy_gbps=100))["stall"].bound == "PCIe"
    # A filesystem with slow metadata is bounded by it once there are enough files.
    slow_md = replace(a, fs_metadata_ops=100)
    assert project(1000, slow_md, r)["fs_save"].bound == "FS metadata"
    assert project(1000, replace(a, fs_metadata_ops=1e6), r)["fs_save"].bound == "FS"
    # Restores from nvme: disk-bound on this machine's disks, CPU-bound on fast drives.
    assert default["restore_nvme"].bound == "disk"
    assert project(1000, a, rates(nvme_read_gbps=50))["restore_nvme"].bound == "CPU"


def test_replicated_optimizer_state() -> None:
    a, r = Assumptions(), rates()
    sharded = project(1000, a, r)
    replicated = project(1000, replace(a, replicas=2), r)
    # Each node holds (and restores) twice the bytes; the FS writes one copy, reads two.
    assert replicated["stall"].seconds == pytest.approx(2 * sharded["stall"].seconds)
    assert replicated["restore_ram"].seconds == pytest.approx(2 * sharded["restore_ram"].seconds)
    assert replicated["fs_save"].seconds == sharded["fs_save"].seconds
    assert replicated["fs_restore"].seconds == pytest.approx(2 * sharded["fs_restore"].seconds)
    # Encoding works on distinct bytes only, spread over every node.
    assert replicated["encode"].seconds == sharded["encode"].seconds


def test_hedged_cold_reads_cost_n_over_k() -> None:
    a = Assumptions(k=4, n=6)
    r = rates(nvme_read_gbps=0.01)  # disk-bound, so the bytes read show
    plain = project(1000, a, r)["restore_cold"]
    hedged = project(1000, replace(a, hedged_cold_reads=True), r)["restore_cold"]
    assert hedged.seconds == pytest.approx(plain.seconds * 6 / 4)


def test_phase_helpers() -> None:
    p = phase({"NIC": 1.0, "CPU": 3.0, "disk": 2.0})
    assert (p.seconds, p.bound) == (3.0, "CPU")
    both = pipelined(phase({"CPU": 2.0, "NIC": 1.5}), phase({"disk": 1.0, "NIC": 1.0}))
    assert (both.seconds, both.bound) == (2.5, "NIC")
    assert both.demands == {"CPU": 2.0, "NIC": 2.5, "disk": 1.0}


def test_bad_assumptions_are_refused() -> None:
    r = rates()
    with pytest.raises(ValueError, match="nodes"):
        project(0, Assumptions(), r)
    with pytest.raises(ValueError, match="nic_gbps"):
        project(10, Assumptions(nic_gbps=0), r)
    with pytest.raises(ValueError, match="k=6 n=4"):
        project(10, Assumptions(k=6, n=4), r)
    with pytest.raises(ValueError, match="memcpy_gbps"):
        project(10, Assumptions(), rates(memcpy_gbps=-1))
    with pytest.raises(ValueError, match="NAME=VALUE"):
        override_rates(r, ["nonsense=1"])
    with pytest.raises(ValueError, match="not a number"):
        override_rates(r, ["memcpy_gbps=fast"])
    assert override_rates(r, ["memcpy_gbps=7"]).memcpy_gbps == 7


# --------------------------------------------------------------------------- result files


def test_missing_results_fall_back_to_defaults_and_say_so(tmp_path: Path) -> None:
    r = load_rates(tmp_path)
    assert r.values() == Rates().values()
    assert all(source.startswith("default") for source in r.sources.values())
    assert "ack.json missing" in r.sources["ack_node_cpu_s_per_gb"]
    assert "nvme.json missing" in r.sources["nvme_write_gbps"]


def test_measured_results_are_used(tmp_path: Path) -> None:
    def row(kind: str, gbps: float, server: float, client: float) -> dict[str, Any]:
        return {
            "kind": kind,
            "config": f"{kind} {gbps}",
            "gbps": gbps,
            "server_cpu_s_per_gb": server,
            "client_cpu_s_per_gb": client,
        }

    ack = {
        "results": [
            row("raw", 2.0, 0.1, 0.1),
            row("baseline", 0.7, 0.8, 0.3),
            row("storaged", 0.04, 20.0, 1.0),
            row("storaged", 0.09, 6.0, 0.5),  # the faster configuration wins
        ]
    }
    (tmp_path / "ack.json").write_text(json.dumps(ack))
    nvme = {
        "writes": {"tier x4": {"best_gbps": 1.5}},
        "reads": {"cold": {"raw": {"best_gbps": 2.5}}},
    }
    (tmp_path / "nvme.json").write_text(json.dumps(nvme))
    r = load_rates(tmp_path)
    assert (r.ack_node_cpu_s_per_gb, r.ack_client_cpu_s_per_gb) == (6.0, 0.5)
    assert "measured: ack.json [storaged 0.09]" in r.sources["ack_node_cpu_s_per_gb"]
    # No restore.json: the one-copy baseline transfer stands in, and says so.
    assert r.restore_cpu_s_per_gb == pytest.approx(1.1)
    assert "restore.json missing" in r.sources["restore_cpu_s_per_gb"]
    assert (r.nvme_write_gbps, r.nvme_read_gbps) == (1.5, 2.5)

    (tmp_path / "restore.json").write_text(json.dumps({"results": [row("storaged", 1, 0.4, 0.6)]}))
    r = load_rates(tmp_path)
    assert r.restore_cpu_s_per_gb == pytest.approx(1.0)
    assert r.sources["restore_cpu_s_per_gb"].startswith("measured: restore.json")


SAVE_DOC: dict[str, Any] = {
    "kind": "save",
    "runs": [
        {
            "kind": "storaged",
            "concurrency": 1,
            "bytes": 1e9,
            "stall_s": 0.5,
            "stall_warm_s": 0.25,
            "ack_seconds": 3.0,
            "gbps": 0.3,
            "node_cpu_s_per_gb": 9.0,
            "client_cpu_s_per_gb": 0.4,
        },
        {
            "kind": "storaged",
            "concurrency": 2,
            "bytes": 1e9,
            "stall_s": 0.6,
            "stall_warm_s": math.nan,  # not measured at this level
            "ack_seconds": 2.5,
            "gbps": 0.4,
            "node_cpu_s_per_gb": 8.0,
            "client_cpu_s_per_gb": 0.5,
        },
    ],
    "baselines": {
        "codec": {"codec": "zfec", "k": 4, "n": 6, "encode_wrapper_gbps": 0.9},
        "disk_write": [{"kind": "disk_write", "concurrency": 1, "gbps": 0.8}],
    },
}
RESTORE_DOC: dict[str, Any] = {
    "runs": [
        {"kind": "storaged", "tier": "memory", "concurrency": 2, "bytes": 5e8, "seconds": 1.0},
        {"kind": "storaged", "tier": "cold", "concurrency": 2, "bytes": 5e8, "seconds": 9.0},
        {"kind": "storaged", "tier": "memory", "concurrency": 1, "bytes": 5e8, "seconds": 1.5},
    ]
}


def test_rates_from_the_save_benchmark(tmp_path: Path) -> None:
    (tmp_path / "save.json").write_text(json.dumps(SAVE_DOC))
    r = load_rates(tmp_path)
    # One rank's 1 GB staged in 0.25 s with warm buffers.
    assert r.memcpy_gbps == pytest.approx(4.0)
    assert "stall_warm_s" in r.sources["memcpy_gbps"]
    # No ack.json: the save benchmark's CPU per GB, from its fastest level.
    assert (r.ack_node_cpu_s_per_gb, r.ack_client_cpu_s_per_gb) == (8.0, 0.5)
    assert "ack.json missing" in r.sources["ack_node_cpu_s_per_gb"]
    assert (r.encode_gbps, r.nvme_write_gbps) == (0.9, 0.8)
    assert r.sources["nvme_read_gbps"].startswith("default")
    # Measured at 4,6 only: another k, n keeps the documented rate.
    assert load_rates(tmp_path, k=8, n=12).encode_gbps == 0.54


def _fabric_doc() -> dict[str, Any]:
    """What ``loadtest.fabric`` writes, trimmed to what the model reads: 1,000 MB saved by
    c0; the nodes sent 2,100 MB and received 3,150 MB; the ack at 0.5 of the client's cap;
    restores by 1 and 4 readers at 0.9 and 0.75 of theirs."""
    links = {f"n{i}": [525.0, 787.5] for i in range(4)} | {"c0": [1000.0, 0.5]}
    return {
        "benchmark": "fabric",
        "caps": {"node": "500mbit", "client": "500mbit", "node_bytes_per_s": 62.5e6},
        "nodes": 4,
        "ack": {"bytes": 1e9, "ratio": 0.5, "links_mb": links, "node_copies_per_client_byte": 2.1},
        "restores": [{"readers": 1, "ratio": 0.9}, {"readers": 4, "ratio": 0.75}],
    }


def test_the_fabric_run_sets_the_link_figures(tmp_path: Path) -> None:
    """A fabric run's ratios replace the whole-NIC assumption: the ack's NIC demand grows by
    the bytes each copy costs on the links over the share of the link the ack reaches, the
    restores' by one over their links' efficiency; the CPU and disk demands stay."""
    a = Assumptions(model_bytes=1000e9, nic_gbps=10, cores=4, nvme_drives=2)
    assumed = project(10, a, Rates())  # 100 GB per node, 2 remote copies
    (tmp_path / "fabric.json").write_text(json.dumps(_fabric_doc()))
    r = load_rates(tmp_path)
    assert (r.ack_link_share, r.ack_egress_copies, r.restore_link_efficiency) == (0.5, 2.1, 0.75)
    assert r.ack_ingress_copies == pytest.approx(3.15)
    assert r.sources["restore_link_efficiency"] == "measured: fabric.json restores[readers=4].ratio"
    assert r.sources["ack_link_share"].startswith("measured: fabric.json ack.ratio (500mbit")
    measured = project(10, a, r)
    # sent: 2.1 / 2 per copy; received: 3.15 / 3 per copy (the same per node here): sent binds
    assert measured["ack"].demands["NIC"] == pytest.approx(2 * 100 * 1.05 / (10 * 0.5))
    assert measured["ack"].demands["CPU"] == assumed["ack"].demands["CPU"]
    for name in ("restore_ram", "restore_nvme", "restore_cold"):
        assert measured[name].demands["NIC"] == pytest.approx(100 / (10 * 0.75))
        assert measured[name].demands["CPU"] == assumed[name].demands["CPU"]
    # A receive side costlier per copy than the send side binds instead.
    doc = _fabric_doc()
    doc["ack"]["links_mb"] |= {f"n{i}": [525.0, 900.0] for i in range(4)}  # 3.6 per byte
    (tmp_path / "fabric.json").write_text(json.dumps(doc))
    received = project(10, a, load_rates(tmp_path))
    assert received["ack"].demands["NIC"] == pytest.approx(2 * 100 * 1.2 / (10 * 0.5))
    # Without the file, the assumed figures, which give the formulas' NIC demands.
    (tmp_path / "fabric.json").unlink()
    defaulted = load_rates(tmp_path)
    assert "fabric.json missing" in defaulted.sources["ack_link_share"]
    assert project(10, a, defaulted)["ack"].demands["NIC"] == pytest.approx(2 * 100 / 10)


def test_a_fabric_run_with_too_few_nodes_keeps_the_assumption(tmp_path: Path) -> None:
    (tmp_path / "fabric.json").write_text(json.dumps(_fabric_doc() | {"nodes": 2}))
    r = load_rates(tmp_path)
    assert r.ack_link_share == 1.0
    assert "fabric.json unreadable (ValueError: 2 nodes" in r.sources["ack_link_share"]


def test_unreadable_results_keep_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "ack.json").write_text("{not json")
    (tmp_path / "nvme.json").write_text(json.dumps({"writes": {}}))
    r = load_rates(tmp_path)
    assert r.ack_node_cpu_s_per_gb == Rates().ack_node_cpu_s_per_gb
    assert "ack.json unreadable" in r.sources["ack_node_cpu_s_per_gb"]
    assert "nvme.json unreadable (KeyError" in r.sources["nvme_write_gbps"]


def test_codec_rates_follow_k_and_n(tmp_path: Path) -> None:
    assert load_rates(tmp_path, k=8, n=12).encode_gbps == 0.54
    scaled = load_rates(tmp_path, k=6, n=12)  # 6 parity blocks: a third of 4,6's rate
    assert scaled.encode_gbps == pytest.approx(1.0 / 3)
    assert "scaled" in scaled.sources["encode_gbps"]


# --------------------------------------------------------------------------- commands


def advise_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="storaged")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["advise", *argv])
    result: int = args.func(args)
    return result


def test_advise_prints_intervals_and_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    assert advise_cli("--mtbf", "24", "--stall", "60", "--restore", "30") == 0
    out = capsys.readouterr().out
    assert "3220 s (53.7 min)" in out  # Young
    assert "3180 s (53.0 min)" in out  # Daly
    assert "interval/2 + R" in out
    assert "C/interval + (interval/2 + R)/M" in out


def test_advise_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert advise_cli("--mtbf", "24", "--stall", "60", "--restore", "30", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["young"]["interval"] == pytest.approx(3219.94, abs=0.01)
    assert doc["young"]["lost_per_failure"] == pytest.approx(3219.94 / 2 + 30, abs=0.01)
    assert doc["sources"] == {"cost": "--stall", "restore": "--restore"}


def test_advise_from_the_scale_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ("--mtbf", "3", "--nodes", "16000", "--results", str(tmp_path), "--json")
    assert advise_cli(*argv) == 0
    doc = json.loads(capsys.readouterr().out)
    expected = project(16000, Assumptions(), load_rates(tmp_path))
    assert doc["cost"] == pytest.approx(expected["stall"].seconds)
    assert doc["restore"] == pytest.approx(expected["restore_ram"].seconds)
    assert "16000 nodes" in doc["sources"]["cost"]
    assert "bound by" in doc["sources"]["restore"]
    # A given figure wins over the model's.
    assert advise_cli(*argv, "--stall", "5") == 0
    assert json.loads(capsys.readouterr().out)["cost"] == 5


def test_advise_warns_when_saves_would_queue(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # At 1,000 nodes the ack takes seconds (default rates); a 36 s MTBF asks for
    # checkpoints faster than that.
    argv = ("--mtbf", "0.01", "--nodes", "1000", "--results", str(tmp_path))
    assert advise_cli(*argv) == 0
    assert "shorter than the ack" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--mtbf", "0", "--stall", "1", "--restore", "1"), "--mtbf must be a positive"),
        (("--mtbf", "-2", "--stall", "1", "--restore", "1"), "--mtbf must be a positive"),
        (("--mtbf", "nan", "--stall", "1", "--restore", "1"), "--mtbf must be a positive"),
        (("--mtbf", "1", "--stall", "0", "--restore", "1"), "--stall must be"),
        (("--mtbf", "1", "--stall", "-1", "--restore", "1"), "--stall must be"),
        (("--mtbf", "1", "--stall", "1", "--restore", "-1"), "--restore must be"),
        (("--mtbf", "1", "--model-bytes", "1TB"), "--model-bytes needs --nodes"),
        (("--mtbf", "1", "--nodes", "0"), "--nodes must be >= 1"),
    ],
)
def test_advise_bad_inputs_exit_2_with_a_message(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert advise_cli(*argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_advise_without_any_source_says_what_to_give(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert advise_cli("--mtbf", "1", "--results", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "save.json missing" in err and "--stall and --restore" in err


def test_advise_reads_measured_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "save.json").write_text(json.dumps({"stall_seconds": 2.0}))
    (tmp_path / "restore.json").write_text(json.dumps({"restore_seconds": 4.0}))
    assert advise_cli("--mtbf", "1", "--results", str(tmp_path), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["cost"], doc["restore"]) == (2.0, 4.0)
    assert doc["sources"]["cost"].startswith("measured:")


def test_advise_reads_the_save_and_restore_benchmarks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "save.json").write_text(json.dumps(SAVE_DOC))
    (tmp_path / "restore.json").write_text(json.dumps(RESTORE_DOC))
    assert advise_cli("--mtbf", "1", "--results", str(tmp_path), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    # Highest concurrency; its warm stall is missing, so the first save's.
    assert (doc["cost"], doc["ack"]) == (0.6, 2.5)
    assert doc["sources"]["cost"].endswith("c=2 stall_s")
    # The RAM restore of 0.5 GB, scaled to the 1 GB saved.
    assert doc["restore"] == pytest.approx(2.0)
    assert "scaled from 500000000 to 1000000000 bytes" in doc["sources"]["restore"]
    argv = ("--mtbf", "1", "--results", str(tmp_path), "--json", "--restore-tier", "cold")
    assert advise_cli(*argv) == 0
    assert json.loads(capsys.readouterr().out)["restore"] == pytest.approx(18.0)
    (tmp_path / "restore.json").write_text(json.dumps({"runs": []}))
    assert advise_cli("--mtbf", "1", "--results", str(tmp_path)) == 2
    assert "no storaged row with" in capsys.readouterr().err


def test_advise_reads_the_result_files_it_is_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Files named by the user, wherever they are, recognised by the end of their name.
    (tmp_path / "run3-save.json").write_text(json.dumps(SAVE_DOC))
    (tmp_path / "run3-restore.json").write_text(json.dumps(RESTORE_DOC))
    files = ["--results", str(tmp_path / "run3-save.json")]
    files += ["--results", str(tmp_path / "run3-restore.json")]
    assert advise_cli("--mtbf", "1", *files, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["cost"], doc["restore"]) == (0.6, pytest.approx(2.0))
    assert "run3-save.json" in doc["sources"]["cost"]
    # Only the save named: the restore time is missing, and the message says so.
    assert advise_cli("--mtbf", "1", *files[:2]) == 2
    assert "no restore.json named (--results)" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("{}")
    assert advise_cli("--mtbf", "1", "--results", str(tmp_path / "notes.txt")) == 2
    assert "neither a directory nor a result file" in capsys.readouterr().err
    # Nothing to go on: no default location is read behind the user's back.
    assert advise_cli("--mtbf", "1") == 2
    assert "--results" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_advise_works_without_the_load_tests(tmp_path: Path) -> None:
    """The product does not import ``loadtest`` (made unimportable here) nor read its
    results: the scale model's projection runs from its documented default rates."""
    script = (
        "import sys; sys.modules['loadtest'] = None\n"
        "from storaged.cli import main\n"
        "sys.argv = ['storaged', 'advise', '--mtbf', '24', '--nodes', '1000', '--json']\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["cost"] > 0 and doc["restore"] > 0
    assert doc["sources"]["cost"].startswith("storaged.tools.model, 1000 nodes")


def test_advise_unparsable_mtbf_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        advise_cli("--mtbf", "soon")
    assert exc.value.code == 2
    assert "--mtbf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        advise_cli("--stall", "1")  # --mtbf is required


@pytest.mark.timeout(120)
def test_storaged_command_offers_advise() -> None:
    """Through the real ``storaged`` entry point: registered, exit codes, messages."""

    def storaged(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "storaged", "advise", *argv],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = storaged("--mtbf", "24", "--stall", "60", "--restore", "30")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "3220 s" in ok.stdout
    bad = storaged("--mtbf", "0", "--stall", "60", "--restore", "30")
    assert bad.returncode == 2
    assert "storaged advise: --mtbf must be a positive number of hours" in bad.stderr
    assert storaged("--stall", "1").returncode == 2  # --mtbf is required


def test_advise_live_cluster_unreachable_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    from storaged.tools.local_cluster import free_port_block

    port = free_port_block(1)  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    assert advise_cli("--mtbf", "1", "--url", url, "--size", "1MiB") == 1
    assert "live measurement failed" in capsys.readouterr().err


@pytest.mark.timeout(120)
async def test_advise_measures_a_live_cluster(
    cluster_factory: ClusterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    cluster = await cluster_factory.start(4)
    argv = ["--mtbf", "1", "--url", cluster.urls[0], "--token", cluster.token, "--size", "4MiB"]
    # The command runs its own event loop: off this one, in a thread.
    assert await asyncio.to_thread(advise_cli, *argv, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost"] > 0 and doc["restore"] > 0 and doc["ack"] >= doc["cost"]
    assert doc["sources"]["cost"].startswith(f"live: {cluster.urls[0]}")
    from storaged.client import Client

    async with Client(cluster.urls, token=cluster.token) as client:
        assert await client.list("storaged-advise") == []  # the probe was deleted


# --------------------------------------------------------------------------- model command


def run_model(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return run_loadtest("loadtest.model", *argv, timeout=timeout, env={"MPLBACKEND": "Agg"})


@pytest.mark.timeout(120)
def test_model_command_writes_json_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_model("--quick", "--results", str(tmp_path), "--out", str(out), "--mtbf", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "documented defaults used" in proc.stdout  # an empty results dir
    doc = json.loads((out / "model.json").read_text())
    assert [row["nodes"] for row in doc["rows"]] == [1000, 24000]
    first = doc["rows"][0]
    assert set(first["phases"]) >= {"stall", "ack", "restore_ram", "fs_save", "fs_restore"}
    assert first["phases"]["ack"]["bound"] in {"CPU", "NIC", "RAM"}
    assert first["advice"]["young"]["interval"] > 0
    assert first["advice"]["mtbf_hours"] == 3
    # The central filesystem's save blocks the job: a far costlier checkpoint.
    assert first["fs_advice"]["cost"] == first["phases"]["fs_save"]["seconds"]
    assert first["fs_advice"]["young"]["overhead"] > first["advice"]["young"]["overhead"]
    # Async to the FS: no checkpoint more often than the FS takes to absorb one.
    assert first["fs_async_advice"]["interval"] >= first["phases"]["fs_save"]["seconds"]
    assert doc["assumptions"]["nic_gbps"] == 50.0
    assert all(s.startswith("default") for s in doc["rate_sources"].values())
    table = (out / "model.md").read_text()
    assert table.startswith("| nodes | GB per node | stall | ack |")
    assert "| 24,000 |" in table and "| interval (Young) |" in table
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "scale.png").exists()  # --out was given: nothing written elsewhere


def test_model_command_refuses_bad_assumptions(tmp_path: Path) -> None:
    for argv in (("--nic-gbps", "0"), ("--mtbf", "-1"), ("--rate", "x=1"), ("--k", "9")):
        proc = run_model(*argv, "--no-plot", "--out", str(tmp_path), timeout=60)
        assert proc.returncode == 2, argv
        assert "loadtest.model:" in proc.stderr
    proc = run_model("--nodes", "0,5", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "node counts must be >= 1" in proc.stderr


def test_node_mtbf_shrinks_with_the_cluster() -> None:
    doc = run([1000, 4000], Assumptions(), rates(), node_mtbf_hours=6000)
    hours = [row["advice"]["mtbf_hours"] for row in doc["rows"]]
    assert hours == pytest.approx([6.0, 1.5])
    # Stall and MTBF both shrink as 1/N: the interval does too, the overhead stays.
    small, large = (row["advice"]["young"] for row in doc["rows"])
    assert large["interval"] == pytest.approx(small["interval"] / 4)
    assert large["overhead"] == pytest.approx(small["overhead"], rel=0.01)


def test_markdown_marks_every_cell_with_its_bound() -> None:
    doc = run([1000, 2000], Assumptions(), rates(), mtbf_hours=3)
    save, restore, advice = (t.splitlines() for t in markdown(doc).split("\n\n"))
    assert [len(t) for t in (save, restore, advice)] == [4, 4, 4]
    cells = save[2].strip("| ").split(" | ")
    assert cells[0] == "1,000"
    assert cells[3].endswith(" (CPU)")  # the ack
    assert restore[3].strip("| ").split(" | ")[-1] == "64.8 s (FS)"
    assert advice[2].endswith("% |")
    assert "advice" not in markdown(run([1000], Assumptions(), rates())).lower()
    assert len(markdown(run([1000], Assumptions(), rates())).split("\n\n")) == 2
