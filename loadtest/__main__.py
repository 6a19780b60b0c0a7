"""``python -m loadtest <benchmark> [options]``: run one load test (``--help`` for each).

``restore`` and ``save`` are the end-to-end checkpoint benchmarks (``loadtest/restore.py``,
``loadtest/save.py``); the others are the component benchmarks, also runnable as
``python -m loadtest.<name>``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

BENCHMARKS = {
    "restore": "restore bandwidth per tier and concurrency, against same-run baselines",
    "save": "save stall, ack throughput and latency, drain and encode backlogs",
    "ack": "3-copy ack throughput next to a one-copy aiohttp upload",
    "codec": "erasure codec throughput next to the raw libraries",
    "nvme": "the nvme tier next to plain file I/O",
    "peer": "peer protocol throughput next to raw loopback and aiohttp",
}


def _usage() -> str:
    lines = ["usage: python -m loadtest <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<8} {text}" for name, text in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"loadtest.{name}")
    run: Callable[[list[str]], int] = module.main
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
