"""Fixtures of the client tests: ``inproc``, clusters of real nodes in the test's own event
loop (``tests/service/inproc.py``), for tests that need no node process of their own."""

from __future__ import annotations

from tests.service.conftest import inproc

__all__ = ["inproc"]
