"""This machine, as every load test sees it: units, event loops, pre-faulted memory, the
CPU seconds of a process (``/proc/<pid>/stat``), the page cache, what is installed, and how a
run stops (SIGTERM as Ctrl-C) and cleans up.

``drop_page_cache`` says in its return value what it could do about the page cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import numpy as np

MiB = 1 << 20


GiB = 1 << 30


GB = 1e9


def new_loop(name: str = "uvloop") -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop (what a node runs) when asked and installed."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop()
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def prefaulted(size: int) -> bytearray:
    """``size`` bytes, every page already touched (so not during a measured transfer)."""
    # bytearray * n fills with memset: every page is touched now, not during a transfer.
    return bytearray(b"\x01") * size


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    return sum(proc_cpu_times(pid))


def drop_page_cache(paths: Iterable[Path] = ()) -> str:
    """Evict file pages so that reads hit the disk; returns what was done.

    ``"fadvise"``: the pages of every file under ``paths`` (``POSIX_FADV_DONTNEED``; the
    files are fsynced, so no page stays dirty). Targeted, so that other work on this
    shared machine keeps its cache. ``"drop_caches"``: no file was given (a cluster seen
    only by its URL), so the whole page cache (``sync``, then ``echo 1 >
    /proc/sys/vm/drop_caches``, which needs root). ``"warm"``: neither was possible;
    reads may come from RAM.
    """
    done = False
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if not path.is_file():
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done = True
            finally:
                os.close(fd)
    if done:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "warm"


#: why the DCP baselines are missing, when they are
NO_TORCH = "torch is not installed (pip install 'storaged[torch]'): no DCP baseline"


def torch_available() -> bool:
    """Whether the DCP baselines can run (torch is an optional extra)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "numpy": np.__version__,
        "loadavg": list(os.getloadavg()),
        "mem_available_gib": _mem_available_gib(),
    }


def run_machine(load_before: Sequence[float], **extra: Any) -> dict[str, Any]:
    """A run's ``machine`` record: CPUs, Python, kernel, the load averages at its start
    (``load_before``) and now, and ``extra`` (the loop, a library's version...)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        **extra,
    }


def _mem_available_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) * 1024 / GiB, 1)
    return None


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, so ``finally`` blocks clean up."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return None
