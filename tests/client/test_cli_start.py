"""What ``storaged`` commands that only ask the cluster import: not numpy, torch, the codecs,
the file formats nor the checkpoint machinery; ``--version`` not even the HTTP client.

Issue 17 wants ``ls``, ``status``, ``nodes`` and ``--version`` to start in at most 0.3 s
on an idle machine; the time itself is a benchmark (``scripts/bench cli_start``,
docs/BENCHMARKS.md), not a test (a timed test flakes on a loaded machine). This holds what
makes the time: each command runs, against a real cluster, in a fresh interpreter that
says at exit which of the heavy modules it imported. ``save`` is the control: it must show
numpy, or the check sees nothing.

Node processes (``LocalCluster``), with the other CLI tests: each command under test is
a fresh interpreter of its own (a child process), which is what the check needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.client.streaming import DEFAULT_WINDOW
from storaged.config import parse_size
from storaged.tools.local_cluster import LocalCluster
from tests.conftest import TOKEN

pytestmark = pytest.mark.timeout(180)

#: what a command that moves no checkpoint data has no use for
HEAVY = (
    "numpy",
    "torch",
    "safetensors",
    "zfec",
    "erasure",
    "tqdm",
    "storaged.client.formats",
    "storaged.client.layout",
    "storaged.tools.model",
    "storaged.client.checkpoint",
    "storaged.client.streaming",
    "storaged.client.file_commands",
    "storaged.tools.demo",
)
#: what ``--version`` (and ``--help``) has no use for on top
CLIENT = ("aiohttp", "asyncio", "uvloop", "storaged.client.client")

# The console script's code, then the heavy modules loaded, on the last line of stderr.
RUN_AND_REPORT = """
import json, sys
from storaged.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
loaded = sorted(m for m in json.loads({watch!r}) if m in sys.modules)
print(json.dumps({{"status": status, "loaded": loaded}}), file=sys.stderr)
"""


def _run(*argv: str, cluster: LocalCluster | None = None) -> tuple[int, list[str], str]:
    """Exit status, the watched modules imported, and stdout of ``storaged argv``."""
    env = {**os.environ, "STORAGED_TOKEN": TOKEN}
    if cluster is not None:
        env["STORAGED_URL"] = ",".join(cluster.urls)
    code = RUN_AND_REPORT.format(watch=json.dumps([*HEAVY, *CLIENT]))
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stderr.strip(), "the child said nothing"
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return int(report["status"] or 0), report["loaded"], done.stdout


def test_version_and_help_import_no_client() -> None:
    for argv in (["--version"], ["--help"], ["ls", "--help"]):
        status, loaded, _ = _run(*argv)
        assert status == 0, argv
        assert loaded == [], f"storaged {' '.join(argv)} imported {loaded}"
    assert _run("--version")[2].startswith("storaged ")


def test_commands_that_ask_the_cluster_import_no_numpy(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    data = tmp_path / "small.bin"
    data.write_bytes(os.urandom(100_000))
    # The control: a command that reads a file does import numpy, and the check sees it.
    status, loaded, _ = _run("save", str(data), "start/one", "--format", "raw", cluster=cluster)
    assert status == 0
    assert "numpy" in loaded and "storaged.client.file_commands" in loaded

    for argv, want in (
        (["ls"], "start/one"),
        (["ls", "--json"], "start/one"),
        (["status", "start/one"], "start/one"),
        (["nodes"], "n0"),
    ):
        status, loaded, out = _run(*argv, cluster=cluster)
        assert status == 0, argv
        assert want in out, argv
        heavy = [m for m in loaded if m in HEAVY]
        assert heavy == [], f"storaged {' '.join(argv)} imported {heavy}"
        assert "aiohttp" in loaded  # it did ask the cluster

    # A failure path imports no more: a checkpoint that is not there, a cluster that is not.
    status, loaded, _ = _run("status", "start/none", cluster=cluster)
    assert status == 1 and not [m for m in loaded if m in HEAVY]
    status, loaded, _ = _run("ls", "--url", "http://127.0.0.1:9")
    assert status == 1 and not [m for m in loaded if m in HEAVY]


def test_the_save_defaults_in_the_help_are_the_real_ones() -> None:
    # The parser names them without importing the modules that define them.
    done = subprocess.run(
        [sys.executable, "-m", "storaged", "save", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = " ".join(done.stdout.split())
    assert f"default {DEFAULT_WINDOW};" in text
    assert parse_size("8MiB") == DEFAULT_CHUNK_SIZE and "default 8MiB" in text
