"""The vocabulary server, client and peer protocol share: bytes, byte ranges, chunk and
checkpoint states, and error codes (API.md). Chunk ids and checkpoint names are in
``storaged.ids``.

A leaf: it imports nothing of the project, so the client can speak it without loading
the server's tiers and a command line can offer its names without loading the client.
The storage leaves (``tiers``, ``erasure``) import nothing from ``storaged``; they keep
their own ``BytesLike`` and ``ByteRange`` (the same shapes) for that reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

#: What is accepted as bytes without a copy being made.
BytesLike = bytes | bytearray | memoryview


class InvalidRange(ValueError):
    """A byte range outside the value, or with end < start."""


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of a value; ``end=None`` means to the end. (The HTTP
    ``Range`` header's end is inclusive; this one is not.)"""

    start: int = 0
    end: int | None = None

    def resolve(self, size: int) -> tuple[int, int]:
        """Return concrete ``(start, end)`` for a value of ``size`` bytes, or raise
        ``InvalidRange``."""
        end = size if self.end is None else self.end
        if self.start < 0 or end < self.start or end > size:
            raise InvalidRange(f"range [{self.start}, {self.end}) outside value of {size} bytes")
        return self.start, end


# --- states ---------------------------------------------------------------------------

#: The states a chunk (and so a checkpoint, by its weakest chunk) reaches, weakest first:
#: in RAM on three nodes, on local disk, erasure coded into the cold tier.
STATES: Final = ("memory", "nvme", "cold")


class ChunkState(enum.IntEnum):
    """A state as a rank: a later state is a larger number. The ranks are persisted by
    the node's state log, so they never change: ``MEMORY`` is 1, not 0."""

    MEMORY = 1
    NVME = 2
    COLD = 3


def state_rank(state: str) -> int:
    """The rank (``ChunkState``) of a state's name; ``ValueError`` for anything else."""
    try:
        return STATES.index(state) + 1
    except ValueError:
        raise ValueError(f"unknown durability level {state!r}; expected one of {STATES}") from None


def state_name(rank: int) -> str:
    """The name of a state's rank (``1`` -> ``"memory"``)."""
    return STATES[rank - 1]


def state_at_least(state: str, level: str) -> bool:
    """True when ``state`` is ``level`` or further along ``memory < nvme < cold``."""
    return state_rank(state) >= state_rank(level)
