"""The conformance suite every ``storaged.coord.catalogue.Catalogue`` passes.

Subclass ``CatalogueTests`` and provide the ``catalogues`` fixture: handles on one cluster's
catalogue as different nodes see it (at least two), so that races between nodes are real.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from storaged.coord.catalogue import Catalogue, CommitConflict
from storaged.coord.manifest_store import CatalogRecord, CheckpointNotFound

_names = itertools.count()


def record(name: str, chunks: list[str], salt: str = "") -> CatalogRecord:
    """A record naming ``chunks``; its digest differs with ``salt``."""
    digest = f"{name}|{salt}|{','.join(chunks)}"
    return CatalogRecord(
        name=name,
        digest=digest,
        created=time.time(),
        committed=time.time(),
        total_bytes=len(chunks),
        chunks=list(chunks),
        manifest=digest.encode(),
    )


def fresh(prefix: str = "conf") -> str:
    return f"{prefix}/c{next(_names)}-{time.monotonic_ns()}"


def cid(i: int) -> str:
    return f"{i:064x}"


class CatalogueTests:
    """Behaviour the node relies on, whatever keeps the records."""

    async def test_commit_then_get_and_identical_retry(self, catalogues: list[Catalogue]) -> None:
        a, b = catalogues[0], catalogues[1]
        name = fresh()
        rec = record(name, [cid(1), cid(2)])
        assert await a.commit(rec) is True
        got = await b.get(name)
        assert (got.digest, got.chunks, got.manifest) == (rec.digest, rec.chunks, rec.manifest)
        # the same manifest again (a client's retry) is not a new commit and not an error
        assert await b.commit(record(name, [cid(1), cid(2)])) is False

    async def test_other_manifest_under_a_taken_name_conflicts(
        self, catalogues: list[Catalogue]
    ) -> None:
        a, b = catalogues[0], catalogues[1]
        name = fresh()
        first = record(name, [cid(3)])
        assert await a.commit(first)
        with pytest.raises(CommitConflict):
            await b.commit(record(name, [cid(4)], salt="other"))
        assert (await a.get(name)).digest == first.digest

    async def test_concurrent_commits_of_one_name_one_wins_and_only_it_is_seen(
        self, catalogues: list[Catalogue]
    ) -> None:
        for _ in range(5):
            name = fresh("race")
            recs = [record(name, [cid(10 + i)], salt=str(i)) for i in range(len(catalogues))]
            results = await asyncio.gather(
                *(c.commit(r) for c, r in zip(catalogues, recs, strict=True)),
                return_exceptions=True,
            )
            winners = [r for r, res in zip(recs, results, strict=True) if res is True]
            assert len(winners) == 1, results
            for res in results:
                assert res is True or isinstance(res, CommitConflict), res
            for c in catalogues:
                assert (await c.get(name)).digest == winners[0].digest

    async def test_delete_leaves_a_tombstone_and_a_later_commit_is_new(
        self, catalogues: list[Catalogue]
    ) -> None:
        a, b = catalogues[0], catalogues[1]
        name = fresh()
        assert await a.commit(record(name, [cid(20)]))
        await b.delete(name)
        with pytest.raises(CheckpointNotFound):
            await a.get(name)
        found = await a.find(name)
        assert found is not None and found.deleted is not None
        with pytest.raises(CheckpointNotFound):
            await b.delete(name)
        with pytest.raises(CheckpointNotFound):
            await a.delete(fresh("never"))
        again = record(name, [cid(21)], salt="again")
        assert await b.commit(again) is True
        assert (await a.get(name)).digest == again.digest

    async def test_list_by_prefix_sorted_without_deleted(self, catalogues: list[Catalogue]) -> None:
        a, b = catalogues[0], catalogues[1]
        prefix = fresh("list")
        names = [f"{prefix}/s{i}" for i in (3, 1, 2)]
        for i, n in enumerate(names):
            assert await catalogues[i % len(catalogues)].commit(record(n, [cid(30 + i)]))
        assert await a.commit(record(f"{prefix}x/other", [cid(39)]))
        await b.delete(names[0])
        listed = [r.name for r in await a.list(prefix + "/")]
        assert listed == sorted(names[1:])

    async def test_delete_during_listings_never_breaks_them(
        self, catalogues: list[Catalogue]
    ) -> None:
        a, b = catalogues[0], catalogues[1]
        prefix = fresh("dl")
        names = [f"{prefix}/s{i}" for i in range(6)]
        for n in names:
            assert await a.commit(record(n, [cid(40)]))
        listings = [a.list(prefix + "/") for _ in range(4)]
        deletes = [b.delete(n) for n in names[:3]]
        results = await asyncio.gather(*listings, *deletes)
        for listed in results[:4]:
            assert listed is not None
            got = [r.name for r in listed]
            assert set(names[3:]) <= set(got) <= set(names)
        assert [r.name for r in await a.list(prefix + "/")] == names[3:]

    async def test_references_name_live_checkpoints_only(self, catalogues: list[Catalogue]) -> None:
        a, b = catalogues[0], catalogues[1]
        keep, gone = fresh("refs"), fresh("refs")
        assert await a.commit(record(keep, [cid(50), cid(51)]))
        assert await a.commit(record(gone, [cid(51), cid(52)]))
        await b.delete(gone)
        refs = await b.references()
        assert refs.complete
        assert {cid(50), cid(51)} <= refs.chunks
        assert cid(52) not in refs.chunks
        assert keep in {r.name for r in refs.live} and gone not in {r.name for r in refs.live}

    async def test_references_taken_after_a_commit_returns_include_it(
        self, catalogues: list[Catalogue]
    ) -> None:
        """GC's consistency: a snapshot begun after a commit answered names its chunks, also
        while other commits race with it."""
        a, b = catalogues[0], catalogues[1]
        for round_ in range(3):
            names = [fresh("snap") for _ in range(4)]
            ids = [cid(1000 + 10 * round_ + i) for i in range(4)]

            async def commit_then_check(i: int, name: str, chunk: str) -> None:
                c = catalogues[i % len(catalogues)]
                assert await c.commit(record(name, [chunk]))
                refs = await (b if i % 2 else a).references()
                assert refs.complete and chunk in refs.chunks

            await asyncio.gather(*(commit_then_check(i, names[i], ids[i]) for i in range(4)))
