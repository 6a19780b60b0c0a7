"""The soak's time limit follows ``--nemesis-seconds`` (the suite's default limit would cut
a long soak short); the run itself bounds every wait."""

from __future__ import annotations

import pytest

#: start-up, wind-down, heal (at most 180 s) and the final reads, over the faults' time
SOAK_OVERHEAD_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = config.getoption("--nemesis-seconds", default=None)
    if seconds is None:
        return
    for item in items:
        if item.name == "test_nemesis_soak":
            item.add_marker(pytest.mark.timeout(float(seconds) + SOAK_OVERHEAD_S))
