"""Smoke tests of ``python -m loadtest restore`` and ``python -m loadtest save``.

Each ``--quick`` mode runs end to end in a subprocess, and its JSON, markdown and PNG are
checked for what they promise: every tier and concurrency level, every ratio, bytes read
from the tier under test, restored bytes checked. No timing is asserted. The harness
pieces (the checkpoint's bytes, the worker pool, clean-up on errors and on Ctrl-C) are
tested on their own.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.harness.checkpoint import ROW_BYTES, Layout
from loadtest.harness.command import run_and_write
from loadtest.harness.machine import drop_page_cache, torch_available
from loadtest.harness.report import markdown_table, ratio
from loadtest.harness.trace import TracedClient, TracedGets
from loadtest.harness.workers import Prepared, WorkerError, WorkerPool
from storaged.client import ChunkNotFound, Client
from storaged.ids import chunk_id_of
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import TOKEN

REPO = Path(__file__).resolve().parent.parent
#: a whole --quick run on this shared two-core machine takes about a minute
QUICK_TIMEOUT = 170


def _env() -> dict[str, str]:
    # The node processes and the benchmark run without asyncio debug mode (conftest sets it).
    return {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadtest", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _table_rows(markdown: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return head, rows


def _outputs(out: Path, kind: str) -> tuple[dict[str, Any], str]:
    paths = [out / f"{kind}.json", out / f"{kind}.md", out / f"{kind}.png"]
    for path in paths:
        assert path.is_file() and path.stat().st_size > 0, f"{path} missing"
    width, height = _png_size(paths[2])
    assert width > 300 and height > 200
    doc = json.loads(paths[0].read_text())
    assert doc["files"] == {"json": str(paths[0]), "markdown": str(paths[1]),
                            "png": str(paths[2])}  # fmt: skip
    return doc, paths[1].read_text()


# -- the two benchmarks, end to end ---------------------------------------------------------------


@pytest.mark.timeout(QUICK_TIMEOUT + 10)
def test_restore_quick_reports_every_tier_and_level(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _run("restore", "--quick", "--out", str(out), "--tmp", str(tmp_path),
                timeout=QUICK_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc, markdown = _outputs(out, "restore")
    assert doc["kind"] == "restore"
    assert doc["command"].startswith("python -m loadtest restore --quick")
    settings = doc["settings"]
    assert settings["concurrency"] == [1, 2]
    assert settings["tiers"] == ["memory", "nvme", "cold"]
    assert settings["saving_ranks"] == 2
    total = settings["bytes"]
    assert 60 << 20 <= total <= 64 << 20

    runs = doc["runs"]
    assert [(r["tier"], r["concurrency"]) for r in runs] == [
        ("memory", 1), ("memory", 2), ("nvme", 1), ("nvme", 2), ("cold", 1), ("cold", 2),
    ]  # fmt: skip
    for r in runs:
        assert r["bytes"] == total
        assert r["verified"] is True, r
        assert r["gbps"] > 0 and r["seconds"] > 0 and r["ttfb_ms"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["client_cpu_s_per_gb"] > 0 and r["node_cpu_s_per_gb"] > 0
        # Every byte came from the tier under test: the evictions and the kill did their job.
        assert r["read_bytes_client"].get(r["tier"], 0) >= total, r["read_bytes_client"]
        assert r["read_bytes_nodes"][r["tier"]] >= total, r["read_bytes_nodes"]
        per_node = r["read_bytes_per_node"]
        assert sum(per_node.values()) == sum(r["read_bytes_nodes"].values())
        assert set(per_node) == ({"n0", "n1", "n2"} if r["tier"] == "cold" else
                                 {"n0", "n1", "n2", "n3"})  # fmt: skip
        assert 0.25 <= r["busiest_node_share"] <= 1
        others = [t for t in settings["tiers"] if t != r["tier"]]
        assert all(r["read_bytes_client"].get(t, 0) == 0 for t in others)
        assert r["baseline"] == {"memory": "aiohttp_memory", "nvme": "disk_read",
                                 "cold": "codec"}[r["tier"]]  # fmt: skip
        for key in ("gbps_x_baseline", "gbps_x_raw_loopback", "gbps_x_dcp_load"):
            assert r["ratios"][key] is not None and r["ratios"][key] > 0, (key, r["ratios"])
        # cold rows: against raw decode on every core as well; the others have no such ratio
        all_cores = r["ratios"]["gbps_x_codec_all_cores"]
        assert (
            (all_cores is not None and all_cores > 0) if r["tier"] == "cold" else all_cores is None
        )
        if r["tier"] == "cold":  # the decode's CPU per GB is its time per GB
            assert r["ratios"]["client_cpu_x_baseline"] > 0
        if r["tier"] != "cold":  # the codec baseline has a rate only
            for key in ("ttfb_x_baseline", "p50_x_baseline", "p99_x_baseline",
                        "client_cpu_x_baseline"):  # fmt: skip
                assert r["ratios"][key] is not None, (key, r["ratios"])
        assert r["cache"] == (None if r["tier"] == "memory" else "fadvise")
    assert doc["events"]["killed"]["node"] == "n3"
    assert doc["events"]["cold"]["state"] == "cold"

    base = doc["baselines"]
    for kind in ("raw_loopback", "aiohttp_memory", "disk_read", "dcp_load_warm", "dcp_load_cold"):
        assert [b["concurrency"] for b in base[kind]] == [1, 2], kind
        assert all(b["gbps"] > 0 for b in base[kind])
        assert all(b.get("verified", True) is not False for b in base[kind])
    assert base["codec"]["decode_raw_gbps"] > 0 and base["codec"]["k"] == 4
    assert base["codec"]["decode_raw_all_cores_gbps"] > 0
    assert base["codec"]["cores"] == os.cpu_count()

    head, rows = _table_rows(markdown, "tier")
    assert head[:7] == ["tier", "c", "baseline", "GB/s (x base)", "x raw loopback", "x DCP load",
                        "x raw decode, all cores"]  # fmt: skip
    # only the cold rows have a figure against the decode on every core
    assert [row[6] != "-" for row in rows] == [False] * 4 + [True] * 2
    assert "busiest node share" in head
    assert [(row[0], row[1]) for row in rows] == [
        ("memory", "1"), ("memory", "2"), ("nvme", "1"), ("nvme", "2"), ("cold", "1"),
        ("cold", "2"),
    ]  # fmt: skip
    assert all("x)" in row[3] for row in rows)  # every GB/s has its ratio
    _, brows = _table_rows(markdown, "baseline")
    assert len(brows) == 10
    assert proc.stdout.count("| tier |") == 1


@pytest.mark.timeout(QUICK_TIMEOUT + 10)
def test_save_quick_reports_every_level_and_the_backlogs(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _run("save", "--quick", "--out", str(out), "--tmp", str(tmp_path),
                timeout=QUICK_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc, markdown = _outputs(out, "save")
    assert doc["kind"] == "save"
    assert doc["settings"]["concurrency"] == [1, 2]
    total = doc["settings"]["bytes"]
    runs = doc["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    for r in runs:
        assert r["bytes"] == total
        assert r["uploaded_bytes"] >= total  # a fresh cluster each level: nothing deduplicated
        assert r["gbps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["stall_s"] > 0 and r["stall_warm_s"] > 0
        assert r["cold_s"] is not None and r["nvme_s"] is not None, r["last_status"]
        assert r["nvme_s"] <= r["cold_s"]  # the status reached nvme, then cold
        assert r["node_cpu_s_per_gb"] > 0 and r["client_cpu_s_per_gb"] > 0
        assert 0 <= r["client_cpu_sys_share"] <= 1
        # The backlogs: all four nodes' gauges were read. A drain or encode that started
        # and ended between two 100 ms rounds is not seen: then there is no time for it.
        assert r["backlog_nodes"] == 4
        series = r["backlog"]
        assert len(series) >= 2
        assert all(len(p) == 3 and p[1] >= 0 and p[2] >= 0 for p in series)
        assert [p[0] for p in series] == sorted(p[0] for p in series)
        for key in ("drained_s", "encoded_s", "nvme_gbps"):
            assert r[key] is None or r[key] > 0, (key, r[key])
        ratios = r["ratios"]
        for key in ("gbps_x_aiohttp_upload", "gbps_x_raw_loopback", "gbps_x_dcp_save",
                    "p50_x_aiohttp_upload", "p99_x_aiohttp_upload", "stall_x_dcp_save",
                    "cold_gbps_x_raw_encode", "client_cpu_x_aiohttp_upload",
                    "node_cpu_x_aiohttp_server"):  # fmt: skip
            assert ratios[key] is not None and ratios[key] > 0, (key, ratios)
        assert (ratios["nvme_gbps_x_disk_write"] is None) == (r["nvme_gbps"] is None)
    base = doc["baselines"]
    for kind in ("raw_loopback", "aiohttp_upload", "disk_write", "dcp_save"):
        assert [b["concurrency"] for b in base[kind]] == [1, 2], kind
        assert all(b["gbps"] > 0 and b["bytes"] == total for b in base[kind] if
                   kind != "raw_loopback")  # fmt: skip
    assert base["codec"]["encode_raw_gbps"] > 0

    head, rows = _table_rows(markdown, "c")
    assert head[1] == "ack GB/s (x aiohttp 1-copy)"
    assert [row[0] for row in rows] == ["1", "2"]
    assert all("x)" in row[1] for row in rows)
    _, brows = _table_rows(markdown, "baseline")
    assert len(brows) == 8


# -- arguments, errors and interruption -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["restore", "--concurrency", "0"], "positive integers"),
        (["save", "--concurrency", "two"], "positive integers"),
        (["restore", "--size", "0.00001"], "too small"),
        (["save", "--chunk-mib", "0.01"], "multiple of 64 KiB"),
        (["restore", "--nodes", "3"], "--nodes must be >= 4"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    proc = _run(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_unknown_benchmark_lists_the_known_ones() -> None:
    proc = _run("nosuch", timeout=60)
    assert proc.returncode == 2
    assert "restore" in proc.stderr and "save" in proc.stderr


def _children(pid: int) -> set[int]:
    """Every process whose parent is ``pid``."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return state[state.rindex(b")") + 2 :].split()[0] != b"Z"


def _wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {p for p in pids if _alive(p)}
        if not left:
            return left
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


@pytest.mark.timeout(120)
def test_ctrl_c_mid_run_stops_nodes_and_workers(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "loadtest", "restore", "--quick", "--no-baselines",
         "--out", str(tmp_path / "results"), "--tmp", str(tmp_path)],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        seen: set[int] = set()
        deadline = time.monotonic() + 90
        # Wait for the workers and the four node processes of the cluster.
        while time.monotonic() < deadline and bench.poll() is None:
            seen |= _children(bench.pid)
            if len(seen) >= 6 and list(tmp_path.glob("loadtest-restore-*/cluster/n3/node.pid")):
                break
            time.sleep(0.2)
        assert bench.poll() is None, bench.communicate()
        time.sleep(1.0)
        seen |= _children(bench.pid)
        assert len(seen) >= 6, seen
        bench.send_signal(signal.SIGINT)  # what Ctrl-C sends the benchmark
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert _wait_gone(seen) == set()
    assert not list(tmp_path.glob("loadtest-restore-*")), "scratch directory left behind"


@pytest.mark.timeout(120)
def test_an_error_stops_the_workers_and_says_why(tmp_path: Path) -> None:
    # Nothing listens on the port given: the run fails once the workers are up.
    bench = subprocess.Popen(
        [sys.executable, "-m", "loadtest", "save", "--quick", "--no-baselines", "--url",
         "http://127.0.0.1:9", "--out", str(tmp_path / "results"), "--tmp", str(tmp_path)],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: set[int] = set()
    try:
        while bench.poll() is None:
            seen |= _children(bench.pid)
            time.sleep(0.1)
        _, err = bench.communicate(timeout=100)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1
    assert "Unavailable" in err or "ConnectionFailed" in err, err[-3000:]
    assert _wait_gone(seen) == set()
    assert not (tmp_path / "results" / "save.json").exists()


# -- harness pieces -------------------------------------------------------------------------------


def test_layout_boxes_partition_the_rows_and_bytes_are_reproducible() -> None:
    layout = Layout.of_size(8 << 20, keys=2, seed=7, multiple=4)
    assert layout.rows % 4 == 0 and layout.nbytes <= 8 << 20
    for ranks in (1, 2, 4):
        boxes = [layout.box(r, ranks) for r in range(ranks)]
        assert boxes[0][0] == 0 and boxes[-1][1] == layout.rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(boxes))
    whole = layout.make(0, 1)
    halves = [layout.make(r, 2) for r in range(2)]
    for i in range(layout.keys):
        key = layout.key(i)
        joined = np.concatenate([halves[0][key], halves[1][key]])
        assert np.array_equal(joined.view(np.uint8), whole[key].view(np.uint8))
        assert layout.check(i, 0, whole[key], step=3)
        assert layout.check(i, layout.box(1, 2)[0], halves[1][key])
        assert whole[key].shape == layout.global_shape


def test_layout_check_finds_one_flipped_byte_and_wrong_places() -> None:
    layout = Layout.of_size(4 << 20, keys=2)
    arrays = layout.make(0, 1)
    got = arrays[layout.key(1)]
    assert layout.check(1, 0, got)
    assert not layout.check(0, 0, got)  # another tensor's bytes
    assert not layout.check(1, 1, got[:-1])  # shifted by one row
    got.view(np.uint8).reshape(-1)[12345] ^= 1
    assert not layout.check(1, 0, got)


def test_layout_chunks_are_all_distinct() -> None:
    # Dedup would make a save upload less than it claims: every chunk must differ.
    layout = Layout.of_size(16 << 20, keys=2)
    other = layout.with_seed(2)
    ids = set()
    for lay in (layout, other):
        for array in lay.make(0, 1).values():
            flat = array.view(np.uint8).reshape(-1)
            for lo in range(0, len(flat), 1 << 20):
                ids.add(chunk_id_of(flat[lo : lo + (1 << 20)].data))
    assert len(ids) == 2 * 16
    assert ROW_BYTES == 64 << 10


class _Sleep:
    """A job whose run takes ``seconds`` and reports its process id."""

    def __init__(self, seconds: float, fail: str = "") -> None:
        self.seconds = seconds
        self.fail = fail

    def prepare(self) -> Prepared:
        if self.fail == "prepare":
            raise ValueError("cannot prepare")
        return _Slept(self)


class _Slept:
    def __init__(self, job: _Sleep) -> None:
        self.job = job

    def run(self) -> dict[str, Any]:
        if self.job.fail == "run":
            raise RuntimeError("broken run")
        if self.job.fail == "exit":
            os._exit(3)
        time.sleep(self.job.seconds)
        return {"pid": os.getpid()}

    def check(self) -> dict[str, Any]:
        return {"checked": True}

    def close(self) -> None:
        pass


def test_worker_pool_runs_jobs_together_in_separate_processes() -> None:
    with WorkerPool(3) as pool:
        results = pool.run([_Sleep(0.3), _Sleep(0.3), _Sleep(0.3)])
        again = pool.run([_Sleep(0.0)])
        pids = set(pool.pids)
    assert {r["pid"] for r in results} == pids and os.getpid() not in pids
    assert again[0]["pid"] in pids  # workers are kept between runs
    assert all(r["checked"] and r["t1"] - r["t0"] >= 0.3 and r["cpu"] >= 0 for r in results)
    # Released together: each one started before any other finished.
    assert max(r["t0"] for r in results) < min(r["t1"] for r in results)
    assert _wait_gone(pids) == set()


@pytest.mark.parametrize(
    ("fail", "message"),
    [("prepare", "cannot prepare"), ("run", "broken run"), ("exit", "exited with 3")],
)
def test_worker_failure_is_raised_and_stops_every_worker(fail: str, message: str) -> None:
    pool = WorkerPool(2)
    pids = set(pool.pids)
    with pytest.raises(WorkerError, match=message):
        pool.run([_Sleep(30.0), _Sleep(0.0, fail=fail)])
    assert _wait_gone(pids, timeout=15) == set()


def test_drop_page_cache_says_what_it_did(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 4096)
    assert drop_page_cache([tmp_path]) == "fadvise"
    # Not called without files here: that drops the whole machine's cache, as root.


def test_backlog_cleared_is_the_first_zero_after_the_last_work() -> None:
    from loadtest.save import backlog_cleared

    series = [(0.0, 0, 0), (0.1, 3, 0), (0.2, 0, 1), (0.3, 2, 1), (0.4, 0, 0), (0.5, 0, 0)]
    assert backlog_cleared(series, 1) == 0.4
    assert backlog_cleared(series, 2) == 0.4
    assert backlog_cleared(series[:4], 1) is None  # still draining when sampling stopped
    assert backlog_cleared([(0.0, 0, 0), (0.1, 0, 0)], 1) is None  # nothing was ever queued


def test_dcp_baselines_need_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    assert torch_available()  # the dev environment has the torch extra
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert not torch_available()


def test_table_and_ratio_helpers() -> None:
    assert markdown_table(["a", "b"], [["1", "2"]]).splitlines() == [
        "| a | b |", "| --- | ---: |", "| 1 | 2 |",
    ]  # fmt: skip
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None


# -- without the plots extra ----------------------------------------------------------------------


def test_a_run_without_matplotlib_writes_its_figures_and_says_how_to_get_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest import restore

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    figures = {"kind": "restore", "runs": [{"tier": "memory", "gbps": 1.5}], "baselines": {}}
    doc = run_and_write(
        "python -m loadtest restore --quick",
        lambda: dict(figures),
        tmp_path,
        "restore",
        lambda d: "| tier | GB/s |\n| ---: | ---: |\n| memory | 1.5 |\n",
        restore.render_plot,  # the benchmark's own plot: matplotlib is its first need
    )
    assert doc is not None
    written = json.loads((tmp_path / "restore.json").read_text())
    assert written["runs"] == figures["runs"] and "plots" in written["plot"]
    assert set(written["files"]) == {"json", "markdown"}
    assert (tmp_path / "restore.md").read_text().startswith("| tier |")
    assert not (tmp_path / "restore.png").exists()
    out = capsys.readouterr().out
    assert "# no plot: matplotlib is not installed" in out and "[plots]" in out


def test_model_without_matplotlib_writes_its_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest import model

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    assert model.main(["--quick", "--results", str(tmp_path), "--out", str(out)]) == 0
    assert json.loads((out / "model.json").read_text())["rows"]
    assert (out / "model.md").is_file() and not (out / "scale.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "aiohttp"])
async def test_traced_client_times_every_chunk_get_and_counts_bytes_by_tier(
    cluster: LocalCluster, direct_reads: bool
) -> None:
    # The product's Client has no trace hooks: the direct path is traced by the harness's
    # own DirectGets (TracedGets), the aiohttp path by aiohttp's trace hooks.
    chunks = [os.urandom((1 << 20) + i) for i in range(3)]
    async with Client(cluster.urls, token=TOKEN) as writer:
        ids = [await writer.put_chunk(c) for c in chunks]
    client = TracedClient(cluster.urls, token=TOKEN, direct_reads=direct_reads)
    await client.open_traced()
    try:
        assert isinstance(client.direct, TracedGets) == direct_reads
        for cid, data in zip(ids, chunks, strict=True):
            assert bytes(await client.get_chunk(cid)) == data
        with pytest.raises(ChunkNotFound):
            await client.get_chunk(chunk_id_of(b"never stored"))
        if direct_reads:
            assert isinstance(client.direct, TracedGets)
            assert client.direct.stats.requests >= len(ids)
    finally:
        await client.close()
    log = client.log
    # Every byte of the three GETs, from RAM; the missing chunk's 404s count for nothing.
    assert log.tier_bytes == {"memory": sum(len(c) for c in chunks)}
    assert len(log.get_latencies) == len(ids) and all(s > 0 for s in log.get_latencies)
    assert log.first_byte is not None and log.first_byte <= time.monotonic()
