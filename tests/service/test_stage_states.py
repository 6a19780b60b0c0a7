"""Background stages tolerate every state a chunk or a file can be in (issue 16, §2):
gone behind the node's back, unreadable, no longer a member's. A traceback in a node log
is a defect: each of these used to end a pass or a call with one."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.peer import PeerUnavailable
from tests.service.http import manifest_for
from tests.service.inproc import InprocFactory, put_bytes, wait_until


async def test_scrub_forgets_a_vanished_fragment_and_passes_over_an_unreadable_one(
    inproc: InprocFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await inproc.start(
        6, k=4, n=6, scrub_interval=3600.0, repair_interval=3600.0, encode_defer=0.0
    )
    entry = cluster.node(0)
    rng = random.Random(3)
    chunks = [rng.randbytes(64 * 1024) for _ in range(3)]
    for data in chunks:
        assert (await put_bytes(entry, data))[0] == 201
    checked = check_manifest(manifest_for(chunks), entry.config.max_chunk_size)
    assert (await entry.commit("scrub/states", checked))[0] == 201
    ids = [chunk_id_of(c) for c in chunks]
    await wait_until("cold", lambda: all(len(cluster.fragments(c)) == 6 for c in ids), 60)
    node = cluster.node(1)
    root = cluster.members[1].config.data_dir / "cold"
    held = [(c, i) for c in ids for i in sorted(node.fragments.get(c, ()))]
    assert len(held) >= 3
    (gone_id, gone_i), (odd_id, odd_i), (flip_id, flip_i) = held[:3]

    def path_of(cid: str, i: int) -> Any:
        key = fragment_key(cid, i)
        return next(p for p in root.rglob("*") if p.is_file() and p.name == key)

    path_of(gone_id, gone_i).unlink()  # gone behind the node's back
    odd = path_of(odd_id, odd_i)
    odd.unlink()
    odd.mkdir()  # a read of it fails with an OSError that is not "not found"
    flipped = path_of(flip_id, flip_i)
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 0x01
    flipped.write_bytes(raw)
    caplog.set_level(logging.WARNING)
    await node.scrub_pass()  # must not raise: one bad file does not end the pass
    assert gone_i not in node.fragments.get(gone_id, set())
    assert flip_i not in node.fragments.get(flip_id, set())  # the pass went on past `odd`
    assert any("cannot be read now" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)
    odd.rmdir()


async def test_a_call_to_a_member_removed_meanwhile_is_an_unreachable_peer(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(4)
    with pytest.raises(PeerUnavailable, match="no longer a member"):
        await cluster.node(0).call("n9", "ping", {})
    # and the stages that ask many peers skip it like a dead one
    held = await cluster.node(0).holdings(["n1", "n9"], ["0" * 64])
    assert held == {"0" * 64: []}
