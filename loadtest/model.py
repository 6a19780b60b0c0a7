"""Past one machine, on paper: ``python -m loadtest.model``.

Projects the save stall, the ack, the drain to nvme, the erasure encode and the restores
of one checkpoint on clusters of 1,000 to 24,000 nodes, next to a central filesystem,
from two inputs kept apart:

- ``Rates``: what one node's storaged does per core, per drive or per thread, measured on
  this machine by the other load tests (``loadtest/results/*.json``). A rate whose result
  file is missing falls back to a documented default, and the output says which.
- ``Assumptions``: what this machine cannot measure (NIC bandwidth, cores given to
  storaged, drives, RAM, GPUs, the filesystem, the model size, the sharding).

Each phase is a set of demands, one per resource it needs (seconds of NIC, CPU, disk,
...); the phase takes as long as its largest demand, and that resource is its bound.
Phases that run concurrently in a real cluster (ack, drain, encode) are summed per
resource to give the time until a checkpoint is durable on nvme or cold. Every formula
is written out in docs/SCALE.md.

Outputs: a markdown table on stdout and in ``<out>/model.md``, ``<out>/model.json``,
and a log-log plot ``<out>/scale.png`` (copied to docs/scale.png when ``--out`` is the
default). ``--mtbf HOURS`` adds the Young/Daly checkpoint interval for every row
(``storaged.tools.advise``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from loadtest.harness.plots import PlotUnavailable, pyplot
from storaged.tools.model import (
    GB,
    Assumptions,
    Rates,
    load_rates,
    project,
)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "loadtest" / "results"
DOCS_PNG = REPO / "docs" / "scale.png"
NODE_COUNTS = (1_000, 2_000, 4_000, 8_000, 16_000, 24_000)


def run(
    node_counts: Sequence[int],
    assumptions: Assumptions,
    rates: Rates,
    *,
    mtbf_hours: float | None = None,
    node_mtbf_hours: float | None = None,
) -> dict[str, Any]:
    """The whole projection as a JSON-ready document (what ``model.json`` holds)."""
    from storaged.tools.advise import advise, at_interval

    rows = []
    for nodes in node_counts:
        phases = project(nodes, assumptions, rates)
        row: dict[str, Any] = {
            "nodes": nodes,
            "gb_per_node": assumptions.model_bytes * assumptions.replicas / nodes / GB,
            "phases": {
                name: {
                    "seconds": p.seconds,
                    "bound": p.bound,
                    "demands": p.demands,
                }
                for name, p in phases.items()
            },
        }
        mtbf = None
        if node_mtbf_hours is not None:
            mtbf = node_mtbf_hours * 3600 / nodes
        elif mtbf_hours is not None:
            mtbf = mtbf_hours * 3600
        if mtbf is not None:
            advice = advise(phases["stall"].seconds, phases["restore_ram"].seconds, mtbf)
            row["advice"] = advice.as_dict()
            # A save returns after its staging copy, but the next one waits for the staging
            # buffer until the previous upload is acked: the stall is only the cost while
            # the interval is longer than the ack.
            row["advice"]["interval_covers_ack"] = advice.young.interval > phases["ack"].seconds
            row["advice"]["mtbf_hours"] = mtbf / 3600
            # The same job checkpointing to the central filesystem, blocking while it writes.
            fs = advise(phases["fs_save"].seconds, phases["fs_restore"].seconds, mtbf)
            row["fs_advice"] = fs.as_dict()
            # Or staging asynchronously to it (as storaged's saver does): the job stalls for
            # the copy only, but cannot checkpoint more often than the FS absorbs a save.
            interval = max(advice.young.interval, phases["fs_save"].seconds)
            row["fs_async_advice"] = asdict(
                at_interval(interval, phases["stall"].seconds, phases["fs_restore"].seconds, mtbf)
            )
        rows.append(row)
    return {
        "command": "python -m loadtest.model " + " ".join(sys.argv[1:]),
        "assumptions": asdict(assumptions),
        "rates": rates.values(),
        "rate_sources": dict(rates.sources),
        "mtbf_hours": mtbf_hours,
        "node_mtbf_hours": node_mtbf_hours,
        "rows": rows,
    }


# --------------------------------------------------------------------------- output

LABELS = {
    "stall": "stall",
    "ack": "ack",
    "drain": "drain",
    "encode": "encode",
    "durable_nvme": "durable on nvme",
    "durable_cold": "durable cold",
    "restore_ram": "restore from RAM",
    "restore_nvme": "restore from nvme",
    "restore_cold": "restore from cold",
    "fs_save": "FS save",
    "fs_restore": "FS restore",
}


def _seconds(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    if s >= 0.01:
        return f"{s:.2f} s"
    return f"{s * 1000:.1f} ms"


SAVE_COLUMNS = ("stall", "ack", "drain", "encode", "durable_nvme", "durable_cold", "fs_save")
RESTORE_COLUMNS = ("restore_ram", "restore_nvme", "restore_cold", "fs_restore")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def markdown(doc: Mapping[str, Any]) -> str:
    """The tables (save, restore, and the advice when asked), one row per node count.

    Each phase's cell is its time and, in brackets, the resource that bounds it.
    """

    def cell(row: Mapping[str, Any], name: str) -> str:
        p = row["phases"][name]
        return f"{_seconds(p['seconds'])} ({p['bound']})"

    rows = doc["rows"]
    nodes = [f"{row['nodes']:,}" for row in rows]
    save = _table(
        ["nodes", "GB per node", *(LABELS[n] for n in SAVE_COLUMNS)],
        [
            [n, f"{row['gb_per_node']:.2f}", *(cell(row, c) for c in SAVE_COLUMNS)]
            for n, row in zip(nodes, rows, strict=True)
        ],
    )
    restore = _table(
        ["nodes", *(LABELS[n] for n in RESTORE_COLUMNS)],
        [[n, *(cell(row, c) for c in RESTORE_COLUMNS)] for n, row in zip(nodes, rows, strict=True)],
    )
    out = [*save, "", *restore]
    advised = [(n, row) for n, row in zip(nodes, rows, strict=True) if "advice" in row]
    if advised:
        advice_rows = []
        for n, row in advised:
            adv, fs, fs_async = row["advice"], row["fs_advice"], row["fs_async_advice"]
            young = adv["young"]
            advice_rows.append(
                [
                    n,
                    f"{adv['mtbf_hours']:.2f} h",
                    _seconds(young["interval"]),
                    _seconds(young["lost_per_failure"]),
                    f"{100 * young['checkpointing']:.2f} %",
                    f"{100 * young['overhead']:.2f} %",
                    f"{_seconds(fs['young']['interval'])}, {100 * fs['young']['overhead']:.1f} %",
                    f"{100 * fs_async['overhead']:.1f} %",
                ]
            )
        head = [
            "nodes",
            "job MTBF",
            "interval (Young)",
            "lost per failure",
            "checkpointing",
            "overhead",
            "FS sync: interval, overhead",
            "FS async: overhead",
        ]
        out += ["", *_table(head, advice_rows)]
    return "\n".join(out)


def describe(doc: Mapping[str, Any]) -> str:
    """Assumptions and rates with their sources, as a markdown list."""
    a = doc["assumptions"]
    out = ["Assumptions:"]
    for name, value in a.items():
        out.append(f"- {name} = {value}")
    out.append("")
    out.append("Rates (per core / per drive / per thread):")
    for name, value in doc["rates"].items():
        out.append(f"- {name} = {value:g} ({doc['rate_sources'].get(name, '?')})")
    return "\n".join(out)


#: Phases drawn: (name, colour, line style). Phases that often coincide (ack and -> nvme
#: when the CPU bounds both; nvme and cold restores when the disk does) differ in style.
PLOTTED = (
    ("stall", "tab:blue", "-"),
    ("ack", "tab:orange", "-"),
    ("durable_nvme", "tab:green", "-."),
    ("durable_cold", "tab:olive", ":"),
    ("restore_ram", "tab:red", "-"),
    ("restore_nvme", "tab:purple", "-."),
    ("restore_cold", "tab:brown", ":"),
)
MARKERS = {
    "CPU": "o",
    "NIC": "s",
    "disk": "^",
    "RAM": "x",
    "memcpy": "D",
    "PCIe": "v",
    "FS": "*",
    "FS metadata": "P",
}


def plot(doc: Mapping[str, Any], path: Path, *, dpi: int = 110) -> None:
    """Time vs nodes per phase, log-log, markers by bounding resource, FS as dashed lines."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    rows = doc["rows"]
    nodes = [row["nodes"] for row in rows]
    fig, ax = plt.subplots(figsize=(10.5, 5.5))
    for name, color, style in PLOTTED:
        ys = [row["phases"][name]["seconds"] for row in rows]
        ax.plot(nodes, ys, color=color, linestyle=style, label=LABELS[name], linewidth=1.8)
        for x, y, row in zip(nodes, ys, rows, strict=True):
            ax.plot(x, y, color=color, marker=MARKERS[row["phases"][name]["bound"]], ms=6)
    for name, color, style in (("fs_save", "black", "--"), ("fs_restore", "gray", ":")):
        ys = [row["phases"][name]["seconds"] for row in rows]
        ax.plot(nodes, ys, color=color, linestyle=style, linewidth=2, label=LABELS[name])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(nodes)
    ax.set_xticklabels([f"{n // 1000}k" if n % 1000 == 0 else str(n) for n in nodes])
    ax.minorticks_off()
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds (one checkpoint)")
    a = doc["assumptions"]
    ax.set_title(
        f"{a['model_bytes'] / 1e12:.2f} TB checkpoint: NIC {a['nic_gbps']:g} GB/s, "
        f"{a['cores']} cores, {a['nvme_drives']} drives per node; FS {a['fs_gbps']:g} GB/s",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    used = sorted({row["phases"][n]["bound"] for row in rows for n, _, _ in PLOTTED})
    bound_handles = [
        Line2D([], [], color="black", marker=MARKERS[b], linestyle="", label=b) for b in used
    ]
    first = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="phase")
    ax.add_artist(first)
    second = ax.legend(
        handles=bound_handles,
        loc="lower left",
        bbox_to_anchor=(1.01, 0.0),
        fontsize=8,
        title="bounded by",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Both legends sit outside the axes: name them, or the tight box cuts them off.
    fig.savefig(path, dpi=dpi, bbox_inches="tight", bbox_extra_artists=[first, second])
    plt.close(fig)


# --------------------------------------------------------------------------- command


def _node_list(text: str) -> list[int]:
    try:
        counts = [int(part.replace("_", "").replace(",", "")) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"node counts must be integers: {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"node counts must be >= 1: {text!r}")
    return sorted(set(counts))


def add_assumption_flags(parser: argparse.ArgumentParser) -> None:
    """``--nic-gbps``, ``--cores``... one flag per ``Assumptions`` field (defaults shown)."""
    defaults = Assumptions()
    for f in fields(Assumptions):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(
                flag,
                dest=f"assume_{f.name}",
                action=argparse.BooleanOptionalAction,
                default=default,
            )
        else:
            parser.add_argument(
                flag,
                dest=f"assume_{f.name}",
                type=type(default),
                default=default,
                help=f"(default {default:g})",
            )


def override_rates(rates: Rates, overrides: Sequence[str]) -> Rates:
    """``rates`` with ``NAME=VALUE`` overrides applied (``ValueError`` for a bad one)."""
    values: dict[str, float] = {}
    sources = dict(rates.sources)
    for text in overrides:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep or name not in rates.values():
            known = ", ".join(rates.values())
            raise ValueError(f"--rate {text!r}: expected NAME=VALUE with NAME one of {known}")
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f"--rate {text!r}: {value!r} is not a number") from None
        sources[name] = "given: --rate"
    changed = replace(rates, **values, sources=sources)
    changed.check()
    return changed


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    values = {f.name: getattr(args, f"assume_{f.name}") for f in fields(Assumptions)}
    assumptions = Assumptions(**values)
    assumptions.check()
    return assumptions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nodes",
        type=_node_list,
        default=list(NODE_COUNTS),
        help="comma-separated node counts (default 1000,2000,4000,8000,16000,24000)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="measured result files")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: --results)")
    parser.add_argument(
        "--docs-png",
        type=Path,
        default=None,
        help="also copy the plot here (default: docs/scale.png when writing to loadtest/results)",
    )
    parser.add_argument("--quick", action="store_true", help="1k and 24k nodes, a small plot")
    parser.add_argument("--no-plot", action="store_true")
    mtbf = parser.add_mutually_exclusive_group()
    mtbf.add_argument("--mtbf", type=float, help="job MTBF in hours: add Young/Daly advice")
    mtbf.add_argument(
        "--node-mtbf", type=float, help="MTBF of one node in hours (job MTBF = this / nodes)"
    )
    parser.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a measured rate, e.g. ack_node_cpu_s_per_gb=1.5 (repeatable)",
    )
    add_assumption_flags(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        assumptions = assumptions_from(args)
        for name in ("mtbf", "node_mtbf"):
            value = getattr(args, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be positive hours, got {value}")
    except ValueError as exc:
        print(f"loadtest.model: {exc}", file=sys.stderr)
        return 2
    node_counts = [NODE_COUNTS[0], NODE_COUNTS[-1]] if args.quick else args.nodes
    rates = load_rates(args.results, k=assumptions.k, n=assumptions.n)
    try:
        rates = override_rates(rates, args.rate)
    except ValueError as exc:
        print(f"loadtest.model: {exc}", file=sys.stderr)
        return 2
    doc = run(
        node_counts,
        assumptions,
        rates,
        mtbf_hours=args.mtbf,
        node_mtbf_hours=args.node_mtbf,
    )
    out: Path = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(doc)
    doc["markdown"] = table
    (out / "model.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "model.md").write_text(table + "\n\n" + describe(doc) + "\n")
    print(describe(doc))
    defaulted = [n for n, s in rates.sources.items() if s.startswith("default")]
    if defaulted:
        print(f"\nnot measured here, documented defaults used: {', '.join(defaulted)}")
    print()
    print(table)
    print(f"\n{out / 'model.json'}, {out / 'model.md'}", end="")
    if not args.no_plot:
        png = out / "scale.png"
        try:
            plot(doc, png, dpi=60 if args.quick else 110)
        except PlotUnavailable as exc:
            print(f"\n({time.perf_counter() - started:.1f} s)\n{exc}")
            return 0
        print(f", {png}", end="")
        copy_to = args.docs_png
        if copy_to is None and out.resolve() == RESULTS.resolve():
            copy_to = DOCS_PNG
        if copy_to is not None and copy_to.resolve() != png.resolve():
            copy_to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, copy_to)
            print(f", {copy_to}", end="")
    print(f"\n({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
