"""Prometheus metrics of one node (its own registry, so several nodes can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tier_bytes = Gauge("storaged_tier_bytes", "Bytes held per tier", ["tier"], registry=r)
        self.tier_chunks = Gauge(
            "storaged_tier_chunks",
            "Chunks (fragments for cold) held per tier",
            ["tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            "storaged_tier_capacity_bytes", "Capacity per tier", ["tier"], registry=r
        )
        self.drain_backlog = Gauge(
            "storaged_drain_backlog", "Chunks in RAM not yet on nvme", registry=r
        )
        self.encode_backlog = Gauge(
            "storaged_encode_backlog", "Chunks this node owns waiting to be encoded", registry=r
        )
        self.ack_latency = Histogram(
            "storaged_ack_seconds",
            "Time from PUT headers to the 3-copy ack",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.put_bytes = Counter("storaged_put_bytes_total", "Chunk bytes acked", registry=r)
        self.restore_bytes = Counter(
            "storaged_read_bytes_total", "Chunk bytes served, by source tier", ["tier"], registry=r
        )
        self.errors = Counter(
            "storaged_errors_total", "Error responses by code", ["code"], registry=r
        )
        self.drained = Counter("storaged_drained_total", "Chunks drained to nvme", registry=r)
        self.encoded = Counter("storaged_encoded_total", "Chunks encoded to cold", registry=r)
        self.repaired = Counter(
            "storaged_repaired_total",
            "Copies or fragments restored by repair",
            ["kind"],
            registry=r,
        )
        self.corrupt = Counter(
            "storaged_corrupt_total", "Stored copies that failed their check", ["tier"], registry=r
        )
        self.shm_leases = Gauge(
            "storaged_shm_leases", "Shared-memory leases held by local clients", registry=r
        )
        self.shm_ops = Counter(
            "storaged_shm_ops_total",
            "Shared-memory requests of local clients by operation and outcome",
            ["op", "outcome"],
            registry=r,
        )
        self.gc_freed = Counter("storaged_gc_freed_total", "Chunks freed by GC", registry=r)
        self.gc_failed_passes = Counter(
            "storaged_gc_failed_passes_total",
            "GC passes that could not take a complete catalogue snapshot",
            registry=r,
        )
        self.gc_stalled = Gauge(
            "storaged_gc_stalled_seconds",
            "How long GC has been stalled (no complete pass for longer than the grace); 0: not",
            registry=r,
        )
        self.gc_last_pass = Gauge(
            "storaged_gc_last_pass_timestamp_seconds",
            "When the last complete GC snapshot was taken (Unix time)",
            registry=r,
        )
        self.repair_backlog = Gauge(
            "storaged_repair_backlog",
            "Chunks this node leads the repair of that lacked copies or fragments at its last "
            "repair pass",
            registry=r,
        )
        self.misplaced_backlog = Gauge(
            "storaged_misplaced_backlog",
            "Chunks this node leads the repair of that lacked nothing but sat outside their "
            "placement at its last repair pass (rebalance moves them, paced)",
            registry=r,
        )
        self.rebalanced = Counter(
            "storaged_rebalanced_total",
            "Rebalance steps: copies and fragments moved to their placement, misplaced dropped",
            ["kind"],
            registry=r,
        )
        self.rebalanced_bytes = Counter(
            "storaged_rebalanced_bytes_total",
            "Bytes this node sent to move copies and fragments to their placement",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
