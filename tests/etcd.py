"""A real etcd cluster for the tests: ``size`` members on 127.0.0.1, data in a temp dir.

Uses Debian's ``etcd-server`` (binary ``etcd``, on PATH or at ``/usr/bin/etcd``);
``scripts/test`` installs it on a fresh machine when run as root. Members can be killed
(SIGKILL: a crashed member), stopped (SIGSTOP: a hung one) and started again from their
data directories; ``close`` stops every member and waits for the processes.

The members are plain child processes, not tied to an event loop: the async methods serve
the tests in one loop, the ``*_blocking`` ones a rig that outlives loops (the session's
rig of ``--coordinator etcd``, tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from storaged.tools.local_cluster import free_port_block

#: heartbeat and election timeout of the members (ms): etcd's defaults are 100 and 1000;
#: a loaded 2-core machine with 3 members and the nodes on it needs more slack
HEARTBEAT_MS = 100
ELECTION_MS = 2000


def etcd_binary() -> str | None:
    """The ``etcd`` server binary, or None when it is not installed."""
    found = shutil.which("etcd")
    if found is not None:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


@dataclass
class EtcdMember:
    index: int
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None


@dataclass
class EtcdCluster:
    """``size`` etcd members under ``root``. ``start`` waits until the cluster takes writes."""

    root: Path
    size: int = 3
    members: list[EtcdMember] = field(default_factory=list)
    binary: str = ""
    _prefixes: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{m.client_port}" for m in self.members]

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        """Member name -> client address: what a proxy in front of each member dials."""
        return {f"e{m.index}": ("127.0.0.1", m.client_port) for m in self.members}

    @property
    def url(self) -> str:
        """The coordinator URL a node is configured with (``Config.coordinator``)."""
        return "etcd://" + ",".join(self.endpoints)

    def fresh_prefix(self, what: str = "t") -> str:
        """A coordinator URL under a key prefix no cluster used before: clusters sharing
        this etcd do not see each other's members or checkpoints."""
        return f"{self.url}/{what}{next(self._prefixes)}-{time.monotonic_ns()}"

    def _initial_cluster(self) -> str:
        return ",".join(f"e{m.index}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    async def start(self, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.start_blocking, timeout)
        await self.wait_healthy(timeout)

    def start_blocking(self, timeout: float = 60.0) -> None:
        """Start the members and wait until each says it sees a leader (``start`` also
        writes through each); for a caller outside an event loop."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server)")
        self.binary = binary
        for attempt in range(3):
            base = free_port_block(2 * self.size)
            self.members = [
                EtcdMember(i, base + i, base + self.size + i, self.root / f"etcd{attempt}-e{i}")
                for i in range(self.size)
            ]
            for m in self.members:
                self.launch(m.index)
            try:
                self.wait_serving(timeout)
                return
            except BaseException:
                # A port taken between the check and the bind kills a member at once: try
                # other ports; anything else is a failure.
                died = not all(self.running(m.index) for m in self.members)
                self.close_blocking()
                if attempt == 2 or not died:
                    raise
        raise AssertionError("unreachable")

    def running(self, i: int) -> bool:
        p = self.members[i].process
        return p is not None and p.poll() is None

    async def start_member(self, i: int) -> None:
        """Start member ``i`` (again, from its data directory if it ran before)."""
        self.launch(i)

    def launch(self, i: int) -> None:
        """``start_member`` without a loop: only spawns the process (it does not wait)."""
        m = self.members[i]
        if self.running(i):
            raise RuntimeError(f"etcd member e{i} is already running")
        m.data_dir.mkdir(parents=True, exist_ok=True)
        # A small local file: the children write their logs there
        log = open(self.root / f"e{i}.log", "ab")  # noqa: SIM115
        try:
            cmd = [
                self.binary,
                "--name", f"e{i}",
                "--data-dir", str(m.data_dir),
                "--listen-client-urls", f"http://127.0.0.1:{m.client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{m.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-cluster", self._initial_cluster(),
                "--initial-cluster-state", "new",
                "--initial-cluster-token", f"storaged-test-{self.members[0].client_port}",
                "--heartbeat-interval", str(HEARTBEAT_MS),
                "--election-timeout", str(ELECTION_MS),
                "--logger", "zap",
                "--log-level", "warn",
            ]  # fmt: skip
            m.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            log.close()

    async def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a crash) and reap it."""
        await asyncio.to_thread(self.kill_blocking, i)

    def kill_blocking(self, i: int) -> None:
        p = self.members[i].process
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped member would not die before it
                p.kill()
            p.wait(timeout=30)

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: it neither answers nor closes its connections."""
        p = self.members[i].process
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        p = self.members[i].process
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)

    async def kill_all(self) -> None:
        await asyncio.to_thread(self.close_blocking)

    def close_blocking(self) -> None:
        for m in self.members:
            self.kill_blocking(m.index)

    async def start_all(self, timeout: float = 60.0) -> None:
        for m in self.members:
            if not self.running(m.index):
                self.launch(m.index)
        await self.wait_healthy(timeout)

    def restore_blocking(self, timeout: float = 60.0) -> None:
        """Continue stopped members, start dead ones, wait until all serve (a rig shared
        by many tests: one may have left a member down)."""
        for m in self.members:
            self.resume(m.index)
            if not self.running(m.index):
                self.launch(m.index)
        self.wait_serving(timeout)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until every member says over HTTP that it is healthy (it sees a leader): the
        check of ``wait_healthy`` for a caller without an event loop. A member that is not
        running, or not healthy within ``timeout``, fails it."""
        deadline = time.monotonic() + timeout
        for m in self.members:
            while self.running(m.index):
                url = f"http://127.0.0.1:{m.client_port}/health"
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        if b'"true"' in resp.read():
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member e{m.index} not healthy within {timeout}s")
                time.sleep(0.1)
            else:
                raise AssertionError(f"etcd member e{m.index} exited: see {self.root}")

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until a write through every running member's endpoint succeeds."""
        from etcd3aio import Etcd3Client, EtcdError

        deadline = time.monotonic() + timeout
        running = [m for m in self.members if self.running(m.index)]
        for m in running:
            async with Etcd3Client([f"127.0.0.1:{m.client_port}"], rpc_max_attempts=1) as client:
                assert client.kv is not None
                while True:
                    if not self.running(m.index):
                        raise AssertionError(f"etcd member e{m.index} exited: see {self.root}")
                    try:
                        await client.kv.put("/storaged-test/health", b"ok", timeout=2.0)
                        break
                    except (EtcdError, TimeoutError):
                        if time.monotonic() > deadline:
                            raise AssertionError(
                                f"etcd member e{m.index} not healthy within {timeout}s"
                            ) from None
                        await asyncio.sleep(0.1)

    async def leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads now (as a running member reports it)."""
        from etcd3aio import Etcd3Client, EtcdError

        deadline = time.monotonic() + timeout
        while True:
            for m in self.members:
                if not self.running(m.index):
                    continue
                async with Etcd3Client([f"127.0.0.1:{m.client_port}"], rpc_max_attempts=1) as c:
                    assert c.maintenance is not None
                    try:
                        status = await c.maintenance.status(timeout=2.0)
                    except (EtcdError, TimeoutError):
                        continue
                    if status.leader and status.leader == status.header.member_id:
                        return m.index
            if time.monotonic() > deadline:
                raise AssertionError(f"no etcd leader within {timeout}s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.kill_all()
