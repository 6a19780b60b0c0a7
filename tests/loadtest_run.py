"""Runs a load test as its users do (``python -m loadtest.<name>``) from the repository, for
the ``tests/test_loadtest_*.py`` smoke tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_loadtest(
    module: str, *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m <module> <args>`` in the repository, its output captured. The node
    processes and the benchmark run without asyncio debug mode (conftest sets it for the
    tests); ``env`` adds to the environment."""
    full = {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
