"""Smoke test of ``python -m loadtest.ack``: it runs end to end and reports what it promises.

No timing is asserted: only the structure of the table and of the JSON, and that the
figures are the kind of numbers they claim to be. The profile summary is checked on a
py-spy file written here, since py-spy itself is optional.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest

from loadtest.ack import SWEEP_FIGURES, SWEEP_RATIOS, Corpus, summarize_perf, summarize_sweep
from loadtest.harness.profile import categorize, is_gil_wait, is_idle, summarize_profile
from loadtest.harness.report import percentile
from tests.loadtest_run import run_loadtest


def _run(*args: str, timeout: float = 55) -> subprocess.CompletedProcess[str]:
    return run_loadtest("loadtest.ack", *args, timeout=timeout)


@pytest.mark.timeout(60)
def test_quick_run_reports_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "ack.json"
    proc = _run("--quick", "--size", "0.0625", "--chunk-mib", "2", "--concurrency", "2",
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = [line for line in lines if line.startswith("| config |")]
    assert len(header) == 1
    assert header[0].split(" | ")[1:] == [
        "GB/s", "p50 ms", "p99 ms", "ratio", "p50 x base", "CPU s/GB nodes", "CPU s/GB client",
        "ratio if CPU-bound |",
    ]  # fmt: skip
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| raw loopback socket, 1 stream",
        "| baseline aiohttp 1 copy, c=2",
        "| storaged 4 nodes x3, c=2",
    ]

    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m loadtest.ack --quick")
    assert doc["settings"]["chunk_bytes"] == 2 << 20
    assert doc["settings"]["chunks"] == 32
    assert doc["profile"]["ran"] is False  # --quick never profiles
    raw, base, store = doc["results"]
    assert [r["kind"] for r in doc["results"]] == ["raw", "baseline", "storaged"]
    for row in (base, store):
        assert row["concurrency"] == 2
        assert 1 <= row["chunks"] <= 32
        assert row["bytes"] == row["chunks"] * (2 << 20)
        assert row["gbps"] > 0 and row["seconds"] > 0
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["server_cpu_s_per_gb"] >= 0 and row["client_cpu_s_per_gb"] >= 0
    assert base["ratio"] is None
    # "gbps" is rounded to 4 decimals: on a loaded machine the quick run's rate can be so
    # small (0.0013 GB/s seen) that the rounding alone moves the quotient by a few %.
    rounding = 0.00005 / store["gbps"] + 0.00005 / base["gbps"]
    assert store["ratio"] == pytest.approx(
        store["gbps"] / base["gbps"], rel=max(0.01, 1.5 * rounding)
    )
    assert store["p50_ratio"] == pytest.approx(store["p50_ms"] / base["p50_ms"], rel=0.02)
    assert store["cpu_bound_ratio"] == pytest.approx(
        store["cpu_bound_gbps"] / base["cpu_bound_gbps"], rel=0.01
    )
    # CPU-bound: never more than the cores allow for the CPU each acked GB costs
    for row in (base, store):
        total = row["server_cpu_s_per_gb"] + row["client_cpu_s_per_gb"]
        assert 0 < row["cpu_bound_gbps"] <= (os.cpu_count() or 1) / total * 1.01
    assert raw["gbps"] > 0 and raw["p50_ms"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "positive integers"),
        (["--concurrency", "four"], "positive integers"),
        (["--size", "0.001"], "holds no chunk"),
        (["--chunk-mib", "0"], "too small"),
        (["--nodes", "2"], "--nodes >= 3"),
        (["--sweep", "3,4"], "must divide the largest"),
        (["--sweep", "8"], "two or more"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    proc = _run("--quick", *args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "| config |" not in proc.stdout


@pytest.mark.timeout(180)
def test_sweep_reports_each_size_from_its_own_rounds(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = _run("--quick", "--sweep", "1,2", "--size", "0.03125", "--concurrency", "2",
                "--repeat", "2", "--nodes", "3", "--out", str(out), timeout=170)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("| config |")]  # no comparison
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert rows[0].split(" | ")[1:] == [
        "nodes CPU s/GB", "idle part", "client CPU s/GB", "nodes net + client", "x 1 MiB",
        "GB/s |",
    ]  # fmt: skip
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 1", "| 2"]

    doc = json.loads(out.read_text())
    assert doc["settings"]["sweep_bytes"] == [1 << 20, 2 << 20]
    assert doc["settings"]["reference_mib"] == "1"  # no 8 MiB in the sweep: the smallest
    assert doc["settings"]["bytes_per_run"] == 32 << 20
    rounds = doc["rounds"]
    assert len(rounds) == 2
    for rnd in rounds:
        assert list(rnd) == ["1", "2"]
        for label, figs in rnd.items():
            assert figs["gbps"] > 0 and figs["client_cpu_s_per_gb"] > 0
            assert 1 <= figs["chunks"] <= 32 // int(label)
            assert figs["nodes_idle_s_per_gb"] >= 0
            assert figs["nodes_net_s_per_gb"] == pytest.approx(
                figs["nodes_cpu_s_per_gb"] - figs["nodes_idle_s_per_gb"], abs=2e-4
            )
            assert figs["cpu_s_per_gb"] == pytest.approx(
                figs["nodes_net_s_per_gb"] + figs["client_cpu_s_per_gb"], abs=2e-4
            )
    for label, s in doc["summary"].items():
        for fig in SWEEP_FIGURES:
            values = [r[label][fig] for r in rounds]
            assert s[fig]["median"] == pytest.approx(statistics.median(values), abs=1e-4)
            assert (s[fig]["min"], s[fig]["max"]) == (min(values), max(values))
        for fig in SWEEP_RATIOS:
            ratio = statistics.median(r[label][fig] / r["1"][fig] for r in rounds)
            assert s["x_ref"][fig] == pytest.approx(ratio, abs=1e-3)
    assert doc["summary"]["1"]["x_ref"] == {fig: 1.0 for fig in SWEEP_RATIOS}


def test_sweep_summary_takes_paired_ratios_to_the_reference() -> None:
    def figs(cpu: float) -> dict[str, float]:
        return {"gbps": 1.0, "nodes_cpu_s_per_gb": cpu, "nodes_idle_s_per_gb": 0.0,
                "nodes_net_s_per_gb": cpu, "client_cpu_s_per_gb": 1.0,
                "cpu_s_per_gb": cpu + 1.0}  # fmt: skip

    rounds = [{"8": figs(2.0), "16": figs(1.0)}, {"8": figs(6.0), "16": figs(5.0)},
              {"8": figs(4.0), "16": figs(4.0)}]  # fmt: skip
    s = summarize_sweep(rounds, "8")
    assert s["16"]["nodes_net_s_per_gb"] == {"median": 4.0, "min": 1.0, "max": 5.0}
    # each round's ratio (0.5, 0.833, 1.0), not the ratio of the medians (1.0)
    assert s["16"]["x_ref"]["nodes_net_s_per_gb"] == 0.833
    assert s["8"]["x_ref"]["cpu_s_per_gb"] == 1.0


def test_corpus_splits_into_views_of_the_same_bytes() -> None:
    corpus = Corpus(64 << 10, 2)
    halves = corpus.split(32 << 10)
    assert halves.chunk == 32 << 10 and len(halves.data) == 4
    assert b"".join(bytes(v) for v in halves.data) == b"".join(bytes(v) for v in corpus.data)
    assert halves.data[1].obj is corpus.data[0].obj  # views, not copies
    with pytest.raises(ValueError):
        corpus.split(48 << 10)


def test_corpus_rounds_are_distinct_chunks_with_true_ids() -> None:
    import blake3

    corpus = Corpus(64 << 10, 3)
    first, second = corpus.uploads(1), corpus.uploads(2)
    ids = {u.chunk_id for u in first} | {u.chunk_id for u in second}
    assert len(ids) == 6  # no dedup between chunks or between rounds
    for up in first:
        body = up.stamp + bytes(up.view[len(up.stamp) :])
        assert blake3.blake3(body).hexdigest() == up.chunk_id
        assert len(body) == up.size


async def test_upload_body_is_the_stamped_chunk_in_client_slices() -> None:
    up = Corpus((3 << 20) + 5, 1).uploads(7)[0]
    pieces = [bytes(p) async for p in up.body()]
    assert b"".join(pieces) == up.stamp + bytes(up.view[len(up.stamp) :])
    assert [len(p) for p in pieces] == [16, (1 << 20) - 16, 1 << 20, 1 << 20, 5]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([2.0, 1.0], 50) == 1.0


def _stack(*frames: str) -> str:
    return ";".join(frames)


LOOP = _stack(
    "<module> (storaged/__main__.py:5)", "cmd_serve (storaged/cli.py:52)",
    "Runner.run (asyncio/runners.py:118)",
)  # fmt: skip
POOL = _stack(
    "Thread._bootstrap_inner (threading.py:1045)", "_worker (concurrent/futures/thread.py:83)",
    "_WorkItem.run (concurrent/futures/thread.py:58)",
)  # fmt: skip


def test_profile_summary_separates_waits_from_work(tmp_path: Path) -> None:
    lines = [
        # waits: the loop in epoll, a pool thread waiting for work, a thread back for the GIL
        _stack(LOOP, "uv_run (core.c:1)", "epoll_pwait (libc.so.6) 50"),
        _stack("Thread._bootstrap_inner (threading.py:1045)",
               "_worker (concurrent/futures/thread.py:81)", "0x7f (libc.so.6) 40"),
        _stack(POOL, "chunk_id_of (storaged/ids.py:31)", "PyEval_RestoreThread (x.so)",
               "pthread_cond_timedwait (libc.so.6)", "0x1 (libc.so.6) 5"),
        # work
        _stack(POOL, "chunk_id_of (storaged/ids.py:31)", "0x2 (blake3/blake3.cpython-311.so) 7"),
        _stack(LOOP, "put_chunk (storaged/front/http.py:168)",
               "Node._receive (storaged/node.py:683)", "0x7f (libc.so.6) 2"),
        _stack(LOOP, "Node._receive (storaged/node.py:689)",
               "PutStream.write (storaged/peer.py:1050)", "write (libc.so.6) 6"),
        _stack(LOOP, "uv__read (stream.c:1)", "read (libc.so.6) 4"),
        _stack(LOOP, "_http_parser_cb_on_body (_http_parser.c:1)", "0x7f (libc.so.6) 1"),
        "garbage line without count",
    ]  # fmt: skip
    path = tmp_path / "profile.txt"
    path.write_text("\n".join(lines) + "\n")
    summary = summarize_profile(path)
    assert summary["samples"] == 20
    assert summary["idle_samples"] == 90
    assert summary["gil_wait_samples"] == 5
    assert summary["categories"] == {
        "BLAKE3 hash (id check)": 0.35,
        "peer protocol (sending replicas, replica receive)": 0.3,
        "socket reads in the event loop (HTTP and replica bodies)": 0.2,
        "copy into the RAM buffer (Node._receive)": 0.1,
        "HTTP (aiohttp parsing, body stream)": 0.05,
    }
    assert summary["top_leaves"][0] == ["? (blake3/blake3.cpython-311.so)", 0.35]


def test_categorize_and_wait_rules_on_single_stacks() -> None:
    assert is_idle(["a (x.py:1)", "epoll_wait (libc.so.6)"])
    assert is_idle(["_worker (/usr/lib/python3.11/concurrent/futures/thread.py:81)", "0x1 (libc)"])
    assert not is_idle(["Node._receive (storaged/node.py:1)", "0x1 (libc.so.6)"])
    assert is_gil_wait(["f (a.py:1)", "pthread_cond_timedwait (libc.so.6)", "0x1 (libc.so.6)"])
    assert (
        categorize(["_write_parts (tiers/_durable.py:574)", "writev (libc.so.6)"])
        == "drain to nvme"
    )
    assert categorize(["Runner.run (asyncio/runners.py:1)", "task_step (x.c:1)"]) == (
        "event loop (uvloop, asyncio tasks)"
    )
    assert categorize(["mystery (elsewhere.py:3)"]) == "other"


PERF_SCRIPT = """python
\tffffffff8205a00f clear_page_erms ([kernel.kallsyms])
\tffffffff8205a00f get_page_from_freelist ([kernel.kallsyms])
\tffffffff8205c5df __mm_populate ([kernel.kallsyms])
\t           f838f __mmap (/usr/lib/x86_64-linux-gnu/libc.so.6)

python
\tffffffff8208651f _copy_from_iter ([kernel.kallsyms])
\tffffffff8206e8cb tcp_sendmsg ([kernel.kallsyms])
\tffffffff81e7e7ab sock_write_iter ([kernel.kallsyms])
\t           f838f __GI___libc_write (/usr/lib/x86_64-linux-gnu/libc.so.6)

python
\t            9f00 _blake3_hash_many_avx512 (/x/site-packages/blake3/blake3.cpython-311.so)

python
\t           1a2b3 __memmove_avx512_unaligned_erms (/usr/lib/x86_64-linux-gnu/libc.so.6)

python
\t           fc08f _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
\t    7f771acd8c80 [unknown] ([unknown])

python
\t    7f771acd8c80 [unknown] ([unknown])
"""


def test_perf_summary_sorts_samples_by_what_the_cpu_did() -> None:
    summary = summarize_perf(PERF_SCRIPT + "\n\npython\n\tnot a frame line\n")
    assert summary["samples"] == 6
    assert summary["categories"] == {
        "new RAM buffers: mmap + zeroing fresh pages": 0.167,
        "kernel TCP over loopback (send/recv, socket copies)": 0.167,
        "BLAKE3 hash (id checks)": 0.167,
        "user-space copies (memcpy/memmove)": 0.167,
        "Python interpreter, objects, allocator": 0.167,
        "other": 0.167,
    }
    assert ["clear_page_erms ([kernel.kallsyms])", 0.167] in summary["top_symbols"]
    assert ["_blake3_hash_many_avx512 (blake3.cpython-311.so)", 0.167] in summary["top_symbols"]
    assert summarize_perf("") == {"samples": 0, "categories": {}, "top_symbols": []}
