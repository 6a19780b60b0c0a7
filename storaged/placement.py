"""Where a chunk lives: rendezvous (highest-random-weight) hashing over node ids, spread
over failure domains (``storaged.domains``).

Every client and node computes the same order from the membership alone, so no
lookup service sits on the data path. When a node leaves, only the chunks it
ranked first for move; everyone else keeps their order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storaged import domains

if TYPE_CHECKING:
    from storaged.coord.membership import MembershipView


def _score(node_id: str, chunk_id: str) -> int:
    digest = hashlib.blake2b(f"{node_id}:{chunk_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(chunk_id: str, node_ids: Sequence[str]) -> list[str]:
    """``node_ids`` ordered by preference for ``chunk_id``, best first.

    Score: the first 8 bytes (big-endian) of BLAKE2b-64 of ``"{node_id}:{chunk_id}"``,
    highest first; equal scores are ordered by node id. Duplicate ids are kept as given.
    """
    return sorted(node_ids, key=lambda node: (-_score(node, chunk_id), node))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where things go, computed from one membership view: an operation (a PUT, a read, the
    repair of a chunk, an encode, a GC pass, a commit) takes one at its start and asks only
    it, so a membership change in the middle cannot split its targets between two views.

    Reads walk ``order`` (every live node, draining ones included: they still serve what
    they hold). New data goes only to live nodes that are not draining (``placeable``): hot
    targets, fragment targets, the owner that encodes, catalogue secondaries.
    """

    view: MembershipView
    replication: int
    n: int

    @property
    def alive(self) -> list[str]:
        """Live node ids, in member order (whom to ask about holdings)."""
        return [m.id for m in self.view.members if m.id in self.view.alive]

    @property
    def placeable(self) -> list[str]:
        """Live node ids that take new placements: not draining."""
        return [n for n in self.alive if n not in self.view.draining]

    def is_alive(self, node_id: str) -> bool:
        return node_id in self.view.alive

    def is_draining(self, node_id: str) -> bool:
        return node_id in self.view.draining

    def order(self, key: str) -> list[str]:
        """Every live node in ``key``'s rendezvous order: where readers look, and who leads
        a chunk's repair (the first holder, a draining one included: it has the bytes)."""
        return rendezvous_order(key, self.alive)

    @property
    def domain_of(self) -> dict[str, str]:
        """Each member's failure-domain key (``storaged.domains.domain_key``)."""
        return {m.id: m.failure_domain for m in self.view.members}

    def domain_sizes(self, without: Collection[str] = ()) -> list[int]:
        """How many placeable nodes (less ``without``) each failure domain has."""
        domain_of = self.domain_of
        return domains.sizes(domain_of[n] for n in self.placeable if n not in without)

    def write_order(self, chunk_id: str) -> list[str]:
        """The placeable nodes in the chunk's order, each domain's best before any domain's
        second (``storaged.domains.interleave``): hot targets first, then the nodes a PUT
        or a repair falls back to. The first is the rendezvous first."""
        return domains.interleave(rendezvous_order(chunk_id, self.placeable), self.domain_of)

    def hot_targets(self, chunk_id: str) -> list[str]:
        return self.write_order(chunk_id)[: self.replication]

    def owner(self, chunk_id: str) -> str | None:
        """The node that encodes the chunk (the first placeable one); None with none."""
        order = self.write_order(chunk_id)
        return order[0] if order else None

    def fragment_targets(self, chunk_id: str) -> list[str]:
        """Node of fragment ``i`` at position ``i``: a second ordering of the placeable
        nodes, dealt to the failure domains in turn (``storaged.domains.spread``; with one
        node a domain, that ordering wrapped); empty when there is none."""
        order = rendezvous_order("fragments/" + chunk_id, self.placeable)
        return domains.spread(order, self.n, self.domain_of)

    def name_targets(self, name: str) -> list[str]:
        """Where a checkpoint's record lives in the embedded catalogue: its primary (the
        first node of the name's order over every member, alive, draining or not: the same
        on every node whatever each thinks is alive) and the next ``replication - 1``
        placeable nodes."""
        order = rendezvous_order("checkpoint/" + name, [m.id for m in self.view.members])
        order = domains.interleave(order, self.domain_of)  # the first stays first
        placeable = set(self.placeable)
        secondaries = [n for n in order[1:] if n in placeable]
        return [order[0], *secondaries[: self.replication - 1]]

    def node_budget(self, k: int, without: Collection[str] = ()) -> int:
        """How many placeable nodes (less ``without``) may lose their data at once, the
        failure model placement is built for (``storaged.domains.node_budget``)."""
        return domains.node_budget(self.domain_sizes(without), self.replication, k, self.n)

    def survives_a_domain(self, k: int, without: Collection[str] = ()) -> bool:
        """Whether placement over the placeable nodes (less ``without``) survives the loss
        of any one whole failure domain (``storaged.domains.survives_a_domain``)."""
        return domains.survives_a_domain(self.domain_sizes(without), self.replication, k, self.n)


def failure_budget(nodes: int, replication: int, k: int, n: int) -> int:
    """How many of ``nodes`` placeable nodes, each its own failure domain, may lose their
    data at once: ``replication - 1`` (hot copies), and no more than lose ``n - k``
    fragments of a chunk whose fragments are spread ``ceil(n / nodes)`` a node."""
    return domains.node_budget([1] * max(nodes, 1), replication, k, n)


def exposed(fragments: Mapping[str, Collection[int]], k: int, budget: int) -> bool:
    """Whether the loss of some ``budget`` of these holders (node -> the fragment indexes it
    holds) would leave fewer than ``k`` distinct indexes: the chunk's fragments are
    concentrated beyond the failure model, as when a node kept indexes of two views of
    the membership (it held 0 and 5 over five nodes, then got 4 over four) and the paced
    rebalance has not moved them yet. Placement's own arrangement is never exposed: any
    ``budget`` nodes hold at most ``budget * ceil(n / nodes) <= n - k`` of its indexes."""
    if budget <= 0:
        return False  # no loss is promised to be survived: nothing to hold to
    holders: dict[int, list[str]] = {}
    for node, indexes in fragments.items():
        for i in indexes:
            holders.setdefault(i, []).append(node)
    # Only an index held by at most ``budget`` nodes can be lost with them.
    fragile: dict[str, int] = {}
    for nodes in holders.values():
        if len(nodes) <= budget:
            for node in nodes:
                fragile[node] = fragile.get(node, 0) + 1
    worst = sum(sorted(fragile.values(), reverse=True)[:budget])
    if len(holders) - worst >= k:
        return False  # even the worst losses leave k (the usual case: no search)
    for lost in itertools.combinations(sorted(fragile), min(budget, len(fragile))):
        gone = set(lost)
        if sum(1 for nodes in holders.values() if not gone.issuperset(nodes)) < k:
            return True
    return False


def tolerance(
    hot: Collection[str],
    fragments: Mapping[str, Collection[int]],
    k: int,
    budget: int,
    domain_of: Mapping[str, str] | None,
) -> tuple[int, bool]:
    """What a chunk held so (the nodes with a hot copy; node -> the fragment indexes it
    holds) survives: how many nodes lost at once, up to ``budget`` (a hot copy left, or
    ``k`` indexes: a bound that may say fewer than the truth, never more), and, where
    ``domain_of`` is given, whether the loss of any one failure domain leaves it readable.
    A chunk unreadable now survives nothing: ``(0, False)``."""
    if not hot and len({i for held in fragments.values() for i in held}) < k:
        return 0, False
    nodes = budget
    while nodes > 0 and len(hot) <= nodes and exposed(fragments, k, nodes):
        nodes -= 1
    if domain_of is None:
        return nodes, False
    of = {n: domain_of.get(n) or domains.domain_key(n, "") for n in (*hot, *fragments)}
    for domain in set(of.values()):
        if any(of[n] != domain for n in hot):
            continue
        left = {i for node, held in fragments.items() if of[node] != domain for i in held}
        if len(left) < k:
            return nodes, False
    return nodes, True
