"""Failure domains in placement (``storaged.domains``, ``storaged.placement``): pure checks.

Without a domain of two nodes placement is what it was (every order, target and record
home the same as the plain rendezvous order gives); with domains, hot copies and fragments
spread so that one whole domain's loss leaves every chunk readable, and the figures that
GC, repair and ``?status`` go by (the node budget, the domain promise, a chunk's
tolerance) agree with a brute-force count of losses.
"""

from __future__ import annotations

import itertools
import math
import random
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from storaged.config import ConfigError, NodeSpec, check_file_document, load_config
from storaged.coord.membership import MembershipView
from storaged.domains import describe, domain_exposed, node_budget, spread, survives_a_domain
from storaged.ids import chunk_id_of
from storaged.placement import Placement, exposed, failure_budget, rendezvous_order, tolerance

CHUNKS = [chunk_id_of(f"chunk {i}".encode()) for i in range(400)]


def placement(domains: list[str], replication: int = 3, n: int = 6) -> Placement:
    """Members n0.. with these domains ("" for none), all alive, none draining."""
    members = tuple(
        NodeSpec(f"n{i}", f"http://h{i}", f"h{i}:1", domain=d) for i, d in enumerate(domains)
    )
    alive = frozenset(m.id for m in members)
    return Placement(MembershipView(members, alive, frozenset(), 0), replication, n)


def readable(chunk: tuple[set[str], dict[str, set[int]]], lost: set[str], k: int) -> bool:
    hot, fragments = chunk
    left = {i for node, held in fragments.items() if node not in lost for i in held}
    return bool(hot - lost) or len(left) >= k


@pytest.mark.parametrize("nodes", [3, 4, 5, 6, 9])
def test_without_shared_domains_placement_is_plain_rendezvous(nodes: int) -> None:
    # No domain declared, or every node alone in its own: the same as before domains.
    for domains in ([""] * nodes, [f"rack{i}" for i in range(nodes)]):
        p = placement(domains)
        ids = [f"n{i}" for i in range(nodes)]
        for cid in CHUNKS[:100]:
            order = rendezvous_order(cid, ids)
            assert p.write_order(cid) == order
            assert p.hot_targets(cid) == order[:3]
            frag = rendezvous_order("fragments/" + cid, ids)
            assert p.fragment_targets(cid) == [frag[i % nodes] for i in range(6)]
            name = rendezvous_order("checkpoint/" + cid, ids)
            assert p.name_targets(cid) == name[:3]
        assert p.node_budget(4) == failure_budget(nodes, 3, 4, 6)
        assert not p.survives_a_domain(4)


def test_three_domains_of_two_spread_every_chunk() -> None:
    p = placement(["a", "a", "b", "b", "c", "c"])
    domain_of = p.domain_of
    owners: Counter[str] = Counter()
    for cid in CHUNKS:
        hot = p.hot_targets(cid)
        assert len({domain_of[n] for n in hot}) == 3, hot
        # the owner (encodes; clients try it first) is still the rendezvous first
        assert p.owner(cid) == hot[0] == rendezvous_order(cid, p.placeable)[0]
        owners[hot[0]] += 1
        frags = p.fragment_targets(cid)
        assert Counter(frags) == Counter(p.placeable)  # one fragment a node
        assert max(Counter(domain_of[n] for n in frags).values()) == 2
        names = p.name_targets(cid)
        assert len({domain_of[n] for n in names}) == 3
    assert set(owners) == set(p.placeable)  # ownership still spreads over every node
    assert p.node_budget(4) == 2 and p.survives_a_domain(4)


@pytest.mark.parametrize(
    ("domains", "k", "budget", "domain"),
    [
        (["a", "a", "b", "b", "c", "c"], 4, 2, True),
        (["a", "a", "b", "b", "c"], 4, 1, True),  # c's one node takes 2 fragments
        (["a", "a", "a", "b", "b", "b"], 4, 2, False),  # a domain would take 3 > n-k
        (["a", "a", "a", "b", "b", "b"], 3, 2, True),
        (["a", "a", "a", "a", "b", "c"], 4, 1, True),  # b's and c's nodes take 2 each
        (["a", "a", "a", "a", "a", "a"], 4, 2, False),  # one domain: nothing to spread over
    ],
)
def test_the_promise_matches_a_count_of_every_loss(
    domains: list[str], k: int, budget: int, domain: bool
) -> None:
    p = placement(domains)
    assert p.node_budget(k) == budget and p.survives_a_domain(k) is domain
    by_domain: dict[str, set[str]] = {}
    for node, d in p.domain_of.items():
        by_domain.setdefault(d, set()).add(node)
    for cid in CHUNKS[:150]:
        hot = set(p.hot_targets(cid))
        fragments: dict[str, set[int]] = {}
        for i, node in enumerate(p.fragment_targets(cid)):
            fragments.setdefault(node, set()).add(i)
        # Cold only (the hot copies evicted) is the hard case: the promise holds there too.
        for chunk in ((hot, fragments), (set(), fragments)):
            for lost in itertools.combinations(p.placeable, budget):
                assert readable(chunk, set(lost), k), (cid, lost)
            if domain:
                for members in by_domain.values():
                    assert readable(chunk, members, k), (cid, members)
        # What GC, repair and rebalance go by: placement's own arrangement is never exposed.
        assert not exposed(fragments, k, budget)
        if domain:
            assert not domain_exposed(fragments, k, p.domain_of)
        assert tolerance(hot, fragments, k, budget, p.domain_of if domain else None) == (
            budget,
            domain,
        )


def test_domain_blind_placement_loses_what_domains_keep() -> None:
    """The same fault, a whole domain lost, on the same six nodes with two copies a chunk:
    placed blind (no domains declared) some chunks had both copies in the lost domain."""
    racks = ["a", "a", "b", "b", "c", "c"]
    lost = {"n0", "n1"}  # domain a
    blind = placement([""] * 6, replication=2)
    aware = placement(racks, replication=2)
    blind_lost = [c for c in CHUNKS if set(blind.hot_targets(c)) <= lost]
    aware_lost = [c for c in CHUNKS if set(aware.hot_targets(c)) <= lost]
    assert len(blind_lost) > 0 and aware_lost == []


def test_spread_deals_domains_in_turn() -> None:
    domain_of = {"x": "a", "y": "a", "z": "b"}
    assert spread(["x", "y", "z"], 6, domain_of) == ["x", "z", "y", "z", "x", "z"]
    assert spread([], 6, domain_of) == []


def test_tolerance_never_says_more_than_the_truth() -> None:
    rng = random.Random(5)
    nodes = [f"n{i}" for i in range(6)]
    domain_of = {n: f"domain:{'abc'[i // 2]}" for i, n in enumerate(nodes)}
    for _ in range(300):
        hot = set(rng.sample(nodes, rng.randint(0, 3)))
        fragments: dict[str, set[int]] = {}
        for i in rng.sample(range(6), rng.randint(0, 6)):
            fragments.setdefault(rng.choice(nodes), set()).add(i)
        got, whole = tolerance(hot, fragments, 4, 2, domain_of)
        chunk = (hot, fragments)
        if not readable(chunk, set(), 4):
            assert (got, whole) == (0, False)
            continue
        for lost in itertools.combinations(nodes, got):
            assert readable(chunk, set(lost), 4), (hot, fragments, got)
        truth = all(
            readable(chunk, {n for n in nodes if domain_of[n] == d}, 4)
            for d in set(domain_of.values())
        )
        assert whole == truth


def test_words() -> None:
    assert describe(2, True) == "one domain or 2 nodes"
    assert describe(1, False) == "one node"
    assert describe(0, False) == "no loss"
    assert describe(0, True) == "one domain"


def test_budget_formula_matches_the_old_one_without_domains() -> None:
    for nodes in range(1, 13):
        for k, n in ((4, 6), (3, 6), (8, 12), (5, 6)):
            per_node = math.ceil(n / nodes)
            old = max(0, min(2, (n - k) // per_node))
            assert node_budget([1] * nodes, 3, k, n) == old
    assert survives_a_domain([2, 2, 2], 3, 4, 6) and not survives_a_domain([2, 2, 2], 1, 4, 6)


CLUSTER = """
replication = 3
[erasure]
k = 4
n = 6
[auth]
cluster_secret = "s3cret"
{nodes}
"""


def _write(tmp_path: Path, domains: list[str]) -> Path:
    entries = "".join(
        f'[[nodes]]\nid = "n{i}"\nurl = "http://127.0.0.1:{7000 + i}"\n'
        f'peer = "127.0.0.1:{8000 + i}"\ndata = "{tmp_path}/n{i}"\n'
        + (f'domain = "{d}"\n' if d else "")
        for i, d in enumerate(domains)
    )
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER.format(nodes=entries))
    return path


def test_the_cluster_file_declares_domains(tmp_path: Path) -> None:
    path = _write(tmp_path, ["a", "a", "b", "b", "c", ""])
    cfg = load_config(path, "n0", environ={})
    assert [n.domain for n in cfg.nodes] == ["a", "a", "b", "b", "c", ""]
    assert cfg.node.failure_domain == "domain:a" and cfg.nodes[5].failure_domain == "node:n5"
    # The flag may repeat the file; it may not contradict it (everyone places from the file).
    assert load_config(path, "n0", environ={}, overrides={"domain": "a"}).domain == "a"
    with pytest.raises(ConfigError, match="domain 'b': node n0's entry in the cluster file"):
        load_config(path, "n0", environ={}, overrides={"domain": "b"})
    # Four nodes, three in one domain: the lone node would hold 3 of 6 fragments, n-k=2.
    path = _write(tmp_path, ["a", "a", "a", "b"])
    with pytest.raises(ConfigError, match="puts up to 3 fragments on one node"):
        load_config(path, "n0", environ={})
    path = _write(tmp_path, ["a", "a", "b", "b"])
    assert load_config(path, "n0", environ={}).nodes[3].domain == "b"
    path.write_text(path.read_text().replace('domain = "b"', 'rack = "b"'))
    # (what `storaged up` checks a file with, key by key)
    with pytest.raises(ConfigError, match="unknown key rack"):
        check_file_document(tomllib.loads(path.read_text()))
