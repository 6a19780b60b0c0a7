"""``Stopwatch``/``Window``: wall seconds of a timed stretch, the CPU seconds of this process
and of the nodes in it, and how busy the whole machine was (a shared machine's other work
shows there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.harness.machine import GB, proc_cpu_seconds

CORES = os.cpu_count() or 1


def machine_jiffies() -> tuple[int, int, int]:
    """(busy, iowait, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    total = sum(ticks[:8])
    return total - ticks[3] - ticks[4], ticks[4], total


@dataclass
class Window:
    """One timed stretch: wall seconds, the CPU seconds each of our processes spent in it,
    and how busy the whole machine was (other work on a shared machine shows there)."""

    seconds: float
    client_cpu: float
    node_cpu: list[float] = field(default_factory=list)
    #: share of all cores busy with anything (ours and others'), and waiting for disk
    machine_busy: float = 0.0
    machine_iowait: float = 0.0

    @property
    def cpu(self) -> float:
        return self.client_cpu + sum(self.node_cpu)

    def busy(self) -> float:
        """Share of all cores busy with this process and the nodes (1.0: every core)."""
        return self.cpu / self.seconds / CORES if self.seconds > 0 else 0.0

    def cpu_per_gb(self, nbytes: int) -> float:
        return self.cpu / (nbytes / GB)

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 4),
            "client_cpu_s": round(self.client_cpu, 3),
            "node_cpu_s": [round(c, 3) for c in self.node_cpu],
            "busy_share_of_cores": round(self.busy(), 3),
            "machine_busy_share": round(self.machine_busy, 3),
            "machine_iowait_share": round(self.machine_iowait, 3),
        }


class Stopwatch:
    """Starts now; ``lap()`` is the Window from the start to now."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self.nodes0 = [proc_cpu_seconds(p) for p in self.pids]
        self.machine0 = machine_jiffies()
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def lap(self) -> Window:
        seconds = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0
        nodes = [proc_cpu_seconds(p) - c for p, c in zip(self.pids, self.nodes0, strict=True)]
        busy, iowait, total = (b - a for a, b in zip(self.machine0, machine_jiffies(), strict=True))
        total = max(total, 1)
        return Window(seconds, cpu, nodes, busy / total, iowait / total)
