"""py-spy profiles summed by where the CPU goes (hashing, copies, aiohttp, peer protocol,
idle, GIL waits...): ``summarize_profile``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: (category, pattern of a frame), tried in order on each frame from the leaf up
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("BLAKE3 hash (id check)", re.compile(r"blake3|chunk_id_of", re.I)),
    ("buffer mapping (mmap + page faults)", re.compile(r"_map_buffer|\bmmap|prefault")),
    ("drain to nvme", re.compile(r"tiers/_durable\.py|\bdrain \(|drain_worker")),
    ("erasure encode", re.compile(r"erasure/|encode_and_spread|encode_worker|zfec", re.I)),
    ("peer protocol (sending replicas, replica receive)",
     re.compile(r"storaged/(peer\.py|peer/|transport\.py)")),
    ("HTTP (aiohttp parsing, body stream)", re.compile(r"aiohttp/|_http_parser|_body_pieces")),
    ("copy into the RAM buffer (Node._receive)", re.compile(r"_receive \(storaged/node\.py")),
    ("memory tier bookkeeping", re.compile(r"tiers/memory\.py")),
    ("rest of storaged", re.compile(r"storaged/|tiers/")),
    ("thread pool hand-offs (to_thread, futures)", re.compile(r"concurrent/futures|threads\.py|"
                                                             r"asyncio/futures\.py")),
]  # fmt: skip


#: socket I/O done by the event loop itself (no Python frame above the syscall)
_LOOP_IO = [
    ("socket reads in the event loop (HTTP and replica bodies)", re.compile(r"^(read|recv)")),
    ("socket writes in the event loop", re.compile(r"^(write|writev|send)")),
]


#: frames every stack starts with: the interpreter, the CLI, the loop runner, thread entry
_ROOT = re.compile(
    r"^(<module>|_run_module_as_main|_run_code|main \(storaged|cmd_serve|run \(asyncio/runners"
    r"|Runner\.run|Thread\.|_bootstrap|_worker \(.*concurrent/futures|_WorkItem\.run|0x|\? )"
)


def categorize(frames: Sequence[str]) -> str:
    """Where one busy py-spy stack (root first) spends its sample."""
    inner = list(frames)
    while inner and _ROOT.match(inner[0]):
        inner.pop(0)
    # The frame nearest the leaf that names a known piece of work decides (a memcpy under
    # Node._receive is the copy, not the aiohttp handler further up).
    for frame in reversed(inner):
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
    if not any(".py:" in f for f in inner):
        for name, pattern in _LOOP_IO:
            if pattern.match(frames[-1]):
                return name
        return "event loop (uvloop, asyncio tasks)"
    return "other"


#: Waits that py-spy --native counts as busy (its idle test misses futex and epoll waits):
#: the event loop polling, pool threads waiting for work, threads blocked on a condition,
#: threads waiting for the disk in fsync.
_IDLE_LEAF = re.compile(r"^(epoll_p?wait|epoll_wait|poll |select |fsync |fdatasync )")


_IDLE_PY = re.compile(r"^(_worker \(.*concurrent/futures/thread\.py|wait \(.*threading\.py)")


#: a thread back from a system call or a C extension waiting to take the GIL again
_GIL_WAIT = re.compile(r"^pthread_cond_(timed)?wait")


def is_idle(frames: Sequence[str]) -> bool:
    """Whether a py-spy stack (root first) is a thread waiting for work, not working."""
    if _IDLE_LEAF.match(frames[-1]):
        return True
    py = [f for f in frames if ".py:" in f]
    return bool(py) and _IDLE_PY.match(py[-1]) is not None


def is_gil_wait(frames: Sequence[str]) -> bool:
    """Whether a py-spy stack is a thread waiting for the GIL (or another condition)."""
    return any(_GIL_WAIT.match(f) for f in frames[-3:])


def summarize_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Busy samples of a py-spy raw file summed by category and by leaf frame (shares)."""
    categories: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    python_leaves: Counter[str] = Counter()
    total = idle = gil = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if is_idle(frames):
            idle += count
            continue
        if is_gil_wait(frames):
            gil += count
            continue
        total += count
        categories[categorize(frames)] += count
        leaves[_frame_name(frames[-1])] += count
        py = [f for f in frames if ".py:" in f]
        if py:
            python_leaves[_frame_name(py[-1], keep_line=True)] += count
    share = {k: round(v / total, 3) for k, v in categories.most_common()} if total else {}
    return {
        "samples": total,
        "idle_samples": idle,
        "gil_wait_samples": gil,
        "categories": share,
        "top_leaves": [[k, round(v / total, 3)] for k, v in leaves.most_common(top)]
        if total
        else [],
        "top_python_lines": [[k, round(v / total, 3)] for k, v in python_leaves.most_common(top)]
        if total
        else [],
    }


def _frame_name(frame: str, keep_line: bool = False) -> str:
    # "func (path/to/file.py:123)" or "0x7f.. (lib.so)": shorten paths, drop addresses.
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    func, where = m.groups()
    where = re.sub(r".*/site-packages/", "", where)
    where = re.sub(r".*/lib/python3\.\d+/", "", where)
    where = re.sub(r"^/work/[^/]+/", "", where)
    if not keep_line:
        where = re.sub(r":\d+$", "", where)
    if func.startswith("0x"):
        func = "?"
    return f"{func} ({where})"
