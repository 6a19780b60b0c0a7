"""docs/CLIENT.md runs as written: its Python blocks, in order, against a real cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from storaged.cluster import LocalCluster
from tests.conftest import TOKEN

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "CLIENT.md"


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
        "StoragedWriter",
    ):
        assert name in joined, name


def test_client_doc_examples_run(cluster: LocalCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "client_doc.py"
    script.write_text("\n\n".join(python_blocks(DOC.read_text())))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONASYNCIODEBUG": "",
        "STORAGED_URL": ",".join(cluster.urls),
        "STORAGED_TOKEN": TOKEN,
    }
    proc = subprocess.run(
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
