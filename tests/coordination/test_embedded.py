"""The embedded coordinator (cluster file, heartbeats, records on the nodes) against the
catalogue and membership conformance suites, with nodes in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from storaged.coord.catalogue import Catalogue
from tests.coordination.catalogue_conformance import CatalogueTests
from tests.coordination.membership_conformance import InprocMembers, Members, MembershipTests
from tests.service.inproc import InprocFactory


class TestEmbeddedCatalogue(CatalogueTests):
    @pytest.fixture
    async def catalogues(self, inproc: InprocFactory) -> AsyncIterator[list[Catalogue]]:
        cluster = await inproc.start(4)
        yield [cluster.node(i).catalogue for i in range(4)]


class TestStaticMembership(MembershipTests):
    @pytest.fixture
    async def members(self, inproc: InprocFactory) -> AsyncIterator[Members]:
        cluster = await inproc.start(4)
        yield InprocMembers(cluster)
