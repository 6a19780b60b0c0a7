"""Fixtures of the service tests: in-process clusters (see ``tests/service/inproc.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.service.inproc import InprocFactory


@pytest.fixture
async def inproc(
    tmp_path: Path, coordinator: Callable[[], str] | None
) -> AsyncIterator[InprocFactory]:
    """Start clusters of nodes in the test's own event loop (on etcd under
    ``--coordinator etcd``); every node is stopped after."""
    factory = InprocFactory(tmp_path, coordinator)
    try:
        yield factory
    finally:
        await factory.close_all()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
