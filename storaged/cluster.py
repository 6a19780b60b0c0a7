"""A local cluster of node processes on 127.0.0.1: what ``storaged up`` and the tests run.

Node ``n<i>`` serves HTTP on ``port + i`` and the peer protocol on
``peer_port + i`` (default ``port + 1000 + i``); its data lives under
``data/n<i>/``. The generated cluster file is ``data/cluster.toml`` (mode 0600:
it holds the cluster secret); each node's pid is in ``data/n<i>/node.pid``.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w


class ClusterError(RuntimeError):
    pass


def default_erasure(nodes: int, n: int = 6) -> tuple[int, int]:
    """(k, n) such that losing any one of ``nodes`` nodes loses at most n - k fragments."""
    n = max(n, min(nodes, 12))
    per_node = math.ceil(n / nodes)
    k = n - per_node
    if k < 1:
        raise ClusterError(f"{nodes} node(s) cannot hold erasure-coded data that survives a loss")
    return k, n


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(count: int, start: int = 10000, end: int | None = None) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (best effort).

    Drawn below the kernel's ephemeral range, so that outgoing connections of other
    processes cannot take one of them between this check and the nodes' bind.
    """
    if end is None:
        end = _ephemeral_low()
    rng = secrets.SystemRandom()
    for _ in range(200):
        base = rng.randrange(start, end - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError("no free block of ports found")


@dataclass
class LocalCluster:
    nodes: int
    data: Path
    port: int
    peer_port: int = 0
    token: str = ""
    replication: int = 3
    settings: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    log_to_files: bool = True
    #: nodes serve HTTPS (settings must carry tls_cert and tls_key)
    https: bool = False
    #: nodes get SIGTERM when the process that started them dies, even by SIGKILL (Linux);
    #: for ``storaged up`` and the demo, so no node outlives its supervisor
    die_with_parent: bool = False
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = Path(self.data)
        if not self.peer_port:
            self.peer_port = self.port + 1000
        self.replication = min(self.replication, self.nodes)

    # ---- config -------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.data / "cluster.toml"

    def node_id(self, i: int) -> str:
        return f"n{i}"

    def url(self, i: int) -> str:
        scheme = "https" if self.https else "http"
        return f"{scheme}://127.0.0.1:{self.port + i}"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(self.nodes)]

    def write_config(self) -> Path:
        """Write the cluster file, keeping the secret of an existing one (restarts reuse it)."""
        self.data.mkdir(parents=True, exist_ok=True)
        secret = secrets.token_hex(32)
        if self.config_path.exists():
            import tomllib

            old = tomllib.loads(self.config_path.read_text())
            secret = old.get("auth", {}).get("cluster_secret", secret)
        k, n = default_erasure(self.nodes)
        doc: dict[str, Any] = {
            "replication": self.replication,
            "erasure": {"codec": "zfec", "k": k, "n": n},
            "auth": {"cluster_secret": secret},
            "nodes": [
                {
                    "id": self.node_id(i),
                    "url": self.url(i),
                    "peer": f"127.0.0.1:{self.peer_port + i}",
                    "data": str(self.data / self.node_id(i)),
                }
                for i in range(self.nodes)
            ],
        }
        if self.token:
            doc["auth"]["token"] = self.token
        for key, value in self.settings.items():
            if key in ("codec", "k", "n"):
                doc["erasure"][key] = value
            else:
                doc[key] = value
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            tomli_w.dump(doc, f)
        return self.config_path

    # ---- processes ----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        self.write_config()
        for i in range(self.nodes):
            self.start_node(i)
        self.wait_healthy(timeout=timeout)
        self.wait_converged(timeout=timeout)

    def wait_converged(self, timeout: float = 60.0) -> None:
        """Wait until every running node sees exactly the running nodes as alive.

        Right after start-up a node may still count a peer that was not listening yet as
        down; a write then would find too few replicas.
        """
        import json

        running = {self.node_id(i) for i in range(self.nodes) if self.alive(i)}
        deadline = time.monotonic() + timeout
        pending = set(running)
        while pending:
            for node in sorted(pending):
                request = urllib.request.Request(
                    self.url(int(node[1:])) + "/v1/cluster",
                    headers={
                        "Accept": "application/json",
                        **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
                    },
                )
                try:
                    with urllib.request.urlopen(
                        request, timeout=2, context=self._health_ssl()
                    ) as resp:
                        doc = json.loads(resp.read())
                except (urllib.error.URLError, OSError, ValueError):
                    continue
                seen = {n["id"] for n in doc["nodes"] if n["alive"]}
                if seen == running:
                    pending.discard(node)
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"nodes {sorted(pending)} do not see {sorted(running)} alive")
            if pending:
                time.sleep(0.1)

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        node_dir = self.data / self.node_id(i)
        node_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "storaged",
            "serve",
            "--config",
            str(self.config_path),
            "--node",
            self.node_id(i),
        ]
        env = {**os.environ, **self.env}
        out: Any = subprocess.DEVNULL
        if self.log_to_files:
            out = open(node_dir / "node.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_term_with_parent if self.die_with_parent else None,
        )
        if self.log_to_files:
            out.close()
        self.procs[i] = proc
        (node_dir / "node.pid").write_text(f"{proc.pid}\n")
        return proc

    def wait_healthy(self, indexes: list[int] | None = None, timeout: float = 60.0) -> None:
        pending = set(range(self.nodes) if indexes is None else indexes)
        deadline = time.monotonic() + timeout
        while pending:
            for i in sorted(pending):
                proc = self.procs.get(i)
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(
                        f"node {self.node_id(i)} exited with {proc.returncode}; "
                        f"see {self.data / self.node_id(i) / 'node.log'}"
                    )
                try:
                    with urllib.request.urlopen(
                        self.url(i) + "/healthz", timeout=1, context=self._health_ssl()
                    ) as resp:
                        if resp.status == 200:
                            pending.discard(i)
                except (urllib.error.URLError, OSError):
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(self.node_id(i) for i in sorted(pending))
                raise ClusterError(f"node(s) {names} not healthy after {timeout:.0f}s")
            if pending:
                time.sleep(0.1)

    def _health_ssl(self) -> ssl.SSLContext | None:
        if not self.https:
            return None
        # Only asks our own loopback node whether it is up: no secret goes over it.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(i)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def restart(self, i: int, timeout: float = 60.0) -> None:
        self.kill(i, signal.SIGTERM)
        self.start_node(i)
        self.wait_healthy([i], timeout=timeout)
        self.wait_converged(timeout=timeout)

    def alive(self, i: int) -> bool:
        proc = self.procs.get(i)
        return proc is not None and proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _term_with_parent() -> None:
    """In the child before exec: ask the kernel for SIGTERM when the parent thread dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: nodes then outlive a killed parent
        pass


def wait_forever_until_signal(cluster: LocalCluster) -> int:
    """Block until SIGINT/SIGTERM, then stop every node. Returns the exit status."""
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop:
        time.sleep(0.2)
    cluster.stop()
    return 0
