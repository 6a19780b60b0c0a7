"""A network of namespaces joined by capped links, made and removed by a load test (root).

``Fabric`` makes, for one run, a ``hub`` namespace holding a bridge and one more namespace
per node (``n<i>``) and per client (``c<j>``), each joined to the bridge by a veth pair
created inside the namespaces (no end ever lives in the host's namespace, so no traffic
can reach the host's interfaces: no default route, no link out). Addresses are in
``10.231.<x>.0/24``, which exists only inside those namespaces: the bridge ``.1``, node
``i`` ``.(10 + i)``, client ``j`` ``.(100 + j)``. A ``tc`` ``tbf`` qdisc caps each node's
link in both directions (the node's end: what it sends; the hub's end: what it receives);
clients' links are capped only with ``client_rate``.

Namespaces are named ``<PREFIX><owner pid>-<role>``: ``sweep`` removes those of a prefix
whose owner is gone (a run killed by SIGKILL), after killing the processes still in them.

A thread moves itself into a namespace with ``enter`` (``setns``: per thread on Linux;
sockets it makes stay in that namespace, threads it starts begin there); a child process
with ``ip netns exec``. ``NetnsCluster`` is a ``LocalCluster`` whose nodes run in the node
namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import storaged
from storaged.tools.local_cluster import LocalCluster

#: prefix of every namespace a load test makes (``ip netns list`` shows them)
PREFIX = "sdfab"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


class FabricUnavailable(RuntimeError):
    """The test bed cannot be built here: the message says which command refused and why."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; ``FabricUnavailable`` with the command and its error when it fails."""
    return _run(["ip", *args], check)


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["tc", *args], check)


def _run(cmd: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FabricUnavailable(f"{' '.join(cmd)}: {exc}") from None
    if check and done.returncode != 0:
        raise FabricUnavailable(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable_reason() -> str | None:
    """Why no fabric can be built here (not root, no ``ip``/``tc``), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (iproute2)"
    return None


def enter(ns: str | Path) -> None:
    """Move the calling thread into network namespace ``ns`` (a name or a ``/proc`` path)."""
    path = ns if isinstance(ns, Path) else NETNS_DIR / ns
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def owned(prefix: str = PREFIX) -> dict[str, int]:
    """Namespaces named ``<prefix><pid>-...``: {name: owner pid}."""
    out = {}
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        head = name.removeprefix(prefix).partition("-")[0]
        if name.startswith(prefix) and head.isdigit():
            out[name] = int(head)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(name: str, grace: float = 5.0) -> None:
    """Kill the processes left in namespace ``name`` (never this one), then delete it."""
    pids = [int(p) for p in ip("netns", "pids", name, check=False).stdout.split() if p.isdigit()]
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in pids if _alive(p)]
        if not pids:
            break
    ip("netns", "delete", name, check=False)


def sweep(prefix: str = PREFIX, owner: int | None = None) -> list[str]:
    """Remove this prefix's namespaces whose owner process is gone (and ``owner``'s, if
    given: a run that ended); the names removed."""
    gone = [n for n, pid in owned(prefix).items() if pid == owner or not _alive(pid)]
    for name in gone:
        remove(name)
    return gone


def rate_bytes(rate: str) -> float:
    """``tc`` rate text (``1gbit``, ``500mbit``, ``800kbit``) in bytes per second."""
    text = rate.strip().lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * scale / 8
    raise ValueError(f"want a rate like 1gbit or 500mbit, not {rate!r}")


@dataclass
class Fabric:
    """The namespaces of one run; ``build`` makes them, ``close`` removes them."""

    nodes: int
    clients: int
    rate: str
    client_rate: str | None = None
    prefix: str = PREFIX
    subnet: int = field(default_factory=lambda: 1 + os.getpid() % 250)
    made: list[str] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"{self.prefix}{os.getpid()}"

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def node_ns(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def client_ns(self, j: int) -> str:
        return f"{self.tag}-c{j}"

    def node_addr(self, i: int) -> str:
        return f"10.231.{self.subnet}.{10 + i}"

    def client_addr(self, j: int) -> str:
        return f"10.231.{self.subnet}.{100 + j}"

    @property
    def rate_bytes(self) -> float:
        return rate_bytes(self.rate)

    def build(self) -> Fabric:
        """Make every namespace, link and cap; on failure remove what was made and raise
        ``FabricUnavailable`` naming the command that refused."""
        try:
            self._add(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "addr", "add", f"10.231.{self.subnet}.1/24", "dev", "br0")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.nodes):
                self._join(self.node_ns(i), f"vn{i}", self.node_addr(i), self.rate)
            for j in range(self.clients):
                self._join(self.client_ns(j), f"vc{j}", self.client_addr(j), self.client_rate)
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _join(self, name: str, hub_end: str, addr: str, rate: str | None) -> None:
        """Namespace ``name`` with ``eth0`` at ``addr``, its peer ``hub_end`` on the bridge."""
        self._add(name)
        ip(
            "-n",
            self.hub,
            "link",
            "add",
            hub_end,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            name,
        )
        ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
        ip("-n", self.hub, "link", "set", hub_end, "up")
        ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        if rate is not None:
            self._cap(name, "eth0", rate)
            self._cap(self.hub, hub_end, rate)

    def _cap(self, ns: str, dev: str, rate: str) -> None:
        # A bucket of ~4 ms at the rate (at least 64 KiB, a few GSO segments): a token bucket
        # smaller than one segment would drop it; one much larger lets bursts through.
        burst = max(64 << 10, int(rate_bytes(rate) * 0.004))
        tc(
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "latency",
            "50ms",
        )

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes each hub-side link carried so far, as seen from its namespace's side:
        {``n<i>``/``c<j>``: (sent, received)} (the hub end's rx is what the node sent)."""
        out = {}
        done = ip("-n", self.hub, "-j", "-s", "link", "show")
        for link in json.loads(done.stdout or "[]"):
            name = str(link.get("ifname", ""))
            stats = link.get("stats64", {})
            if name[:2] in ("vn", "vc"):
                out[name[1:]] = (int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
        return out

    def close(self) -> None:
        """Remove every namespace made (killing what still runs in it), hub last."""
        for name in reversed(self.made):
            remove(name)
        self.made.clear()

    def __enter__(self) -> Fabric:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class NetnsCluster(LocalCluster):
    """A ``LocalCluster`` whose node ``i`` runs in ``fabric``'s namespace ``n<i>`` and
    serves on that namespace's address; this process must be in a namespace of the fabric
    (``enter(fabric.hub)``) to reach the nodes."""

    fabric: Fabric | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fabric is None:
            raise ValueError("NetnsCluster needs a fabric")
        # The generated node table with the namespaces' addresses (settings win over it).
        self.settings = {
            **self.settings,
            "nodes": [
                {
                    "id": self.node_id(i),
                    "url": self.url(i),
                    "peer": f"{self.fabric.node_addr(i)}:{self.peer_port + i}",
                    "data": str(self.data / self.node_id(i)),
                }
                for i in range(self.nodes)
            ],
        }

    def url(self, i: int) -> str:
        assert self.fabric is not None
        return f"http://{self.fabric.node_addr(i)}:{self.port + i}"

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        assert self.fabric is not None
        node_dir = self.data / self.node_id(i)
        node_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            "ip",
            "netns",
            "exec",
            self.fabric.node_ns(i),
            sys.executable,
            "-P",
            "-m",
            self.node_module,
            "serve",
            "--config",
            str(self.config_path),
            "--node",
            self.node_id(i),
        ]
        env = self.node_environ()
        root = str(Path(storaged.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        with open(node_dir / "node.log", "ab") as out:
            self._log_starts[i] = out.tell()
            # ``ip netns exec`` execs the command in place: the pid is the node's.
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_term_with_parent
            )
        self.procs[i] = proc
        (node_dir / "node.pid").write_text(f"{proc.pid}\n")
        return proc

    def serves(self, i: int) -> bool:
        """Whether node ``i`` runs and answers ``/healthz``: its address exists in its own
        namespace alone, so no other process can answer for it."""
        proc = self.procs.get(i)
        if proc is None or proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url(i) + "/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False


@dataclass(frozen=True)
class InNetns:
    """A ``WorkerPool`` job run by a worker moved into namespace ``ns`` first (its client
    threads and sockets are made after, so they are in ``ns`` too)."""

    ns: str
    job: Any

    def prepare(self) -> Any:
        enter(self.ns)
        return self.job.prepare()
