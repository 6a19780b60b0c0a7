"""The embedded coordinator (cluster file, heartbeats, records on the nodes) against the
catalogue and membership conformance suites, with nodes in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from storaged.catalogue import Catalogue
from storaged.membership import Membership
from tests.coordination.catalogue_conformance import CatalogueTests
from tests.coordination.membership_conformance import Members, MembershipTests
from tests.service.inproc import InprocCluster, InprocFactory


class TestEmbeddedCatalogue(CatalogueTests):
    @pytest.fixture
    async def catalogues(self, inproc: InprocFactory) -> AsyncIterator[list[Catalogue]]:
        cluster = await inproc.start(4)
        yield [cluster.node(i).catalogue for i in range(4)]


class _InprocMembers(Members):
    def __init__(self, cluster: InprocCluster) -> None:
        self.cluster = cluster

    def ids(self) -> list[str]:
        return [self.cluster.node_id(i) for i in range(self.cluster.nodes)]

    def of(self, node_id: str) -> Membership:
        return self.cluster.node(self.cluster.index_of(node_id)).membership

    async def stop(self, node_id: str) -> None:
        await self.cluster.kill(self.cluster.index_of(node_id))

    async def start(self, node_id: str) -> None:
        await self.cluster.start_node(self.cluster.index_of(node_id))


class TestStaticMembership(MembershipTests):
    @pytest.fixture
    async def members(self, inproc: InprocFactory) -> AsyncIterator[Members]:
        cluster = await inproc.start(4)
        yield _InprocMembers(cluster)
