"""Storage tiers of a storaged node: memory (DRAM), nvme (local disk), cold (erasure fragments)."""

from tiers import base
from tiers.base import *  # noqa: F403 (the protocol and its errors, named in base.__all__)

__all__ = base.__all__
