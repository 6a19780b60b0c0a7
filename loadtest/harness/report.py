"""What a benchmark writes: tables, ratios, percentiles, JSON, markdown and the notes on a
run. ``RESULTS`` is where the benchmarks write by default (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: where the benchmarks write their results (``--out``): loadtest/results
RESULTS = Path(__file__).resolve().parent.parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def parse_levels(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; argparse's error for anything but positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive integers like 1,2,4, not {text!r}")
    return values


def by_concurrency(rows: Sequence[Mapping[str, Any]], c: int) -> dict[str, Any]:
    """The row of ``rows`` measured at concurrency ``c`` ({} if none)."""
    return next((dict(r) for r in rows if r["concurrency"] == c), {})


def fmt(value: float | None, spec: str = ".2f", ratio: float | None = None) -> str:
    """``1.23`` or ``1.23 (0.45x)``; ``-`` for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = format(value, spec)
    return text if ratio is None else f"{text} ({ratio:.2f}x)"


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run_notes(doc: Mapping[str, Any]) -> list[str]:
    """The markdown lines on how the run went: seconds per step, and why the DCP baselines are
    missing if they are."""
    lines = []
    steps = doc.get("step_seconds", {})
    if steps:
        lines.append(
            f"run time {sum(steps.values()):.0f} s: "
            + ", ".join(f"{label} {sec:.0f} s" for label, sec in steps.items())
        )
    if doc["baselines"].get("dcp_skipped"):
        lines.append(doc["baselines"]["dcp_skipped"] + ".")
    return lines


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def finish(path: Path, doc: Mapping[str, Any]) -> int:
    """A load test's last step: its results written to ``path`` (``write_json``), said on
    standard output; the exit status 0."""
    write_json(path, doc)
    print(f"# results: {path}")
    return 0
