"""The cluster under test and what its nodes say about themselves.

- ``start_cluster``: a ``LocalCluster`` of node processes, stopped again if start-up fails;
  ``wait_prefaulted``: until the nodes' memory tiers are faulted in.
- ``MetricsSampler`` / ``read_bytes``: the nodes' ``/metrics``, sampled in a thread.
- ``node_cpu``, ``CpuMeter``: CPU seconds of the node processes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.harness.machine import MiB, proc_cpu_seconds
from storaged.tools.local_cluster import LocalCluster, free_port_block

HOST = "127.0.0.1"


TOKEN = "loadtest-token"


#: admin token of the clusters the load tests start (POST /v1/admin/evict)
ADMIN_TOKEN = "loadtest-admin-token"


TIERS = ("memory", "nvme", "cold")
#: node read counters by the tier they stand for: a cold chunk reaches a client either
#: decoded by a node (``cold``) or as fragments the client decodes itself (``fragment``,
#: extension E12); both are the cold tier's restore
SERVED_AS = {"fragment": "cold"}


def start_cluster(
    root: Path,
    nodes: int = 4,
    *,
    memory: str = "2GiB",
    max_chunk: int = 16 * MiB,
    settings: Mapping[str, Any] | None = None,
    node_module: str = "storaged",
    die_with_parent: bool = False,
    make: Callable[..., LocalCluster] = LocalCluster,
) -> LocalCluster:
    """A ``LocalCluster`` with token ``TOKEN`` under ``root``, healthy; stopped if start fails.
    ``node_module``: what the nodes run (``response_node.RESPONSE_NODE``: the old GET path).
    ``die_with_parent``: the nodes get SIGTERM when the thread that started them ends (call
    from the main thread only), so a benchmark killed mid-run takes its nodes along.
    ``make``: the cluster class (or a partial of it), e.g. ``netns.NetnsCluster``."""
    merged: dict[str, Any] = {
        "max_chunk_size": max_chunk,
        "tiers": {"memory_capacity": memory, "nvme_capacity": "256GiB",
                  "cold_capacity": "256GiB"},
        "log_level": "WARNING",
        "admin_token": ADMIN_TOKEN,
        # Every rank of a load test comes from 127.0.0.1: the per-client PUT cap (a guard
        # against one greedy client) would throttle the measured load itself.
        "max_client_puts": 4096,
    }  # fmt: skip
    merged.update(settings or {})
    port = free_port_block(nodes * 2 + 1)
    cluster = make(
        nodes=nodes,
        data=root,
        port=port,
        peer_port=port + nodes,
        token=TOKEN,
        settings=merged,
        env={"PYTHONASYNCIODEBUG": ""},
        node_module=node_module,
        die_with_parent=die_with_parent,
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_prefaulted(cluster: LocalCluster, timeout: float = 120.0) -> float:
    """Wait until every node has mapped its RAM pool (its "pre-faulted" log line, which the
    nodes write at INFO); the seconds that took. ``TimeoutError`` after ``timeout``."""
    t0 = time.monotonic()
    logs = [cluster.data / cluster.node_id(i) / "node.log" for i in range(cluster.nodes)]
    while True:
        done = 0
        for log in logs:
            with contextlib.suppress(OSError):
                done += "pre-faulted" in log.read_text(errors="replace")
        if done == len(logs):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{len(logs) - done} node(s) still mapping their RAM pool")
        time.sleep(0.2)


def scrape(url: str, timeout: float = 2.0) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A node's ``/metrics``: sample name -> {sorted label pairs: value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = float(sample.value)
    return out


def _each_node(
    urls: Iterable[str], name: str
) -> Iterator[tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    """(url, samples of ``name``) of each node that answers; a dead node's counters died
    with it."""
    for url in urls:
        try:
            samples = scrape(url).get(name, {})
        except (urllib.error.URLError, OSError, ValueError):
            continue
        yield url, samples


def errors_of(urls: Iterable[str], code: str) -> int:
    """How many error answers of ``code`` (``storaged_errors_total``) the nodes that answer
    gave in all."""
    return int(sum(
        v
        for _, samples in _each_node(urls, "storaged_errors_total")
        for labels, v in samples.items()
        if dict(labels).get("code") == code
    ))  # fmt: skip


def read_bytes(urls: Iterable[str]) -> dict[str, dict[str, float]]:
    """``storaged_read_bytes_total`` of each node that answers: {url: {tier: bytes}}."""
    out: dict[str, dict[str, float]] = {}
    for url, samples in _each_node(urls, "storaged_read_bytes_total"):
        tiers = out.setdefault(url, dict.fromkeys(TIERS, 0.0))
        for labels, value in samples.items():
            tier = dict(labels).get("tier", "?")
            tier = SERVED_AS.get(tier, tier)
            tiers[tier] = tiers.get(tier, 0.0) + value
    return out


def read_bytes_delta(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes read between two ``read_bytes``: (by tier, by node url)."""
    by_tier = dict.fromkeys(TIERS, 0)
    by_node: dict[str, int] = {}
    for url, tiers in after.items():
        old = before.get(url, {})
        for tier, value in tiers.items():
            delta = int(value - old.get(tier, 0.0))
            by_tier[tier] = by_tier.get(tier, 0) + delta
            by_node[url] = by_node.get(url, 0) + delta
    return by_tier, by_node


class MetricsSampler:
    """Samples the nodes' backlog gauges every ``period`` seconds in a thread.

    ``samples``: (seconds since start, {node url: {gauge: value}}) per round.
    """

    GAUGES = ("storaged_drain_backlog", "storaged_encode_backlog")

    def __init__(self, urls: Sequence[str], period: float = 0.1) -> None:
        self.urls = list(urls)
        self.period = period
        self.samples: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)

    def start(self) -> MetricsSampler:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            nodes: dict[str, dict[str, float]] = {}
            for url in self.urls:
                try:
                    samples = scrape(url, timeout=1.0)
                except (urllib.error.URLError, OSError, ValueError):
                    continue
                nodes[url] = {g: sum(samples.get(g, {}).values()) for g in self.GAUGES}
            self.samples.append((t - self.started, nodes))
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t)))

    def nodes_answering(self) -> int:
        """The most nodes that answered in one round (0 before the first)."""
        return max((len(nodes) for _, nodes in self.samples), default=0)

    def totals(self) -> list[tuple[float, float, float]]:
        """(t, drain backlog, encode backlog) summed over nodes, per sample."""
        return [
            (
                round(t, 3),
                sum(n.get(self.GAUGES[0], 0.0) for n in nodes.values()),
                sum(n.get(self.GAUGES[1], 0.0) for n in nodes.values()),
            )
            for t, nodes in self.samples
        ]

    def __enter__(self) -> MetricsSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def node_cpu(pids: Sequence[int]) -> float:
    """CPU seconds so far of the processes that still exist (a killed node counts no more)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += proc_cpu_seconds(pid)
    return total


class CpuMeter:
    """CPU seconds of the processes ``pids`` (all threads) since ``start``."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._at = 0.0

    def start(self) -> None:
        self._at = node_cpu(self.pids)

    def seconds(self) -> float:
        return node_cpu(self.pids) - self._at
