"""The nemesis's cluster: ``LocalCluster`` with every peer link through a fault proxy, and
optionally one node whose disks are small tmpfs mounts that a fault can fill."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from storaged.cluster import LocalCluster, free_port_block
from tests.nemesis.proxy import FaultProxies

#: the subdirectories of a node's data dir that hold chunk bytes (tiers/_durable.py layout)
DISK_TIERS = ("nvme", "cold")
FILL_NAME = ".nemesis-fill"  # at a tier's root: the tier's scan only looks two levels down


@dataclass
class NemesisCluster(LocalCluster):
    """Nodes dial their peers through ``proxies`` (started by ``start``), and node
    ``small_disk`` (if not None) keeps its nvme and cold tiers on tmpfs mounts of
    ``small_disk_bytes`` each (root only: ``mount_small_disk`` says whether it could)."""

    small_disk: int | None = None
    small_disk_bytes: int = 96 * 2**20
    proxies: FaultProxies | None = None
    mounts: list[Path] = field(default_factory=list)

    def start(self, timeout: float = 60.0) -> None:
        peers = {self.node_id(i): ("127.0.0.1", self.peer_port + i) for i in range(self.nodes)}
        self.proxies = FaultProxies(peers)
        self.proxies.start(free_port_block(len(self.proxies.links)))
        super().start(timeout=timeout)

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        assert self.proxies is not None, "start() first: the routes name the proxies' ports"
        # LocalCluster gives every node the same environment; only the routes differ.
        shared = self.env
        self.env = {**shared, "STORAGED_PEER_ROUTES": self.proxies.routes(self.node_id(i))}
        try:
            return super().start_node(i)
        finally:
            self.env = shared

    def mount_small_disk(self) -> str | None:
        """Mount the small tmpfs disks of node ``small_disk``; None, or why not."""
        if self.small_disk is None:
            return "no node chosen for the full disk"
        if os.geteuid() != 0:
            return "not root: cannot mount a small tmpfs (the full-disk fault is skipped)"
        for tier in DISK_TIERS:
            path = self.data / self.node_id(self.small_disk) / tier
            path.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.small_disk_bytes}", "tmpfs", str(path)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                self.unmount_small_disk()
                return f"mount -t tmpfs failed: {done.stderr.strip()}"
            self.mounts.append(path)
        return None

    def unmount_small_disk(self) -> None:
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
        self.mounts.clear()

    def fill_small_disk(self) -> int:
        """Fill the small disks to the last page; returns the bytes written."""
        written = 0
        for path in self.mounts:
            fd = os.open(path / FILL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                step = 2**20
                while step >= 4096:  # halve the writes once ENOSPC comes: fill to the brim
                    try:
                        written += os.write(fd, b"\0" * step)
                    except OSError:
                        step //= 2
            finally:
                os.close(fd)
        return written

    def free_small_disk(self) -> None:
        for path in self.mounts:
            with contextlib.suppress(FileNotFoundError):
                (path / FILL_NAME).unlink()

    def pid(self, i: int) -> int | None:
        proc = self.procs.get(i)
        return proc.pid if proc is not None and proc.poll() is None else None

    def signal_node(self, i: int, sig: int) -> bool:
        proc = self.procs.get(i)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(sig)
        return True

    def stop(self, timeout: float = 0.0) -> None:
        # A SIGSTOPped node would sit out the SIGTERM until the timeout: wake every node first.
        for i in list(self.procs):
            self.signal_node(i, signal.SIGCONT)
        try:
            super().stop(timeout=timeout)
        finally:
            if self.proxies is not None:
                self.proxies.close()
            self.unmount_small_disk()
