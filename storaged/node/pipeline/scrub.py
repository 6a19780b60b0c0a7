"""Scrub: re-read every stored copy and fragment; what fails its check is quarantined.

Upholds **I7** over time (bit rot is found before a reader meets it) and feeds repair:
a quarantined copy or fragment is no longer reported held, so repair replaces it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tiers import ChunkNotFound, CorruptChunk

if TYPE_CHECKING:
    from storaged.node.services import LocalStore


log = logging.getLogger("storaged.node.scrub")


class Scrubber:
    def __init__(self, local: LocalStore) -> None:
        self.local = local

    async def scrub_pass(self) -> None:
        """One read of everything stored. A file that fails its check is quarantined (by
        the tier) and forgotten; one gone behind the node's back is forgotten; one that
        cannot be read now (an I/O error) is logged and left for the next pass, and the
        pass goes on with the others."""
        async for key in self.local.nvme.keys():
            try:
                await self.local.nvme.get(key)
            except CorruptChunk:
                self.local.metrics.corrupt.labels("nvme").inc()
            except ChunkNotFound:
                pass
            except OSError as exc:
                log.warning("scrub: nvme copy %s cannot be read now: %s", key, exc)
        async for key in self.local.cold.keys():
            try:
                await self.local.cold.get(key)
            except CorruptChunk:
                self.local.metrics.corrupt.labels("cold").inc()
                self.local.forget_fragment(key)
            except ChunkNotFound:
                self.local.forget_fragment(key)  # gone behind the node's back: not held
            except OSError as exc:
                log.warning("scrub: fragment %s cannot be read now: %s", key, exc)
