"""Fixtures of the coordination tests: the service tests' in-process clusters."""

from tests.service.conftest import http, inproc

__all__ = ["http", "inproc"]
