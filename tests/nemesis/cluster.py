"""The nemesis's cluster: ``LocalCluster`` with every peer link through a fault proxy,
on etcd every node's etcd links through proxies of their own, optionally one node whose
disks are small tmpfs mounts that a fault can fill, and spare node slots that join
later (etcd only: the embedded cluster file is static)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from storaged.coord.target import parse_etcd_url
from storaged.tools.local_cluster import LocalCluster, free_port_block
from tests.nemesis.proxy import FaultProxies

#: the subdirectories of a node's data dir that hold chunk bytes (tiers/_durable.py layout)
DISK_TIERS = ("nvme", "cold")
FILL_NAME = ".nemesis-fill"  # at a tier's root: the tier's scan only looks two levels down


@dataclass
class NemesisCluster(LocalCluster):
    """Nodes dial their peers through ``proxies`` (started by ``start``), and node
    ``small_disk`` (if not None) keeps its nvme and cold tiers on tmpfs mounts of
    ``small_disk_bytes`` each (root only: ``mount_small_disk`` says whether it could).

    ``start`` starts the first ``initial`` of the ``nodes`` slots (all when None); the
    others are spares that ``start_node`` joins later, on etcd. With ``etcd_members``
    (name -> client address of each etcd member) every node reaches etcd through its own
    links of ``etcd_proxies`` (node id, member name): its coordinator URL names them."""

    small_disk: int | None = None
    small_disk_bytes: int = 96 * 2**20
    proxies: FaultProxies | None = None
    mounts: list[Path] = field(default_factory=list)
    initial: int | None = None
    etcd_members: dict[str, tuple[str, int]] | None = None
    etcd_proxies: FaultProxies | None = None

    def start(self, timeout: float = 60.0) -> None:
        ids = [self.node_id(i) for i in range(self.nodes)]
        peers = {node: ("127.0.0.1", self.peer_port + i) for i, node in enumerate(ids)}
        self.proxies = FaultProxies(peers)
        self.proxies.start(free_port_block(len(self.proxies.links)))
        if self.etcd_members is not None:
            self.etcd_proxies = FaultProxies(self.etcd_members, dialers=ids)
            self.etcd_proxies.start(free_port_block(len(self.etcd_proxies.links)))
        first = self.nodes if self.initial is None else self.initial
        self.check_not_running()
        self.write_config()
        for i in range(first):
            self.start_node(i)
        self.wait_healthy(list(range(first)), timeout=timeout)
        self.wait_converged(timeout=timeout)

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        assert self.proxies is not None, "start() first: the routes name the proxies' ports"
        # LocalCluster gives every node the same environment and coordinator; only the
        # routes (and the etcd endpoints) differ.
        shared, coordinator = self.env, self.coordinator
        node = self.node_id(i)
        self.env = {**shared, "STORAGED_PEER_ROUTES": self.proxies.routes(node)}
        if self.etcd_proxies is not None:
            root = parse_etcd_url(coordinator).root
            self.coordinator = f"etcd://{','.join(self.etcd_proxies.endpoints(node))}{root}"
        try:
            return super().start_node(i)
        finally:
            self.env, self.coordinator = shared, coordinator

    def wipe(self, i: int) -> int:
        """Empty node ``i``'s data directory (it must be down), keeping its log and the
        small disk's mount points; returns the entries removed."""
        root = self.data / self.node_id(i)
        removed = 0
        for entry in sorted(root.iterdir()) if root.exists() else []:
            if entry.name == "node.log":
                continue  # not data: the end's log check reads it
            if entry in self.mounts:
                for inner in entry.iterdir():
                    _remove(inner)
                    removed += 1
                continue
            _remove(entry)
            removed += 1
        return removed

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
            for proxies in (self.proxies, self.etcd_proxies):
                if proxies is not None:
                    proxies.close()
            self.unmount_small_disk()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
