"""Fixtures of the client tests: ``inproc``, clusters of real nodes in the test's own event
loop (``tests/service/inproc.py``), for tests that need no node process of their own, and
``inproc_cluster``, one such cluster of 4 nodes started with the client tests' settings
and a shared-memory listener on each node.

Tests whose nodes run in the test's loop must keep that loop free: synchronous work that
talks to the nodes (DCP's writer and reader, the ``storaged`` command's ``main``, a child
process waited for) runs in a thread (``asyncio.to_thread``)."""

from __future__ import annotations

import pytest

from tests.client.helpers import CLIENT_SETTINGS
from tests.service.conftest import inproc
from tests.service.inproc import InprocCluster, InprocFactory, start_with_shm

__all__ = ["inproc", "inproc_cluster"]


@pytest.fixture
async def inproc_cluster(inproc: InprocFactory) -> InprocCluster:
    """4 in-process nodes with ``CLIENT_SETTINGS``, every one alive in every view and each
    with a shared-memory listener, as node processes have (``start_with_shm``); stopped
    after the test (each test has its own: starting one takes tens of milliseconds)."""
    return await start_with_shm(inproc, 4, **CLIENT_SETTINGS)
