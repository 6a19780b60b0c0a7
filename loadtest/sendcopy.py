"""A sealed chunk to the socket, with and without a user-space copy:
``python -m loadtest.sendcopy``.

Issue 20 §1 asks whether a sealed segment can go to the socket without a user-space copy.
A node sends a replica (``storaged.node.write.WritePath._send_all``, ``PutStream.write``)
as 1 MiB memoryview slices of the sealed, memfd-backed mapping written to a uvloop
transport whose high-water mark is 1 MiB (``PeerClient``'s ``write_buffer``), waiting in
``drain()`` while it is paused. This probe holds ``--chunks`` chunks of ``--chunk-mib`` MiB
as the node does (``MemoryTier.lease_shared``, filled, ``seal_shared``, ``put``) and sends
``--mib`` MiB of them per transfer over TCP loopback to one receiver process, five ways:

- ``send``: the baseline. A blocking ``socket.sendall`` of each slice (no user-space
  buffer: the kernel copies the caller's pages into its socket buffers).
- ``sendfile``: ``os.sendfile`` of each slice from the sealed memfd (the kernel takes the
  page cache pages by reference on the send side: no copy into socket buffers).
- ``uvloop``: today's path, written as ``PutStream.write`` does it (each slice to a uvloop
  transport, high-water mark ``--write-buffer-kib``, ``drain`` while paused).
- ``asyncio``: the same on the standard library's loop, which (on Python 3.11) copies
  what the socket does not take at once into its own bytearray: the copy made visible.

The receiver is the same for all: one blocking thread per connection, ``recv_into`` a
reused 1 MiB buffer, then it answers with its own CPU seconds (user, system) for that
transfer. The modes run round after round, their order rotated each round, so load on this
shared machine hits them alike; CPU seconds (the thread CPU clock of the sending and the
receiving thread, split into user and system as ``getrusage`` splits it) do not count time
spent waiting, unlike wall time. Reported per mode: the median and the min-max over the
rounds of the sender's and the receiver's CPU s/GB and GB/s, and the median over rounds of
each round's ratio to ``send`` (the same round's figure).

Before the rounds, a copy check answers (a) directly for the two loops: a 16 MiB bytearray
written to a transport whose receiver does not read yet, overwritten right after
``write`` returns, then read out. Bytes the kernel did not take at once ("deferred") and
that still arrive as first written were copied by the loop into a buffer of its own;
those that arrive overwritten were sent from the caller's memory.

The results go to ``loadtest/results/sendcopy.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import blake3

from loadtest.harness.loopback import FlowControl
from loadtest.harness.machine import new_loop, prefaulted, run_machine
from loadtest.harness.report import finish
from tiers.memory import MemoryTier

MiB = 1 << 20
GB = 1e9
HOST = "127.0.0.1"
RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("send", "sendfile", "uvloop", "asyncio")
BASELINE = "send"
#: a transfer: its length; the receiver's answer: its CPU seconds (user, system)
LENGTH = struct.Struct("!Q")
ANSWER = struct.Struct("!dd")
#: the copy check's buffer: well above what a loopback socket takes at once
CHECK_BYTES = 16 * MiB


def _thread_cpu() -> tuple[float, float, float]:
    """This thread's CPU seconds: user and system as ``getrusage`` counts them, and the total
    by ``CLOCK_THREAD_CPUTIME_ID``. Take two and pass them to ``_cpu_between``."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime, time.thread_time()


def _cpu_between(
    start: tuple[float, float, float], end: tuple[float, float, float]
) -> tuple[float, float]:
    """(user, system) seconds from ``start`` to ``end``: their sum is the thread clock's
    delta, and ``getrusage`` only splits it. ``getrusage`` alone misses the stretch a thread
    has been running: the kernel adds it at a tick or when the thread sleeps, so a receiver
    that found the whole body already queued counted 0 s (a CI run, stop 29). When
    ``getrusage`` saw nothing the split is unknown and the whole goes to system time (a
    transfer's work is mostly the kernel's copy)."""
    total = max(0.0, end[2] - start[2])
    user, system = end[0] - start[0], end[1] - start[1]
    if user + system <= 0:
        return 0.0, total
    return total * user / (user + system), total * system / (user + system)


# -- the receiver (a child process) ---------------------------------------------------------------


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError("sender went away")
        data += got
    return data


def _receive_transfers(conn: socket.socket) -> None:
    """Transfers on one connection until it closes: each a length, then that many bytes
    into a reused buffer, answered with this thread's CPU seconds for the body."""
    view = memoryview(prefaulted(MiB))
    with conn:
        while True:
            try:
                (left,) = LENGTH.unpack(_recv_exactly(conn, LENGTH.size))
            except ConnectionError:
                return
            start = _thread_cpu()
            while left:
                n = conn.recv_into(view[: min(left, len(view))])
                if not n:
                    return
                left -= n
            conn.sendall(ANSWER.pack(*_cpu_between(start, _thread_cpu())))


def serve_receiver(control: Connection) -> None:
    """Accept connections (one thread each) until killed; the port goes to ``control``."""
    listener = socket.create_server((HOST, 0), backlog=16)
    control.send(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_receive_transfers, args=(conn,), daemon=True).start()


# -- the chunks, held as the node holds a co-located client's -----------------------------------


@dataclass
class Sealed:
    """A chunk in a sealed memfd: its read-only mapping (as the node sends it) and the fd."""

    view: memoryview
    fd: int


async def _sealed_chunks(tier: MemoryTier, chunk: int, count: int) -> list[Sealed]:
    out = []
    for i in range(count):
        seg = await tier.lease_shared(chunk)
        with mmap.mmap(seg.fd, seg.nbytes, flags=mmap.MAP_SHARED) as writable:
            writable[:chunk] = blake3.blake3(b"sendcopy" + i.to_bytes(8, "big")).digest(chunk)
        alloc = await tier.seal_shared(seg, chunk)
        chunk_id = blake3.blake3(alloc.view).hexdigest()
        await tier.put(chunk_id, alloc, verified=True)
        view = await tier.get(chunk_id)  # valid for the run (a detached buffer)
        async with tier.lease_fd(chunk_id) as (fd, _):
            out.append(Sealed(view, os.dup(fd)))
    return out


def _slices(chunks: Sequence[Sealed], nbytes: int, piece: int) -> Iterator[tuple[Sealed, int, int]]:
    """(chunk, offset, length) of each slice of a transfer of ``nbytes``: whole chunks in
    turn, each in slices of ``piece`` bytes."""
    sent, i = 0, 0
    while sent < nbytes:
        ch = chunks[i % len(chunks)]
        size = min(len(ch.view), nbytes - sent)
        for off in range(0, size, piece):
            yield ch, off, min(piece, size - off)
        sent += size
        i += 1


# -- the senders --------------------------------------------------------------------------------


@dataclass
class Transfer:
    """One mode's transfer in one round."""

    mode: str
    nbytes: int
    seconds: float
    send_user: float
    send_sys: float
    recv_user: float
    recv_sys: float
    #: bytes a loop's ``write`` left queued (the kernel did not take them at once)
    deferred: int = 0


def _blocking_transfer(
    mode: str, sock: socket.socket, chunks: Sequence[Sealed], nbytes: int, piece: int
) -> Transfer:
    sock.sendall(LENGTH.pack(nbytes))
    t0, cpu0 = time.perf_counter(), _thread_cpu()
    if mode == "send":
        for ch, off, n in _slices(chunks, nbytes, piece):
            sock.sendall(ch.view[off : off + n])
    else:
        out = sock.fileno()
        for ch, off, n in _slices(chunks, nbytes, piece):
            while n:
                sent = os.sendfile(out, ch.fd, off, n)
                off, n = off + sent, n - sent
    answer = _recv_exactly(sock, ANSWER.size)
    cpu1, seconds = _thread_cpu(), time.perf_counter() - t0
    (user, system), (ruser, rsystem) = _cpu_between(cpu0, cpu1), ANSWER.unpack(answer)
    return Transfer(mode, nbytes, seconds, user, system, ruser, rsystem)


class _Source(FlowControl):
    """The sender's end on a loop: flow control as ``storaged.peer``'s connections have it
    (``FlowControl``) and the receiver's answer, or the copy check's bytes, collected."""

    def __init__(self, high: int) -> None:
        super().__init__()
        self._high = high
        self.transport: asyncio.Transport | None = None
        self.answer = bytearray()
        self._want = 0
        self._answered: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        assert self.transport is not None
        self.transport.set_write_buffer_limits(high=self._high)

    def expect(self, n: int) -> asyncio.Future[bytes]:
        self.answer.clear()
        self._want = n
        self._answered = asyncio.get_running_loop().create_future()
        return self._answered

    def data_received(self, data: bytes) -> None:
        self.answer += data
        fut = self._answered
        if fut is not None and not fut.done() and len(self.answer) >= self._want:
            fut.set_result(bytes(self.answer[: self._want]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for fut in (self._resumed, self._answered):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError(f"receiver went away: {exc!r}"))


async def _loop_transfer(
    mode: str, proto: _Source, chunks: Sequence[Sealed], nbytes: int, piece: int
) -> Transfer:
    transport = proto.transport
    assert transport is not None
    answered = proto.expect(ANSWER.size)
    transport.write(LENGTH.pack(nbytes))
    deferred = 0
    t0, cpu0 = time.perf_counter(), _thread_cpu()
    for ch, off, n in _slices(chunks, nbytes, piece):
        # As PutStream.write: the slice to the transport, then wait while it is paused.
        before = transport.get_write_buffer_size()
        transport.write(ch.view[off : off + n])
        deferred += transport.get_write_buffer_size() - before
        if proto.paused:
            await proto.drain()
    answer = await answered
    cpu1, seconds = _thread_cpu(), time.perf_counter() - t0
    (user, system), (ruser, rsystem) = _cpu_between(cpu0, cpu1), ANSWER.unpack(answer)
    return Transfer(mode, nbytes, seconds, user, system, ruser, rsystem, deferred)


async def _open_source(port: int, high: int) -> _Source:
    _, proto = await asyncio.get_running_loop().create_connection(lambda: _Source(high), HOST, port)
    return proto


# -- the copy check -------------------------------------------------------------------------------


async def copy_check(nbytes: int = CHECK_BYTES) -> dict[str, int]:
    """Write ``nbytes`` of b"A" to this loop's transport towards a socket nobody reads yet,
    overwrite them with b"B" as soon as ``write`` returns, then read everything out.

    ``deferred``: the bytes ``write`` left queued; ``arrived_as_written``: the b"A" bytes
    read out; ``copied``: those of them beyond what the kernel took at once (so copied by
    the loop into its own buffer before the overwrite)."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]
    with listener:
        client = await loop.run_in_executor(None, socket.create_connection, (HOST, port))
        server, _ = listener.accept()
    with server:
        _, proto = await loop.create_connection(lambda: _Source(nbytes), sock=client)
        transport = proto.transport
        assert transport is not None
        data = bytearray(b"A") * nbytes
        transport.write(memoryview(data))
        deferred = transport.get_write_buffer_size()
        data[:] = b"B" * nbytes  # the caller reuses its memory while the loop still holds it

        def read_all() -> bytes:
            got = bytearray()
            while len(got) < nbytes:
                piece = server.recv(min(nbytes - len(got), 4 * MiB))
                if not piece:
                    break
                got += piece
            return bytes(got)

        received = await loop.run_in_executor(None, read_all)
        transport.close()
    as_written = received.count(b"A")
    return {
        "bytes": nbytes,
        "received": len(received),
        "deferred": deferred,
        "arrived_as_written": as_written,
        "copied": as_written - (nbytes - deferred),
    }


# -- where the sender's CPU goes (perf) ---------------------------------------------------------

#: (category, leaf symbols): the copies a send can make, first match wins
COPY_SYMBOLS = (
    ("kernel copy from the caller's pages into socket buffers",
     re.compile(r"^(_copy_from_iter|copy_user_\w+|rep_movs_alternative|copy_from_user\w*)$")),
    ("user-space copies (memcpy, memmove)", re.compile(r"^__(memmove|memcpy)\w*$")),
)  # fmt: skip
_PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+\[([k.])\]\s+(\S.*?)\s*$")


def summarize_perf_report(text: str, top: int = 8) -> dict[str, Any]:
    """From ``perf report --stdio --no-children --sort sym``: each ``COPY_SYMBOLS`` category's
    share of the samples (0..1), the rest as "other", and the ``top`` symbols."""
    shares: dict[str, float] = {name: 0.0 for name, _ in COPY_SYMBOLS}
    shares["other"] = 0.0
    symbols: list[tuple[str, float]] = []
    for line in text.splitlines():
        m = _PERF_LINE.match(line)
        if m is None:
            continue
        share, sym = float(m.group(1)) / 100, m.group(3)
        symbols.append((f"[{m.group(2)}] {sym}", share))
        name = next((n for n, rx in COPY_SYMBOLS if rx.match(sym)), "other")
        shares[name] += share
    return {
        "shares": {k: round(v, 4) for k, v in shares.items()},
        "top": [[sym, round(share, 4)] for sym, share in symbols[:top]],
    }


def perf_transfer(transfer: Callable[[], object], path: Path) -> dict[str, Any] | None:
    """``transfer()`` with ``perf record`` (cpu-clock, 1999 Hz) on this process: the sender
    alone, all its threads. None when perf is missing or fails."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    rec = subprocess.Popen(
        [perf, "record", "-F", "1999", "-p", str(os.getpid()), "-o", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.5)  # perf attaches; the wait itself samples nothing (idle)
        transfer()
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    report = subprocess.run(
        [perf, "report", "-i", str(path), "--stdio", "--no-children", "--sort", "sym"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if rec.returncode not in (0, -signal.SIGINT) or report.returncode != 0:
        return None
    return summarize_perf_report(report.stdout)


# -- the rounds -----------------------------------------------------------------------------------


def _per_gb(t: Transfer) -> dict[str, float]:
    gb = t.nbytes / GB
    return {
        "gbps": round(gb / t.seconds, 4),
        "send_cpu_s_per_gb": round((t.send_user + t.send_sys) / gb, 4),
        "send_user_s_per_gb": round(t.send_user / gb, 4),
        "send_sys_s_per_gb": round(t.send_sys / gb, 4),
        "recv_cpu_s_per_gb": round((t.recv_user + t.recv_sys) / gb, 4),
        "deferred_share": round(t.deferred / t.nbytes, 4),
    }


FIGURES = (
    "gbps", "send_cpu_s_per_gb", "send_user_s_per_gb", "send_sys_s_per_gb",
    "recv_cpu_s_per_gb", "deferred_share",
)  # fmt: skip
#: figures whose per-round ratio to the baseline is reported
RATIOS = ("gbps", "send_cpu_s_per_gb", "recv_cpu_s_per_gb")


def summarize(rounds: list[dict[str, dict[str, float]]], modes: Sequence[str]) -> dict[str, Any]:
    """Per mode and figure: median, min, max over ``rounds`` (each {mode: figures}); and
    per figure of ``RATIOS`` the median over rounds of the round's ratio to ``BASELINE``."""
    out: dict[str, Any] = {}
    for mode in modes:
        figs: dict[str, Any] = {}
        for fig in FIGURES:
            values = [r[mode][fig] for r in rounds]
            figs[fig] = {
                "median": round(statistics.median(values), 4),
                "min": min(values),
                "max": max(values),
            }
        if BASELINE in modes:
            figs["x_send"] = {
                fig: round(statistics.median(r[mode][fig] / r[BASELINE][fig] for r in rounds), 3)
                for fig in RATIOS
            }
        out[mode] = figs
    return out


def _rotated(modes: Sequence[str], k: int) -> list[str]:
    k %= len(modes)
    return [*modes[k:], *modes[:k]]


def run(
    port: int,
    modes: Sequence[str],
    chunk: int,
    count: int,
    nbytes: int,
    piece: int,
    high: int,
    rounds: int,
    progress: Callable[[str], None] = lambda _: None,
    perf_dir: Path | None = None,
) -> tuple[dict[str, dict[str, int]], list[dict[str, dict[str, float]]], dict[str, Any]]:
    """The copy checks, then ``rounds`` rounds of every mode (plus one warm-up transfer
    each, not kept), then with ``perf_dir`` one more transfer of each mode under perf;
    returns (checks by loop, the rounds' figures by mode, the profiles by mode)."""
    runners = {
        "uvloop": asyncio.Runner(loop_factory=lambda: new_loop("uvloop")),
        "asyncio": asyncio.Runner(loop_factory=lambda: new_loop("asyncio")),
    }
    tier = MemoryTier(count * chunk * 2)
    fds: list[int] = []
    socks: dict[str, socket.socket] = {}
    try:
        uv = runners["uvloop"]
        chunks = uv.run(_sealed_chunks(tier, chunk, count))
        fds = [c.fd for c in chunks]
        checks = {name: runner.run(copy_check()) for name, runner in runners.items()}
        sources = {m: runners[m].run(_open_source(port, high)) for m in modes if m in runners}
        for m in modes:
            if m not in runners:
                socks[m] = socket.create_connection((HOST, port))

        def transfer(mode: str, size: int) -> Transfer:
            if mode in runners:
                return runners[mode].run(_loop_transfer(mode, sources[mode], chunks, size, piece))
            return _blocking_transfer(mode, socks[mode], chunks, size, piece)

        for mode in modes:  # warm-up: the connections' buffers grow, first touches happen
            transfer(mode, min(nbytes, 4 * chunk))
        results: list[dict[str, dict[str, float]]] = []
        for rnd in range(rounds):
            figures = {m: _per_gb(transfer(m, nbytes)) for m in _rotated(modes, rnd)}
            results.append({m: figures[m] for m in modes})
            progress(
                f"# round {rnd + 1}: "
                + ", ".join(f"{m} {figures[m]['send_cpu_s_per_gb']:.3f}" for m in modes)
                + " sender CPU s/GB"
            )
        profiles: dict[str, Any] = {}
        if perf_dir is not None:
            for m in modes:
                profiles[m] = perf_transfer(
                    partial(transfer, m, nbytes), perf_dir / f"sendcopy-{m}.perf.data"
                )
        for proto in sources.values():
            if proto.transport is not None:
                proto.transport.close()
        return checks, results, profiles
    finally:
        for s in socks.values():
            s.close()
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(Exception):
            runners["uvloop"].run(tier.close())
        for runner in runners.values():
            runner.close()


def _table(summary: dict[str, Any], modes: Sequence[str]) -> str:
    head = ("mode", "sender CPU s/GB", "x send", "user / sys", "receiver CPU s/GB", "x send",
            "GB/s", "deferred")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for mode in modes:
        s = summary[mode]

        def span(fig: str, fmt: str = ".3f", s: dict[str, Any] = s) -> str:
            f = s[fig]
            return f"{f['median']:{fmt}} ({f['min']:{fmt}}-{f['max']:{fmt}})"

        x = s.get("x_send", {})
        lines.append(
            f"| {mode} | {span('send_cpu_s_per_gb')} | {x.get('send_cpu_s_per_gb', '-')} "
            f"| {s['send_user_s_per_gb']['median']:.3f} / {s['send_sys_s_per_gb']['median']:.3f} "
            f"| {span('recv_cpu_s_per_gb')} | {x.get('recv_cpu_s_per_gb', '-')} "
            f"| {span('gbps', '.2f')} | {s['deferred_share']['median'] * 100:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from loadtest.harness.loopback import spawn_server, stop_server

    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sendcopy", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--chunk-mib", type=float, default=8.0)
    parser.add_argument("--chunks", type=int, default=8, help="distinct sealed chunks, cycled")
    parser.add_argument("--mib", type=float, default=512.0, help="MiB per transfer")
    parser.add_argument("--slice-kib", type=int, default=1024, help="bytes per write or sendfile")
    parser.add_argument("--write-buffer-kib", type=int, default=1024, help="loops' high-water mark")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--perf",
        action="store_true",
        help="then one more transfer of each mode under perf record: the copies' share",
    )
    parser.add_argument("--quick", action="store_true", help="32 MiB transfers, 3 rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "sendcopy.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = min(args.mib, 32.0), min(args.rounds, 3)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) < len(modes):
        parser.error(f"--modes takes a subset of {','.join(MODES)}")
    chunk, nbytes, piece = int(args.chunk_mib * MiB), int(args.mib * MiB), args.slice_kib << 10
    if chunk < 1 or nbytes < chunk or piece < 1 or args.chunks < 1 or args.rounds < 1:
        parser.error("--chunk-mib, --chunks, --slice-kib and --rounds must be positive, "
                     "--mib at least one chunk")  # fmt: skip
    command = "python -m loadtest.sendcopy " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}".rstrip(), flush=True)
    load_before = os.getloadavg()
    proc, port = spawn_server(serve_receiver)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        checks, rounds, profiles = run(port, modes, chunk, args.chunks, nbytes, piece,
                                       args.write_buffer_kib << 10, args.rounds,
                                       lambda line: print(line, flush=True),
                                       args.out.parent if args.perf else None)  # fmt: skip
    finally:
        stop_server(proc)
    summary = summarize(rounds, modes)
    for name, check in checks.items():
        print(f"# copy check, {name}: {check['deferred']} of {check['bytes']} bytes deferred by "
              f"write, {check['copied']} of them copied by the loop")  # fmt: skip
    print(f"# {args.mib:g} MiB per transfer as {args.chunk_mib:g} MiB sealed chunks, "
          f"{args.slice_kib} KiB slices; median (min-max) of {args.rounds} rounds; "
          f"x send: median of each round's ratio")  # fmt: skip
    print(_table(summary, modes))
    for mode, profile in profiles.items():
        if profile is None:
            print(f"# perf, {mode}: no profile (perf missing or refused)")
            continue
        shares = profile["shares"].items()
        print(f"# perf, {mode}, the sender's samples: "
              + ", ".join(f"{share * 100:.1f} % {name}" for name, share in shares))  # fmt: skip
    result = {
        "command": command,
        "machine": run_machine(load_before),
        "settings": {"chunk_bytes": chunk, "chunks": args.chunks, "transfer_bytes": nbytes,
                     "slice_bytes": piece, "write_buffer": args.write_buffer_kib << 10,
                     "rounds": args.rounds, "modes": modes, "baseline": BASELINE},
        "copy_check": checks,
        "rounds": rounds,
        "summary": summary,
        "perf": profiles,
    }  # fmt: skip
    return finish(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
