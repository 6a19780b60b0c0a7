"""Where a chunk lives: rendezvous (highest-random-weight) hashing over node ids.

Every client and node computes the same order from the membership alone, so no
lookup service sits on the data path. When a node leaves, only the chunks it
ranked first for move; everyone else keeps their order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _score(node_id: str, chunk_id: str) -> int:
    digest = hashlib.blake2b(f"{node_id}:{chunk_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(chunk_id: str, node_ids: Sequence[str]) -> list[str]:
    """``node_ids`` ordered by preference for ``chunk_id``, best first.

    Score: the first 8 bytes (big-endian) of BLAKE2b-64 of ``"{node_id}:{chunk_id}"``,
    highest first; equal scores are ordered by node id. Duplicate ids are kept as given.
    """
    return sorted(node_ids, key=lambda node: (-_score(node, chunk_id), node))
