"""The stall a training loop sees per checkpoint, lazy saves against today's:
``python -m loadtest.lazy_save [--quick]``.

A loop of steps on the main thread: a simulated forward and backward pass (a sleep of
fixed length, at least three copies of the state long: ``--fb-ms``, or that by default)
and a ``torch.optim.SGD`` step that changes every parameter, so that every checkpoint is
fresh bytes (the same bytes twice would measure dedup). The saver's event loop runs on a
thread of its own, as in a trainer. Every ``--every`` steps a checkpoint, in each mode:

- **save**: today's ``AsyncSaver.save``: the stall is the call (the copy into staging);
- **lazy**: ``save(lazy=True)`` and ``hold_optimizer``: the stall is the call plus the
  time the next step's pre-hook waited for the copy (it runs during the forward pass);
- **save, budget** and **lazy, budget**: the same with ``staging_budget`` a quarter of the
  state: staged in waves, each uploaded before a later one reuses its buffer.

Between two checkpoints the loop waits, untimed, for the previous one's ack, so that the
stall is the copy's and not backpressure from a slow upload. Beside them, one memcpy of
the whole state into a reused buffer (``np.copyto``), measured in the same run: each
stall is reported as a ratio to it (the target for lazy: at most 0.1; the median of the
memcpy before the run and before each mode). A lazy stall is mostly the ``save`` call's
trip to the saver's loop thread and back: on a loaded machine that thread's wake-up, not
the copy, is what the ratio shows for small states (``--quick``). Each stall is also
given as its two parts, the ``save`` call (and of it, the save's own time on the saver's
loop: the rest is the two thread hops) and the step's wait in the hook, and a lazy
save's copy (from the call until ``staged``, seen from the saver's loop) beside the
forward+backward it must fit in. The peak RSS
growth of this process during each mode's checkpoints (VmHWM after a reset through
/proc/self/clear_refs) is reported against the staging budget. The last checkpoint of
each mode is restored and compared with the parameters at the step it was taken at.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from loadtest.harness.cluster import TOKEN, start_cluster
from loadtest.harness.machine import new_loop
from loadtest.harness.report import RESULTS, markdown_table
from loadtest.harness.state_dict import digest_arrays
from storaged.client import AsyncSaver, Client, restore_checkpoint

MiB = 1 << 20
MODES = ("save", "lazy", "save, budget", "lazy, budget")
T = TypeVar("T")


def _kib(field: str) -> int | None:
    try:
        found = re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _reset_peak() -> int | None:
    """Reset VmHWM to the current RSS (Linux); the RSS in bytes, None where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _kib("VmRSS")
    return None if rss is None else rss * 1024


class Trainer:
    """Parameters, an optimizer whose step moves every one, and the saver's loop thread."""

    def __init__(self, size: int, tensors: int, loop: asyncio.AbstractEventLoop) -> None:
        import torch

        torch.manual_seed(0)
        per = size // tensors // 4
        self.params = [torch.nn.Parameter(torch.randn(per)) for _ in range(tensors)]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-3)
        self.optimizer = torch.optim.SGD(self.params, lr=1.0)
        self.optimizer.step()  # torch's imports for a first step, before any timing
        self.loop = loop
        self.waited = 0.0
        self._before = 0.0

    def state(self) -> dict[str, Any]:
        """The parameters as numpy views of their memory: what a saver copies."""
        return {f"p{i}": p.detach().numpy() for i, p in enumerate(self.params)}

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def time_hooks(self, saver: AsyncSaver) -> list[Any]:
        """Hooks around the saver's: the time its pre-hook held the step lands in ``waited``."""

        def before(*_: Any) -> None:
            self._before = time.perf_counter()

        def after(*_: Any) -> None:
            self.waited += time.perf_counter() - self._before

        first = self.optimizer.register_step_pre_hook(before)
        held = saver.hold_optimizer(self.optimizer)
        return [first, held, self.optimizer.register_step_pre_hook(after)]


async def _timed_save(
    saver: AsyncSaver, name: str, state: dict[str, Any], lazy: bool
) -> tuple[Any, float]:
    """``saver.save`` and the seconds it took on the loop: the rest of the caller's wait is
    the two thread hops (to the saver's loop and back)."""
    began = time.perf_counter()
    handle = await saver.save(name, {0: state}, lazy=lazy)
    return handle, time.perf_counter() - began


def _copied(into: list[float], began: float, _: Any) -> None:
    into.append(time.perf_counter() - began)


def memcpy_seconds(state: dict[str, Any], rounds: int) -> float:
    """The median time of one copy of the whole state into a reused buffer."""
    total = sum(a.nbytes for a in state.values())
    buffer = np.empty(total, np.uint8)
    buffer[:] = 1
    times = []
    for _ in range(rounds):
        t0, pos = time.perf_counter(), 0
        for a in state.values():
            np.copyto(buffer[pos : pos + a.nbytes], a.reshape(-1).view(np.uint8))
            pos += a.nbytes
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_mode(
    trainer: Trainer, client: Client, mode: str, args: argparse.Namespace, fb: float, size: int
) -> dict[str, Any]:
    lazy = mode.startswith("lazy")
    budget = size // 4 if mode.endswith("budget") else None

    async def make() -> AsyncSaver:
        saver = AsyncSaver(client, staging_budget=budget)
        await saver.prepare({0: trainer.state()})
        return saver

    saver = trainer.call(make())
    hooks = trainer.time_hooks(saver) if lazy else []
    stalls: list[float] = []
    calls: list[float] = []  # the save() call alone; a lazy stall adds the step's wait
    copied: list[float] = []  # a lazy save's copy: from the call until staged
    in_loop: list[float] = []  # of a call, the save's own time on the saver's loop
    base = _reset_peak()
    digest, name, handle, after_save = "", "", None, False
    # One step more than the checkpoints need: the last one's copy is waited for too.
    for step in range(1, args.checkpoints * args.every + 2):
        time.sleep(fb)  # forward and backward (a lazy copy runs meanwhile): only reads
        trainer.waited = 0.0
        trainer.optimizer.step()
        if after_save:  # the step right after a lazy checkpoint: what its hook held it
            stalls[-1] += trainer.waited
            after_save = False
        if step % args.every or len(stalls) == args.checkpoints:
            continue
        if handle is not None:  # untimed: this checkpoint starts unhindered by the last
            trainer.call(handle.acked())
        name = f"lazy-bench/{mode.replace(', ', '-')}/{step}"
        digest = digest_arrays(list(trainer.state().values()))
        t0 = time.perf_counter()
        handle, inside = trainer.call(_timed_save(saver, name, trainer.state(), lazy))
        stalls.append(time.perf_counter() - t0)
        calls.append(stalls[-1])
        in_loop.append(inside)
        after_save = lazy
        if lazy:  # when its copy was done (seen from the saver's loop): against the fb
            staged = asyncio.run_coroutine_threadsafe(handle.staged(), trainer.loop)
            staged.add_done_callback(functools.partial(_copied, copied, t0))
    assert handle is not None
    trainer.call(handle.acked())
    peak = _kib("VmHWM")
    for hook in hooks:
        hook.remove()
    trainer.call(saver.aclose())
    back = trainer.call(restore_checkpoint(client, name))
    restored = digest_arrays([back[f"p{i}"] for i in range(len(trainer.params))])
    return {
        "stalls_s": stalls,
        "calls_s": calls,
        "held_s": [stall - call for stall, call in zip(stalls, calls, strict=True)],
        "copy_s": copied,
        "in_loop_s": in_loop,
        "budget": budget,
        "peak_rss_growth": None if base is None or peak is None else peak * 1024 - base,
        "verified": restored == digest,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="state, MiB (256)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--checkpoints", type=int, default=4, help="per mode (4)")
    parser.add_argument("--every", type=int, default=3, help="steps per checkpoint (3)")
    parser.add_argument("--fb-ms", type=float, default=None, help="forward+backward, ms")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 checkpoints a mode")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.checkpoints, args.every = 16, 2, 2
    size = args.size * MiB
    root = Path(tempfile.mkdtemp(prefix="storaged-lazy-"))
    cluster = start_cluster(root / "cluster", 4, memory=f"{max(512, 3 * args.size)}MiB")
    loop = new_loop()
    thread = threading.Thread(target=loop.run_forever, name="saver-loop", daemon=True)
    thread.start()
    try:
        trainer = Trainer(size, args.tensors, loop)
        copies = [memcpy_seconds(trainer.state(), 5)]
        fb = args.fb_ms / 1000 if args.fb_ms is not None else max(0.05, 3 * copies[0])
        client = trainer.call(_open(cluster.urls))
        results = {}
        for mode in MODES:  # the memcpy again before each mode: the machine's load drifts
            copies.append(memcpy_seconds(trainer.state(), 3))
            results[mode] = run_mode(trainer, client, mode, args, fb, size)
        trainer.call(client.close())
        memcpy = statistics.median(copies)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    doc = report(results, memcpy, fb, size, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lazy_save.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out / 'lazy_save.json'}")
    return 0 if all(r["verified"] for r in results.values()) else 1


async def _open(urls: Sequence[str]) -> Client:
    client = Client(list(urls), token=TOKEN)
    await client.open()
    return client


def report(
    results: dict[str, dict[str, Any]],
    memcpy: float,
    fb: float,
    size: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    rows = []
    for mode, r in results.items():
        med = statistics.median(r["stalls_s"])
        growth = r["peak_rss_growth"]
        rows.append([
            mode, f"{med * 1000:.1f}", f"{min(r['stalls_s']) * 1000:.1f}-"
            f"{max(r['stalls_s']) * 1000:.1f}",
            f"{statistics.median(r['calls_s']) * 1000:.1f} "
            f"({statistics.median(r['in_loop_s']) * 1000:.1f}) / "
            f"{statistics.median(r['held_s']) * 1000:.1f}", f"{med / memcpy:.3f}",
            "-" if r["budget"] is None else f"{r['budget'] / MiB:.0f}",
            "-" if growth is None else f"{growth / MiB:.0f}", str(r["verified"]),
        ])  # fmt: skip
    print(f"# stall per checkpoint of {size / MiB:.0f} MiB ({args.tensors} tensors), "
          f"{args.checkpoints} checkpoints a mode, forward+backward {fb * 1000:.0f} ms; "
          f"one memcpy of the state {memcpy * 1000:.1f} ms")  # fmt: skip
    print(markdown_table(
        ["mode", "stall ms median", "min-max", "call (on the loop) / step held ms, medians",
         "x memcpy",
         "budget MiB",
         "peak RSS growth MiB", "restored = saved"], rows))  # fmt: skip
    copies = results["lazy"]["copy_s"]
    if copies:
        print(f"lazy copy (call until staged) {statistics.median(copies) * 1000:.1f} ms median, "
              f"{min(copies) * 1000:.1f}-{max(copies) * 1000:.1f}; forward+backward "
              f"{fb * 1000:.0f} ms")  # fmt: skip
    lazy, today = (statistics.median(results[m]["stalls_s"]) for m in ("lazy", "save"))
    print(f"lazy / memcpy {lazy / memcpy:.3f} (target <= 0.1); save / memcpy "
          f"{today / memcpy:.3f}; lazy / save {lazy / today:.3f}")  # fmt: skip
    return {
        "size": size,
        "tensors": args.tensors,
        "forward_backward_s": fb,
        "memcpy_s": memcpy,
        "modes": results,
        "ratios": {mode: statistics.median(r["stalls_s"]) / memcpy for mode, r in results.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
