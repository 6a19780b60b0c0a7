"""How fast ``storaged`` commands that only ask the cluster start: ``python -m loadtest.cli_start``.

Against a local cluster of 3 nodes holding one small checkpoint, it runs, round after
round and interleaved (drift on a shared machine hits every row alike):

- the baselines: ``python -c pass`` (the interpreter and site), ``python -c "import
  aiohttp"`` (the HTTP library every client command needs) and one aiohttp GET of
  ``/v1/cluster`` from ``python -c`` (the floor of any command built on aiohttp);
- ``storaged --version``, ``storaged ls``, ``storaged status NAME`` and ``storaged nodes``,
  run as the console script does (``from storaged.cli import main``).

Each figure is a whole process, start to exit, request and answer included (the cluster
answers in a millisecond or two): wall seconds (best and median round) and CPU seconds of
the process (user + system, median round; on a loaded machine the wall waits for a core,
the CPU time much less). Bytecode is cached in a temporary directory, warmed by one round
that is not counted, as an installed package has its ``.pyc`` files. The target (issue 17):
at most 0.3 s on an idle machine for ``ls``, ``status``, ``nodes`` and ``--version``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.harness.cluster import TOKEN, start_cluster
from loadtest.harness.machine import git_commit, machine_info, remove_tree
from loadtest.harness.report import RESULTS, markdown_table, ratio, write_json

NAME = "start/ckpt"
ENTRY = "import sys; from storaged.cli import main; sys.exit(main())"
AIOHTTP_GET = (
    "import asyncio, sys, aiohttp\n"
    "async def get():\n"
    "    async with aiohttp.ClientSession() as s, s.get(sys.argv[1] + '/v1/cluster',"
    " headers={'Authorization': 'Bearer ' + sys.argv[2]}) as r:\n"
    "        await r.read()\n"
    "asyncio.run(get())\n"
)
TARGET_SECONDS = 0.3


def _run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and exit status of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[2:]} exited {done.returncode}: {done.stderr.decode()[-400:]}")
    return wall, cpu, done.returncode


def measure(rounds: int, nodes: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cli-start-"))
    cluster = start_cluster(root / "cluster", nodes, memory="256MiB", die_with_parent=True)
    try:
        url = ",".join(cluster.urls)
        env = {
            **os.environ,
            "STORAGED_URL": url,
            "STORAGED_TOKEN": TOKEN,
            "PYTHONPYCACHEPREFIX": str(root / "pycache"),
        }
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        py = sys.executable
        data = root / "small.bin"
        data.write_bytes(os.urandom(1 << 20))
        _run_once([py, "-c", ENTRY, "save", str(data), NAME, "--format", "raw"], env)
        commands: dict[str, list[str]] = {
            "python -c pass": [py, "-c", "pass"],
            'python -c "import aiohttp"': [py, "-c", "import aiohttp"],
            "one aiohttp GET /v1/cluster": [py, "-c", AIOHTTP_GET, cluster.urls[0], TOKEN],
            "storaged --version": [py, "-c", ENTRY, "--version"],
            "storaged ls": [py, "-c", ENTRY, "ls"],
            f"storaged status {NAME}": [py, "-c", ENTRY, "status", NAME],
            "storaged nodes": [py, "-c", ENTRY, "nodes"],
        }
        for argv in commands.values():  # warm-up: bytecode written, files in the page cache
            _run_once(argv, env)
        walls: dict[str, list[float]] = {label: [] for label in commands}
        cpus: dict[str, list[float]] = {label: [] for label in commands}
        for _ in range(rounds):
            for label, argv in commands.items():
                wall, cpu, _status = _run_once(argv, env)
                walls[label].append(wall)
                cpus[label].append(cpu)
    finally:
        cluster.stop()
        remove_tree(root)
    rows = []
    floor = min(walls["python -c pass"])
    aiohttp_best = min(walls['python -c "import aiohttp"'])
    for label in commands:
        best = min(walls[label])
        rows.append(
            {
                "command": label,
                "best_s": round(best, 4),
                "median_s": round(statistics.median(walls[label]), 4),
                "cpu_median_s": round(statistics.median(cpus[label]), 4),
                "over_python_s": round(best - floor, 4),
                "x_import_aiohttp": ratio(best, aiohttp_best),
            }
        )
    return {
        "benchmark": "cli_start",
        "rounds": rounds,
        "nodes": nodes,
        "target_s": TARGET_SECONDS,
        "commit": git_commit(),
        "machine": machine_info(),
        "load_average": os.getloadavg(),
        "rows": rows,
    }


def report(doc: dict[str, Any]) -> str:
    head = ["command", "best s", "median s", "CPU s (median)", "best - python", "x import aiohttp"]
    table = markdown_table(
        head,
        (
            [
                f"`{r['command']}`",
                f"{r['best_s']:.3f}",
                f"{r['median_s']:.3f}",
                f"{r['cpu_median_s']:.3f}",
                f"{r['over_python_s']:.3f}",
                f"{r['x_import_aiohttp']:.2f}",
            ]
            for r in doc["rows"]
        ),
    )
    load = ", ".join(f"{x:.1f}" for x in doc["load_average"])
    return f"{table}\n\n{doc['rounds']} rounds, load average {load} at the end"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.cli_start", description=__doc__)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of every command")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the local cluster")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="1 round (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.rounds < 1 or args.nodes < 1:
        parser.error("--rounds and --nodes must be at least 1")
    began = time.perf_counter()
    doc = measure(args.rounds, args.nodes)
    print(report(doc))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cli_start.json"
    write_json(path, doc)
    print(f"# wrote {path}; took {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
