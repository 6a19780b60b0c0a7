"""Scrub: re-read every stored copy and fragment; what fails its check is quarantined.

Upholds **I7** over time (bit rot is found before a reader meets it) and feeds repair:
a quarantined copy or fragment is no longer reported held, so repair replaces it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiers import ChunkNotFound, CorruptChunk

if TYPE_CHECKING:
    from storaged.node.core import Node


class Scrubber:
    def __init__(self, node: Node) -> None:
        self.node = node

    async def scrub_pass(self) -> None:
        node = self.node
        async for key in node.nvme.keys():
            try:
                await node.nvme.get(key)
            except CorruptChunk:
                node.metrics.corrupt.labels("nvme").inc()
            except ChunkNotFound:
                pass
        async for key in node.cold.keys():
            try:
                await node.cold.get(key)
            except CorruptChunk:
                node.metrics.corrupt.labels("cold").inc()
                node.forget_fragment(key)
            except ChunkNotFound:
                pass
