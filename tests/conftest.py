"""Shared fixtures: real node processes on 127.0.0.1, and a guard against a blocked event loop."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storaged.cluster import LocalCluster, free_port_block

# asyncio's debug mode logs every callback that holds the loop for longer than
# slow_callback_duration; the guard below turns long ones into test failures.
os.environ.setdefault("PYTHONASYNCIODEBUG", "1")
#: a callback holding the loop this long fails the test (generous: the machine is shared)
BLOCKING_LIMIT_S = 0.5
_SLOW = re.compile(r"Executing .* took (\d+\.\d+) seconds")

TOKEN = "test-token-0123456789"

#: small, quick settings for test clusters
FAST_SETTINGS: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "down_after": 1.5,
    "repair_interval": 1.0,
    "gc_interval": 1.0,
    "keepalive_timeout": 3.0,
    "max_chunk_size": 16 * 2**20,
    "tiers": {"memory_capacity": "512MiB", "nvme_capacity": "4GiB", "cold_capacity": "4GiB"},
}


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.slow: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = _SLOW.search(record.getMessage())
        if m and float(m.group(1)) > BLOCKING_LIMIT_S:
            self.slow.append(record.getMessage()[:300])


@pytest.fixture(autouse=True)
def no_blocking_event_loop() -> Iterator[None]:
    """Fail a test during which an asyncio callback held the loop over BLOCKING_LIMIT_S."""
    handler = _SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.slow:
        pytest.fail("the event loop was blocked:\n" + "\n".join(handler.slow))


def _node_env() -> dict[str, str]:
    # Node processes run without asyncio debug mode: it would slow them, not test them.
    return {"PYTHONASYNCIODEBUG": ""}


class ClusterFactory:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.clusters: list[LocalCluster] = []

    def __call__(
        self, nodes: int = 4, *, token: str = TOKEN, https: bool = False, **settings: Any
    ) -> LocalCluster:
        merged = {**FAST_SETTINGS, **settings}
        if "tiers" in settings:
            merged["tiers"] = {**FAST_SETTINGS["tiers"], **settings["tiers"]}
        port = free_port_block(nodes * 2 + 1)
        cluster = LocalCluster(
            nodes=nodes,
            data=self.root / f"cluster{len(self.clusters)}",
            port=port,
            peer_port=port + nodes,
            token=token,
            settings=merged,
            env=_node_env(),
            https=https,
        )
        self.clusters.append(cluster)
        cluster.start()
        return cluster

    def stop_all(self) -> None:
        for cluster in self.clusters:
            cluster.stop()


def _dump_logs(cluster: LocalCluster) -> str:
    out = []
    for i in range(cluster.nodes):
        log = cluster.data / cluster.node_id(i) / "node.log"
        if log.exists():
            out.append(f"--- {log} (tail)\n" + "\n".join(log.read_text().splitlines()[-30:]))
    return "\n".join(out)


@pytest.fixture
def cluster_factory(request: pytest.FixtureRequest) -> Iterator[ClusterFactory]:
    """Start clusters of real node processes; all are stopped (and their dirs removed) after."""
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    factory = ClusterFactory(root)
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
def cluster() -> Iterator[LocalCluster]:
    """One 4-node cluster shared by a module's tests (tests that kill nodes use the factory)."""
    root = Path(tempfile.mkdtemp(prefix="storaged-test-"))
    factory = ClusterFactory(root)
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
