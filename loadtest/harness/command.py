"""How ``restore`` and ``save`` are run: their shared command line (``add_workload_arguments``,
``add_cluster_arguments``, ``add_output_arguments``; ``resolve_workload``: their ``--quick``
defaults and checks), ``run_and_write`` (run, then write ``<name>.json/.md/.png``; without
matplotlib the JSON and markdown, and how to get the plot) and ``Progress``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.harness.checkpoint import ROW_BYTES, Layout
from loadtest.harness.machine import GiB, MiB, interrupt_on_sigterm
from loadtest.harness.plots import PlotUnavailable
from loadtest.harness.report import RESULTS, parse_levels, write_json
from storaged.client.layout import DEFAULT_CHUNK_SIZE


def add_workload_arguments(parser: argparse.ArgumentParser, *, levels: str, per: str) -> None:
    """``--size --keys --concurrency --nodes --memory --chunk-mib --client-concurrency``;
    ``levels`` says what ``--concurrency`` counts, ``per`` what one ``Client`` serves."""
    parser.add_argument("--size", type=float, help="checkpoint GiB (default 2; --quick 1/16)")
    parser.add_argument("--keys", type=int, help="tensors in the checkpoint (default 16; quick 4)")
    parser.add_argument("--concurrency", type=parse_levels, help=f"{levels} (1,2,4)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--memory", help="memory tier capacity per node (2GiB; quick 256MiB)")
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_SIZE / MiB)
    parser.add_argument("--client-concurrency", type=int, default=8,
                        help=f"requests in flight per {per} (Client max_concurrency)")  # fmt: skip


def add_cluster_arguments(parser: argparse.ArgumentParser, *, url: str) -> None:
    """``--url`` (its help: ``url``), ``--token`` (default ``$STORAGED_TOKEN``), ``--loop``."""
    parser.add_argument("--url", help=url)
    parser.add_argument("--token", default=os.environ.get("STORAGED_TOKEN"),
                        help="client token for --url (default $STORAGED_TOKEN)")  # fmt: skip
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-baselines --out --tmp --quick``."""
    parser.add_argument(
        "--no-baselines", action="store_true", help="storaged only: no baseline, no ratio"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--tmp", type=Path, help="scratch directory (default: system temp)")
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB, concurrency 1,2: the CI smoke test"
    )


@dataclass(frozen=True)
class Workload:
    """What ``add_workload_arguments`` asked for, with the ``--quick`` defaults filled in."""

    #: checkpoint bytes
    size: int
    keys: int
    concurrency: list[int]
    #: chunk bytes, a whole number of ``ROW_BYTES``
    chunk: int
    #: memory tier capacity per node, as the node takes it ("2GiB")
    memory: str
    #: the command line, as a reader of the results would type it
    command: str


def resolve_workload(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    *,
    divides: Sequence[int] = (),
) -> Workload:
    """The workload of ``args`` (``parser.error`` if it cannot be laid out): the rows of
    every tensor split evenly over each concurrency level and over each of ``divides``."""
    size = args.size if args.size is not None else (1 / 16 if args.quick else 2.0)
    keys = args.keys if args.keys is not None else (4 if args.quick else 16)
    conc = args.concurrency or ([1, 2] if args.quick else [1, 2, 4])
    chunk = int(args.chunk_mib * MiB)
    if chunk < ROW_BYTES or chunk % ROW_BYTES:
        parser.error(f"--chunk-mib must be a multiple of {ROW_BYTES >> 10} KiB")
    try:
        Layout.of_size(int(size * GiB), keys, multiple=math.lcm(*divides, *conc))
    except ValueError as exc:
        parser.error(f"--size {size} GiB is too small: {exc}")
    command = f"{parser.prog} " + " ".join(sys.argv[1:] if argv is None else argv)
    return Workload(
        size=int(size * GiB),
        keys=keys,
        concurrency=conc,
        chunk=chunk,
        memory=args.memory or ("256MiB" if args.quick else "2GiB"),
        command=command.rstrip(),
    )


def run_and_write(
    command: str,
    run: Callable[[], dict[str, Any]],
    out: Path,
    stem: str,
    render_markdown: Callable[[dict[str, Any]], str],
    render_plot: Callable[[dict[str, Any], Path], None],
) -> dict[str, Any] | None:
    """Print ``command``, ``run()`` (SIGTERM interrupts it like Ctrl-C), then write
    ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` in ``out`` (the doc records their paths
    under ``files``) and print the markdown. The doc; None if interrupted (said on stderr)."""
    print(f"# {command}", flush=True)
    try:
        with interrupt_on_sigterm():
            doc = run()
    except KeyboardInterrupt:
        print("# interrupted: every process this run started is stopped", file=sys.stderr)
        return None
    md = render_markdown(doc)
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md",
             "png": out / f"{stem}.png"}  # fmt: skip
    no_plot = None
    try:
        render_plot(doc, paths["png"])
    except PlotUnavailable as exc:
        # The figures are the result; the plot is a view of them, for those who have it.
        no_plot = str(exc)
        del paths["png"]
        doc["plot"] = no_plot
    doc["files"] = {k: str(v) for k, v in paths.items()}
    write_json(paths["json"], doc)
    paths["markdown"].write_text(md)
    print(md)
    print(f"# results: {', '.join(str(p) for p in paths.values())}")
    if no_plot is not None:
        print(f"# {no_plot}")
    return doc


class Progress:
    """A tqdm bar (stderr) over the steps of a run, and the seconds each step took."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{desc}: {n}/{total} |{bar}| {elapsed}<{remaining} {postfix}",
        )
        #: label -> seconds, in the order the steps ran
        self.seconds: dict[str, float] = {}
        self._label = ""
        self._since = time.monotonic()

    def begin(self, label: str) -> None:
        self._label = label
        self._since = time.monotonic()
        self.bar.set_postfix_str(label)

    def done(self, steps: int = 1) -> None:
        now = time.monotonic()
        spent = self.seconds.get(self._label, 0.0) + now - self._since
        self.seconds[self._label] = round(spent, 2)
        self._since = now
        self.bar.update(steps)

    def skip(self, steps: int) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()
