"""``storaged.wire``: the one ordering of states (ranks from 1, as the state log persists
them) and the byte range the client and the DCP adapter use."""

from __future__ import annotations

import pytest

from storaged import client, wire
from storaged.node import index
from tiers import base as tier_base


def test_states_rank_from_one_in_order_for_server_and_client() -> None:
    assert wire.STATES == ("memory", "nvme", "cold")
    assert [wire.state_rank(s) for s in wire.STATES] == [1, 2, 3]
    assert [wire.state_name(r) for r in (1, 2, 3)] == list(wire.STATES)
    assert tuple(wire.ChunkState) == (index.MEMORY, index.NVME, index.COLD)
    # what the state log packs stays a plain int
    assert all(type(r) is int for r in (index.MEMORY, index.NVME, index.COLD))
    assert wire.state_at_least("cold", "nvme") and wire.state_at_least("nvme", "nvme")
    assert not wire.state_at_least("memory", "nvme")


@pytest.mark.parametrize("bad", ["", "Memory", "ram", "hot"])
def test_an_unknown_state_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown durability level"):
        wire.state_rank(bad)
    with pytest.raises(ValueError):
        wire.state_at_least("cold", bad)


def test_the_client_exports_the_wire_range_with_the_tiers_semantics() -> None:
    assert client.ByteRange is wire.ByteRange and client.STATES is wire.STATES
    for start, end in [(0, None), (3, 7), (10, 10), (0, 10)]:
        assert wire.ByteRange(start, end).resolve(10) == tier_base.ByteRange(start, end).resolve(10)
    for start, end in [(-1, 3), (5, 4), (0, 11), (11, None)]:
        with pytest.raises(wire.InvalidRange, match="outside value of 10 bytes"):
            wire.ByteRange(start, end).resolve(10)
        with pytest.raises(tier_base.InvalidRange, match="outside value of 10 bytes"):
            tier_base.ByteRange(start, end).resolve(10)
