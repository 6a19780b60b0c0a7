"""What a restarted node advertises (issue 16, §1 item 9).

A node rebuilds its index from its disks at start-up. Fragments damaged while it was
down (a torn write, a flipped bit) used to be advertised as held until the scrubber's
first pass found them (up to ``scrub_interval`` later), so repair, ``can_leave`` and the
status counted a fragment that could not be read. The start-up check reads every
fragment before any is advertised and quarantines what fails.
"""

from __future__ import annotations

import random

from erasure import fragment_key
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from tests.service.http import manifest_for
from tests.service.inproc import InprocFactory, put_bytes, wait_until


async def test_a_fragment_flipped_while_the_node_was_down_is_never_advertised(
    inproc: InprocFactory,
) -> None:
    # No scrub during the test: only the start-up check can find the flip; and repair only
    # when the test runs it, so that what the restarted node advertises can be looked at.
    cluster = await inproc.start(
        6, k=4, n=6, scrub_interval=3600.0, repair_interval=3600.0, encode_defer=0.0
    )
    entry = cluster.node(0)
    data = random.Random(9).randbytes(96 * 1024)
    cid = chunk_id_of(data)
    assert (await put_bytes(entry, data))[0] == 201
    checked = check_manifest(manifest_for([data]), entry.config.max_chunk_size)
    assert (await entry.commit("restart/flip", checked))[0] == 201
    await wait_until("the chunk is cold", lambda: len(cluster.fragments(cid)) == 6, 60)
    victim = next(i for i in range(6) if cluster.node(i).fragments.get(cid))
    index = min(cluster.node(victim).fragments[cid])
    key = fragment_key(cid, index)
    root = cluster.members[victim].config.data_dir / "cold"
    await cluster.kill(victim)
    files = [p for p in root.rglob("*") if p.is_file() and key in p.name]
    assert len(files) == 1, files
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0x01  # the last payload byte: the header still parses
    files[0].write_bytes(raw)
    await cluster.start_node(victim)
    node = cluster.node(victim)
    # From its first moment up, the node does not hold the damaged fragment...
    assert index not in node.fragments.get(cid, set())
    asker = cluster.node((victim + 1) % 6)
    info, _ = await asker.call(node.id, "chunk_info", {"ids": [cid]})
    reported = info["info"].get(cid)
    assert reported is None or index not in reported[2]
    assert not files[0].exists()
    assert list((root / "quarantine").glob(f"{key}.*"))
    sample = node.metrics.registry.get_sample_value("storaged_corrupt_total", {"tier": "cold"})
    assert sample == 1.0
    # ...and repair puts a good one back.
    for i in range(6):
        await cluster.node(i).repair_pass()
    assert index in cluster.node(victim).fragments.get(cid, set())
