"""The ack's floor per role (``loadtest.harness.floor``): the sums, on placements small enough
to add up by hand, and the rates measured here."""

from __future__ import annotations

import os

import pytest

from loadtest.harness.floor import FloorRates, floor_table, measure_rates, role_floors

GB = 1e9
RATES = FloorRates(copy=1.0, blake3=10.0, crc32c=100.0, send=1000.0, recv=10000.0)
NODES = ["n0", "n1", "n2", "n3"]


def test_colocated_entry_that_holds_a_copy() -> None:
    # one GB chunk handed to n0 in shared memory; n0, n1, n2 hold it
    floor = role_floors({"a": ["n0", "n1", "n2"]}, {"a": int(GB)}, lambda c, h: "n0", RATES,
                        colocated=True, nodes=NODES)  # fmt: skip
    assert floor.client == pytest.approx(1.0)  # the copy into leased memory
    # n0: its own BLAKE3, one CRC, two sends
    assert floor.nodes["n0"] == pytest.approx(10 + 100 + 2 * 1000)
    # each peer: a receive, the CRC check, its BLAKE3
    assert floor.nodes["n1"] == floor.nodes["n2"] == pytest.approx(10000 + 100 + 10)
    assert floor.nodes["n3"] == 0
    assert floor.entered == {"n0": int(GB)} and floor.sent == {"n0": 2 * int(GB)}


def test_colocated_entry_that_holds_none_sends_three() -> None:
    floor = role_floors({"a": ["n1", "n2", "n3"]}, {"a": int(GB)}, lambda c, h: "n0", RATES,
                        colocated=True, nodes=NODES)  # fmt: skip
    # n0 checks the id (one BLAKE3), one CRC, three sends
    assert floor.nodes["n0"] == pytest.approx(10 + 100 + 3 * 1000)
    assert floor.sent == {"n0": 3 * int(GB)}
    assert floor.total == pytest.approx(1 + 3110 + 3 * 10110)


def test_remote_client_hashes_and_sends_and_the_entry_receives() -> None:
    half = int(GB // 2)
    holders = {"a": ["n1", "n2", "n3"], "b": ["n2", "n0", "n1"]}
    floor = role_floors(holders, {"a": half, "b": half}, lambda c, h: h[0], RATES,
                        colocated=False, nodes=NODES)  # fmt: skip
    assert floor.client == pytest.approx(1010.0)  # BLAKE3 + send of the whole GB
    assert floor.entered == {"n1": half, "n2": half}
    # n1: entry of a (recv, CRC, 2 sends, BLAKE3) and peer of b (recv, CRC, BLAKE3)
    assert floor.nodes["n1"] == pytest.approx(0.5 * (10000 + 100 + 2000 + 10) + 0.5 * 10110)
    assert floor.nodes["n3"] == pytest.approx(0.5 * 10110)


def test_table_has_a_line_per_role_and_the_ratio() -> None:
    floor = role_floors({"a": ["n0", "n1", "n2"]}, {"a": int(GB)}, lambda c, h: "n0", RATES,
                        colocated=True, nodes=NODES[:3])  # fmt: skip
    text = floor_table([("P2", 1.0, floor, 2.0, {"n0": 4220.0, "n1": 0.0, "n2": 10110.0})])
    lines = text.splitlines()
    assert lines[2] == "| P2 | client | 2.00 | 1.00 | 2.00 |"
    assert lines[3] == "| P2 | n0 | 4220.00 | 2110.00 | 2.00 |"
    assert lines[4] == "| P2 | n1 | 0.00 | 10110.00 | 0.00 |"
    assert lines[-1].startswith("| P2 | all | 14332.00 | 22331.00 |")


def test_measured_rates_are_per_gb_and_ordered() -> None:
    sample = os.urandom(4 << 20)
    rates = measure_rates(sample, 0.1, {"client_cpu_s_per_gb": 0.4, "server_cpu_s_per_gb": 0.5})
    assert (rates.copy, rates.send, rates.recv) == (0.1, 0.4, 0.5)
    # a hash costs CPU, and the CRC (hardware-assisted) is cheaper than BLAKE3
    assert rates.blake3 > 0 and rates.crc32c > 0
    assert rates.crc32c < rates.blake3
