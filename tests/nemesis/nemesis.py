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
- ``one_way``: one node's peer links cut in one direction only (its dialled links, or the
  others' links to it, DROP or BLACKHOLE) while the other direction works.
- ``delay``: a few peer links delay every piece by 20-200 ms.
- ``drain``: ``POST /v1/nodes/{id}/drain``, ``GET`` it until ``can_leave``, then the node
  is stopped (SIGTERM or SIGKILL) at once: it leaves for good (while the members stay at
  ``replication + 2`` or more: the first drain of a run always leaves, so the end's
  checks see a departed node), or comes back after a while with an empty disk, its mark
  cancelled.
- ``gone``: SIGKILL, then the node stays down past ``gone_after`` (its data rebuilt
  elsewhere), then restarts with its old disk or an empty one.
- ``empty_disk``: SIGKILL, the data directory emptied (the log kept), restart.
- ``gc_stall``: ``POST /v1/admin/gc {"pause": s}`` to one or two nodes for 2-3 times
  the GC grace; ``/v1/cluster`` must report ``gc.stalled_since`` for them meanwhile (a
  node without the endpoint answers 404: the fault is counted "skipped").
- ``shm_kill``: a co-located writer in a process of its own (``shm_writer``) saves
  through one node's shared-memory socket and is SIGKILLed after a drawn 0.3-4 s, with
  leases open or not; the checkpoints it was told are committed must survive like any.
- ``join`` (etcd only: the embedded cluster file is static): a spare node slot starts
  against etcd as a fresh member.
- ``etcd_cut`` / ``etcd_delay`` (etcd only): one node's links to every etcd member
  (each node reaches etcd through its own proxies) dropped or blackholed, or delayed by
  50-400 ms: that node alone loses or strains its coordinator.
- ``etcd_member`` (only when the nodes coordinate through etcd): one member of the 3-member
  etcd killed (SIGKILL) or stopped (SIGSTOP), then started again or continued. These come
  on a schedule of their own (every ``etcd_gap`` s, drawn from the seed's own stream, so
  the node faults' draws are those of the embedded runs), overlapping the node faults; one
  member at a time, so etcd keeps its quorum; the node budget below does not count them.

At most ``replication - 1`` nodes are impaired at once (killed, stopped, flipped, full,
partitioned, draining, gone, emptied, cut off from etcd): the failure model the cluster
promises to survive; fewer when fewer members remain than the erasure code spreads
fragments over one a node, or where a small failure domain puts more on its nodes
(``Nemesis.budget``). Or, instead, one whole failure domain (``domain_kill``: every member
of one, SIGKILLed at once, nothing else meanwhile), which placement over the cluster's
domains survives (``storaged.domains``). A node whose data was
lost (kill -9, flips) still counts as impaired after its restart, for ``settle`` seconds
and then until no chunk of the checkpoints live at the fault is short of full
replication (however long repair takes: every ``settle_max`` s it is noted as overdue),
so that losses of successive faults do not add up beyond that model before repair has
acted. The first faults go through every
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
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erasure import HEADER_SIZE as FRAGMENT_HEADER_SIZE
from storaged.client import Client, StoragedError
from storaged.domains import domain_key, node_budget, sizes, survives_a_domain
from storaged.tools.local_cluster import ClusterError
from tests.etcd import EtcdCluster
from tests.nemesis.checker import DiskCensus, Replication
from tests.nemesis.cluster import DISK_TIERS, NemesisCluster
from tests.nemesis.history import CheckpointRecord, History
from tests.nemesis.proxy import FaultProxies, Link, LinkMode
from tests.nemesis.workload import manifest_of
from tiers._durable import HEADER_SIZE as FILE_HEADER_SIZE

KINDS = (
    "kill9",
    "term_restart",
    "pause",
    "flip",
    "full_disk",
    "partition",
    "one_way",
    "delay",
    "drain",
    "gone",
    "empty_disk",
    "gc_stall",
    "shm_kill",
    "join",
    "etcd_cut",
    "etcd_delay",
    "domain_kill",
)
WEIGHTS = {
    "kill9": 3,
    "term_restart": 2,
    "pause": 2,
    "flip": 1,
    "full_disk": 1,
    "partition": 3,
    "one_way": 2,
    "delay": 2,
    "drain": 1,
    "gone": 1,
    "empty_disk": 1,
    "gc_stall": 1,
    "shm_kill": 2,
    "join": 1,
    "etcd_cut": 1,
    "etcd_delay": 1,
    "domain_kill": 1,
}
#: kinds that need the nodes to coordinate through etcd
ETCD_KINDS = ("join", "etcd_cut", "etcd_delay")
#: kinds that hold a node for long (gone_after, a whole drain): the first pass starts
#: them first, so that a short run sees them all beside the others; one at a time after
LONG_KINDS = ("gone", "drain", "empty_disk")
#: kinds that impair no node (they need no room in the budget)
FREE_KINDS = ("delay", "gc_stall", "shm_kill", "join")

#: the checkout the co-located writer's process imports ``tests`` from
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class NemesisShape:
    duration: tuple[float, float] = (1.0, 3.0)
    gap: tuple[float, float] = (0.3, 1.2)
    #: a node whose files were flipped counts as impaired this long at least after its
    #: restart (the scrubber's pass finds the flips), then until repair is done
    settle: float = 6.0
    #: the same for a node that lost data it knows it lost (RAM, a wiped disk): a few
    #: repair passes have counted what it lacks by then
    settle_lost: float = 2.5
    #: a node that lost data counts as impaired until repair is done (noted as overdue
    #: every this many seconds)
    settle_max: float = 60.0
    #: faults start after ``warm_acks`` acknowledged commits, or ``warmup`` seconds
    warm_acks: int = 3
    warmup: float = 20.0
    restart_timeout: float = 60.0
    #: time between the end of one etcd member fault and the next (etcd mode only)
    etcd_gap: tuple[float, float] = (2.0, 6.0)
    #: the nodes' ``gone_after`` and GC grace (the gone and GC stall faults outlast them)
    gone_after: float = 10.0
    gc_grace: float = 4.0
    #: a drain not at ``can_leave`` after this long is a violation
    drain_timeout: float = 90.0
    #: a co-located writer is killed after a drawn time in this range
    shm_kill_after: tuple[float, float] = (0.3, 4.0)


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
        initial: int | None = None,
        client: Client | None = None,
    ) -> None:
        self.cluster = cluster
        #: asks ``?plan`` for the settle's measure of repair (see ``_repair_quiet``)
        self.client = client
        self.etcd = etcd
        self.history = history
        self.shape = shape
        self.rng = random.Random(f"{history.seed}/nemesis")
        self.kinds = [
            k
            for k in KINDS
            if (full_disk or k != "full_disk")
            and (etcd is not None or k not in ETCD_KINDS)
            and (cluster.domains or k != "domain_kill")
        ]
        self.etcd_rng = random.Random(f"{history.seed}/etcd")
        settings = cluster.settings
        self.k, self.n = int(settings.get("k", 4)), int(settings.get("n", 6))
        self.admin_token = str(settings.get("admin_token", ""))
        first = cluster.nodes if initial is None else initial
        #: nodes that are in the cluster (started, not left for good)
        self.members: set[int] = set(range(first))
        #: spare slots never started (etcd: a ``join`` starts one), in order
        self.spares: list[int] = list(range(first, cluster.nodes))
        #: spares being started: members, but no other fault may pick them meanwhile (one
        #: that did would find no process to stop and start a second one beside the first)
        self.joining: set[int] = set()
        #: nodes whose GC a gc_stall fault holds paused: another must not pick them (its
        #: end resumes GC, which would cut the other's pause short and hide its stall)
        self.gc_paused: set[int] = set()
        #: nodes that left for good on ``can_leave``: they stay down to the end
        self.left: list[int] = []
        #: node -> monotonic time until which it counts as impaired (inf while a fault runs)
        self.impaired: dict[int, float] = {}
        #: link -> the fault that set its mode (a partition takes links over from a delay)
        self.link_owner: dict[Link, int] = {}
        self.injected: collections.Counter[str] = collections.Counter()
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._fault_ids = 0
        self._shm_writers = 0
        self._census = DiskCensus(cluster)
        #: long faults (LONG_KINDS) running: one at a time after the first pass
        self._long = 0
        self._first_pass = True
        #: a domain_kill was drawn and waits for every node to be free: no other fault
        #: that impairs a node starts meanwhile
        self._domain_waiting = False
        #: the kinds the first pass has yet to start
        self._first_left: list[str] = []
        #: set once every kind has been started once
        self.first_pass_done = asyncio.Event()

    @property
    def budget(self) -> int:
        """Nodes that may be impaired at once: placement's node budget over the members'
        failure domains (``storaged.domains``; each node its own without domains)."""
        return node_budget(self._domain_sizes(), self.cluster.replication, self.k, self.n)

    def _domain_of(self, i: int) -> str:
        return domain_key(self.cluster.node_id(i), self.cluster.domains.get(i, ""))

    def _domain_sizes(self) -> list[int]:
        return sizes(self._domain_of(i) for i in self.members)

    def _whole_domain(self) -> list[int] | None:
        """The members of a failure domain drawn among those whose every member is free,
        when nothing else is impaired and placement over the members survives a domain's
        loss (``storaged.domains.survives_a_domain``); None otherwise."""
        free = set(self._free())
        if self.impaired or not self._domain_possible():
            return None
        by_domain: dict[str, list[int]] = {}
        for i in sorted(self.members):
            by_domain.setdefault(self._domain_of(i), []).append(i)
        whole = [nodes for nodes in by_domain.values() if len(nodes) > 1 and free >= set(nodes)]
        return self.rng.choice(whole) if whole else None

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
        # Stable sorts keep the seeded order within each group: a join first (a member more
        # before a drain may leave keeps the budget), then the long kinds, then the rest.
        # A whole domain's kill waits for every node to be free, and holds the other
        # faults back meanwhile (``_domain_waiting``): last of the first pass.
        first.sort(key=lambda kind: (kind != "join", kind not in LONG_KINDS, kind == "domain_kill"))
        names = list(WEIGHTS)
        weights = [WEIGHTS[k] if k in self.kinds else 0 for k in names]
        while not self.stopping.is_set():
            first = [k for k in first if self._possible(k)]
            self._first_pass, self._first_left = bool(first), first
            if not first:
                self.first_pass_done.set()
            if first:
                # The first of the first pass that can start now: one waiting for room (or
                # for a spare) does not hold back the kinds that need none.
                kind = next((k for k in first if self._launch(k)), None)
                if kind is not None:
                    first.remove(kind)
            else:
                kind = self.rng.choices(names, weights)[0]
                kind = kind if self._launch(kind) else None
            if kind is not None:
                await self._sleep(self.rng.uniform(*self.shape.gap))
            else:
                await self._sleep(0.25)  # no room: wait for a fault to end

    async def finish(self) -> None:
        """Stop injecting, undo every fault, and bring every member back (those that left
        for good stay down)."""
        self.stopping.set()
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
        for proxies in (self.cluster.proxies, self.cluster.etcd_proxies):
            if proxies is not None:
                await proxies.heal_all()
        await asyncio.to_thread(self.cluster.free_small_disk)
        for i in sorted(self.members):
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
        return [i for i in sorted(self.members) if i not in self.impaired and i not in self.joining]

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
        nodes = [i for i in nodes if i in self.members]  # one that left holds nothing
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
        """Hold ``nodes`` impaired ``hold`` s, then until repair is done. Never released
        while data is short: on a loaded machine repair can take minutes, and releasing
        at a cap let the losses of later faults add up beyond the model (soak run 27: a
        chunk lost to four whole-disk faults in a row, each settle given up at 60 s with
        chunks still short). Repair that never finishes keeps them impaired to the end,
        where the heal check (I6) names it."""
        try:
            await self._sleep(hold)
            # What a fault could damage was saved before it: chunks acknowledged later had
            # their copies at the ack (I1), and a save in flight is transiently short.
            before = {r.name for r in self.history.live_checkpoints()}
            waited = 0.0
            while True:
                took, trail, done = await self._repair_quiet(before)
                waited += took
                if done or self.stopping.is_set():
                    break
                self.history.counts["settle_overdue"] += 1
                self.history.note(
                    f"nemesis: {self._names(nodes)} not settled {waited:.1f}s after the "
                    f"hold (repair backlog {trail[-8:]}): still impaired"
                )
            self.history.note(
                f"nemesis: {self._names(nodes)} {'settled' if done else 'stopped'} "
                f"{waited:.1f}s after the hold (repair backlog {trail[-8:]})"
            )
        finally:
            for i in nodes:
                self.impaired[i] = time.monotonic()

    async def _repair_quiet(self, before: set[str]) -> tuple[float, list[int | None], bool]:
        """Until repair is done twice running (``settle_max`` at most, or until the run
        stops); the time waited, the counts seen and whether it was done. Done: with
        ``client``, no chunk of ``before`` (checkpoints live when the hold began) short of
        full replication on the members (the end's own measure: the nodes'
        ``repair_backlog`` also counts garbage and chunks being saved, and stays above 0
        while the writers run); else the repair passes report nothing."""
        started = time.monotonic()
        deadline = started + self.shape.settle_max
        quiet = 0
        trail: list[int | None] = []
        # The files are the truth: one count of none short will do; the nodes' own
        # backlogs must say nothing twice running (a pass may not have counted yet).
        need = 1 if self.client is not None else 2
        while quiet < need and time.monotonic() < deadline and not self.stopping.is_set():
            if self.client is not None:
                try:
                    short, _ = await Replication(
                        self.cluster, self.history, self.client, self.members, self._census
                    ).short(before)
                    backlog: int | None = len(short)
                except StoragedError:
                    backlog = None
            else:
                backlog = await asyncio.to_thread(self._repair_backlog)
            trail.append(backlog)
            quiet = quiet + 1 if backlog == 0 else 0
            if quiet < need:
                await self._sleep(1.0)
        return time.monotonic() - started, trail, quiet >= need

    def _alive_members(self, exclude: Collection[int] = ()) -> list[int]:
        return [i for i in sorted(self.members) if i not in exclude and self.cluster.alive(i)]

    def _http(
        self,
        i: int,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        admin: bool = False,
        timeout: float = 5.0,
    ) -> tuple[int, Any] | None:
        """(status, JSON document or None) of one request to node ``i``; None when no
        answer came. Blocking: call it in a thread."""
        token = self.admin_token if admin else self.cluster.token
        request = urllib.request.Request(
            self.cluster.url(i) + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={
                "Accept": "application/json",
                "Content-Type": "application/json",
                "Authorization": f"Bearer {token}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (OSError, ValueError):
            return None
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None

    async def _ask(
        self, among: list[int], method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any] | None:
        """The first answer below 500 from the nodes ``among``, in turn (an admin call)."""
        for i in among:
            got = await asyncio.to_thread(self._http, i, method, path, body, admin=True)
            if got is not None and got[0] < 500:
                return got
        return None

    def _repair_backlog(self) -> int | None:
        """Chunks the nodes' last repair passes found short of copies or fragments (None
        when no node answers)."""
        for i in self._alive_members():
            got = self._http(i, "GET", "/v1/cluster")
            if got is None or got[0] != 200 or not isinstance(got[1], dict):
                continue
            return sum(int(n.get("repair_backlog") or 0) for n in got[1]["nodes"] if n["alive"])
        return None

    def _possible(self, kind: str) -> bool:
        """Whether ``kind`` can still ever start (the small disk's node may have left, the
        spares may be used up)."""
        if kind == "full_disk":
            return self.cluster.small_disk in self.members
        if kind == "join":
            return bool(self.spares)
        if kind == "domain_kill":
            return self._domain_possible()
        return True

    def _domain_possible(self) -> bool:
        """Whether placement over the members survives a whole domain's loss now."""
        return survives_a_domain(self._domain_sizes(), self.cluster.replication, self.k, self.n)

    def _launch(self, kind: str) -> bool:
        if kind not in self.kinds:
            return False
        if self._domain_waiting and kind not in FREE_KINDS and kind != "domain_kill":
            return False  # a domain's kill waits for every node to be free: none is taken
        if kind in LONG_KINDS and self._long and not self._first_pass:
            return False  # one at a time: the other faults keep the rest of the budget
        room = self._room()
        if kind not in FREE_KINDS and room < 1:
            return False
        coro: Coroutine[None, None, None]
        if kind == "full_disk":
            target = self.cluster.small_disk
            if target is None or target not in self._free():
                return False
            coro = self._full_disk(self._take(1, [target]))
        elif kind == "kill9":
            coro = self._kill9(self._take(self.rng.randint(1, room)))
        elif kind == "domain_kill":
            domain = self._whole_domain()
            # Drawn, it waits for the faults under way to end (else it would seldom find
            # every node free), unless placement cannot survive a domain now.
            # (In the first pass only once every other kind has started: the long ones
            # would otherwise hold the rest of the pass back.)
            self._domain_waiting = (
                domain is None
                and self._domain_possible()
                and not (self._first_pass and self._first_left != ["domain_kill"])
            )
            if domain is None:
                return False
            # More nodes than the node budget, maybe: the one failure the cluster then
            # survives is this domain's (nothing else starts while they are impaired).
            coro = self._kill9(
                self._take(len(domain), domain), self.cluster.domains.get(domain[0], "")
            )
        elif kind == "partition":
            coro = self._partition(self._take(self.rng.randint(1, room)))
        elif kind == "delay":
            coro = self._delay()
        elif kind == "gc_stall":
            alive = self._alive_members(exclude=self.gc_paused)
            if not alive:
                return False
            coro = self._gc_stall(
                sorted(self.rng.sample(alive, min(len(alive), self.rng.randint(1, 2))))
            )
        elif kind == "shm_kill":
            alive = self._alive_members()
            if not alive:
                return False
            coro = self._shm_kill(self.rng.choice(alive))
        elif kind == "join":
            if not self.spares:
                return False
            coro = self._join(self.spares.pop(0))
        else:
            if not self._free():
                return False
            faults = {
                "term_restart": self._term_restart,
                "pause": self._pause,
                "flip": self._flip,
                "one_way": self._one_way,
                "drain": self._drain,
                "gone": self._gone,
                "empty_disk": self._empty_disk,
                "etcd_cut": self._etcd_cut,
                "etcd_delay": self._etcd_delay,
            }
            coro = faults[kind](self._take(1))
        self._count(kind)
        if kind in LONG_KINDS:
            self._long += 1
            coro = self._ending_long(coro)
        self._spawn(coro)
        return True

    async def _ending_long(self, coro: Coroutine[None, None, None]) -> None:
        try:
            await coro
        finally:
            self._long -= 1

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
        if self.cluster.alive(i):
            # Never a second process beside a running one (it would be refused, and the
            # running one would go on untracked): a bug of this suite, said as such.
            self.history.violate("restart", f"{self.cluster.node_id(i)} restarted while running")
            return
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

    async def _kill9(self, nodes: list[int], domain: str | None = None) -> None:
        """``nodes`` SIGKILLed at once (``domain``: the whole failure domain they are, a
        rack's power), all restarted after the drawn time; their RAM is gone."""
        duration = self._duration()
        what = self._names(nodes) if domain is None else f"domain {domain} ({self._names(nodes)})"
        self.history.note(f"nemesis: kill -9 {what} for {duration:.1f}s")
        try:
            for i in nodes:
                self.cluster.signal_node(i, signal.SIGKILL)
            for i in nodes:
                await asyncio.to_thread(self._reap, i)
            await self._sleep(duration)
        finally:
            for i in nodes:
                await self._restart(i)
            self._release(nodes, self.shape.settle_lost)

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

    async def _undo_links(
        self, links: list[Link], owner: int, proxies: FaultProxies | None = None
    ) -> None:
        mine = [link for link in links if self.link_owner.get(link) == owner]
        for link in mine:
            del self.link_owner[link]
        proxies = proxies or self.cluster.proxies
        assert proxies is not None
        await proxies.set_mode(mine, LinkMode.PASS)

    async def _cut_links(
        self,
        nodes: list[int],
        proxies: FaultProxies,
        links: list[Link],
        mode: LinkMode,
        duration: float,
        what: str,
    ) -> None:
        """Hold ``links`` in ``mode`` for ``duration`` (resetting their open connections for
        a drop), noted as ``what``; then give the links back and release ``nodes``."""
        owner = self._own(links)
        try:
            await proxies.set_mode(links, mode)
            cut = await proxies.cut(links) if mode is LinkMode.DROP else 0
            self.history.note(
                f"nemesis: {what} ({mode.value}, {cut} connections reset) for {duration:.1f}s"
            )
            await self._sleep(duration)
        finally:
            await self._undo_links(links, owner, proxies)
            self._release(nodes)

    async def _partition(self, nodes: list[int]) -> None:
        proxies = self.cluster.proxies
        assert proxies is not None
        side = {self.cluster.node_id(i) for i in nodes}
        links = [(a, b) for a, b in proxies.links if (a in side) != (b in side)]
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        duration = self._duration()
        await self._cut_links(
            nodes, proxies, links, mode, duration, f"partition {sorted(side)} | rest"
        )

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

    async def _one_way(self, nodes: list[int]) -> None:
        """One node's peer links cut in one direction: the links it dials (it cannot reach
        the others, they reach it) or the others' links to it (the reverse)."""
        proxies = self.cluster.proxies
        assert proxies is not None
        (i,) = nodes
        node = self.cluster.node_id(i)
        outward = self.rng.random() < 0.5
        links = [
            (a, b) for a, b in proxies.links if (a == node if outward else b == node) and a != b
        ]
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        duration = self._duration()
        way = f"{node} -> rest" if outward else f"rest -> {node}"
        await self._cut_links(
            nodes, proxies, links, mode, duration, f"one-way partition {way}, the other way works"
        )

    # ---- membership ----------------------------------------------------------------------
    async def _drain(self, nodes: list[int]) -> None:
        """Drain a node until ``can_leave``, stop it at once, then it leaves for good or
        comes back with an empty disk. Impaired from the drain's start until it left (its
        data is elsewhere then) or, coming back, until repair has settled."""
        (i,) = nodes
        node = self.cluster.node_id(i)
        # A node may leave for good while replication + 2 members stay (the budget shrinks
        # with fewer: Nemesis.budget); the first drain of a run leaves whenever it may.
        may_leave = len(self.members) - 1 >= self.cluster.replication + 2
        leave = may_leave and (not self.left or self.rng.random() < 0.5)
        how = self.rng.choice([signal.SIGTERM, signal.SIGKILL])
        away = self.rng.uniform(1.0, 4.0)
        others = [j for j in self._alive_members(exclude=[i])]
        self.rng.shuffle(others)
        started = time.monotonic()
        left = False
        recheck = False
        hold = 0.0
        try:
            got = await self._ask(others, "POST", f"/v1/nodes/{node}/drain", {})
            if got is None or got[0] != 200:
                self.history.counts["drain_refused"] += 1
                self.history.note(f"nemesis: drain {node} refused ({got})")
                return
            self.history.note(f"nemesis: drain {node} ({got[1]})")
            progress = await self._until_can_leave(i, started)
            if progress is None:
                await self._cancel_drain(i)
                return
            waited = time.monotonic() - started
            self.cluster.signal_node(i, signal.SIGCONT)
            if how == signal.SIGKILL:
                self.cluster.signal_node(i, signal.SIGKILL)
                await asyncio.to_thread(self._reap, i)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(self.cluster.kill, i, signal.SIGTERM)
                self.cluster.signal_node(i, signal.SIGKILL)
                await asyncio.to_thread(self._reap, i)
            self.history.counts["drained"] += 1
            if leave:
                self.members.discard(i)
                self.impaired.pop(i, None)
                self.left.append(i)
                left = True
                self.history.note(
                    f"nemesis: {node} left for good ({how.name}) {waited:.1f}s after its "
                    f"drain began, at can_leave ({progress})"
                )
                return
            removed = await asyncio.to_thread(self.cluster.wipe, i)
            self.history.note(
                f"nemesis: {node} stopped ({how.name}) at can_leave after {waited:.1f}s "
                f"({progress}); back in {away:.1f}s with an empty disk ({removed} entries wiped)"
            )
            await self._sleep(away)
            # On etcd a graceful stop of a draining node deregisters it (it left): 404.
            absent = self.etcd is not None and how == signal.SIGTERM
            recheck = not await self._cancel_drain(i, left_ok=absent)
            hold = self.shape.settle_lost
        finally:
            if not left:
                if not self.cluster.alive(i):
                    await self._restart(i)
                if recheck and self.cluster.alive(i):
                    # Back, it joined anew: a cancel now finds it a member (200, active);
                    # one that cannot be made means a mark survived its leaving.
                    await self._cancel_drain(i)
                self._release(nodes, hold)

    async def _until_can_leave(self, i: int, started: float) -> dict[str, Any] | None:
        """Poll the drain of node ``i`` until ``can_leave``: its last progress document, or
        None when the run stopped first, or the drain took over ``drain_timeout`` (a
        violation: with at most one other node impaired, nothing should hold it that long)."""
        node = self.cluster.node_id(i)
        last: Any = None
        while not self.stopping.is_set():
            if time.monotonic() - started > self.shape.drain_timeout:
                self.history.violate(
                    "drain",
                    f"{node} not at can_leave {self.shape.drain_timeout:.0f}s after its drain "
                    f"began (last progress {last})",
                )
                return None
            got = await self._ask(self._alive_members(), "GET", f"/v1/nodes/{node}/drain")
            if got is not None and got[0] == 200 and isinstance(got[1], dict):
                last = got[1]
                if last.get("can_leave") is True:
                    return {k: last.get(k) for k in ("chunks", "fragments")}
            await self._sleep(0.5)
        self.history.note(f"nemesis: drain of {node} cut short by the end (last {last})")
        return None

    async def _cancel_drain(self, i: int, *, left_ok: bool = False) -> bool:
        """Cancel node ``i``'s drain mark; False when it had none to cancel because the
        node left the members (``left_ok``: on etcd a draining node's graceful stop
        deregisters it, mark and all: 404 ``node_not_found``)."""
        node = self.cluster.node_id(i)
        # As an operator would: again until it takes. On etcd the mark is etcd's to change,
        # and a member fault (a leader election) or a node cut off from etcd answers 503
        # meanwhile; a minute of that is a coordinator that does not come back.
        deadline = time.monotonic() + 60.0
        got: tuple[int, Any] | None = None
        while time.monotonic() < deadline:
            others = self._alive_members(exclude=[i])
            got = await self._ask(others, "POST", f"/v1/nodes/{node}/drain", {"cancel": True})
            if got is not None and got[0] == 200:
                self.history.note(f"nemesis: drain of {node} cancelled ({got[1]})")
                return True
            if left_ok and got is not None and got[0] == 404:
                self.history.note(f"nemesis: {node} left at its stop: no drain mark to cancel")
                return False
            await asyncio.sleep(0.5)
        self.history.violate(
            "drain", f"the drain mark of {node} could not be cancelled in 60 s (last: {got})"
        )
        return True

    async def _gone(self, nodes: list[int]) -> None:
        """SIGKILL, down past ``gone_after`` and until repair has rebuilt its data
        elsewhere, then back with its old disk or an empty one."""
        (i,) = nodes
        node = self.cluster.node_id(i)
        empty = self.rng.random() < 0.5
        down = self.shape.gone_after * 1.2 + 1.0
        self.history.note(
            f"nemesis: kill -9 {node}, down {down:.1f}s (gone_after {self.shape.gone_after}s), "
            f"then back with {'an empty' if empty else 'its old'} disk"
        )
        try:
            self.cluster.signal_node(i, signal.SIGKILL)
            await asyncio.to_thread(self._reap, i)
            await self._sleep(down)
            if empty:
                await asyncio.to_thread(self.cluster.wipe, i)
        finally:
            # Its data was rebuilt elsewhere once it was gone; back, it counts as impaired
            # until repair is quiet (what it lacks, or holds beyond placement, settled).
            await self._restart(i)
            self._release(nodes, self.shape.settle_lost)

    async def _empty_disk(self, nodes: list[int]) -> None:
        (i,) = nodes
        try:
            self.cluster.signal_node(i, signal.SIGKILL)
            await asyncio.to_thread(self._reap, i)
            removed = await asyncio.to_thread(self.cluster.wipe, i)
            self.history.note(
                f"nemesis: kill -9 {self.cluster.node_id(i)}, data dir emptied "
                f"({removed} entries), restart"
            )
        finally:
            await self._restart(i)
            self._release(nodes, self.shape.settle_lost)

    async def _join(self, i: int) -> None:
        """A spare slot starts against etcd: a fresh member (no data), not impaired."""
        node = self.cluster.node_id(i)
        self.joining.add(i)
        self.members.add(i)
        self.history.note(f"nemesis: {node} joins")
        try:
            await self._restart(i)
        finally:
            self.joining.discard(i)
        if not self.cluster.alive(i):
            self.members.discard(i)  # it never came up: not a member to bring back

    # ---- GC stalls -----------------------------------------------------------------------
    async def _gc_stall(self, nodes: list[int]) -> None:
        """Pause GC on ``nodes`` for longer than the grace; every paused node that stayed
        up through it must be reported ``gc.stalled_since`` by some node meanwhile."""
        # 2-3 x the grace: a stall is reported once the last pass is older than the grace,
        # so the window to see it is at least one grace long (1.5 x left 1.8 s under load)
        pause = self.shape.gc_grace * self.rng.uniform(2.0, 3.0)
        names = {i: self.cluster.node_id(i) for i in nodes}
        pids = {i: self.cluster.pid(i) for i in nodes}
        paused: list[int] = []
        self.gc_paused.update(nodes)
        try:
            for i in nodes:
                got = await asyncio.to_thread(
                    self._http, i, "POST", "/v1/admin/gc", {"pause": pause}, admin=True
                )
                if got is not None and got[0] == 404:
                    self.history.counts["gc_stall skipped"] += 1
                    self.history.note("nemesis: gc_stall skipped: not supported (404)")
                    return
                if got is not None and got[0] == 200:
                    paused.append(i)
            if not paused:
                return
            self.history.note(f"nemesis: GC paused on {self._names(paused)} for {pause:.1f}s")
            seen = await self._sample_stalls(paused, time.monotonic() + pause)
            for i in paused:
                # A node restarted by another fault meanwhile ended its pause itself.
                if (
                    seen.get(i) is None
                    and self.cluster.pid(i) == pids[i]
                    and not self.stopping.is_set()
                ):
                    self.history.violate(
                        "gc_stall",
                        f"GC of {names[i]} paused {pause:.1f}s (grace {self.shape.gc_grace}s) "
                        "but no node reported gc.stalled_since for it meanwhile",
                    )
                elif seen.get(i) is not None:
                    self.history.counts["gc_stall reported"] += 1
        finally:
            for i in paused:
                await asyncio.to_thread(
                    self._http, i, "POST", "/v1/admin/gc", {"pause": 0}, admin=True
                )
            self.gc_paused.difference_update(nodes)

    async def _sample_stalls(self, nodes: list[int], until: float) -> dict[int, float | None]:
        """Node -> the first ``stalled_since`` some node's ``/v1/cluster`` gave it before
        ``until`` (None: never)."""
        ids = {self.cluster.node_id(i): i for i in nodes}
        seen: dict[int, float | None] = dict.fromkeys(nodes)
        while time.monotonic() < until - 0.3 and not self.stopping.is_set():
            # Asked side by side, each for at most 1.5 s: one stopped or delayed node
            # must not hold the question to the others past the pause (seen: a SIGSTOPped
            # peer's 5 s timeout ate the paused node's whole window of stall).
            asked = [*nodes, *self._alive_members(exclude=nodes)][:3]
            answers = await asyncio.gather(
                *(
                    asyncio.to_thread(self._http, j, "GET", "/v1/cluster", timeout=1.5)
                    for j in asked
                )
            )
            for got in answers:
                if got is None or got[0] != 200 or not isinstance(got[1], dict):
                    continue
                for entry in got[1].get("nodes", []):
                    gc = entry.get("gc") or {}
                    i = ids.get(entry.get("id"))
                    if i is not None and gc.get("stalled_since") is not None:
                        seen[i] = seen[i] or float(gc["stalled_since"])
            if all(v is not None for v in seen.values()):
                break
            await asyncio.sleep(0.5)
        return seen

    # ---- co-located writers --------------------------------------------------------------
    async def _shm_kill(self, i: int) -> None:
        """A co-located writer on node ``i``'s shared-memory socket, SIGKILLed after a drawn
        time; what it was told is committed joins the history as acknowledged."""
        self._shm_writers += 1
        name = f"shm{self._shm_writers}"
        after = self.rng.uniform(*self.shape.shm_kill_after)
        out = Path(tempfile.mkdtemp(prefix="nemesis-shm-", dir=self.cluster.data)) / "record"
        path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-P", "-m", "tests.nemesis.shm_writer"),
            *(self.cluster.url(i), self.cluster.token, str(self.history.seed), name, str(out)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        try:
            # The timer starts at its first lease (an interpreter starts slowly here).
            for _ in range(150):
                if proc.returncode is not None or (out.exists() and out.stat().st_size):
                    break
                await self._sleep(0.1)
            await self._sleep(after)
        finally:
            alive = proc.returncode is None
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            _, err = await proc.communicate()
        records = self._shm_record(out, name)
        self.history.note(
            f"nemesis: co-located writer {name} on {self.cluster.node_id(i)} SIGKILLed after "
            f"{after:.1f}s ({records}){'' if alive else '; it had exited: ' + err.decode()[-300:]}"
        )

    def _shm_record(self, out: Path, name: str) -> str:
        """Take what the killed writer recorded into the history; a summary."""
        h = self.history
        try:
            lines = out.read_text().splitlines()
        except OSError:
            lines = []
        sealed = open_leases = 0
        pending: dict[str, CheckpointRecord] = {}
        error = ""
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a line the kill cut short (one write: should not happen)
            if "lease" in doc:
                h.chunk(doc["lease"], int(doc["size"]))
                open_leases += 1
            elif "sealed" in doc:
                open_leases -= 1
                if int(doc["status"]) in (200, 201):
                    sealed += 1
                    h.counts["shm_sealed"] += 1
            elif "commit" in doc:
                chunks = [(str(c), int(n)) for c, n in doc["chunks"]]
                manifest = manifest_of(chunks, {"step": doc["step"], "shm": name})
                record = CheckpointRecord(doc["commit"], -1, [manifest], [c for c, _ in chunks])
                record.outcome = "unknown"  # sent: it may exist, until its ack is read
                h.checkpoints[record.name] = record
                pending[record.name] = record
            elif "committed" in doc:
                record = pending.pop(doc["committed"])
                record.outcome = "acked"
                record.statuses.append("shm writer: acked")
                h.counts["acked"] += 1
                h.counts["shm_acked"] += 1
            elif "error" in doc:
                error = str(doc["error"])
        h.counts["shm_killed_mid_lease"] += int(open_leases > 0)
        acked = sum(1 for r in h.checkpoints.values() if r.name.startswith(f"{name}/") and r.live)
        summary = (
            f"{sealed} chunks sealed, {acked} checkpoints acked, lease open: {open_leases > 0}"
        )
        return summary + (f", stopped on: {error}" if error else "")

    # ---- the coordinator's links (etcd) --------------------------------------------------
    async def _etcd_cut(self, nodes: list[int]) -> None:
        """One node's links to every etcd member dropped (after a reset) or blackholed: it
        alone is cut off from its coordinator."""
        proxies = self.cluster.etcd_proxies
        assert proxies is not None
        (i,) = nodes
        links = proxies.links_of(self.cluster.node_id(i))
        mode = self.rng.choice([LinkMode.DROP, LinkMode.BLACKHOLE])
        duration = self.rng.uniform(1.0, 6.0)
        await self._cut_links(
            nodes, proxies, links, mode, duration, f"{self.cluster.node_id(i)} cut off etcd"
        )

    async def _etcd_delay(self, nodes: list[int]) -> None:
        """One node's etcd links delayed (its lease keep-alives and watches late)."""
        proxies = self.cluster.etcd_proxies
        assert proxies is not None
        (i,) = nodes
        links = proxies.links_of(self.cluster.node_id(i))
        delay = self.rng.uniform(0.05, 0.4)
        duration = self.rng.uniform(1.0, 6.0)
        owner = self._own(links)
        try:
            await proxies.set_mode(links, LinkMode.DELAY, delay)
            self.history.note(
                f"nemesis: etcd links of {self.cluster.node_id(i)} delayed {delay * 1000:.0f} ms "
                f"for {duration:.1f}s"
            )
            await self._sleep(duration)
        finally:
            await self._undo_links(links, owner, proxies)
            self._release(nodes)
