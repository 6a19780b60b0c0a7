"""ArchiveTier: the conformance suite against a real S3 server (Swift's s3api, started for
this module) and a ``file://`` directory, then the archive's own paths: the layout, objects
flipped or gone behind its back, a server that stops answering or dies, refused
credentials, and the manifests."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import ClassVar

import obstore
import pytest
from obstore.store import S3Store

from storaged.ids import CHECKPOINT_NAME_RE, chunk_id_of
from tests.s3server import SwiftS3Server, swift_for_tests
from tests.tiers.tier_conformance import KiB, MiB, TierTests, all_keys
from tiers.archive import (
    MANIFEST_NAME_RE,
    ArchiveDenied,
    ArchiveTier,
    ArchiveTimeouts,
    ArchiveUnavailable,
    ManifestNotFound,
    S3Options,
)
from tiers.base import ByteRange, ChunkNotFound, CorruptChunk, InvalidKey, Tier, TierFull

#: generous for a loaded 2-core machine, short enough that a hung server fails a test
TIMEOUTS = ArchiveTimeouts(connect=2.0, request=20.0, retries=1, retry_window=10.0)
#: for the tests of a server that stops answering: every call ends within about 2 x 2 s
SHORT = ArchiveTimeouts(connect=1.0, request=2.0, retries=1, retry_window=2.0)


@pytest.fixture(scope="module")
def swift() -> Iterator[SwiftS3Server]:
    """One Swift for the module."""
    yield from swift_for_tests()


def s3_options(server: SwiftS3Server, secret: str | None = None) -> S3Options:
    return S3Options(
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=secret or server.secret_key,
    )


def prefix_of(path: Path) -> str:
    """A prefix in the bucket no other test uses: tests open tiers by path."""
    return "t-" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


def s3_url(server: SwiftS3Server, path: Path) -> str:
    return f"s3://{server.bucket}/{prefix_of(path)}"


def raw_store(server: SwiftS3Server, path: Path) -> S3Store:
    """The bucket under a tier's prefix, through the library, without the tier."""
    return S3Store(
        server.bucket,
        prefix=prefix_of(path),
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        client_options={"allow_http": True},
    )


async def open_s3(server: SwiftS3Server, path: Path, capacity: int = 1 << 30) -> ArchiveTier:
    return await ArchiveTier.open(
        s3_url(server, path), capacity, s3=s3_options(server), timeouts=TIMEOUTS
    )


class TestArchiveTierS3Conformance(TierTests):
    persistent = True
    server: ClassVar[SwiftS3Server]

    @pytest.fixture(autouse=True)
    def _server(self, swift: SwiftS3Server) -> None:
        type(self).server = swift

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        return await open_s3(self.server, path, capacity)

    def bad_keys(self) -> list[str]:
        return [*super().bad_keys(), "0" * 64 + ".1"]  # a fragment key is not a chunk id


class TestArchiveTierFileConformance(TierTests):
    persistent = True

    async def open_tier(self, path: Path, capacity: int) -> Tier:
        return await ArchiveTier.open(path.as_uri(), capacity)

    def bad_keys(self) -> list[str]:
        return [*super().bad_keys(), "0" * 64 + ".1"]


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def rng() -> random.Random:
    return random.Random(19)


def chunk(rng: random.Random, size: int) -> tuple[str, bytes]:
    data = rng.randbytes(size)
    return chunk_id_of(data), data


@pytest.fixture
async def s3_tier(swift: SwiftS3Server, tmp_path: Path) -> AsyncIterator[ArchiveTier]:
    tier = await open_s3(swift, tmp_path)
    yield tier
    await tier.close()


async def raw_paths(store: S3Store, prefix: str) -> list[str]:
    return sorted([m["path"] async for batch in obstore.list(store, prefix) for m in batch])


# --- layout --------------------------------------------------------------------------------


async def test_chunks_are_objects_named_by_id_holding_the_bytes(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 300 * KiB)
    await s3_tier.put(key, value)
    await s3_tier.put(key, value)  # a second put of the same bytes: one object still
    raw = raw_store(swift, tmp_path)
    assert await raw_paths(raw, "") == [f"chunks/{key}"]
    stored = await (await obstore.get_async(raw, f"chunks/{key}")).bytes_async()
    assert bytes(stored) == value  # as they are: readable without the tier


async def test_a_put_of_an_object_another_writer_archived_uploads_nothing(
    swift: SwiftS3Server, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 100 * KiB)
    first = await open_s3(swift, tmp_path)
    second = await open_s3(swift, tmp_path)  # another node on the same prefix
    await first.put(key, value)
    assert second.usage().count == 0  # it listed before the put
    # Marked so that an upload would show: same size, other bytes (a HEAD sees no difference)
    marked = bytes(len(value))
    raw = raw_store(swift, tmp_path)
    await obstore.put_async(raw, f"chunks/{key}", marked)
    await second.put(key, value)
    assert bytes(await (await obstore.get_async(raw, f"chunks/{key}")).bytes_async()) == marked
    assert second.usage().count == 1 and second.usage().used == len(value)
    with pytest.raises(CorruptChunk):  # and a read still never serves the wrong bytes
        await second.get(key)


async def test_a_put_after_another_writer_deleted_the_object_uploads_it_again(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 100 * KiB)
    await s3_tier.put(key, value)
    raw = raw_store(swift, tmp_path)
    await obstore.delete_async(raw, f"chunks/{key}")  # e.g. another node's garbage collection
    await s3_tier.put(key, value)  # the tier thought it held: the store is asked
    assert bytes(await (await obstore.get_async(raw, f"chunks/{key}")).bytes_async()) == value
    assert s3_tier.usage().count == 1 and s3_tier.usage().used == len(value)


async def test_a_put_that_does_not_match_its_id_stores_nothing(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 128 * KiB)
    with pytest.raises(CorruptChunk) as info:
        await s3_tier.put(key, value[1:] + value[:1])
    assert info.value.key == key and "BLAKE3" in info.value.reason
    assert await raw_paths(raw_store(swift, tmp_path), "") == []


async def test_put_missing_produces_the_bytes_only_for_an_object_the_store_lacks(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 200 * KiB)
    asked: list[str] = []

    async def produce() -> bytes:
        asked.append(key)
        return value

    assert await s3_tier.put_missing(key, produce) is True
    assert asked == [key] and s3_tier.usage().count == 1
    raw = raw_store(swift, tmp_path)
    assert bytes(await (await obstore.get_async(raw, f"chunks/{key}")).bytes_async()) == value
    assert await s3_tier.put_missing(key, produce) is False  # held: no second read
    assert asked == [key]
    await obstore.delete_async(raw, f"chunks/{key}")  # gone behind the tier's back
    assert await s3_tier.put_missing(key, produce) is True  # the store is asked, not memory
    assert asked == [key, key]
    assert bytes(await (await obstore.get_async(raw, f"chunks/{key}")).bytes_async()) == value


async def test_put_missing_of_bytes_that_do_not_match_stores_nothing(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 64 * KiB)

    async def produce() -> bytes:
        return value[::-1]

    with pytest.raises(CorruptChunk) as info:
        await s3_tier.put_missing(key, produce)
    assert info.value.key == key
    assert await raw_paths(raw_store(swift, tmp_path), "") == []
    assert s3_tier.usage().count == 0


async def test_put_missing_passes_the_producers_error_and_stores_nothing(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, _ = chunk(rng, 1 * KiB)

    async def produce() -> bytes:
        raise LookupError("no node holds it")

    with pytest.raises(LookupError):
        await s3_tier.put_missing(key, produce)
    assert await raw_paths(raw_store(swift, tmp_path), "") == []


# --- objects changed behind the tier's back ----------------------------------------------


@pytest.mark.parametrize("byte_range", [None, ByteRange(0, 10)])
async def test_a_flipped_object_is_corrupt_quarantined_and_never_served(
    swift: SwiftS3Server,
    s3_tier: ArchiveTier,
    tmp_path: Path,
    rng: random.Random,
    byte_range: ByteRange | None,
) -> None:
    key, value = chunk(rng, 200 * KiB)
    await s3_tier.put(key, value)
    flipped = bytearray(value)
    flipped[len(flipped) // 3] ^= 0x04
    raw = raw_store(swift, tmp_path)
    await obstore.put_async(raw, f"chunks/{key}", bytes(flipped))
    with pytest.raises(CorruptChunk) as info:
        await s3_tier.get(key, byte_range)  # a range in the good part is refused too
    assert info.value.key == key
    assert not await s3_tier.exists(key)
    assert s3_tier.usage().count == 0
    aside = await raw_paths(raw, "quarantine/")
    assert len(aside) == 1 and key in aside[0]
    await s3_tier.put(key, value)  # archived anew from a good copy
    assert bytes(await s3_tier.get(key)) == value


async def test_a_flipped_file_in_a_file_archive_is_corrupt(
    tmp_path: Path, rng: random.Random
) -> None:
    tier = await ArchiveTier.open((tmp_path / "a").as_uri(), 1 << 30)
    key, value = chunk(rng, 100 * KiB)
    await tier.put(key, value)
    path = tmp_path / "a" / "chunks" / key
    flipped = bytearray(path.read_bytes())
    flipped[-1] ^= 0x80
    path.write_bytes(flipped)
    with pytest.raises(CorruptChunk):
        await tier.get(key)
    assert not path.exists()
    assert len(list((tmp_path / "a" / "quarantine").iterdir())) == 1
    with pytest.raises(ChunkNotFound):
        await tier.get(key)


async def test_an_object_deleted_behind_the_tiers_back_is_not_found(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 10 * KiB)
    await s3_tier.put(key, value)
    await obstore.delete_async(raw_store(swift, tmp_path), f"chunks/{key}")
    with pytest.raises(ChunkNotFound) as info:
        await s3_tier.get(key, ByteRange(0, 1))
    assert isinstance(info.value, KeyError) and info.value.key == key
    assert s3_tier.usage().count == 0
    assert await all_keys(s3_tier) == []


# --- the server ----------------------------------------------------------------------------


async def test_a_server_that_stops_answering_fails_each_call_within_its_timeouts(
    swift: SwiftS3Server, tmp_path: Path, rng: random.Random
) -> None:
    tier = await ArchiveTier.open(
        s3_url(swift, tmp_path), 1 << 30, s3=s3_options(swift), timeouts=SHORT
    )
    key, value = chunk(rng, 100 * KiB)
    await tier.put(key, value)
    other_key, other = chunk(rng, 100 * KiB)
    swift.stop("proxy")  # SIGSTOP: connections open, nothing answers
    try:
        for call in (tier.get(key), tier.stat(key), tier.put(other_key, other)):
            began = time.monotonic()
            with pytest.raises(ArchiveUnavailable) as info:
                await call
            took = time.monotonic() - began
            assert took < 15, took  # 2 attempts of 2 s, their backoff, a loaded machine
            assert s3_url(swift, tmp_path) in str(info.value)  # which store
    finally:
        swift.resume("proxy")
    assert bytes(await tier.get(key)) == value  # it answers again: so does the tier
    assert tier.usage().count == 1  # the failed put counted nothing


async def test_a_dead_server_fails_calls_at_once_and_a_restarted_one_serves(
    swift: SwiftS3Server, tmp_path: Path, rng: random.Random
) -> None:
    tier = await ArchiveTier.open(
        s3_url(swift, tmp_path), 1 << 30, s3=s3_options(swift), timeouts=SHORT
    )
    key, value = chunk(rng, 100 * KiB)
    await tier.put(key, value)
    await asyncio.to_thread(swift.kill, "proxy")
    try:
        began = time.monotonic()
        with pytest.raises(ArchiveUnavailable):
            await tier.get(key)
        assert time.monotonic() - began < 15
        with pytest.raises(ArchiveUnavailable):
            await ArchiveTier.open(s3_url(swift, tmp_path), 1 << 30, s3=s3_options(swift))
    finally:
        swift.launch("proxy")
        await asyncio.to_thread(swift.wait_serving, 120)
    assert bytes(await tier.get(key)) == value


@pytest.mark.parametrize("who", ["secret", "user"])
async def test_refused_credentials_fail_the_open_with_archive_denied(
    swift: SwiftS3Server, tmp_path: Path, who: str
) -> None:
    options = s3_options(swift, secret="not-the-secret")
    if who == "user":
        options = S3Options(
            endpoint=swift.endpoint,
            region=swift.region,
            access_key_id="test:nobody",
            secret_access_key=swift.secret_key,
        )
    began = time.monotonic()
    with pytest.raises(ArchiveDenied) as info:
        await ArchiveTier.open(s3_url(swift, tmp_path), 1 << 30, s3=options, timeouts=TIMEOUTS)
    assert time.monotonic() - began < 15  # refused, not retried until the window closes
    assert "refused" in str(info.value)


async def test_a_full_bucket_is_tier_full_and_nothing_is_counted(
    swift: SwiftS3Server, tmp_path: Path, rng: random.Random
) -> None:
    # The quota refuses a PUT larger than the room left; the room is from the container's
    # cached size, a few seconds late, so the test is a value bigger than the whole quota
    bucket = f"quota-{prefix_of(tmp_path)}"
    await asyncio.to_thread(swift.make_bucket, bucket, 150 * KiB)
    tier = await ArchiveTier.open(
        f"s3://{bucket}", 1 << 30, s3=s3_options(swift), timeouts=TIMEOUTS
    )  # its own capacity is far away: the store is what is full
    key, value = chunk(rng, 200 * KiB)
    with pytest.raises(TierFull) as info:
        await tier.put(key, value)
    assert "no room" in str(info.value)
    assert not await tier.exists(key)
    assert tier.usage().count == 0 and tier.usage().used == 0
    small_key, small = chunk(rng, 100 * KiB)
    await tier.put(small_key, small)  # what fits is stored
    assert bytes(await tier.get(small_key)) == small


def test_urls_of_other_kinds_are_refused(tmp_path: Path) -> None:
    for url in ("http://127.0.0.1:1/b", "s3://", "file://host/x", str(tmp_path), "gs://b"):
        with pytest.raises(ValueError):
            asyncio.run(ArchiveTier.open(url, 1 << 20))


# --- manifests -----------------------------------------------------------------------------


@pytest.fixture(params=["s3", "file"])
async def archive(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ArchiveTier]:
    if request.param == "s3":
        tier = await open_s3(request.getfixturevalue("swift"), tmp_path)
    else:
        tier = await ArchiveTier.open((tmp_path / "archive").as_uri(), 1 << 30)
    yield tier
    await tier.close()


async def test_manifests_round_trip_list_by_string_prefix_and_delete(
    archive: ArchiveTier,
) -> None:
    bodies = {
        "job/step-1": b"one",
        "job/step-10": b"ten" * 1000,
        "job/step-2": b"",
        "jobs/a": b"a",
        "other": bytes(range(256)) * 300,
    }
    for name, body in bodies.items():
        await archive.put_manifest(name, body)
    for name, body in bodies.items():
        assert bytes(await archive.get_manifest(name)) == body
    assert await archive.list_manifests() == sorted(bodies)
    assert await archive.list_manifests("job/step-1") == ["job/step-1", "job/step-10"]
    steps = ["job/step-1", "job/step-10", "job/step-2"]
    assert await archive.list_manifests("job") == [*steps, "jobs/a"]
    assert await archive.list_manifests("job/") == steps
    assert await archive.list_manifests("nothing/") == []
    for name in bodies:
        assert await archive.has_manifest(name)
    for name in ("job", "job/step", "nothing"):  # a directory, a prefix: no manifest
        assert not await archive.has_manifest(name)
    await archive.put_manifest("job/step-1", b"replaced")
    assert bytes(await archive.get_manifest("job/step-1")) == b"replaced"
    await archive.delete_manifest("job/step-1")
    await archive.delete_manifest("job/step-1")  # idempotent
    with pytest.raises(ManifestNotFound) as info:
        await archive.get_manifest("job/step-1")
    assert isinstance(info.value, KeyError) and info.value.key == "job/step-1"
    assert "job/step-1" not in await archive.list_manifests()
    assert not await archive.has_manifest("job/step-1")
    assert archive.usage().count == 0  # manifests are not chunks


async def test_manifest_names_outside_the_api_form_are_refused(archive: ArchiveTier) -> None:
    for bad in ("", "/a", "a/", "a//b", "../a", "a/../b", ".a", "a/b/c/d/e", "a b", "é"):
        with pytest.raises(InvalidKey):
            await archive.put_manifest(bad, b"x")
        with pytest.raises(ValueError):
            await archive.get_manifest(bad)
        with pytest.raises(InvalidKey):
            await archive.delete_manifest(bad)
    assert await archive.list_manifests() == []


def test_manifest_names_are_the_api_checkpoint_names() -> None:
    assert MANIFEST_NAME_RE.pattern == CHECKPOINT_NAME_RE.pattern


async def test_a_half_archived_checkpoint_is_not_listed(
    archive: ArchiveTier, rng: random.Random
) -> None:
    shared_key, shared = chunk(rng, 64 * KiB)
    keys = [shared_key]
    for _ in range(3):
        key, value = chunk(rng, 32 * KiB)
        await archive.put(key, value)
        keys.append(key)
    await archive.put(shared_key, shared)
    assert await archive.list_manifests() == []  # chunks alone: no checkpoint
    await archive.put_manifest("job/step-1", ",".join(keys).encode())
    await archive.put_manifest("job/step-2", shared_key.encode())  # shares one chunk
    assert await archive.list_manifests("job/") == ["job/step-1", "job/step-2"]
    assert archive.usage().count == 4  # the shared chunk is one object


async def test_a_flipped_manifest_is_corrupt_and_quarantined(
    swift: SwiftS3Server, tmp_path: Path
) -> None:
    tier = await open_s3(swift, tmp_path)
    await tier.put_manifest("job/step-1", b"manifest bytes" * 100)
    raw = raw_store(swift, tmp_path)
    stored = bytearray(await (await obstore.get_async(raw, "manifests/job/step-1")).bytes_async())
    stored[-5] ^= 0x01
    await obstore.put_async(raw, "manifests/job/step-1", bytes(stored))
    with pytest.raises(CorruptChunk) as info:
        await tier.get_manifest("job/step-1")
    assert "manifest" in info.value.reason
    assert await tier.list_manifests() == []
    assert len(await raw_paths(raw, "quarantine/")) == 1
    await obstore.put_async(raw, "manifests/job/step-2", b"not a manifest of ours")
    with pytest.raises(CorruptChunk):
        await tier.get_manifest("job/step-2")


async def test_large_chunks_take_one_single_put_each(
    swift: SwiftS3Server, s3_tier: ArchiveTier, tmp_path: Path, rng: random.Random
) -> None:
    key, value = chunk(rng, 8 * MiB)
    await s3_tier.put(key, value)
    meta = await obstore.head_async(raw_store(swift, tmp_path), f"chunks/{key}")
    # A multipart upload's ETag ends in "-<parts>"; a single PUT's is the bytes' MD5
    assert meta["e_tag"] is not None
    assert meta["e_tag"].strip('"') == hashlib.md5(value).hexdigest()
    assert bytes(await s3_tier.get(key, ByteRange(MiB, MiB + 7))) == value[MiB : MiB + 7]
