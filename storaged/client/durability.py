"""Durability levels of a checkpoint (API.md): ``memory < nvme < cold``, and their order.

Apart from the client so that a command line can offer them (``--wait``) without
importing the HTTP client.
"""

from __future__ import annotations

from typing import Final

#: Durability levels, weakest first.
STATES: Final = ("memory", "nvme", "cold")


def state_rank(state: str) -> int:
    """Position of a durability level in ``STATES``; ``ValueError`` for anything else."""
    try:
        return STATES.index(state)
    except ValueError:
        raise ValueError(f"unknown durability level {state!r}; expected one of {STATES}") from None


def state_at_least(state: str, level: str) -> bool:
    """True when ``state`` is ``level`` or further along ``memory < nvme < cold``."""
    return state_rank(state) >= state_rank(level)
