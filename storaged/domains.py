"""Failure domains: the nodes that may fail together (a rack, a switch, a power feed), and
how placement spreads a chunk's hot copies and fragments over them.

A node declares its domain (``[[nodes]] domain`` in the cluster file, ``--domain`` on etcd,
where its member record carries it); a node that declares none is a domain of its own, and
a cluster where no domain holds two nodes is placed exactly as before domains existed.
Everything here is pure arithmetic on the members' domains, so every node and client
computes the same answers from the membership alone (``storaged.placement`` uses it).

Placement keeps the rendezvous order and re-ranks it by domain:

- hot copies: ``interleave`` puts each domain's best node before any domain's second, so
  the ``replication`` copies go to as many distinct domains as there are (up to
  ``replication``); the first node, which encodes and which clients try first, is the
  rendezvous first as before;
- fragments: ``spread`` deals the ``n`` fragments to the domains in turn (ordered by their
  best node), each domain cycling through its own nodes, so no domain holds more than
  ``ceil(n / domains)`` of a chunk's fragments and its nodes share them evenly.

What the cluster then survives: ``node_budget`` nodes lost at once (as before: the hot
copies less one, and no more than lose ``n - k`` fragments at the worst a node holds), and
one whole domain when ``survives_a_domain``: at least two domains, two hot copies, and
``ceil(n / domains) <= n - k``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence


def domain_key(node_id: str, domain: str) -> str:
    """The key of a node's failure domain: the declared one, else the node alone (the
    prefixes keep a node id from colliding with a domain's name)."""
    return f"domain:{domain}" if domain else f"node:{node_id}"


def interleave(order: Sequence[str], domain_of: Mapping[str, str]) -> list[str]:
    """``order`` (best first) re-ranked by domain: first every domain's best node, in
    ``order``; then every domain's second best; and so on. With one node a domain, it is
    ``order`` itself."""
    taken: dict[str, int] = {}
    ranked: list[tuple[int, int, str]] = []
    for position, node in enumerate(order):
        domain = domain_of[node]
        turn = taken.get(domain, 0)
        taken[domain] = turn + 1
        ranked.append((turn, position, node))
    ranked.sort()
    return [node for _, _, node in ranked]


def spread(order: Sequence[str], count: int, domain_of: Mapping[str, str]) -> list[str]:
    """``count`` slots over ``order``'s nodes (slot ``i`` at position ``i``): the domains,
    in the order of their best node, take turns, each cycling through its own nodes in
    ``order``. With one node a domain, slot ``i`` is ``order[i % len(order)]``. Empty when
    ``order`` is."""
    groups: dict[str, list[str]] = {}
    for node in order:
        groups.setdefault(domain_of[node], []).append(node)
    turns = list(groups.values())
    if not turns:
        return []
    return [
        turns[i % len(turns)][(i // len(turns)) % len(turns[i % len(turns)])] for i in range(count)
    ]


def sizes(domains: Iterable[str]) -> list[int]:
    """How many nodes each domain has, from each node's domain key."""
    count: dict[str, int] = {}
    for domain in domains:
        count[domain] = count.get(domain, 0) + 1
    return list(count.values())


def fragments_per_node(domain_sizes: Collection[int], n: int) -> int:
    """The most of a chunk's ``n`` fragments that ``spread`` may put on one node: a domain
    takes up to ``ceil(n / domains)``, shared among its nodes; the smallest domain's nodes
    carry the most."""
    if not domain_sizes:
        return n
    per_domain = math.ceil(n / len(domain_sizes))
    return math.ceil(per_domain / min(domain_sizes))


def node_budget(domain_sizes: Collection[int], replication: int, k: int, n: int) -> int:
    """How many nodes may lose their data at once: ``replication - 1`` (hot copies), and no
    more than lose ``n - k`` fragments of a chunk where one node holds up to
    ``fragments_per_node``. With one node a domain: ``ceil(n / nodes)`` a node."""
    per_node = fragments_per_node(domain_sizes, n)
    return max(0, min(replication - 1, (n - k) // per_node))


def survives_a_domain(domain_sizes: Collection[int], replication: int, k: int, n: int) -> bool:
    """Whether placement over domains of these sizes survives the loss of any one whole
    domain: some domain has two nodes or more (else a domain is a node: ``node_budget``
    says it), there are two domains or more, two hot copies or more (they go to distinct
    domains), and no domain holds more than ``n - k`` fragments of a chunk."""
    count = len(domain_sizes)
    return (
        count >= 2 and max(domain_sizes) > 1 and replication >= 2 and math.ceil(n / count) <= n - k
    )


def describe(budget: int, domain: bool) -> str:
    """What a cluster or a checkpoint survives, in words: ``one domain`` (and the nodes),
    ``2 nodes``, ``one node``, or ``no loss``."""
    nodes = {0: "no loss", 1: "one node"}.get(budget, f"{budget} nodes")
    if not domain:
        return nodes
    return "one domain" if budget == 0 else f"one domain or {nodes}"


def domain_exposed(
    fragments: Mapping[str, Collection[int]], k: int, domain_of: Mapping[str, str]
) -> bool:
    """Whether losing some one domain (every holder in it) would leave fewer than ``k``
    distinct indexes of these fragments (node -> the indexes it holds)."""
    holders: dict[int, set[str]] = {}
    for node, indexes in fragments.items():
        for i in indexes:
            holders.setdefault(i, set()).add(domain_of.get(node, domain_key(node, "")))
    for domain in {d for held in holders.values() for d in held}:
        if sum(1 for held in holders.values() if held - {domain}) < k:
            return True
    return False
