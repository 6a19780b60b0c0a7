"""A storaged node; ``core.Node`` ties the stages of a chunk's life together."""

from storaged.node.core import Node
from storaged.node.index import (
    COLD,
    MEMORY,
    NVME,
    Holding,
    IndexEntry,
)
from storaged.wire import STATES, state_name, state_rank

__all__ = [
    "COLD",
    "MEMORY",
    "NVME",
    "STATES",
    "Holding",
    "IndexEntry",
    "Node",
    "state_name",
    "state_rank",
]
