"""Who leads a chunk's repair and rebalance, and which members are *away*: what repair
learns each pass and rebalance, GC and evacuation go by (one object, shared).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from storaged.config import Config
from storaged.domains import domain_exposed
from storaged.node.index import Holding
from storaged.placement import Placement, exposed


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
        self,
        fragments: Mapping[str, Collection[int]],
        placement: Placement,
        *,
        at_most: int | None = None,
        without: Collection[str] = (),
    ) -> bool:
        """Whether the fragments on the nodes that stay (node -> the indexes it holds; the
        placeable nodes less ``without``) are more concentrated than the failure model
        allows: the loss of ``placement.node_budget`` nodes (``at_most``, if given and
        fewer) would leave fewer than ``k`` (``storaged.placement.exposed``), or, where
        placement promises to survive a whole failure domain, the loss of one domain would
        (``storaged.domains.domain_exposed``). Repair moves them (at once where one loss
        is too many), GC keeps the nvme copies, the drain is not done."""
        cfg = self.config
        budget = placement.node_budget(cfg.k, without)
        if exposed(fragments, cfg.k, budget if at_most is None else min(budget, at_most)):
            return True
        return placement.survives_a_domain(cfg.k, without) and domain_exposed(
            fragments, cfg.k, placement.domain_of
        )
