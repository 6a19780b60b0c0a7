"""docs/CLIENT.md runs as written: its Python blocks, in order, against a real cluster, and
its multi-rank DCP example (docs/examples/dcp_torchrun.py, quoted there verbatim) under
torchrun with two ranks.

The nodes are in-process (``inproc_cluster``: real nodes in the test's event loop); the
doc's script, the control and the torchrun ranks are child processes, waited for in a
thread so that the loop keeps serving them."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storaged.client import Client, restore_checkpoint
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "CLIENT.md"
TORCHRUN_EXAMPLE = REPO / "docs" / "examples" / "dcp_torchrun.py"
#: what torch prints for a DCP save or load without a process group (or with ``no_dist``)
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@pytest.fixture
def torch_installed() -> None:
    """Skips the test without torch. A fixture: torch is imported here, not in the test's
    event loop, which its import would hold for seconds (the nodes serve in that loop)."""
    pytest.importorskip("torch")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


def test_the_blocks_are_found() -> None:
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5
    joined = "\n".join(blocks)
    for name in (
        "Client(",
        "save_checkpoint",
        "restore_checkpoint",
        "AsyncSaver",
        "hold_optimizer",
        "staging_budget",
        "StoragedWriter",
    ):
        assert name in joined, name


async def test_client_doc_examples_run(
    inproc_cluster: InprocCluster, tmp_path: Path, torch_installed: None
) -> None:
    cluster = inproc_cluster
    script = tmp_path / "client_doc.py"
    script.write_text("\n\n".join(python_blocks(DOC.read_text())))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONASYNCIODEBUG": "",
        "STORAGED_URL": ",".join(cluster.urls),
        "STORAGED_TOKEN": TOKEN,
    }
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "4 nodes, replication 3" in out
    assert "no such checkpoint, as expected" in out
    assert re.search(r"committed \d+ chunks, 256\d+ bytes", out), out
    assert "state nvme" in out or "state cold" in out
    assert out.count("training stalled") == 3
    assert "lazy saves restored as taken" in out
    # The single-process DCP form runs in a process group of one: torch does not warn.
    assert NO_DIST_WARNING not in proc.stderr, proc.stderr


async def test_the_no_dist_warning_is_what_the_doc_avoids(
    inproc_cluster: InprocCluster, tmp_path: Path, torch_installed: None
) -> None:
    """The control: ``no_dist=True`` does print the warning the single-process form avoids
    (if a torch release drops it, this fails and the doc's advice can go)."""
    code = (
        "import os, torch, torch.distributed.checkpoint as dcp\n"
        "from storaged.client.dcp import StoragedWriter\n"
        "url = os.environ['STORAGED_URL'].split(',')\n"
        "w = StoragedWriter(url, 'docs/no-dist-control', os.environ['STORAGED_TOKEN'])\n"
        "dcp.save({'x': torch.ones(3)}, storage_writer=w, no_dist=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONASYNCIODEBUG": "",
           "STORAGED_URL": ",".join(inproc_cluster.urls), "STORAGED_TOKEN": TOKEN}  # fmt: skip
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert NO_DIST_WARNING in proc.stderr


def test_the_torchrun_example_is_quoted_verbatim() -> None:
    text = DOC.read_text()
    quoted = re.search(
        r"^```python file=docs/examples/dcp_torchrun.py\n(.*?)^```$",
        text,
        flags=re.DOTALL | re.MULTILINE,
    )
    assert quoted is not None, "docs/CLIENT.md does not quote docs/examples/dcp_torchrun.py"
    assert quoted.group(1) == TORCHRUN_EXAMPLE.read_text()
    assert "torchrun --standalone --nproc-per-node 2 docs/examples/dcp_torchrun.py" in text


@pytest.mark.torch
async def test_the_torchrun_example_runs_on_two_ranks(
    inproc_cluster: InprocCluster, tmp_path: Path, torch_installed: None
) -> None:
    cluster = inproc_cluster
    name = f"docs/torchrun-{os.getpid()}-{tmp_path.name[-12:]}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONASYNCIODEBUG": "",
        "STORAGED_URL": ",".join(cluster.urls),
        "STORAGED_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets stay on the loopback
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = await asyncio.to_thread(
        subprocess.run,
        [*argv, str(TORCHRUN_EXAMPLE), name],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2: saved rows, loaded columns and the whole weight: ok" in (
            proc.stdout
        ), proc.stdout + proc.stderr
    assert NO_DIST_WARNING not in proc.stderr

    # One checkpoint with both ranks' shards: the numpy client reads it whole, on one process.
    async with Client(cluster.urls, token=TOKEN) as client:
        manifest = await client.get_manifest(name)
        ranks = {shard["rank"] for shard in manifest["shards"]}
        assert ranks == {0, 1}, manifest
        back: dict[str, Any] = await restore_checkpoint(client, name)
    want = np.arange(48, dtype=np.float32).reshape(8, 6)
    assert np.array_equal(back["weight"], want)
    assert np.allclose(back["bias"], np.linspace(-1.0, 1.0, 6, dtype=np.float32))
