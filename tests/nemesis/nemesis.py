"""The nemesis: faults drawn from the seed, injected while the writers run.

Faults (each lasts a drawn 1-3 s unless said otherwise, then is undone):

- ``kill9``: SIGKILL of one or two nodes (RAM copies lost), restarted after the fault.
- ``term_restart``: SIGTERM (a graceful stop must drain RAM first: I5), then a restart.
- ``pause``: SIGSTOP, then SIGCONT (peers see a node that neither answers nor closes).
- ``flip``: SIGKILL, a byte flipped in the header of some files and in the payload of
  every file under the node's ``nvme/`` and ``cold/``, restart.
- ``full_disk``: the small-disk node's tmpfs nvme and cold mounts filled to the brim.
- ``partition``: one or two nodes cut off from the others on the peer links (DROP after
  resetting open connections, or BLACKHOLE); clients still reach every node.
- ``delay``: a few peer links delay every piece by 20-200 ms.
- ``etcd_member`` (only when the nodes coordinate through etcd): one member of the 3-member
  etcd killed (SIGKILL) or stopped (SIGSTOP), then started again or continued. These come
  on a schedule of their own (every ``etcd_gap`` s, drawn from the seed's own stream, so
  the node faults' draws are those of the embedded runs), overlapping the node faults; one
  member at a time, so etcd keeps its quorum; the node budget below does not count them.

At most ``replication - 1`` nodes are impaired at once (killed, stopped, flipped, full,
partitioned): the failure model the cluster promises to survive. A node whose data was
lost (kill -9, flips) still counts as impaired after its restart, for ``settle`` seconds
and then until the nodes' repair passes report nothing left to repair (``repair_backlog``
in ``/v1/cluster``; ``settle_max`` at most), so that losses of successive faults do not
add up beyond that model before repair has acted. The first faults go through every
kind once (in a seeded order), so that even a short run sees each; then kinds and
targets are drawn from the seed. The sequence of draws is seeded; its timing against
the workload is not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import signal
import subprocess
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path

from erasure import HEADER_SIZE as FRAGMENT_HEADER_SIZE
from storaged.cluster import ClusterError
from tests.etcd import EtcdCluster
from tests.nemesis.cluster import DISK_TIERS, NemesisCluster
from tests.nemesis.history import History
from tests.nemesis.proxy import Link, LinkMode
from tiers._durable import HEADER_SIZE as FILE_HEADER_SIZE

KINDS = ("kill9", "term_restart", "pause", "flip", "full_disk", "partition", "delay")
WEIGHTS = {
    "kill9": 3,
    "term_restart": 2,
    "pause": 2,
    "flip": 1,
    "full_disk": 1,
    "partition": 3,
    "delay": 2,
}


@dataclass(frozen=True, slots=True)
class NemesisShape:
    duration: tuple[float, float] = (1.0, 3.0)
    gap: tuple[float, float] = (0.3, 1.2)
    settle: float = 6.0
    #: a node that lost data counts as impaired until repair is done, or this long at most
    settle_max: float = 60.0
    #: faults start after ``warm_acks`` acknowledged commits, or ``warmup`` seconds
    warm_acks: int = 3
    warmup: float = 20.0
    restart_timeout: float = 60.0
    #: time between the end of one etcd member fault and the next (etcd mode only)
    etcd_gap: tuple[float, float] = (2.0, 6.0)


def flip_files(root: Path, rng: random.Random) -> int:
    """Flip bytes in every value file under ``root``'s tiers: always in the payload (where a
    header check cannot see it), in the file header of about a third. Returns files hit."""
    hit = 0
    for tier in DISK_TIERS:
        for path in sorted((root / tier).rglob("*")):
            rel = path.relative_to(root / tier).parts
            if not path.is_file() or len(rel) != 3 or rel[-1].startswith("."):
                continue  # the lock, the fill file, temp files, quarantine/
            size = path.stat().st_size
            start = FILE_HEADER_SIZE + (FRAGMENT_HEADER_SIZE if tier == "cold" else 0)
            if size <= start:
                continue
            offsets = {rng.randrange(start, size), start + (size - start) // 2}
            if rng.random() < 0.3:
                offsets.add(rng.randrange(0, FILE_HEADER_SIZE))
            with open(path, "r+b") as f:
                for offset in sorted(offsets):
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
            hit += 1
    return hit


class Nemesis:
    def __init__(
        self,
        cluster: NemesisCluster,
        history: History,
        shape: NemesisShape,
        *,
        full_disk: bool,
        etcd: EtcdCluster | None = None,
    ) -> None:
        self.cluster = cluster
        self.etcd = etcd
        self.history = history
        self.shape = shape
        self.rng = random.Random(f"{history.seed}/nemesis")
        self.kinds = [k for k in KINDS if full_disk or k != "full_disk"]
        self.etcd_rng = random.Random(f"{history.seed}/etcd")
        self.budget = cluster.replication - 1
        #: node -> monotonic time until which it counts as impaired (inf while a fault runs)
        self.impaired: dict[int, float] = {}
        #: link -> the fault that set its mode (a partition takes links over from a delay)
        self.link_owner: dict[Link, int] = {}
        self.injected: collections.Counter[str] = collections.Counter()
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._fault_ids = 0

    @property
    def faults(self) -> int:
        return sum(self.injected.values())

    # ---- the schedule --------------------------------------------------------------------
    async def run(self) -> None:
        # Faults begin once the writers have committed something: a flip or a full disk on
        # an empty cluster tests nothing.
        for _ in range(int(self.shape.warmup / 0.1)):
            if self.stopping.is_set() or self.history.counts["acked"] >= self.shape.warm_acks:
                break
            await asyncio.sleep(0.1)
        if self.etcd is not None:
            self._spawn(self._etcd_faults())
        first = list(self.kinds)
        self.rng.shuffle(first)
        names = list(WEIGHTS)
        weights = [WEIGHTS[k] if k in self.kinds else 0 for k in names]
        while not self.stopping.is_set():
            kind = first[0] if first else self.rng.choices(names, weights)[0]
            if self._launch(kind):
                if first:
                    first.pop(0)
                await self._sleep(self.rng.uniform(*self.shape.gap))
            else:
                await self._sleep(0.25)  # no room: wait for a fault to end

    async def finish(self) -> None:
        """Stop injecting, undo every fault, and bring every node back."""
        self.stopping.set()
        if self._tasks:
            await asyncio.gather(*list(self._tasks))
        assert self.cluster.proxies is not None
        await self.cluster.proxies.heal_all()
        await asyncio.to_thread(self.cluster.free_small_disk)
        for i in range(self.cluster.nodes):
            self.cluster.signal_node(i, signal.SIGCONT)
            if not self.cluster.alive(i):
                await self._restart(i)
        if self.etcd is not None:
            for m in self.etcd.members:
                self.etcd.resume(m.index)
                if not self.etcd.running(m.index):
                    await self._etcd_restart(m.index)
        self.history.note(f"nemesis: stopped after {self.faults} faults {dict(self.injected)}")

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    def _free(self) -> list[int]:
        now = time.monotonic()
        for i, until in list(self.impaired.items()):
            if until <= now:
                del self.impaired[i]
        return [i for i in range(self.cluster.nodes) if i not in self.impaired]

    def _room(self) -> int:
        self._free()
        return self.budget - len(self.impaired)

    def _take(self, count: int, among: list[int] | None = None) -> list[int]:
        free = self._free() if among is None else [i for i in among if i in self._free()]
        nodes = sorted(self.rng.sample(free, min(count, len(free))))
        for i in nodes:
            self.impaired[i] = math.inf
        return nodes

    def _release(self, nodes: list[int], hold: float = 0.0) -> None:
        if hold <= 0:
            for i in nodes:
                self.impaired[i] = time.monotonic()
            return
        # Lost data stays lost until repair has put it back: the node counts as impaired
        # until then (at least ``hold`` s, so that the scrubber has found what was flipped),
        # or the failure model would be exceeded by faults that only add up over time.
        task = asyncio.create_task(self._settle(nodes, hold))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, nodes: list[int], hold: float) -> None:
        try:
            await self._sleep(hold)
            deadline = time.monotonic() + self.shape.settle_max
            quiet = 0
            while quiet < 2 and time.monotonic() < deadline and not self.stopping.is_set():
                backlog = await asyncio.to_thread(self._repair_backlog)
                quiet = quiet + 1 if backlog == 0 else 0
                await self._sleep(1.0)
        finally:
            for i in nodes:
                self.impaired[i] = time.monotonic()

    def _repair_backlog(self) -> int | None:
        """Chunks the nodes' last repair passes found short of copies or fragments (None
        when no node answers)."""
        for i in range(self.cluster.nodes):
            if not self.cluster.alive(i):
                continue
            request = urllib.request.Request(
                self.cluster.url(i) + "/v1/cluster",
                headers={
                    "Accept": "application/json",
                    "Authorization": f"Bearer {self.cluster.token}",
                },
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    doc = json.loads(resp.read())
            except (OSError, ValueError):
                continue
            return sum(int(n.get("repair_backlog") or 0) for n in doc["nodes"] if n["alive"])
        return None

    def _launch(self, kind: str) -> bool:
        room = self._room()
        if kind != "delay" and room < 1:
            return False
        if kind == "full_disk":
            target = self.cluster.small_disk
            if target is None or target not in self._free():
                return False
            coro = self._full_disk(self._take(1, [target]))
        elif kind == "kill9":
            coro = self._kill9(self._take(self.rng.randint(1, room)))
        elif kind == "partition":
            coro = self._partition(self._take(self.rng.randint(1, room)))
        elif kind == "delay":
            coro = self._delay()
        else:
            node = self._take(1)
            coro = {"term_restart": self._term_restart, "pause": self._pause, "flip": self._flip}[
                kind
            ](node)
        self._count(kind)
        self._spawn(coro)
        return True

    def _count(self, kind: str) -> None:
        self.injected[kind] += 1
        self.history.counts[f"fault {kind}"] += 1

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _names(self, nodes: list[int]) -> str:
        return ",".join(self.cluster.node_id(i) for i in nodes)

    def _duration(self) -> float:
        return self.rng.uniform(*self.shape.duration)

    # ---- the faults ----------------------------------------------------------------------
    async def _restart(self, i: int) -> None:
        for attempt in range(2):
            try:
                await asyncio.to_thread(self.cluster.start_node, i)
                await asyncio.to_thread(self.cluster.wait_healthy, [i], self.shape.restart_timeout)
                self.history.note(f"nemesis: {self.cluster.node_id(i)} restarted")
                return
            except ClusterError as exc:
                self.history.violate(
                    "restart", f"{self.cluster.node_id(i)} did not come back (try {attempt}): {exc}"
                )
                self.cluster.signal_node(i, signal.SIGKILL)
                await asyncio.to_thread(self._reap, i)

    def _reap(self, i: int) -> None:
        proc = self.cluster.procs.get(i)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)

    async def _kill9(self, nodes: list[int]) -> None:
        duration = self._duration()
        self.history.note(f"nemesis: kill -9 {self._names(nodes)} for {duration:.1f}s")
        try:
            for i in nodes:
                self.cluster.signal_node(i, signal.SIGKILL)
                await asyncio.to_thread(self._reap, i)
            await self._sleep(duration)
        finally:
            for i in nodes:
                await self._restart(i)
            self._release(nodes, self.shape.settle)

    async def _term_restart(self, nodes: list[int]) -> None:
        (i,) = nodes
        self.history.note(f"nemesis: SIGTERM {self.cluster.node_id(i)}, restart")
        try:
            try:
                await asyncio.to_thread(self.cluster.kill, i, signal.SIGTERM)
            except subprocess.TimeoutExpired:
                self.history.violate(
                    "I5", f"{self.cluster.node_id(i)} still running 30 s after SIGTERM"
                )
                self.cluster.signal_node(i, signal.SIGKILL)
                await asyncio.to_thread(self._reap, i)
            await self._sleep(self.rng.uniform(0.0, 1.0))
        finally:
            await self._restart(i)
            self._release(nodes)

    async def _pause(self, nodes: list[int]) -> None:
        (i,) = nodes
        duration = self._duration()
        self.history.note(f"nemesis: SIGSTOP {self.cluster.node_id(i)} for {duration:.1f}s")
        try:
            self.cluster.signal_node(i, signal.SIGSTOP)
            await self._sleep(duration)
        finally:
            self.cluster.signal_node(i, signal.SIGCONT)
            self._release(nodes)

    async def _flip(self, nodes: list[int]) -> None:
        (i,) = nodes
        root = self.cluster.data / self.cluster.node_id(i)
        try:
            self.cluster.signal_node(i, signal.SIGKILL)
            await asyncio.to_thread(self._reap, i)
            hit = await asyncio.to_thread(flip_files, root, random.Random(self.rng.random()))
            self.history.counts["files_flipped"] += hit
            self.history.note(f"nemesis: flipped bytes in {hit} files of {self.cluster.node_id(i)}")
        finally:
            await self._restart(i)
            self._release(nodes, self.shape.settle)

    async def _full_disk(self, nodes: list[int]) -> None:
        duration = self._duration()
        try:
            filled = await asyncio.to_thread(self.cluster.fill_small_disk)
            self.history.note(
                f"nemesis: disks of {self._names(nodes)} full ({filled} bytes of filler) "
                f"for {duration:.1f}s"
            )
            await self._sleep(duration)
        finally:
            await asyncio.to_thread(self.cluster.free_small_disk)
            self._release(nodes)

    def _own(self, links: list[Link]) -> int:
        self._fault_ids += 1
        for link in links:
            self.link_owner[link] = self._fault_ids
        return self._fault_ids

    async def _undo_links(self, links: list[Link], owner: int) -> None:
        mine = [link for link in links if self.link_owner.get(link) == owner]
        for link in mine:
            del self.link_owner[link]
        assert self.cluster.proxies is not None
        await self.cluster.proxies.set_mode(mine, LinkMode.PASS)

    async def _partition(self, nodes: list[int]) -> None:
        proxies = self.cluster.proxies
        assert proxies is not None
        side = {self.cluster.node_id(i) for i in nodes}
        links = [(a, b) for a, b in proxies.links if (a in side) != (b in side)]
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        duration = self._duration()
        owner = self._own(links)
        try:
            await proxies.set_mode(links, mode)
            cut = await proxies.cut(links) if mode is LinkMode.DROP else 0
            self.history.note(
                f"nemesis: partition {sorted(side)} | rest ({mode.value}, {cut} connections "
                f"reset) for {duration:.1f}s"
            )
            await self._sleep(duration)
        finally:
            await self._undo_links(links, owner)
            self._release(nodes)

    async def _etcd_faults(self) -> None:
        """One etcd member at a time down or stopped, every ``etcd_gap`` s, until the end."""
        assert self.etcd is not None
        rng = self.etcd_rng
        while not self.stopping.is_set():
            await self._sleep(rng.uniform(*self.shape.etcd_gap))
            if self.stopping.is_set():
                return
            i = rng.randrange(len(self.etcd.members))
            how = rng.choice(["kill -9", "SIGSTOP"])
            duration = rng.uniform(*self.shape.duration)
            self._count("etcd_member")
            self.history.note(f"nemesis: etcd member e{i} {how} for {duration:.1f}s")
            try:
                if how == "kill -9":
                    await asyncio.to_thread(self.etcd.kill_blocking, i)
                else:
                    self.etcd.pause(i)
                await self._sleep(duration)
            finally:
                self.etcd.resume(i)
                if not self.etcd.running(i):
                    await self._etcd_restart(i)

    async def _etcd_restart(self, i: int) -> None:
        """Start etcd member ``i`` again and wait until every member serves."""
        assert self.etcd is not None
        try:
            self.etcd.launch(i)
            await asyncio.to_thread(self.etcd.wait_serving, self.shape.restart_timeout)
            self.history.note(f"nemesis: etcd member e{i} back")
        except (AssertionError, OSError) as exc:
            self.history.violate("restart", f"etcd member e{i} did not come back: {exc}")

    async def _delay(self) -> None:
        proxies = self.cluster.proxies
        assert proxies is not None
        free = [link for link in proxies.links if link not in self.link_owner]
        links = self.rng.sample(free, min(len(free), self.rng.randint(2, 8)))
        delay = self.rng.uniform(0.02, 0.2)
        duration = self._duration()
        owner = self._own(links)
        try:
            await proxies.set_mode(links, LinkMode.DELAY, delay)
            self.history.note(
                f"nemesis: delay {delay * 1000:.0f} ms on {len(links)} links for {duration:.1f}s"
            )
            await self._sleep(duration)
        finally:
            await self._undo_links(links, owner)
