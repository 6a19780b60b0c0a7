"""Codec throughput next to the raw libraries, in one run: ``python -m loadtest.codec``.

For each (k, n) it times, on one chunk (8 MiB by default):

- encode: ``codec.encode(chunk_id, data)`` (split, pad, code, CRC-32C and header of every
  fragment) against the raw library called directly (zfec: ``Encoder.encode`` on the k
  primary blocks, split beforehand and not timed; pyeclib: ``ECDriver.encode``);
- decode from the k primary fragments, and decode with fragment 0 missing (real
  reconstruction): ``codec.decode(chunk_id, whole fragments as bytes)`` (header checks,
  CRC-32C of the k payloads used, decode, join, BLAKE3 check) against the raw library.
  Raw zfec's decode returns the k blocks and, from primaries, does nothing at all; the
  baseline therefore includes the one ``b"".join`` any caller needs to get the chunk back.

Operations run interleaved, round after round, so that drift on this shared, noisy machine
hits both sides alike. GB/s is chunk bytes (10^9) per second from the best round (other
processes only ever add time); ``ratio`` is wrapper / raw throughput from the best rounds,
``median ratio`` the same from the median rounds. The costs of the checks alone (BLAKE3 of the
chunk, CRC-32C of the payloads, the join) are timed too: they are where the time goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c
import zfec

from erasure import isal_available, make_codec
from erasure.zfec_codec import block_size
from loadtest.harness.baselines import raw_zfec_ops, wrapper_ops
from storaged.ids import chunk_id_of

MiB = 1 << 20
DEFAULT_PARAMETERS = ((4, 6), (8, 12), (10, 14))


@dataclass
class Measure:
    label: str
    run: Callable[[], object]
    times: list[float]


def _raw_pyeclib(data: bytes, k: int, n: int) -> dict[str, Callable[[], object]]:
    from pyeclib.ec_iface import ECDriver

    from erasure.isal import EC_TYPE

    driver = ECDriver(k=k, m=n - k, ec_type=EC_TYPE)
    fragments = driver.encode(data)
    return {
        "encode": lambda: driver.encode(data),
        "decode primaries": lambda: driver.decode(fragments[:k]),
        "decode missing #0": lambda: driver.decode(fragments[1 : k + 1]),
    }


def _checks(data: bytes, k: int, n: int) -> dict[str, Callable[[], object]]:
    size = block_size(len(data), k)
    parity = bytes(size * (n - k))
    view = memoryview(data)
    return {
        "BLAKE3 of the chunk": lambda: chunk_id_of(data),
        "CRC-32C of n payloads": lambda: (crc32c.crc32c(data), crc32c.crc32c(parity)),
        "CRC-32C of k payloads": lambda: crc32c.crc32c(data),
        "join k segments": lambda: b"".join(view[i * size : (i + 1) * size] for i in range(k)),
    }


def _gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9 if seconds > 0 else float("inf")


def run(
    parameters: Sequence[tuple[int, int]], size: int, rounds: int, codecs: Sequence[str]
) -> str:
    data = os.urandom(size)
    lines = [
        f"# chunk {size / MiB:g} MiB, best of {rounds} interleaved rounds;"
        f" python {sys.version.split()[0]}, zfec {zfec.__version__}",
        f"{'codec':<6} {'k,n':<6} {'operation':<18} {'wrapper GB/s':>12} {'raw GB/s':>9}"
        f" {'ratio':>6} {'median ratio':>12}  {'wrapper ms':>10} {'raw ms':>7}",
    ]
    check_lines: list[str] = []
    for k, n in parameters:
        pairs: list[tuple[str, str, Measure, Measure]] = []
        extra: list[Measure] = []
        for name in codecs:
            raw = raw_zfec_ops(data, k, n) if name == "zfec" else _raw_pyeclib(data, k, n)
            wrapped = wrapper_ops(make_codec(name, k, n), data)
            for op in raw:
                pairs.append((name, op, Measure(op, wrapped[op], []), Measure(op, raw[op], [])))
        for label, fn in _checks(data, k, n).items():
            extra.append(Measure(label, fn, []))
        everything = [m for _, _, w, r in pairs for m in (w, r)] + extra
        for measure in everything:  # warm-up: first-touch page faults, lazy tables
            measure.run()
        for _ in range(rounds):
            for measure in everything:
                start = time.perf_counter()
                measure.run()
                measure.times.append(time.perf_counter() - start)
        for name, op, wrapper, raw_measure in pairs:
            w, r = min(wrapper.times), min(raw_measure.times)
            median = statistics.median(raw_measure.times) / statistics.median(wrapper.times)
            lines.append(
                f"{name:<6} {f'{k},{n}':<6} {op:<18} {_gbps(size, w):>12.2f}"
                f" {_gbps(size, r):>9.2f} {r / w:>6.2f} {median:>12.2f}"
                f"  {w * 1e3:>10.2f} {r * 1e3:>7.2f}"
            )
        check_lines.append(
            f"checks at k,n={k},{n}: "
            + ", ".join(f"{m.label} {min(m.times) * 1e3:.2f} ms" for m in extra)
        )
    return "\n".join([*lines, *check_lines])


def _parameters(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split():
        k, n = (int(x) for x in item.split(","))
        out.append((k, n))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.codec", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds: 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15, quick 3)")
    parser.add_argument("--size-mib", type=float, default=8.0, help="chunk size (default 8)")
    parser.add_argument(
        "--params",
        type=_parameters,
        default=list(DEFAULT_PARAMETERS),
        help='space-separated k,n pairs (default "4,6 8,12 10,14")',
    )
    parser.add_argument(
        "--codecs", default=None, help="comma-separated (default: zfec, and isal if installed)"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 15)
    if args.codecs:
        codecs = args.codecs.split(",")
    else:
        codecs = ["zfec", "isal"] if isal_available() else ["zfec"]
    started = time.perf_counter()
    print(run(args.params, int(args.size_mib * MiB), rounds, codecs))
    print(f"# took {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
