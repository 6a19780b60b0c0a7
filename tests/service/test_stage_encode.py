"""``Encoder.advance`` alone, on real in-process nodes: the owner of a chunk drained on
every holder turns it into ``n`` fragments on the placement's targets, marks it cold and
only then drops the other holders' nvme copies; an encode whose fragment cannot land (a
target down that the owner's view still counts) leaves the chunk as it was, on nvme, for
the next offer (I6); a damaged nvme copy is never what gets encoded.

The encoders' workers are stopped right after the start: each test calls ``advance``
itself, so nothing is encoded behind its back (the drains run as usual).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.node import Node
from storaged.node.index import COLD, NVME
from tests.service.inproc import InprocCluster, InprocFactory, put_bytes, wait_until

#: no background pass interferes; an encode runs as soon as it is asked
QUIET: dict[str, Any] = {
    "repair_interval": 3600.0,
    "gc_interval": 3600.0,
    "scrub_interval": 3600.0,
    "encode_defer": 0.0,
}


async def _start(inproc: InprocFactory, nodes: int, **settings: Any) -> InprocCluster:
    cluster = await inproc.start(nodes, **{**QUIET, **settings})
    for i in cluster.running():
        await cluster.node(i).encoder.close()
    return cluster


async def _drained(cluster: InprocCluster) -> tuple[bytes, str, list[Node]]:
    """A new chunk PUT and on nvme on each of its hot holders: (bytes, id, holders)."""
    data = os.urandom(96 << 10)
    chunk_id = chunk_id_of(data)
    order = cluster.order(chunk_id)
    status, _ = await put_bytes(cluster.node(order[0]), data)
    assert status == 201
    rf = cluster.node(order[0]).config.replication
    holders = [cluster.node(i) for i in order[:rf]]
    await wait_until("on nvme everywhere", lambda: all(n.nvme_has(chunk_id) for n in holders))
    return data, chunk_id, holders


def _flip_last_byte(root: Path, chunk_id: str) -> None:
    path = next(root.rglob(chunk_id))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)


async def _fragments_are_of(node: Node, chunk_id: str, data: bytes, cluster: InprocCluster) -> None:
    """Every fragment index sits on its placement target and is the encoding of ``data``."""
    expected = await node.codec.encode_async(chunk_id, data)
    targets = node.placement().fragment_targets(chunk_id)
    assert len(targets) == node.config.n
    for index, target in enumerate(targets):
        holder = cluster.node(cluster.index_of(target))
        assert index in holder.fragments.get(chunk_id, set()), (index, target)
        stored = await holder.cold.get(fragment_key(chunk_id, index))
        assert bytes(stored) == expected[index].to_bytes()


async def test_the_owner_encodes_n_fragments_onto_the_placement_then_trims(
    inproc: InprocFactory,
) -> None:
    cluster = await _start(inproc, 4)
    data, chunk_id, holders = await _drained(cluster)
    owner = holders[0]
    assert owner.placement().owner(chunk_id) == owner.id
    assert cluster.fragments(chunk_id) == set()

    # Only the owner encodes: another holder's call changes nothing.
    await holders[1].encoder.advance(chunk_id)
    assert cluster.fragments(chunk_id) == set()

    await owner.encoder.advance(chunk_id)
    await _fragments_are_of(owner, chunk_id, data, cluster)
    assert all(h.index[chunk_id].state == COLD for h in holders)
    # Retention: the owner keeps its nvme copy, the other holders' go.
    assert owner.nvme_has(chunk_id)
    assert not any(h.nvme_has(chunk_id) for h in holders[1:])
    # Offered again (a repair pass, a restart): nothing more is done.
    await owner.encoder.advance(chunk_id)
    assert cluster.fragments(chunk_id) == set(range(owner.config.n))


async def test_a_target_down_leaves_the_chunk_on_nvme_and_a_later_offer_encodes_it(
    inproc: InprocFactory,
) -> None:
    """The owner's view still counts a fragment target that died (it is not yet down for
    anyone: ``down_after`` is long): its fragment does not land, so the chunk is not
    marked cold and no nvme copy goes (I6). Once the target is back, the next offer
    encodes it."""
    cluster = await _start(inproc, 5, down_after=60.0)
    data, chunk_id, holders = await _drained(cluster)
    owner = holders[0]
    order = cluster.order(chunk_id)
    targets = owner.placement().fragment_targets(chunk_id)
    victim = next(i for i in order[len(holders) :] if cluster.node_id(i) in targets)
    await cluster.kill(victim)
    assert owner.placement().is_alive(cluster.node_id(victim))  # the view predates the death

    await owner.encoder.advance(chunk_id)
    assert all(h.index[chunk_id].state == NVME for h in holders)
    assert all(h.nvme_has(chunk_id) for h in holders)
    assert len(cluster.fragments(chunk_id)) < owner.config.n

    await cluster.restart(victim)
    await owner.encoder.advance(chunk_id)
    await _fragments_are_of(owner, chunk_id, data, cluster)
    assert all(h.index[chunk_id].state == COLD for h in holders)


async def test_a_damaged_nvme_copy_is_not_what_gets_encoded(inproc: InprocFactory) -> None:
    """The owner's only local copy is a damaged nvme file: it is quarantined, never
    encoded; the fragments are made from a sound holder's copy."""
    cluster = await _start(inproc, 4)
    data, chunk_id, holders = await _drained(cluster)
    owner = holders[0]
    await owner.memory.delete(chunk_id)
    await asyncio.to_thread(_flip_last_byte, owner.config.data_dir / "nvme", chunk_id)

    await owner.encoder.advance(chunk_id)
    assert not owner.nvme_has(chunk_id)  # quarantined on the read
    await _fragments_are_of(owner, chunk_id, data, cluster)
