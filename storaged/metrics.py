"""Prometheus metrics of one node (its own registry, so several nodes can share a process)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: seconds, from a loopback ack to a slow disk's
_ACK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class NodeMetrics:
    """Every metric of a node, registered group by group (in the order ``render`` lists
    them): the tiers, the data path, the pipeline's work, shared memory, GC, repair."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._tiers()
        self._data_path()
        self._pipeline()
        self._shared_memory()
        self._gc()
        self._repair()

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _tiers(self) -> None:
        self.tier_bytes = self._gauge("storaged_tier_bytes", "Bytes held per tier", ["tier"])
        self.tier_chunks = self._gauge(
            "storaged_tier_chunks", "Chunks (fragments for cold) held per tier", ["tier"]
        )
        self.tier_capacity = self._gauge(
            "storaged_tier_capacity_bytes", "Capacity per tier", ["tier"]
        )
        self.drain_backlog = self._gauge("storaged_drain_backlog", "Chunks in RAM not yet on nvme")
        self.encode_backlog = self._gauge(
            "storaged_encode_backlog", "Chunks this node owns waiting to be encoded"
        )

    def _data_path(self) -> None:
        self.ack_latency = Histogram(
            "storaged_ack_seconds",
            "Time from PUT headers to the 3-copy ack",
            buckets=_ACK_BUCKETS,
            registry=self.registry,
        )
        self.put_bytes = self._counter("storaged_put_bytes_total", "Chunk bytes acked")
        self.restore_bytes = self._counter(
            "storaged_read_bytes_total", "Chunk bytes served, by source tier", ["tier"]
        )
        self.errors = self._counter("storaged_errors_total", "Error responses by code", ["code"])

    def _pipeline(self) -> None:
        self.drained = self._counter("storaged_drained_total", "Chunks drained to nvme")
        self.encoded = self._counter("storaged_encoded_total", "Chunks encoded to cold")
        self.repaired = self._counter(
            "storaged_repaired_total", "Copies or fragments restored by repair", ["kind"]
        )
        self.corrupt = self._counter(
            "storaged_corrupt_total", "Stored copies that failed their check", ["tier"]
        )

    def _shared_memory(self) -> None:
        self.shm_leases = self._gauge(
            "storaged_shm_leases", "Shared-memory leases held by local clients"
        )
        self.shm_ops = self._counter(
            "storaged_shm_ops_total",
            "Shared-memory requests of local clients by operation and outcome",
            ["op", "outcome"],
        )

    def _gc(self) -> None:
        self.gc_freed = self._counter("storaged_gc_freed_total", "Chunks freed by GC")
        self.gc_failed_passes = self._counter(
            "storaged_gc_failed_passes_total",
            "GC passes that could not take a complete catalogue snapshot",
        )
        self.gc_stalled = self._gauge(
            "storaged_gc_stalled_seconds",
            "How long GC has been stalled (no complete pass for longer than the grace); 0: not",
        )
        self.gc_last_pass = self._gauge(
            "storaged_gc_last_pass_timestamp_seconds",
            "When the last complete GC snapshot was taken (Unix time)",
        )

    def _repair(self) -> None:
        self.repair_backlog = self._gauge(
            "storaged_repair_backlog",
            "Chunks this node leads the repair of that lacked copies or fragments at its last "
            "repair pass",
        )
        self.misplaced_backlog = self._gauge(
            "storaged_misplaced_backlog",
            "Chunks this node leads the repair of that lacked nothing but sat outside their "
            "placement at its last repair pass (rebalance moves them, paced)",
        )
        self.rebalanced = self._counter(
            "storaged_rebalanced_total",
            "Rebalance steps: copies and fragments moved to their placement, misplaced dropped",
            ["kind"],
        )
        self.rebalanced_bytes = self._counter(
            "storaged_rebalanced_bytes_total",
            "Bytes this node sent to move copies and fragments to their placement",
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
