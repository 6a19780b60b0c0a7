"""Shared fixtures: real node processes on 127.0.0.1, and a guard against a blocked event loop."""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pytest

from storaged.tools.local_cluster import ClusterError, LocalCluster, free_port_block
from tests.etcd import EtcdCluster, etcd_binary

#: a callback holding the loop this long fails the test (generous: the machine is shared)
BLOCKING_LIMIT_S = 0.5

TOKEN = "test-token-0123456789"
#: the admin token of test clusters (POST /v1/admin/evict)
ADMIN_TOKEN = "test-admin-token-9876543210"

#: small, quick settings for test clusters
FAST_SETTINGS: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "down_after": 1.5,
    "repair_interval": 1.0,
    # a node down this long is gone: its data is rebuilt elsewhere (production: 600 s)
    "gone_after": 3.0,
    "gc_interval": 1.0,
    "keepalive_timeout": 3.0,
    "prefault_fraction": 0.0,
    "admin_token": ADMIN_TOKEN,
    "max_chunk_size": 16 * 2**20,
    "tiers": {"memory_capacity": "512MiB", "nvme_capacity": "4GiB", "cold_capacity": "4GiB"},
}


class _GcClock:
    """Seconds the cyclic garbage collector has spent in each thread (``gc.callbacks``). A
    collection that runs in a loop's thread holds the loop, but its length is the whole
    process's heap (in one pytest process: every module imported and every test's garbage
    so far), not the code under test: the guard does not count it (a full suite's run once
    saw a collection hold a loop for over 0.5 s, inside hypothesis's gc callback)."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._spent: dict[int, float] = {}
        gc.callbacks.insert(0, self._callback)  # first: its clock includes the others'

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.monotonic()
            return
        began = self._started.pop(thread, None)
        if began is not None:
            self._spent[thread] = self._spent.get(thread, 0.0) + time.monotonic() - began

    def spent(self, thread: int | None) -> float:
        """Seconds of collection in ``thread`` so far, the one running now included."""
        if thread is None:
            return 0.0
        began = self._started.get(thread)
        running = time.monotonic() - began if began is not None else 0.0
        return self._spent.get(thread, 0.0) + running


_GC_CLOCK = _GcClock()


class _LoopWatchdog:
    """Notices when a loop stops turning: a callback on the loop beats every 50 ms, and a
    thread records the loop thread's stack when a running loop has not beaten for
    ``BLOCKING_LIMIT_S``. Cheaper and quieter than asyncio's debug mode."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.last = time.monotonic()
        self.thread_id: int | None = None
        self.native_id: int | None = None
        self._cpu_at_beat: tuple[float, float] = (0.0, 0.0)  # (beat time, thread CPU s)
        self._gc_at_beat = 0.0  # the loop thread's collection seconds at the last beat
        self._running_since: float | None = None
        self._reported_for = 0.0
        loop.call_soon(self._beat)
        threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()

    def _beat(self) -> None:
        self.last = time.monotonic()
        self.thread_id = threading.get_ident()
        self.native_id = threading.get_native_id()
        self._gc_at_beat = _GC_CLOCK.spent(self.thread_id)
        if not self.loop.is_closed():
            self.loop.call_later(0.05, self._beat)

    def _watch(self) -> None:
        while not self.loop.is_closed():
            time.sleep(0.05)
            now = time.monotonic()
            if not self.loop.is_running():
                self._running_since = None
                continue
            if self._running_since is None:
                self._running_since = now
                continue
            since = max(self.last, self._running_since)
            state, cpu = _thread_state(self.native_id)
            if self._cpu_at_beat[0] != self.last:
                self._cpu_at_beat = (self.last, cpu)
            # The garbage collector's time in the loop thread since the beat is not a block
            held = now - since - max(0.0, _GC_CLOCK.spent(self.thread_id) - self._gc_at_beat)
            if held > BLOCKING_LIMIT_S and self._reported_for != since:
                frame = sys._current_frames().get(self.thread_id or -1)
                if frame is None or _in_loop_machinery(frame):
                    continue  # the loop itself, starved of CPU by a busy machine: not a block
                if state == "R" and cpu - self._cpu_at_beat[1] < 0.5 * (now - since):
                    continue  # runnable but given little CPU: starved by other work, not ours
                self._reported_for = since
                where = "".join(traceback.format_stack(frame)[-6:])
                _BLOCKED.append(f"loop blocked for over {BLOCKING_LIMIT_S}s at:\n{where}")


_BLOCKED: list[str] = []
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_state(native_id: int | None) -> tuple[str, float]:
    """(scheduler state letter, CPU seconds used) of a thread of this process, from /proc."""
    if native_id is None:
        return "?", 0.0
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return "?", 0.0
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


#: (function, file) of the machinery that starts a thread from the loop and waits for it
#: to run: the default executor adding a worker, asyncio's child watcher for a subprocess
_STARTS_A_THREAD: Final = frozenset(
    {("_adjust_thread_count", "thread.py"), ("add_child_handler", "unix_events.py")}
)
#: (function, file) where the loop thread, standing in it, waits for a lock that a thread
#: starting a thread holds: every executor's ``submit`` takes one lock shared by all the
#: executors of the process, and holds it while it adds a worker (a DCP executor in the
#: test's thread held it past 0.5 s on a starved machine)
_WAITS_FOR_A_THREAD_START: Final = frozenset({("submit", "thread.py")})


def _in_loop_machinery(frame: types.FrameType) -> bool:
    """Whether the loop thread stands in asyncio's own code (polling, dispatching), or
    waits for a thread asyncio or the default executor starts to be scheduled (a worker, or
    the child watcher of a subprocess: ``Thread.start`` waits until the new thread runs, and
    on a starved machine that took over 0.5 s), or for the lock another thread holds while
    it starts one."""
    filename = frame.f_code.co_filename
    if filename.startswith(_ASYNCIO_DIR) or filename.endswith("selectors.py"):
        return True
    if (frame.f_code.co_name, os.path.basename(filename)) in _WAITS_FOR_A_THREAD_START:
        return True
    outer: types.FrameType | None = frame
    while outer is not None:
        code = outer.f_code
        if (code.co_name, os.path.basename(code.co_filename)) in _STARTS_A_THREAD:
            return True
        outer = outer.f_back
    return False


def _guarded_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    _LoopWatchdog(loop)
    return loop


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--coordinator",
        choices=("embedded", "etcd"),
        default="embedded",
        help="what the test clusters coordinate through (cluster, cluster_factory, inproc, "
        "the nemesis cluster): the embedded membership and catalogue, or a real 3-member "
        "etcd on 127.0.0.1 started for the session (one key prefix per cluster)",
    )
    group = parser.getgroup("nemesis", "the nemesis suite (tests/nemesis)")
    group.addoption(
        "--nemesis-seconds",
        type=float,
        default=None,
        help="run the nemesis soak for this many seconds of faults (random seed, printed)",
    )
    group.addoption(
        "--nemesis-seed",
        type=int,
        default=None,
        help="replay a nemesis run: the seed its report line printed",
    )


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts background commands with SIGINT ignored, and an
    # ignored signal stays ignored across exec: the Ctrl-C tests' children (demo, load
    # test) would then never see the SIGINT the tests send them. A handled signal is reset
    # to the default on exec, so handling it here gives every child a normal Ctrl-C.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--coordinator") != "etcd":
        return
    for item in items:
        marker = item.get_closest_marker("embedded_only")
        if marker is not None:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"embedded coordination only: {why}"))


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"guarded": _guarded_loop}


@pytest.fixture(autouse=True)
def no_blocking_event_loop() -> Iterator[None]:
    """Fail a test during which its event loop was held for over BLOCKING_LIMIT_S."""
    _BLOCKED.clear()
    yield
    if _BLOCKED:
        report = "\n".join(_BLOCKED)
        _BLOCKED.clear()
        pytest.fail("the event loop was blocked:\n" + report)


def _node_env() -> dict[str, str]:
    # Node processes run without asyncio debug mode: it would slow them, not test them.
    return {"PYTHONASYNCIODEBUG": ""}


def etcd_missing() -> str | None:
    """Why the etcd tests cannot run here, or None."""
    if etcd_binary() is None or importlib.util.find_spec("etcd3aio") is None:
        return (
            "needs etcd (apt-get install etcd-server; scripts/test does it as root) and the "
            "etcd extra (pip install -e .[etcd])"
        )
    return None


@pytest.fixture(scope="session")
def etcd_rig(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    """A real 3-member etcd on 127.0.0.1 for the whole session, started when a test first
    needs it; every cluster on it gets a key prefix of its own (``fresh_prefix``)."""
    why = etcd_missing()
    if why is not None:
        if request.config.getoption("--coordinator") == "etcd":
            pytest.fail(f"--coordinator etcd: {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="storaged-etcd-"))
    rig = EtcdCluster(root)
    rig.start_blocking()
    try:
        yield rig
    finally:
        rig.close_blocking()
        shutil.rmtree(root, ignore_errors=True)


def coordinator_for(request: pytest.FixtureRequest) -> Callable[[], str] | None:
    """Under ``--coordinator etcd``: a maker of fresh coordinator URLs on the session's etcd
    (every member running again, should a test have left one down); else None."""
    if request.config.getoption("--coordinator") != "etcd":
        return None
    return healthy_rig(request).fresh_prefix


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Callable[[], str] | None:
    """``coordinator_for`` as a fixture: a sync one, so that an async fixture depending on
    it never starts the etcd rig inside its event loop."""
    return coordinator_for(request)


def healthy_rig(request: pytest.FixtureRequest) -> EtcdCluster:
    """The session's etcd, every member running (a test may have left one down)."""
    rig: EtcdCluster = request.getfixturevalue("etcd_rig")
    rig.restore_blocking()
    return rig


class ClusterFactory:
    """Starts ``LocalCluster``s; with ``coordinator`` (a fresh coordinator URL per call)
    their nodes run on that etcd instead of the embedded coordination."""

    def __init__(self, root: Path, coordinator: Callable[[], str] | None = None) -> None:
        self.root = root
        self.coordinator = coordinator
        self.clusters: list[LocalCluster] = []

    def __call__(
        self,
        nodes: int = 4,
        *,
        token: str = TOKEN,
        https: bool = False,
        node_module: str = "storaged",
        domains: Mapping[int, str] | None = None,
        archive: str | Mapping[str, Any] = "",
        env: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> LocalCluster:
        """``archive``: the [archive] table (or its URL) of every node; ``env``: variables
        the nodes get besides the tests' (an archive's AWS_* credentials)."""
        merged = {**FAST_SETTINGS, **settings}
        if "tiers" in settings:
            merged["tiers"] = {**FAST_SETTINGS["tiers"], **settings["tiers"]}
        for attempt in range(2):
            port = free_port_block(nodes * 2 + 1)
            cluster = LocalCluster(
                nodes=nodes,
                data=self.root / f"cluster{len(self.clusters)}",
                port=port,
                peer_port=port + nodes,
                token=token,
                settings=merged,
                env={**_node_env(), **(env or {})},
                https=https,
                coordinator=self.coordinator() if self.coordinator is not None else "",
                node_module=node_module,
                domains=dict(domains or {}),
                archive=archive,
            )
            self.clusters.append(cluster)
            try:
                cluster.start()
            except ClusterError:
                # Another process may have taken a port between the check and the bind.
                cluster.stop()
                if attempt:
                    raise
                continue
            return cluster
        raise AssertionError("unreachable")

    async def start(
        self,
        nodes: int = 4,
        *,
        token: str = TOKEN,
        https: bool = False,
        node_module: str = "storaged",
        domains: Mapping[int, str] | None = None,
        archive: str | Mapping[str, Any] = "",
        env: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> LocalCluster:
        """``self(...)`` off the event loop: for async tests."""
        return await asyncio.to_thread(
            functools.partial(
                self,
                nodes,
                token=token,
                https=https,
                node_module=node_module,
                domains=domains,
                archive=archive,
                env=env,
                **settings,
            )
        )

    def stop_all(self) -> None:
        for cluster in self.clusters:
            cluster.stop()


def _dump_logs(cluster: LocalCluster) -> str:
    # The whole logs outlive the test's directory, for a look after a failure.
    keep = Path(tempfile.gettempdir()) / "storaged-failed-logs" / cluster.data.parent.name
    out = [f"node logs kept in {keep}"]
    for i in range(cluster.nodes):
        log = cluster.data / cluster.node_id(i) / "node.log"
        if log.exists():
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, keep / f"{cluster.data.name}-{cluster.node_id(i)}.log")
            out.append(f"--- {log} (tail)\n" + "\n".join(log.read_text().splitlines()[-30:]))
    return "\n".join(out)


@pytest.fixture
def cluster_factory(
    request: pytest.FixtureRequest, coordinator: Callable[[], str] | None
) -> Iterator[ClusterFactory]:
    """Start clusters of real node processes (on etcd under ``--coordinator etcd``); all are
    stopped (and their dirs removed) after."""
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    factory = ClusterFactory(root, coordinator)
    try:
        yield factory
    finally:
        factory.stop_all()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for cluster in factory.clusters:
                print(_dump_logs(cluster))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """One 4-node cluster shared by a module's tests (tests that kill nodes use the factory)."""
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    factory = ClusterFactory(root, coordinator_for(request))
    try:
        yield factory()
    finally:
        factory.stop_all()
        shutil.rmtree(root, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
