"""When to checkpoint: ``storaged advise --mtbf HOURS``.

From the cost of one checkpoint to the job (the save stall: what training waits for) and
the time to restore after a failure, the optimal checkpoint interval for a mean time
between failures, with what it costs:

- Young (1974): ``interval = sqrt(2 x cost x MTBF)``.
- Daly (2006), higher order: ``interval = sqrt(2 C M) x (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C``
  for ``C < 2M``, else ``interval = M``.
- Expected work lost per failure: ``interval / 2 + restore`` (on average a failure lands
  half-way through an interval; then the job waits for its restore).
- Fraction of the run spent checkpointing: ``cost / interval``.
- Total expected overhead: ``cost / interval + (interval / 2 + restore) / MTBF``.

The cost and the restore time come, by strength: from ``--stall`` / ``--restore``; from a
live cluster (``--url``: a quick save of ``--size`` bytes with ``AsyncSaver`` for the stall,
then ``restore_checkpoint``); from the scale model's projection (``--nodes``,
``--model-bytes``, see ``storaged.tools.model``, with the rates of any ``--results`` files);
from the load tests' result files named by ``--results`` (``save.json`` and
``restore.json`` as ``python -m loadtest save`` / ``restore`` write them, or a directory
holding them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from storaged.config import ConfigError, parse_size

#: The state of a 405e9-parameter model at 16 bytes per parameter.
DEFAULT_MODEL_BYTES = 405e9 * 16
RESTORE_TIERS = ("ram", "nvme", "cold")


class AdviceError(ValueError):
    """An input the advice cannot be computed from; the message says which and why."""


class LiveMeasurementFailed(Exception):
    """The quick save and restore on ``--url`` did not complete; the message says why."""


# --------------------------------------------------------------------------- formulas


def _check(name: str, value: float, *, zero_ok: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        wanted = "zero or more" if zero_ok else "more than zero"
        raise AdviceError(f"{name} must be a finite number of seconds {wanted}, got {value!r}")


def young_interval(cost: float, mtbf: float) -> float:
    """Young's optimal interval between checkpoints: ``sqrt(2 x cost x mtbf)`` (seconds)."""
    _check("cost", cost)
    _check("mtbf", mtbf)
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum; ``mtbf`` itself once ``cost >= 2 x mtbf``."""
    _check("cost", cost)
    _check("mtbf", mtbf)
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


@dataclass(frozen=True)
class Interval:
    """What checkpointing every ``interval`` seconds of work costs."""

    interval: float
    #: interval / 2 + restore
    lost_per_failure: float
    #: cost / interval
    checkpointing: float
    #: cost / interval + (interval / 2 + restore) / mtbf
    overhead: float


def at_interval(interval: float, cost: float, restore: float, mtbf: float) -> Interval:
    """The first-order costs of checkpointing every ``interval`` seconds."""
    _check("interval", interval)
    _check("cost", cost)
    _check("restore", restore, zero_ok=True)
    _check("mtbf", mtbf)
    lost = interval / 2 + restore
    return Interval(interval, lost, cost / interval, cost / interval + lost / mtbf)


@dataclass(frozen=True)
class Advice:
    cost: float
    restore: float
    mtbf: float
    young: Interval
    daly: Interval

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def advise(cost: float, restore: float, mtbf: float) -> Advice:
    """Young's and Daly's intervals for a checkpoint ``cost``, ``restore`` time and ``mtbf``.

    All in seconds. ``AdviceError`` (a ``ValueError``) for a cost or MTBF that is not
    positive and finite, or a negative restore time.
    """
    young = at_interval(young_interval(cost, mtbf), cost, restore, mtbf)
    daly = at_interval(daly_interval(cost, mtbf), cost, restore, mtbf)
    return Advice(cost, restore, mtbf, young, daly)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """The figures the advice is computed from, each with where it came from."""

    cost: float
    restore: float
    cost_source: str
    restore_source: str
    #: Seconds from the start of a save to its ack, when the source knows it.
    ack: float | None = None


@dataclass(frozen=True)
class Measured:
    """What the load tests' result files say, None where they do not say it."""

    stall: float | None
    stall_source: str
    restore: float | None
    restore_source: str
    ack: float | None = None


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _pick(doc: Any, keys: tuple[str, ...], tier: str | None = None) -> Mapping[str, Any]:
    """The storaged row at the highest concurrency that has one of ``keys`` (and ``tier``).

    Rows are ``doc["runs"]`` or ``doc["results"]``; a document with one of ``keys`` at
    the top is its own row.
    """
    if not isinstance(doc, Mapping):
        raise ValueError("not a JSON object")
    rows: list[Mapping[str, Any]] = [
        r
        for section in ("runs", "results")
        for r in doc.get(section) or []
        if isinstance(r, Mapping) and r.get("kind", "storaged") == "storaged"
    ]
    tiers = {"ram": ("memory", "ram"), "nvme": ("nvme",), "cold": ("cold",)}
    if tier is not None:
        rows = [r for r in rows if r.get("tier") is None or r.get("tier") in tiers[tier]]
    rows = [r for r in rows if any(_positive(r.get(k)) for k in keys)] + (
        [doc] if any(_positive(doc.get(k)) for k in keys) else []
    )
    if not rows:
        raise KeyError(f"no storaged row with {' or '.join(keys)}")
    return max(rows, key=lambda r: int(r.get("concurrency") or 0))


def named_results(paths: Sequence[Path]) -> dict[str, Path]:
    """Result kind (``storaged.tools.model.RESULT_KINDS``) -> file, from ``--results`` paths: a
    file whose name ends in ``<kind>.json``, or a directory holding such files."""
    from storaged.tools.model import RESULT_KINDS  # here: ``storaged ls`` registers advise only

    files: dict[str, Path] = {}
    for path in paths:
        if path.is_dir():
            for kind in RESULT_KINDS:
                files.setdefault(kind, path / f"{kind}.json")
            continue
        named = [k for k in RESULT_KINDS if path.name.endswith(f"{k}.json")]
        if not named:
            names = ", ".join(f"{k}.json" for k in RESULT_KINDS)
            raise AdviceError(
                f"--results {path}: neither a directory nor a result file (a name ending in "
                f"one of {names}, as python -m loadtest writes them)"
            )
        files[named[0]] = path
    return files


def from_results(results: Mapping[str, Path], tier: str = "ram") -> Measured:
    """The stall, ack and restore time measured by ``python -m loadtest save`` / ``restore``,
    from the result files ``results`` names by kind (``named_results``).

    The stall is the warm one (staging buffers reused, as in a training loop) when
    measured, at the highest concurrency measured. A restore measured on another number
    of bytes than the save is scaled to the save's bytes (linearly, and the source says so).
    """

    def load(kind: str) -> tuple[Any, str]:
        path = results.get(kind)
        if path is None:
            return None, f"no {kind}.json named (--results)"
        try:
            return json.loads(path.read_text()), ""
        except FileNotFoundError:
            return None, f"{path} missing"
        except (OSError, ValueError) as exc:
            return None, f"{path} unreadable: {exc}"

    stall = restore = ack = None
    save_bytes = None
    doc, stall_source = load("save")
    if doc is not None:
        keys = ("stall_warm_s", "stall_s", "stall_seconds")
        try:
            row = _pick(doc, keys)
        except (KeyError, ValueError) as exc:
            stall_source = f"{results['save']}: {exc}"
        else:
            key = next(k for k in keys if _positive(row.get(k)))
            stall = _positive(row[key])
            ack = _positive(row.get("ack_seconds"))
            save_bytes = _positive(row.get("bytes"))
            at = f"c={row['concurrency']} " if "concurrency" in row else ""
            stall_source = f"measured: {results['save']} {at}{key}"
    doc, restore_source = load("restore")
    if doc is not None:
        keys = ("restore_s", "restore_seconds", "seconds")
        try:
            row = _pick(doc, keys, tier)
        except (KeyError, ValueError) as exc:
            restore_source = f"{results['restore']}: {exc}"
        else:
            key = next(k for k in keys if _positive(row.get(k)))
            restore = _positive(row[key])
            at = f"c={row['concurrency']} " if "concurrency" in row else ""
            restore_source = f"measured: {results['restore']} {at}{key}"
            restore_bytes = _positive(row.get("bytes"))
            if restore is not None and save_bytes and restore_bytes and save_bytes != restore_bytes:
                restore *= save_bytes / restore_bytes
                restore_source += f", scaled from {restore_bytes:.0f} to {save_bytes:.0f} bytes"
    return Measured(stall, stall_source, restore, restore_source, ack)


def from_model(
    nodes: int, model_bytes: float, results: Mapping[str, Path], tier: str
) -> tuple[float, str, float, str, float]:
    """The scale model's stall, restore (from ``tier``) and ack for ``nodes`` nodes, with the
    rates of the ``results`` files (documented defaults for what they do not measure)."""
    from storaged.tools.model import Assumptions, load_rates, project

    assumptions = Assumptions(model_bytes=model_bytes)
    phases = project(nodes, assumptions, load_rates(results, k=assumptions.k, n=assumptions.n))
    where = f"storaged.tools.model, {nodes} nodes, {model_bytes / 1e12:.2f} TB"
    stall, restore = phases["stall"], phases[f"restore_{tier}"]
    return (
        stall.seconds,
        f"{where}: host staging copy, bound by {stall.bound}",
        restore.seconds,
        f"{where}: restore from {tier}, bound by {restore.bound}",
        phases["ack"].seconds,
    )


async def measure_live(url: str, token: str | None, size: int) -> tuple[float, float, float]:
    """(stall, restore, ack) seconds of saving and restoring ``size`` random bytes on a cluster.

    Saves one rank's state with ``AsyncSaver`` (the stall is its staging copy), waits for
    the ack, restores it with ``restore_checkpoint`` (from RAM, right after the save), and
    deletes the probe checkpoint.
    """
    import asyncio

    import numpy as np

    from storaged.client import AsyncSaver, Client, restore_checkpoint

    rng = np.random.default_rng()
    # Random bytes so that nothing dedups against an earlier probe; made in a thread since
    # a large one takes a while.
    probe = await asyncio.to_thread(lambda: np.frombuffer(rng.bytes(size), dtype=np.uint8))
    name = f"storaged-advise/probe-{uuid.uuid4().hex[:16]}"
    async with Client(url, token=token) as client:
        try:
            async with AsyncSaver(client) as saver:
                began = time.perf_counter()
                handle = await saver.save(name, {0: {"probe": probe}}, meta={"advise": True})
                await handle.acked()
                ack = time.perf_counter() - began
            began = time.perf_counter()
            restored = await restore_checkpoint(client, name)
            restore = time.perf_counter() - began
            if restored["probe"].nbytes != size:
                raise AdviceError("the probe checkpoint came back with another size")
            return handle.stall_seconds, restore, ack
        finally:
            # The probe is garbage either way; a failure above matters more than this one.
            with contextlib.suppress(Exception):
                await client.delete(name)


def gather_inputs(args: argparse.Namespace) -> Inputs:
    """The cost and restore time from the strongest source that gives them."""
    cost: float | None = args.stall
    restore: float | None = args.restore
    cost_source = "--stall" if cost is not None else ""
    restore_source = "--restore" if restore is not None else ""
    ack: float | None = None
    if cost is not None and restore is not None:
        return Inputs(cost, restore, cost_source, restore_source)
    if args.model_bytes is not None and args.nodes is None:
        raise AdviceError("--model-bytes needs --nodes (the scale model's cluster size)")
    if args.url:
        import asyncio  # here: ``storaged --version`` parses this command's options only

        try:
            stall, restored, ack = asyncio.run(measure_live(args.url, args.token, args.size))
        except Exception as exc:  # any client failure: reported, not a traceback
            raise LiveMeasurementFailed(f"{args.url}: {type(exc).__name__}: {exc}") from exc
        live = f"live: {args.url}, {args.size} bytes"
        if cost is None:
            cost, cost_source = stall, f"{live}, AsyncSaver stall"
        if restore is None:
            restore, restore_source = restored, f"{live}, restore_checkpoint right after the ack"
    elif args.nodes is not None:
        if args.nodes < 1:
            raise AdviceError(f"--nodes must be >= 1, got {args.nodes}")
        model_bytes = DEFAULT_MODEL_BYTES if args.model_bytes is None else args.model_bytes
        stall, s_source, restored, r_source, ack = from_model(
            args.nodes, model_bytes, named_results(args.results), args.restore_tier
        )
        if cost is None:
            cost, cost_source = stall, s_source
        if restore is None:
            restore, restore_source = restored, r_source
    elif args.results:
        measured = from_results(named_results(args.results), args.restore_tier)
        if cost is None:
            cost, cost_source = measured.stall, measured.stall_source
        if restore is None:
            restore, restore_source = measured.restore, measured.restore_source
        ack = measured.ack
    else:
        cost_source = cost_source or "not given"
        restore_source = restore_source or "not given"
    if cost is None or restore is None:
        lacking = ", ".join(
            f"{what} ({why})"
            for what, value, why in (
                ("stall", cost, cost_source),
                ("restore time", restore, restore_source),
            )
            if value is None
        )
        raise AdviceError(
            f"no {lacking}; give --stall and --restore, --url of a cluster, --nodes, or "
            "--results with the load tests' save.json and restore.json"
        )
    return Inputs(cost, restore, cost_source, restore_source, ack)


# --------------------------------------------------------------------------- command


def _duration(seconds: float) -> str:
    if seconds >= 7200:
        return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"
    if seconds >= 120:
        return f"{seconds:.0f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.3g} s"


def report(advice: Advice, inputs: Inputs) -> str:
    """The advice as text: inputs with their sources, both intervals, the formulas."""
    a = advice
    lines = [
        f"checkpoint cost C = {_duration(a.cost)}   [{inputs.cost_source}]",
        f"restore time    R = {_duration(a.restore)}   [{inputs.restore_source}]",
        f"MTBF            M = {_duration(a.mtbf)}",
        "",
        f"{'':<34}{'Young':>18}{'Daly':>18}",
    ]

    def row(label: str, young: str, daly: str) -> None:
        lines.append(f"{label:<34}{young:>18}{daly:>18}")

    row("interval between checkpoints", _duration(a.young.interval), _duration(a.daly.interval))
    row(
        "work lost per failure",
        _duration(a.young.lost_per_failure),
        _duration(a.daly.lost_per_failure),
    )
    row(
        "time spent checkpointing",
        f"{100 * a.young.checkpointing:.3f} %",
        f"{100 * a.daly.checkpointing:.3f} %",
    )
    row("total overhead", f"{100 * a.young.overhead:.3f} %", f"{100 * a.daly.overhead:.3f} %")
    lines += [
        "",
        "Young: interval = sqrt(2 C M)",
        "Daly:  interval = sqrt(2 C M) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C   (C < 2M; else M)",
        "work lost per failure = interval/2 + R;  time checkpointing = C/interval",
        "total overhead = C/interval + (interval/2 + R)/M",
    ]
    if inputs.ack is not None:
        lines.append(f"a save is acked {_duration(inputs.ack)} after it starts")
        if a.young.interval < inputs.ack:
            lines.append(
                "WARNING: the interval is shorter than the ack: each save would wait for the"
                " previous one's staging buffer, so the real cost approaches the ack time"
            )
    if a.cost >= 2 * a.mtbf:
        lines.append(
            "WARNING: C >= 2M: failures come faster than checkpoints; Daly falls back to M and"
            " the first-order figures above do not hold"
        )
    return "\n".join(lines)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``advise`` to the ``storaged`` command's subparsers."""
    p = sub.add_parser(
        "advise",
        help="optimal checkpoint interval (Young/Daly) for an MTBF",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mtbf", type=float, required=True, help="mean time between failures, hours")
    p.add_argument("--stall", type=float, help="checkpoint cost to the job, seconds")
    p.add_argument("--restore", type=float, help="restore time after a failure, seconds")
    p.add_argument("--url", help="measure on this cluster (a quick save and restore)")
    p.add_argument("--token", default=os.environ.get("STORAGED_TOKEN") or None)
    p.add_argument(
        "--size", type=_size, default=256 * 2**20, help="bytes saved by --url (default 256MiB)"
    )
    p.add_argument("--nodes", type=int, help="use the scale model's projection for N nodes")
    p.add_argument(
        "--model-bytes",
        type=_size,
        help="checkpoint bytes for the scale model (default 405e9 x 16 = 6.48TB)",
    )
    p.add_argument(
        "--restore-tier",
        choices=RESTORE_TIERS,
        default="ram",
        help="which tier's restore figure to use, modelled or measured (default ram)",
    )
    p.add_argument(
        "--results",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a load test's result file (save.json, restore.json, ack.json, nvme.json) or a "
        "directory of them; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.set_defaults(func=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    """Print the advice; 2 with a message on stderr for unusable inputs, 1 if --url fails."""
    try:
        mtbf_hours: float = args.mtbf
        if not (math.isfinite(mtbf_hours) and mtbf_hours > 0):
            raise AdviceError(f"--mtbf must be a positive number of hours, got {mtbf_hours}")
        for flag in ("stall", "restore"):
            value = getattr(args, flag)
            if value is not None:
                _check(f"--{flag}", value, zero_ok=flag == "restore")
        if args.size <= 0:
            raise AdviceError(f"--size must be positive, got {args.size}")
        inputs = gather_inputs(args)
        advice = advise(inputs.cost, inputs.restore, mtbf_hours * 3600)
    except AdviceError as exc:
        print(f"storaged advise: {exc}", file=sys.stderr)
        return 2
    except LiveMeasurementFailed as exc:
        print(f"storaged advise: live measurement failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        doc = advice.as_dict()
        doc["sources"] = {"cost": inputs.cost_source, "restore": inputs.restore_source}
        doc["ack"] = inputs.ack
        print(json.dumps(doc, indent=2))
    else:
        print(report(advice, inputs))
    return 0
