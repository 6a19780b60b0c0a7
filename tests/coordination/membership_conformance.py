"""The conformance suite every ``storaged.coord.membership.Membership`` passes.

Subclass ``MembershipTests`` and provide the ``members`` fixture: a ``Members`` handle on a
running cluster whose nodes can be stopped and started again.
"""

from __future__ import annotations

import abc
import asyncio
import time

import pytest

from storaged.coord.membership import Membership
from tests.service.inproc import InprocCluster


class Members(abc.ABC):
    """A running cluster, seen through each node's membership."""

    @abc.abstractmethod
    def ids(self) -> list[str]: ...

    @abc.abstractmethod
    def of(self, node_id: str) -> Membership:
        """``node_id``'s view (the node must be running)."""

    @abc.abstractmethod
    async def stop(self, node_id: str) -> None:
        """Stop ``node_id`` like a crash."""

    @abc.abstractmethod
    async def start(self, node_id: str) -> None: ...

    @abc.abstractmethod
    async def begin_stopping(self, node_id: str) -> None:
        """Begin a graceful stop of ``node_id`` as ``Node.shutdown`` does (it refuses PUTs
        and calls ``leaving``), without finishing it: the node goes on running."""


async def _eventually(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


class MembershipTests:
    #: whether ``forget`` removes a down member (a coordinator that holds the member list);
    #: the embedded membership keeps it (its cluster file decides)
    forgets: bool = False

    async def test_every_member_listed_in_a_stable_order_and_alive(self, members: Members) -> None:
        ids = members.ids()
        for node_id in ids:
            view = members.of(node_id)
            assert view.all_ids() == ids
            assert view.alive_ids() == ids
            assert view.is_alive(view.self_id) and view.self_id == node_id
            assert view.node(node_id).id == node_id
            with pytest.raises(KeyError):
                view.node("no-such-node")

    async def test_a_stopped_node_goes_down_everywhere_and_comes_back(
        self, members: Members
    ) -> None:
        ids = members.ids()
        victim, others = ids[-1], ids[:-1]
        await members.stop(victim)
        await _eventually(
            f"{victim} down in every view",
            lambda: all(not members.of(n).is_alive(victim) for n in others),
        )
        for n in others:
            assert members.of(n).alive_ids() == others  # stable order, without the victim
        await members.start(victim)
        await _eventually(
            f"{victim} alive again everywhere",
            lambda: all(members.of(n).alive_ids() == ids for n in ids),
        )

    async def test_a_reported_failure_counts_until_the_node_answers_again(
        self, members: Members
    ) -> None:
        ids = members.ids()
        view = members.of(ids[0])
        view.report_failure(ids[1])
        assert not view.is_alive(ids[1])  # at once: placement skips it from the next call
        view.report_failure(ids[0])
        assert view.is_alive(ids[0])  # a node never counts itself down
        await _eventually(f"{ids[1]} back after answering", lambda: view.is_alive(ids[1]))

    async def test_down_since_and_forgetting_a_gone_member(self, members: Members) -> None:
        ids = members.ids()
        victim, others = ids[-1], ids[:-1]
        view = members.of(ids[0])
        assert view.down_since(victim) is None  # alive
        assert not await view.forget(ids[1])  # a live member is never forgotten
        assert view.all_ids() == ids
        stopped = time.time()
        await members.stop(victim)
        await _eventually(f"{victim} down", lambda: not view.is_alive(victim))
        since = view.down_since(victim)
        # From its last sign of life (a heartbeat, the lease's last renewal) or later.
        assert since is not None and stopped - 30 < since <= time.time()
        assert await view.forget(victim) == self.forgets
        if self.forgets:
            await _eventually(
                f"{victim} no longer a member anywhere",
                lambda: all(victim not in members.of(n).all_ids() for n in others),
            )
            assert view.down_since(victim) is None  # not a member: neither up nor down
        else:
            assert view.all_ids() == ids  # still listed, as down
        await members.start(victim)  # comes back: registers anew where it was forgotten
        await _eventually(
            f"{victim} a live member again everywhere",
            lambda: all(members.of(n).alive_ids() == ids for n in ids),
        )

    async def test_a_drain_mark_outlives_forgetting_the_member(self, members: Members) -> None:
        """A member forgotten (down past ``gone_after``) while draining comes back draining:
        the timer does not undo the operator's decommission."""
        ids = members.ids()
        victim, others = ids[-1], ids[:-1]
        view = members.of(ids[0])
        assert view.drains.draining_since(victim) is None
        before = time.time()
        await view.drains.mark(victim)
        await _eventually(
            f"{victim} draining in every view",
            lambda: all(members.of(n).drains.is_draining(victim) for n in ids),
        )
        # when the drain began, the same in every view (the mark's time, not the node's start)
        began = {members.of(n).drains.draining_since(victim) for n in ids}
        assert len(began) == 1, began
        (since,) = began
        assert since is not None and before - 1 <= since <= time.time() + 1
        await members.stop(victim)
        await _eventually(f"{victim} down", lambda: not view.is_alive(victim))
        assert await view.forget(victim) == self.forgets
        if self.forgets:
            await _eventually(
                f"{victim} no longer a member anywhere",
                lambda: all(victim not in members.of(n).all_ids() for n in others),
            )
            assert not view.drains.is_draining(victim)  # not a member: neither draining nor not
        await members.start(victim)
        await _eventually(
            f"{victim} a live member again everywhere, draining",
            lambda: all(
                members.of(n).alive_ids() == ids and members.of(n).drains.is_draining(victim)
                for n in ids
            ),
        )
        assert members.of(victim).view().draining == frozenset({victim})
        assert all(members.of(n).drains.draining_since(victim) == since for n in ids)
        await view.drains.mark(victim, draining=False)  # and the mark can be lifted
        await _eventually(
            f"{victim} active again everywhere",
            lambda: not any(members.of(n).drains.is_draining(victim) for n in ids),
        )
        assert all(members.of(n).drains.draining_since(victim) is None for n in ids)

    async def test_a_node_beginning_a_graceful_stop_leaves_placement_while_it_runs(
        self, members: Members
    ) -> None:
        ids = members.ids()
        victim, others = ids[-1], ids[:-1]
        await members.begin_stopping(victim)
        await _eventually(
            f"{victim}, stopping, out of every other view",
            lambda: all(not members.of(n).is_alive(victim) for n in others),
        )
        view = members.of(victim)  # still running: it drains and serves reads
        assert view.is_alive(victim) and view.alive_ids() == [*others, victim]
        await members.stop(victim)
        await members.start(victim)  # started again, it is placed again
        await _eventually(
            f"{victim} alive again everywhere",
            lambda: all(members.of(n).alive_ids() == ids for n in ids),
        )


def as_a_crash(membership: Membership) -> None:
    """Make the next ``close`` of ``membership`` tell the coordinator nothing, as a crash
    does: a draining etcd member that closes leaves the members for good, and any closes by
    revoking its lease; a dead process does neither (its lease runs out)."""
    if hasattr(membership, "_lease"):  # the etcd membership

        async def no_leave() -> None:
            pass

        # setattr: the leave of an etcd membership is not on the abstract interface
        setattr(membership, "_lease", 0)  # noqa: B010
        setattr(membership, "leave", no_leave)  # noqa: B010


class InprocMembers(Members):
    """``Members`` over an in-process cluster (``tests/service/inproc.py``), whatever
    coordinator its nodes use."""

    def __init__(self, cluster: InprocCluster) -> None:
        self.cluster = cluster

    def ids(self) -> list[str]:
        return [self.cluster.node_id(i) for i in range(self.cluster.nodes)]

    def of(self, node_id: str) -> Membership:
        return self.cluster.node(self.cluster.index_of(node_id)).membership

    async def stop(self, node_id: str) -> None:
        i = self.cluster.index_of(node_id)
        as_a_crash(self.cluster.node(i).membership)
        await self.cluster.kill(i)

    async def start(self, node_id: str) -> None:
        await self.cluster.start_node(self.cluster.index_of(node_id))

    async def begin_stopping(self, node_id: str) -> None:
        node = self.cluster.node(self.cluster.index_of(node_id))
        node.stopping = True  # the first two steps of Node.shutdown
        await node.membership.leaving()
