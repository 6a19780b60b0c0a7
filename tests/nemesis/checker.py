"""After the faults: wait for full replication (timed), then check I1-I7 against the history.

Replication is judged from what is really there, not from the nodes' own bookkeeping (a
chunk's recorded state only moves forward, so ``?status`` still says ``cold`` after a
fragment was flipped and quarantined): RAM copies from ``?plan``, nvme copies and
fragments from the nodes' files, each read and checked (BLAKE3 of a chunk's payload, the
fragment's own checksum) once per file.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import random
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from erasure import CorruptFragment, parse_fragment
from storaged.client import CheckpointNotFound, Client, StoragedError
from storaged.domains import domain_exposed, domain_key, node_budget, sizes, survives_a_domain
from storaged.ids import chunk_id_of, is_chunk_id
from storaged.placement import exposed
from storaged.retention import Policy, job_of, sequence_of
from storaged.tools.local_cluster import ClusterError
from tests.nemesis.cluster import DISK_TIERS, NemesisCluster
from tests.nemesis.history import CheckpointRecord, History
from tests.nemesis.workload import RawHttp, check_visible, verify_checkpoint
from tiers._durable import HEADER_SIZE as FILE_HEADER_SIZE
from tiers._durable import InvalidValue, parse_file_header


@dataclass
class Report:
    seed: int
    faults: int
    acked: int
    verified: int
    lost: int
    wrong: int
    heal: float | None

    def line(self) -> str:
        heal = f"{self.heal:.1f}s" if self.heal is not None else "never"
        return (
            f"nemesis seed={self.seed} faults={self.faults} acked={self.acked} "
            f"verified={self.verified} lost={self.lost} wrong={self.wrong} heal={heal}"
        )


class DiskCensus:
    """Good nvme copies and fragments per chunk, from the files of every node."""

    def __init__(self, cluster: NemesisCluster) -> None:
        self.cluster = cluster
        #: (path, inode, size, mtime) -> whether the file checked out
        self._checked: dict[tuple[str, int, int, int], bool] = {}

    def scan(
        self, nodes: Collection[int] | None = None
    ) -> tuple[dict[str, set[str]], dict[str, dict[str, set[int]]]]:
        """(chunk id -> nodes with a good nvme copy, chunk id -> node -> the good fragment
        indexes it holds), from the files of ``nodes`` (default all)."""
        nvme: dict[str, set[str]] = defaultdict(set)
        frags: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
        for i in sorted(range(self.cluster.nodes) if nodes is None else nodes):
            node = self.cluster.node_id(i)
            for tier in DISK_TIERS:
                root = self.cluster.data / node / tier
                for path in root.glob("??/??/*"):
                    key = path.name
                    if key.startswith("."):
                        continue
                    cid, _, index = key.partition(".")
                    if not is_chunk_id(cid) or not self._good(path, tier, cid, index):
                        continue
                    if tier == "nvme":
                        nvme[cid].add(node)
                    else:
                        frags[cid][node].add(int(index))
        return nvme, frags

    def _good(self, path: Path, tier: str, cid: str, index: str) -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self._checked:
            self._checked[key] = _check_file(path, tier, cid, index)
        return self._checked[key]


def _check_file(path: Path, tier: str, cid: str, index: str) -> bool:
    try:
        raw = path.read_bytes()
    except OSError:
        return False
    try:
        header = parse_file_header(raw)
    except InvalidValue:
        return False
    payload = memoryview(raw)[FILE_HEADER_SIZE:]
    if header.digest.hex() != cid or header.length != len(payload):
        return False
    if tier == "nvme":
        return chunk_id_of(payload) == cid
    try:
        fragment = parse_fragment(payload)
    except CorruptFragment:
        return False
    return (fragment.chunk_id, str(fragment.index)) == (cid, index)


class Replication:
    """Which chunks of the live checkpoints are short of full replication on ``nodes``
    (default all): fewer than ``replication`` hot copies (RAM ones from ``?plan``, nvme
    ones from the files) and fewer than ``n`` good fragments (from the files)."""

    def __init__(
        self,
        cluster: NemesisCluster,
        history: History,
        client: Client,
        nodes: Collection[int] | None = None,
        census: DiskCensus | None = None,
    ) -> None:
        self.cluster = cluster
        self.history = history
        self.client = client
        self.nodes = set(range(cluster.nodes) if nodes is None else nodes)
        self.names = {cluster.node_id(i) for i in self.nodes}
        #: a census may be shared: it checks each file once, whoever asks
        self.census = census or DiskCensus(cluster)

    async def short(self, among: Collection[str] | None = None) -> tuple[dict[str, str], set[str]]:
        """(chunk id or checkpoint name -> what it lacks, chunks beyond repair: no hot
        copy and fewer than ``k`` fragments), over the live checkpoints (those named in
        ``among`` only, if given)."""
        erasure = self.client.cluster.erasure
        assert erasure is not None, "the cluster does not say its erasure code"
        n, k = erasure.n, erasure.k
        replication = self.client.cluster.replication
        live = [r for r in self.history.live_checkpoints() if among is None or r.name in among]
        deletable = retention_may_delete(self.history, self.history.retention)
        in_ram: dict[str, set[str]] = defaultdict(set)
        short: dict[str, str] = {}
        for record in list(live):
            gone = record.name in deletable and record.archived
            if gone and await _archive_only(self.client, record.name):
                live.remove(record)  # deleted by the policy, served by the archive alone
                continue
            try:
                plan = await self.client.plan(record.name)
            except CheckpointNotFound as exc:
                if record.name in deletable:
                    live.remove(record)  # deleted by the retention policy: nothing to heal
                    continue
                short[record.name] = f"no plan: {exc}"
                continue
            except StoragedError as exc:
                short[record.name] = f"no plan: {exc}"
                continue
            for cid, holders in plan.items():
                in_ram[cid].update(
                    h.node for h in holders if h.tier == "memory" and h.node in self.names
                )
        nvme, held = await asyncio.to_thread(self.census.scan, self.nodes)
        # The failure model over the nodes counted and their failure domains: fragments
        # all there but concentrated on too few of them (a node the only holder of more
        # than it may lose; a domain, where placement promises to survive one) are short
        # too, and so are hot copies on fewer domains than placement spreads them over.
        domain_of = {
            self.cluster.node_id(i): domain_key(
                self.cluster.node_id(i), self.cluster.domains.get(i, "")
            )
            for i in self.nodes
        }
        domain_sizes = sizes(domain_of.values())
        budget = node_budget(domain_sizes, replication, k, n)
        whole = survives_a_domain(domain_sizes, replication, k, n)
        hot_domains = min(replication, len(domain_sizes)) if whole else 1
        lost: set[str] = set()
        for record in live:
            for cid in record.chunks:
                hot = in_ram[cid] | nvme[cid]
                frags = {i for indexes in held[cid].values() for i in indexes}
                if not hot and len(frags) < k:
                    lost.add(cid)  # beyond repair: the reads report it lost
                    continue
                hot_ok = len(hot) >= replication and (
                    len({domain_of.get(node, node) for node in hot}) >= hot_domains
                )
                cold_ok = (
                    len(frags) >= n
                    and not exposed(held[cid], k, budget)
                    and not (whole and domain_exposed(held[cid], k, domain_of))
                )
                if not hot_ok and not cold_ok:
                    where = {node: sorted(f) for node, f in sorted(held[cid].items())}
                    short[cid] = f"{len(hot)} hot ({sorted(hot)}), fragments {where}"
        return short, lost


async def wait_healed(
    cluster: NemesisCluster,
    history: History,
    client: Client,
    timeout: float,
    remaining: Collection[int] | None = None,
) -> float | None:
    """Seconds until every chunk of every live checkpoint has ``replication`` hot copies or
    all ``n`` good fragments on the ``remaining`` nodes (default all); None (and an I6
    violation) if that does not happen in time. Chunks beyond repair (no hot copy, fewer
    than ``k`` fragments) are left to the reads, which count them lost: they would
    otherwise hide how long the rest took to heal."""
    replication = Replication(cluster, history, client, remaining)
    gone = sorted(set(range(cluster.nodes)) - replication.nodes)
    started = time.monotonic()
    while True:
        short, lost = await replication.short()
        elapsed = time.monotonic() - started
        if not short:
            if lost:
                history.note(f"healed but for {len(lost)} chunks beyond repair")
            return elapsed
        if elapsed > timeout:
            examples = "; ".join(f"{cid[:12]}: {why}" for cid, why in list(short.items())[:5])
            left = f" on the nodes that remain ({cluster.node_id(gone[0])}" if gone else ""
            left += "".join(f", {cluster.node_id(i)}" for i in gone[1:])
            left += " left for good at can_leave)" if gone else ""
            history.violate(
                "I6",
                f"{len(short)} chunks still under-replicated after {timeout:.0f}s{left}: "
                + examples,
            )
            return None
        await asyncio.sleep(1.0)


async def check_history(
    cluster: NemesisCluster,
    history: History,
    raw: RawHttp,
    client: Client,
    *,
    faults: int,
    heal_timeout: float,
    remaining: Collection[int] | None = None,
) -> Report:
    """The end of a run: all ``remaining`` nodes up (default all; those that left for good
    stay down) and faults undone. Times the heal on the remaining nodes, then reads every
    live checkpoint back whole from every node in turn until one serves each chunk, then
    reads the node logs for tracebacks. A live checkpoint the run's retention policy may have
    deleted (``retention_may_delete``) is checked only if its manifest is still served; one
    it must keep is checked as any other."""
    try:
        await asyncio.to_thread(cluster.wait_converged, 120.0)
    except ClusterError as exc:
        # Still checked: what the nodes serve, and how long they take to heal, say more.
        history.violate("converge", f"the nodes do not agree who is alive: {exc}")
    await client.refresh_cluster()
    heal = await wait_healed(cluster, history, client, heal_timeout, remaining)
    rng = random.Random(f"{history.seed}/checker")
    verified: set[str] = set()
    lost: set[str] = set()
    deletable = retention_may_delete(history, history.retention)
    history.note(f"retention may have deleted {len(deletable)}: {sorted(deletable)}")
    for record in sorted(history.checkpoints.values(), key=lambda r: r.name):
        if not (record.live or record.archived):
            await check_visible(history, raw, record, rng.choice(raw.urls), final=True)
            continue
        # What the policy may have deleted is gone or whole; an archived checkpoint is
        # whole either way (deleted since, its reads go through the archive).
        may_be_gone = record.name in deletable and not record.archived
        if may_be_gone and await _deleted(raw, record.name):
            history.counts["retention_deleted"] += 1
            continue
        if not record.live:
            history.counts["archived_after_delete"] += 1
        result = await verify_checkpoint(
            history, raw, record, rng, during_faults=False, may_be_gone=may_be_gone
        )
        for cid, outcome in result.items():
            if outcome == "ok":
                verified.add(cid)
            elif outcome == "unread" and may_be_gone:
                # deleted by the policy since its manifest was read: its chunks may be gone
                history.counts["retention_deleted_while_read"] += 1
            elif outcome == "unread" and cid not in lost:
                lost.add(cid)
                blame = _blame(history, cid) if record.live else "archive"
                history.violate(
                    blame,
                    f"chunk of {'acknowledged' if record.live else 'archived'} {record.name} "
                    "lost: no node serves it\n" + history.story(cid),
                )
    history.note(
        f"retention deleted {history.counts['retention_deleted']} of them "
        f"({history.counts['retention_deleted_while_read']} chunks while they were read)"
    )
    await _check_listing(history, client, deletable)
    await asyncio.to_thread(check_logs, cluster, history)
    return Report(
        seed=history.seed,
        faults=faults,
        acked=history.counts["acked"],
        verified=len(verified),
        lost=len(lost),
        wrong=history.counts["wrong"],
        heal=heal,
    )


TRACEBACK = "Traceback (most recent call last)"

#: tracebacks a node may log without failing the run: (how the exception line starts,
#: why it is no failure)
TRACEBACK_ALLOWED: tuple[tuple[str, str], ...] = ()


def tracebacks(text: str) -> list[tuple[str, str]]:
    """Every traceback in a log: its last line (the exception), and where it came from (the
    log line that logged it and the innermost frames), for the event log."""
    found = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if TRACEBACK not in line:
            continue
        last, frames = line, []
        for follow in lines[n + 1 : n + 400]:
            last = follow
            # A traceback's frames are indented; its exception line is not.
            if follow and not follow.startswith((" ", "\t")):
                break
            if follow.strip().startswith("File "):
                frames.append(follow.strip())
        logged = lines[n - 1].strip() if n and TRACEBACK not in lines[n - 1] else line.strip()
        where = " <- ".join(reversed(frames[-4:]))
        found.append((last.strip(), f"logged as {logged[:200]!r}; innermost: {where}"))
    return found


def check_logs(cluster: NemesisCluster, history: History) -> None:
    """No node log holds a traceback, but for those ``TRACEBACK_ALLOWED`` explains."""
    for i in range(cluster.nodes):
        try:
            text = cluster.log_path(i).read_text(errors="replace")
        except FileNotFoundError:
            continue
        counts: dict[str, int] = defaultdict(int)
        origin: dict[str, str] = {}
        for exc, where in tracebacks(text):
            if any(exc.startswith(prefix) for prefix, _ in TRACEBACK_ALLOWED):
                history.counts["tracebacks_allowed"] += 1
                continue
            counts[exc] += 1
            origin.setdefault(exc, where)
        for exc, times in sorted(counts.items()):
            history.violate(
                "log",
                f"{cluster.node_id(i)} logged a traceback {times}x ending {exc!r} "
                f"(log: {cluster.log_path(i)}); the first {origin[exc]}",
            )


def _blame(history: History, cid: str) -> str:
    """The invariant a lost chunk most directly breaks, from what happened to it."""
    notes = " ".join(history.chunk_notes.get(cid, []))
    if "deleted" in notes or "/missing says held" in notes or "re-PUT" in notes:
        return "I3"  # referenced again after a delete or a dedup answer, then collected
    if "aborted" in notes:
        return "I2"
    return "I1"


async def _archive_only(client: Client, name: str) -> bool:
    """Whether the cluster answers ``name``'s status from the archive alone (deleted here)."""
    try:
        return (await client.status(name)).state == "archived"
    except StoragedError:
        return False


async def _deleted(raw: RawHttp, name: str) -> bool:
    """Whether a node says 404 for ``name`` before any serves its manifest."""
    for url in raw.urls:
        got = await raw.manifest(url, name)
        if got is not None and got[0] in (200, 404):
            return got[0] == 404
    return False


def retention_may_delete(history: History, policy: Policy) -> set[str]:
    """The live (acknowledged, not deleted) checkpoints ``policy`` may have deleted; the
    others it must keep, in every order the cluster may have seen the commits in.

    It must keep a checkpoint whose sequence number an every-Nth clause names (with no end:
    the nemesis's policy has none), and one with fewer than ``max(keep_last, 1)`` others of
    its job that may be live and committed after it: those whose step comes later, and
    those of an earlier step whose commit's outcome is unknown (it may have landed late).
    A writer commits its steps in turn (a race's after its step's), so an acknowledged
    commit of an earlier step came before."""
    deletable: set[str] = set()
    if not policy:
        return deletable
    jobs: dict[str, list[CheckpointRecord]] = defaultdict(list)
    for record in history.checkpoints.values():
        if record.outcome != "refused" and record.deleted != "acked":  # may be live
            jobs[job_of(record.name)].append(record)

    def order(name: str) -> tuple[int, bool]:
        return sequence_of(name) or 0, "/race-" in name

    # Per job, the orders sorted, all and those of commits not acknowledged: "later" is then
    # two binary searches a checkpoint (the run has thousands: a pair-wise count held the
    # nemesis's loop for seconds).
    orders = {job: sorted(order(r.name) for r in records) for job, records in jobs.items()}
    unacked = {
        job: sorted(order(r.name) for r in records if r.outcome != "acked")
        for job, records in jobs.items()
    }
    for record in history.checkpoints.values():
        rule = policy.rule_for(record.name)
        if not record.live or rule is None:
            continue
        seq = sequence_of(record.name)
        if rule.keep_every and seq is not None and seq % rule.keep_every == 0:
            assert rule.keep_every_for is None, "the nemesis's every-Nth clause has no end"
            continue
        job, mine = job_of(record.name), order(record.name)
        # others whose step comes later, and others not acknowledged (they may have landed
        # after this one) whose step does not: the record itself is acknowledged (live)
        later = len(orders[job]) - bisect.bisect_right(orders[job], mine)
        later += bisect.bisect_right(unacked[job], mine)
        if later >= max(rule.keep_last, 1):
            deletable.add(record.name)
    return deletable


async def _check_listing(history: History, client: Client, deletable: set[str]) -> None:
    # A listing walks the whole catalogue (on etcd, page by page): one that times out right
    # after the heal (etcd still catching up) is tried again, thrice at most, and counted.
    failures: list[str] = []
    for _ in range(3):
        try:
            listed = {c.name: c.state for c in await client.list()}
            break
        except StoragedError as exc:
            failures.append(str(exc))
            history.counts["final_listing_retried"] += 1
            await asyncio.sleep(2.0)
    else:
        history.violate("I4", f"the final listing failed thrice: {failures}")
        return
    for record in history.checkpoints.values():
        if record.live and record.name not in listed and record.name not in deletable:
            history.violate("I4", f"acknowledged {record.name} missing from the listing")
        if record.archived and record.name not in listed:
            history.violate("archive", f"archived {record.name} missing from the listing")
        from_archive = record.archive_asked and listed.get(record.name) == "archived"
        if from_archive and record.outcome == "acked":
            continue  # deleted from the cluster, listed from the archive
        if record.name in listed and (record.outcome == "refused" or record.deleted == "acked"):
            history.violate(
                "I4", f"{record.name} ({record.outcome}, deleted {record.deleted}) is listed"
            )


def dump(history: History, path: Path) -> None:
    """The whole event log and every chunk story, for a look after a failed run."""
    with open(path, "w") as f:
        for t, text in history.log:
            f.write(f"{t:8.2f} {text}\n")
    os.chmod(path, 0o644)
