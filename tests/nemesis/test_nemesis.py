"""Randomized, seeded fault injection against a 6-node cluster in two failure domains of
three (k=3 of n=6, 3 hot copies).

The CI run (fixed seed, about a minute of faults) is in the default suite; the soak runs
with ``--nemesis-seconds N`` (random seed, printed first; ``--nemesis-seed S`` replays).
Each prints one line: ``nemesis seed=S faults=F acked=A verified=V lost=L wrong=W heal=Hs``.

Under ``--coordinator etcd`` the nodes coordinate through the session's 3-member etcd and
the nemesis also kills or stops one etcd member now and then; the default suite has a
short etcd run of its own (``test_nemesis_etcd_ci``, fixed seed, about 20 s of faults).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from storaged.retention import parse_rules
from storaged.tools.local_cluster import ClusterError, free_port_block
from tests.conftest import FAST_SETTINGS, TOKEN, _dump_logs, healthy_rig
from tests.etcd import EtcdCluster
from tests.nemesis.checker import Report, check_history, dump
from tests.nemesis.cluster import NemesisCluster
from tests.nemesis.history import History
from tests.nemesis.nemesis import Nemesis, NemesisShape
from tests.nemesis.workload import RawHttp, WorkloadShape, Writer, writer_client

pytestmark = pytest.mark.nemesis

NODES = 6
CI_SEED = 1

#: 6 nodes in two failure domains of 3, 3 hot copies, k=3 of n=6: both tiers survive 2
#: nodes down, or one whole domain (3 nodes: a copy and 3 fragments are on the other). GC
#: runs every half second with a 4 s grace, so it races with saves that reuse chunks; the
#: scrubber finds flipped files within seconds; encoding waits little, so chunks go cold
#: during the run.
SETTINGS: dict[str, Any] = {
    **FAST_SETTINGS,
    "k": 3,
    "n": 6,
    "gc_grace": 4.0,
    "gc_interval": 0.5,
    # a node down this long is gone (its data rebuilt elsewhere; on etcd its member record
    # removed): past a kill's restart, so only the gone fault reaches it, within a run
    "gone_after": 8.0,
    "repair_interval": 1.0,
    "scrub_interval": 5.0,
    "encode_defer": 0.5,
    "drain_defer": 0.2,
    "max_chunk_size": 2**20,
    "tiers": {"memory_capacity": "256MiB", "nvme_capacity": "1GiB", "cold_capacity": "1GiB"},
    # A retention policy over every writer's checkpoints (jobs w0, w1, ...), tighter than
    # the writers' own deletes (their newest 3): the leader deletes the third newest but
    # every third step through the rm path while the faults run, and the checker requires
    # what the policy must keep (checker.retention_may_delete).
    "retention": [{"prefix": "w", "keep_last": 2, "keep_every": 3}],
    "retention_interval": 1.0,
}
#: the policy the nodes apply, as the checker reads it
RETENTION = parse_rules(SETTINGS["retention"])


def domains(slots: int) -> dict[int, str]:
    """Slot -> failure domain: the first six in two racks of three (n0-n2, n3-n5); spares
    that join (etcd) alternate between them."""
    racks = {}
    for i in range(slots):
        first = i < NODES // 2 if i < NODES else i % 2 == 0
        racks[i] = "rack-a" if first else "rack-b"
    return racks


@dataclass(frozen=True, slots=True)
class RunShape:
    seconds: float
    workload: WorkloadShape
    nemesis: NemesisShape
    heal_timeout: float
    #: how long the writers may take to finish their step once told to stop
    wind_down: float = 120.0
    #: node slots beyond the first six that a ``join`` may start (etcd only)
    spares: int = 2
    #: the faults go on past ``seconds`` until every kind has run once, this long at most
    first_pass_grace: float = 40.0


#: share of committed checkpoints a writer archives when the cluster has an archive (the
#: embedded runs: a file:// directory beside the nodes')
ARCHIVE_RATE = 0.2

#: the default suite's run (the suite's time budget: the soak is the long one)
#: the nemesis's view of the nodes' timing
SHAPE = NemesisShape(gone_after=SETTINGS["gone_after"], gc_grace=SETTINGS["gc_grace"])

CI = RunShape(seconds=30.0, workload=WorkloadShape(writers=3), nemesis=SHAPE, heal_timeout=60.0)
#: the default suite's etcd run: shorter, beside the embedded CI run
ETCD_CI = RunShape(
    seconds=30.0, workload=WorkloadShape(writers=3), nemesis=SHAPE, heal_timeout=60.0
)

#: (seed, the etcd to coordinate through or None, spare slots) -> the started cluster
ClusterMaker = Callable[[int, EtcdCluster | None, int], NemesisCluster]


@pytest.fixture
def nemesis_etcd(request: pytest.FixtureRequest) -> EtcdCluster | None:
    """The session's etcd under ``--coordinator etcd`` (every member running), else None."""
    if request.config.getoption("--coordinator") != "etcd":
        return None
    return healthy_rig(request)


@pytest.fixture
def nemesis_cluster(request: pytest.FixtureRequest) -> Iterator[ClusterMaker]:
    """Starts the run's cluster (proxied peer links; a small-disk node when root); stops
    every node and proxy, unmounts and removes everything after, also on failure."""
    root = Path(tempfile.mkdtemp(prefix="storaged-nemesis-"))
    made: list[NemesisCluster] = []

    def make(seed: int, etcd: EtcdCluster | None, spares: int) -> NemesisCluster:
        # Spare slots join through etcd; the embedded cluster file is static.
        slots = NODES + (spares if etcd is not None else 0)
        for attempt in range(2):
            port = free_port_block(slots * 2 + 1)
            cluster = NemesisCluster(
                nodes=slots,
                initial=NODES,
                etcd_members=etcd.addresses if etcd is not None else None,
                data=root / f"cluster{len(made)}",
                port=port,
                peer_port=port + slots,
                token=TOKEN,
                settings=SETTINGS,
                env={"PYTHONASYNCIODEBUG": ""},
                small_disk=random.Random(f"{seed}/small-disk").randrange(NODES),
                domains=domains(slots),
                # Both modes archive some checkpoints (workload.py, step 7)
                archive=(root / f"archive{len(made)}").as_uri(),
                coordinator=etcd.fresh_prefix("nemesis") if etcd is not None else "",
            )
            made.append(cluster)
            why = cluster.mount_small_disk()
            if why is not None:
                print(f"nemesis: full-disk fault skipped: {why}")
            try:
                cluster.start()
            except ClusterError:
                cluster.stop()  # a port taken between the check and the bind: once more
                if attempt:
                    raise
                continue
            return cluster
        raise AssertionError("unreachable")

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for cluster in made:
                print(_dump_logs(cluster))
        shutil.rmtree(root, ignore_errors=True)


async def _until(event: asyncio.Event) -> None:
    await event.wait()


async def run_nemesis(
    cluster: NemesisCluster, seed: int, shape: RunShape, etcd: EtcdCluster | None = None
) -> tuple[Report, History]:
    history = History(seed, RETENTION)
    rng = random.Random(f"{seed}/base")
    base = [history.chunk(f"base/{i}", rng.randint(*shape.workload.sizes)) for i in range(6)]
    base_ids = [(cid, len(data)) for cid, data in base]
    stop = asyncio.Event()
    workload = shape.workload
    if cluster.archive and not workload.archive:
        workload = dataclasses.replace(workload, archive=ARCHIVE_RATE)
    # The writers know the first six nodes (spares that join are found through them).
    urls = cluster.urls[:NODES]
    clients = [writer_client(urls, TOKEN) for _ in range(shape.workload.writers + 2)]
    nemesis = Nemesis(
        cluster,
        history,
        shape.nemesis,
        full_disk=bool(cluster.mounts),
        etcd=etcd,
        initial=NODES,
        client=clients[-2],
    )
    timeout = aiohttp.ClientTimeout(total=30, sock_connect=3)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        raw = RawHttp(session, urls, TOKEN)
        for client in clients:
            await client.open()
        try:
            writers = [
                Writer(w, history, clients[w], raw, workload, base_ids)
                for w in range(shape.workload.writers)
            ]
            tasks = [asyncio.create_task(w.run(stop)) for w in writers]
            chaos = asyncio.create_task(nemesis.run())
            try:
                done, _ = await asyncio.wait([*tasks, chaos], timeout=shape.seconds)
                if not done and not nemesis.first_pass_done.is_set():
                    # A short run still sees every kind once (the budget may have held some).
                    history.note("nemesis: faults go on until every kind has run once")
                    passed = asyncio.create_task(_until(nemesis.first_pass_done))
                    done, _ = await asyncio.wait(
                        [*tasks, chaos, passed],
                        timeout=shape.first_pass_grace,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    passed.cancel()
                for task in done:
                    task.result()  # a bug in the suite itself fails the run at once
            finally:
                stop.set()
                await nemesis.finish()
                await chaos
                async with asyncio.timeout(shape.wind_down):
                    await asyncio.gather(*tasks)
            left = ", ".join(cluster.node_id(i) for i in nemesis.left) or "none"
            history.note(f"faults over, all members up (left for good: {left}): checking")
            report = await check_history(
                cluster,
                history,
                raw,
                clients[-1],
                faults=nemesis.faults,
                heal_timeout=shape.heal_timeout,
                remaining=nemesis.members,
            )
        finally:
            for client in clients:
                await client.close()
    return report, history


def _conclude(
    report: Report, history: History, capsys: pytest.CaptureFixture[str], etcd: object | None
) -> None:
    kinds = {k[6:]: n for k, n in sorted(history.counts.items()) if k.startswith("fault ")}
    skipped = {k: n for k, n in sorted(history.counts.items()) if k.endswith(" skipped")}
    with capsys.disabled():
        print("\n" + report.line())
        if history.counts["archive_asked"]:
            print(
                f"nemesis archive: {history.counts['archive_asked']} asked, "
                f"{history.counts['archived']} confirmed, "
                f"{history.counts['archived_after_delete']} read back after their delete"
            )
        print(f"nemesis faults by kind: {kinds}" + (f" ({skipped})" if skipped else ""))
    # Named by mode too: the two CI runs share seed 1 and run at once on two workers.
    mode = "embedded" if etcd is None else "etcd"
    log = Path(tempfile.gettempdir()) / f"storaged-nemesis-{mode}-seed{history.seed}.log"
    dump(history, log)
    if history.violations:
        listed = "\n".join(
            f"[{v.invariant}] t={v.at:.1f}s {v.text}" for v in history.violations[:20]
        )
        more = len(history.violations) - 20
        pytest.fail(
            f"{report.line()}\n{len(history.violations)} violation(s)"
            + (f" ({more} not shown)" if more > 0 else "")
            + f"; event log in {log}\n{listed}\ncounts: {dict(sorted(history.counts.items()))}"
        )
    assert report.acked > 0 and report.verified > 0, f"the run checked nothing: {report.line()}"


@pytest.mark.timeout(420)
async def test_nemesis_ci(
    nemesis_cluster: ClusterMaker,
    nemesis_etcd: EtcdCluster | None,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    replay = request.config.getoption("--nemesis-seed")
    seed = CI_SEED if replay is None else int(replay)
    cluster = await asyncio.to_thread(nemesis_cluster, seed, nemesis_etcd, CI.spares)
    report, history = await run_nemesis(cluster, seed, CI, nemesis_etcd)
    assert history.counts["archive_asked"] > 0, "no checkpoint was archived"
    _conclude(report, history, capsys, nemesis_etcd)


@pytest.mark.timeout(420)
async def test_nemesis_etcd_ci(
    nemesis_cluster: ClusterMaker,
    etcd_rig: EtcdCluster,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The default suite's etcd-mode run (the embedded one is ``test_nemesis_ci``)."""
    if request.config.getoption("--coordinator") == "etcd":
        pytest.skip("under --coordinator etcd, test_nemesis_ci runs on etcd itself")
    replay = request.config.getoption("--nemesis-seed")
    seed = CI_SEED if replay is None else int(replay)
    await asyncio.to_thread(etcd_rig.restore_blocking)
    cluster = await asyncio.to_thread(nemesis_cluster, seed, etcd_rig, ETCD_CI.spares)
    report, history = await run_nemesis(cluster, seed, ETCD_CI, etcd_rig)
    assert history.counts["archive_asked"] > 0, "no checkpoint was archived"
    _conclude(report, history, capsys, etcd_rig)


async def test_nemesis_soak(
    nemesis_cluster: ClusterMaker,
    nemesis_etcd: EtcdCluster | None,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seconds = request.config.getoption("--nemesis-seconds")
    if seconds is None:
        pytest.skip("the soak runs with --nemesis-seconds N")
    replay = request.config.getoption("--nemesis-seed")
    seed = secrets.randbelow(2**31) if replay is None else int(replay)
    with capsys.disabled():
        print(f"\nnemesis soak: seed={seed} for {seconds:.0f}s of faults")
    shape = RunShape(
        seconds=float(seconds),
        workload=WorkloadShape(writers=4),
        nemesis=NemesisShape(),
        heal_timeout=180.0,
    )
    cluster = await asyncio.to_thread(nemesis_cluster, seed, nemesis_etcd, shape.spares)
    report, history = await run_nemesis(cluster, seed, shape, nemesis_etcd)
    _conclude(report, history, capsys, nemesis_etcd)
