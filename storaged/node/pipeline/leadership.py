"""Who leads a chunk's repair and rebalance, and which members are *away*: what repair
learns each pass and rebalance, GC and evacuation go by (one object, shared).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from storaged.config import Config
from storaged.node.index import Holding
from storaged.placement import Placement, exposed, failure_budget


class Leadership:
    def __init__(self, config: Config) -> None:
        self.config = config
        #: members down for less than ``gone_after``, and live ones that did not answer the
        #: current batch's question: what they hold is expected back (rebalance waits too);
        #: set by each repair pass
        self.away: frozenset[str] = frozenset()

    @staticmethod
    def leader(chunk_id: str, held: list[Holding], placement: Placement) -> str | None:
        """Who leads the chunk's repair: the first in placement order holding a hot copy,
        or, without any, the first holding fragments (a draining holder too: it has the
        bytes)."""
        hot = {h.node for h in held if h.hot}
        with_fragments = {h.node for h in held if h.fragments}
        holders = hot or with_fragments
        return next((n for n in placement.order(chunk_id) if n in holders), None)

    def exposed(
        self, fragments: Mapping[str, Collection[int]], nodes: int, at_most: int | None = None
    ) -> bool:
        """Whether the fragments on the nodes that stay (node -> the indexes it holds, with
        ``nodes`` placeable nodes) are
        more concentrated than the failure model allows (``storaged.placement.exposed``;
        ``at_most`` losses only, if given): repair moves them (at once where one loss is
        too many), GC keeps the nvme copies, the drain is not done."""
        cfg = self.config
        budget = failure_budget(nodes, cfg.replication, cfg.k, cfg.n)
        return exposed(fragments, cfg.k, budget if at_most is None else min(budget, at_most))
