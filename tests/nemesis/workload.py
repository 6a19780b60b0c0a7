"""The writers: overlapping checkpoints saved, re-saved, raced, deleted and read back, all
choices drawn from the seed, every answer recorded in the ``History``.

What a step of writer ``w`` does (each "sometimes" a draw from the writer's own RNG):

1. Picks the chunks of its next checkpoint: some of the base chunks every writer shares
   (frozen layers: concurrent uploads of the same bytes), some of its previous checkpoint
   (unchanged tensors), sometimes some of a checkpoint deleted earlier (reuse after delete),
   and fresh ones (sizes varied).
2. Sometimes aborts an upload half-way (the connection reset) of a chunk the cluster already
   holds for a committed checkpoint (I2), or of a fresh chunk nobody will commit (an orphan).
3. Sometimes re-PUTs reused chunks with raw HTTP (dedup through a 200 PUT), otherwise asks
   ``/missing`` and uploads only what is missing (dedup through ``/missing``).
4. Sometimes re-PUTs a chunk of its oldest live checkpoint (by then often cold).
5. Commits (retrying lost answers; re-uploading chunks a 409 names as missing).
6. Sometimes commits two different manifests under one name at once (I4).
7. With an archive (``WorkloadShape.archive``), archives its first acknowledged checkpoint
   and sometimes the one it just committed (``Client.archive``, waiting a few seconds at
   most); the checker then wants it restored byte-exact at the end, also once it is
   deleted (read through the archive).
8. Deletes its checkpoints beyond the newest ``keep``.
9. Sometimes reads a live checkpoint back: manifest and every chunk, some by range, from
   random nodes with raw HTTP, every 200/206 body checked (I7).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgpack

from storaged.client import (
    CheckpointNotFound,
    Client,
    Exists,
    MissingChunks,
    StoragedError,
)
from storaged.client.documents import WaitTimeout
from storaged.client.retry import RetryPolicy
from tests.nemesis.history import CheckpointRecord, History
from tests.nemesis.proxy import reset

#: every writer's checkpoints carry the same creation time: the manifests are a function of
#: the seed alone
CREATED = 1764403200.0


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    writers: int = 3
    #: at most this many steps per writer (None: until stopped)
    steps: int | None = None
    chunks: tuple[int, int] = (8, 14)
    sizes: tuple[int, int] = (48 * 1024, 320 * 1024)
    base_chunks: int = 6
    #: live checkpoints a writer keeps; older ones are deleted
    keep: int = 3
    #: share of committed checkpoints archived (the cluster must have an archive)
    archive: float = 0.0


def manifest_of(chunks: Sequence[tuple[str, int]], meta: dict[str, Any]) -> dict[str, Any]:
    """One rank whose stream is ``chunks``, one uint8 item over all of it."""
    total = sum(size for _, size in chunks)
    return {
        "format": 1,
        "created": CREATED,
        "meta": meta,
        "shards": [
            {
                "rank": 0,
                "chunks": [[cid, size] for cid, size in chunks],
                "items": [
                    {
                        "key": "blob",
                        "dtype": "uint8",
                        "global_shape": [total],
                        "offsets": [0],
                        "shape": [total],
                        "start": 0,
                        "length": total,
                    }
                ],
            }
        ],
    }


class RawHttp:
    """The parts of the API the client hides: raw PUTs, GETs whose bodies are checked, and
    uploads dropped half-way."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], token: str) -> None:
        self.session = session
        self.urls = urls
        self.token = token
        self.headers = {"Authorization": f"Bearer {token}"}

    async def put(self, url: str, cid: str, data: bytes) -> int | None:
        """Status of a PUT of the chunk, None when no answer came."""
        try:
            async with self.session.put(
                f"{url}/v1/chunks/{cid}", data=data, headers=self.headers
            ) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def get(
        self, url: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes] | None:
        try:
            async with self.session.get(
                url + path, headers={**self.headers, **(headers or {})}
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def manifest(self, url: str, name: str) -> tuple[int, Any] | None:
        got = await self.get(url, f"/v1/checkpoints/{name}", {"Accept": "application/msgpack"})
        if got is None:
            return None
        status, body = got
        return status, (msgpack.unpackb(body, raw=False) if status == 200 else None)

    async def abort_upload(self, url: str, cid: str, data: bytes, rng: random.Random) -> None:
        """Send the head and part of the body of a PUT, then reset the connection."""
        parts = urlsplit(url)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port), 5.0
            )
        except (OSError, TimeoutError):
            return
        head = (
            f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {self.token}\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        try:
            writer.write(head + data[: rng.randrange(1, max(2, len(data) - 1))])
            await asyncio.wait_for(writer.drain(), 5.0)
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        except (OSError, TimeoutError):
            pass
        finally:
            reset(writer)


def writer_client(urls: list[str], token: str) -> Client:
    """A client patient enough to ride out a fault, not so patient that a writer stalls."""
    return Client(
        urls,
        token=token,
        max_concurrency=4,
        retry=RetryPolicy(max_attempts=6, deadline=20.0),
        request_timeout=20.0,
        connect_timeout=3.0,
        read_timeout=10.0,
    )


class Writer:
    def __init__(
        self,
        index: int,
        history: History,
        client: Client,
        raw: RawHttp,
        shape: WorkloadShape,
        base: list[tuple[str, int]],
    ) -> None:
        self.w = index
        self.history = history
        self.client = client
        self.raw = raw
        self.shape = shape
        self.base = base
        self.rng = random.Random(f"{history.seed}/writer/{index}")
        #: this writer's checkpoints that may still exist, oldest first
        self.mine: list[CheckpointRecord] = []
        #: chunks of checkpoints deleted earlier, for reuse (bounded)
        self.deleted_pool: list[tuple[str, int]] = []
        self.previous: list[tuple[str, int]] = []
        #: whether this writer asked for an archive yet
        self.archive_asked = False

    async def run(self, stop: asyncio.Event) -> None:
        step = 0
        while not stop.is_set() and (self.shape.steps is None or step < self.shape.steps):
            await self.step(step)
            step += 1
        self.history.note(f"w{self.w}: stopped after {step} steps")

    def url(self) -> str:
        return self.rng.choice(self.raw.urls)

    # ---- one step ----------------------------------------------------------------------
    async def step(self, s: int) -> None:
        h, rng = self.history, self.rng
        chunks: dict[str, int] = {}
        for cid, size in rng.sample(self.base, rng.randint(1, 3)):
            chunks[cid] = size
        if self.previous:
            for cid, size in rng.sample(self.previous, min(len(self.previous), 4)):
                chunks[cid] = size
        reused: list[tuple[str, int]] = []
        if self.deleted_pool and rng.random() < 0.6:
            reused = rng.sample(self.deleted_pool, min(len(self.deleted_pool), 3))
            for cid, size in reused:
                chunks[cid] = size
                h.note_chunk(cid, f"w{self.w}/step-{s:05d} reuses it after its delete")
        count = rng.randint(*self.shape.chunks)
        i = 0
        while len(chunks) < count:
            cid, _ = h.chunk(f"w{self.w}/s{s}/c{i}", rng.randint(*self.shape.sizes))
            chunks[cid] = h.chunks[cid].size
            i += 1
        order = list(chunks.items())
        rng.shuffle(order)

        await self._aborts(s, order)
        if not await self._upload(s, order, raw_put=[c for c, _ in reused if rng.random() < 0.5]):
            return
        await self._re_put_old()
        name = f"w{self.w}/step-{s:05d}"
        record = CheckpointRecord(name, self.w, [manifest_of(order, {"step": s})], list(chunks))
        h.checkpoints[name] = record
        await self._commit(record, 0)
        if record.outcome != "refused":
            self.mine.append(record)
        if record.outcome == "acked":
            self.previous = order
            # A writer's first acknowledged checkpoint is archived, then a share of them
            first = not self.archive_asked and self.shape.archive > 0
            if first or rng.random() < self.shape.archive:
                await self._archive(record)
        if rng.random() < 0.25:
            await self._race(s, order)
        await self._delete_old()
        if rng.random() < 0.5:
            live = [r for r in self.mine if r.live]
            if live:
                await verify_checkpoint(h, self.raw, rng.choice(live), rng, during_faults=True)

    async def _aborts(self, s: int, order: list[tuple[str, int]]) -> None:
        h, rng = self.history, self.rng
        if self.previous and rng.random() < 0.3:
            cid, _ = rng.choice(self.previous)
            h.note_chunk(cid, f"w{self.w}: upload aborted half-way (the chunk is held)")
            h.counts["aborted_uploads"] += 1
            await self.raw.abort_upload(self.url(), cid, h.bytes_of(cid), rng)
        if rng.random() < 0.25:
            cid, data = h.chunk(f"w{self.w}/s{s}/orphan", rng.randint(*self.shape.sizes))
            h.counts["aborted_uploads"] += 1
            await self.raw.abort_upload(self.url(), cid, data, rng)

    async def _upload(self, s: int, order: list[tuple[str, int]], raw_put: list[str]) -> bool:
        h = self.history
        for cid in raw_put:
            status = await self.raw.put(self.url(), cid, h.bytes_of(cid))
            h.note_chunk(cid, f"w{self.w}: raw re-PUT answered {status}")
            h.counts[f"raw_put_{status}"] += 1
        ids = [cid for cid, _ in order]
        try:
            missing = await self.client.missing_chunks(ids)
            for cid in set(ids) - set(missing):
                h.note_chunk(cid, f"w{self.w}/step-{s:05d}: /missing says held")
            await self.client.put_chunks([h.bytes_of(c) for c in missing], missing)
            h.counts["chunks_uploaded"] += len(missing)
            h.counts["chunks_deduped"] += len(ids) - len(missing)
            return True
        except StoragedError as exc:
            # memory_full and insufficient_replicas (503) come with faults; so does
            # nvme_full (507, E16) while full_disk fills a node's disks: refused, not lost
            h.counts["uploads_failed"] += 1
            h.counts[f"upload_failed_{exc.code}"] += 1
            h.note(f"w{self.w}/step-{s:05d}: upload failed ({exc}); nothing committed")
            return False

    async def _re_put_old(self) -> None:
        h, rng = self.history, self.rng
        live = [r for r in self.mine if r.live]
        if not live or rng.random() >= 0.3:
            return
        cid = rng.choice(live[0].chunks)
        status = await self.raw.put(self.url(), cid, h.bytes_of(cid))
        h.counts[f"re_put_old_{status}"] += 1
        h.note_chunk(cid, f"w{self.w}: re-PUT of a chunk of {live[0].name} answered {status}")

    async def _commit(self, record: CheckpointRecord, side: int) -> str:
        """Commit manifest ``side`` of ``record``: "acked", "refused" (every answer a 4xx)
        or "unknown"; ``record.outcome`` is set for a plain (not raced) commit."""
        h = self.history
        manifest = record.manifests[side]
        answer_lost = False
        result = "unknown"
        for attempt in range(4):
            try:
                got = await self.client.commit(record.name, manifest)
                record.statuses.append(f"{side}:{201 if got.created else 200}")
                result = "acked"
                break
            except MissingChunks as exc:
                record.statuses.append(f"{side}:409 missing {len(exc.missing)}")
                answer_lost = answer_lost or exc.replayed
                result = "refused"
                await self._upload_again(record.name, exc.missing)
            except Exists as exc:
                record.statuses.append(f"{side}:409 exists")
                answer_lost = answer_lost or exc.replayed
                result = "refused"
                break
            except StoragedError as exc:
                if exc.status is not None and 400 <= exc.status < 500:
                    raise  # a manifest the suite got wrong: a bug here, not in the cluster
                record.statuses.append(f"{side}:{exc.status or exc.code}")
                answer_lost = True
                h.counts[f"commit_error_{exc.code}"] += 1
                await asyncio.sleep(self.rng.uniform(0.2, 1.0) * (attempt + 1))
        if result == "refused" and answer_lost:
            result = "unknown"  # an earlier attempt may have committed before its answer was lost
        h.note(f"commit {record.name}[{side}]: {result} ({', '.join(record.statuses)})")
        if len(record.manifests) == 1:
            record.outcome = result
            if result == "acked":
                h.counts["acked"] += 1
            elif result == "refused" and "exists" in record.statuses[-1]:
                h.violate("I4", f"{record.name}: 409 exists for the only manifest ever sent")
        return result

    async def _archive(self, record: CheckpointRecord) -> None:
        """Archive ``record`` and wait a little for it: confirmed, it must restore from
        the archive once deleted; unconfirmed, it may be in the archive all the same."""
        h = self.history
        record.archive_asked = self.archive_asked = True
        h.counts["archive_asked"] += 1
        try:
            await self.client.archive(record.name, wait=True, timeout=10.0)
        except (StoragedError, WaitTimeout) as exc:
            h.counts["archive_unconfirmed"] += 1
            h.note(f"archive {record.name}: not confirmed ({exc})")
            return
        record.archived = True
        h.counts["archived"] += 1
        h.note(f"archive {record.name}: archived")

    async def _upload_again(self, name: str, missing: list[str]) -> None:
        """PUT the chunks a commit said are missing, without asking ``/missing`` first: it
        may say held what the commit does not count (recorded, then uploaded regardless)."""
        h = self.history
        try:
            said_missing = set(await self.client.missing_chunks(missing))
        except StoragedError:
            said_missing = set(missing)
        for cid in missing:
            where = "says missing too" if cid in said_missing else "says held"
            h.note_chunk(cid, f"commit of {name} said missing (/missing {where}): PUT again")
            if cid not in said_missing:
                h.counts["missing_disagrees_with_commit"] += 1
            try:
                await self.client.put_chunk_result(h.bytes_of(cid), cid)
            except StoragedError as exc:
                h.note_chunk(cid, f"PUT again failed: {exc}")

    async def _race(self, s: int, order: list[tuple[str, int]]) -> None:
        """Two different manifests committed at once under one name: one wins, or neither."""
        h = self.history
        name = f"w{self.w}/race-{s:05d}"
        sides = [manifest_of(order, {"step": s, "side": side}) for side in (0, 1)]
        record = CheckpointRecord(name, self.w, sides, [cid for cid, _ in order])
        h.checkpoints[name] = record
        h.counts["races"] += 1
        results = await asyncio.gather(self._commit(record, 0), self._commit(record, 1))
        acked = [i for i, r in enumerate(results) if r == "acked"]
        if len(acked) == 2:
            h.violate("I4", f"{name}: both racing commits were acknowledged ({record.statuses})")
            record.outcome = "both"
            return
        if acked:
            record.outcome, record.winner = "acked", acked[0]
            h.counts["acked"] += 1
        elif all(r == "refused" for r in results):
            record.outcome = "refused"
        else:
            record.outcome = "unknown"
        self.mine.append(record)
        await check_visible(h, self.raw, record, self.url())

    async def _delete_old(self) -> None:
        h = self.history
        while len(self.mine) > self.shape.keep:
            record = self.mine.pop(0)
            if record.outcome == "refused":
                continue
            try:
                await self.client.delete(record.name)
                record.deleted = "acked"
                h.counts["deleted"] += 1
            except CheckpointNotFound:
                if record.outcome == "acked":
                    # The cluster denies a checkpoint it acknowledged: keep it for the end's
                    # check (a partition may explain a 404 now, nothing explains one then).
                    h.counts["delete_404_on_acked"] += 1
                    h.note(f"delete {record.name}: 404 although acknowledged")
                continue
            except StoragedError as exc:
                record.deleted = "unknown"
                h.note(f"delete {record.name}: {exc}")
            h.note(f"delete {record.name}: {record.deleted}")
            for cid in record.chunks:
                h.note_chunk(cid, f"its checkpoint {record.name} deleted ({record.deleted})")
            self.deleted_pool = [
                *self.deleted_pool,
                *((cid, h.chunks[cid].size) for cid in record.chunks),
            ][-40:]


def expected_manifest(record: CheckpointRecord) -> dict[str, Any] | None:
    """The manifest that must be visible under ``record.name`` (None: none may be)."""
    if record.outcome == "acked":
        return record.manifests[record.winner or 0]
    return None


async def check_visible(
    h: History, raw: RawHttp, record: CheckpointRecord, url: str, *, final: bool = False
) -> bool | None:
    """I4 on what ``url`` answers for ``record.name``. True: the right manifest (or rightly
    none); False: a violation; None: no answer (or a 404 for an acknowledged checkpoint
    before the end, which a partition may explain)."""
    got = await raw.manifest(url, record.name)
    if got is None or got[0] >= 500:
        return None
    status, doc = got
    want = expected_manifest(record)
    if status == 200:
        if final and record.deleted == "acked":
            if record.archive_asked and doc == want:
                return True  # from the archive, which keeps what it was given
            h.violate("I4", f"{record.name}: deleted (204) but its manifest is served again")
            return False
        if want is not None and doc == want:
            return True
        if want is None and record.outcome == "unknown" and doc in record.manifests:
            return True
        if record.deleted is not None and doc == want:
            return True
        h.violate(
            "I4",
            f"{record.name} ({record.outcome}, statuses {record.statuses}) shows a manifest "
            f"that is not the acknowledged one: meta {doc.get('meta') if doc else None}",
        )
        return False
    if status == 404:
        if final and record.archived:
            h.violate("archive", f"{record.name}: archived, but 404 at the end")
            return False
        if want is None or record.deleted is not None:
            return True
        if final:
            h.violate("I4", f"{record.name}: acknowledged ({record.statuses}) but 404 at the end")
            return False
        h.counts["manifest_404_during_faults"] += 1
        return None
    h.note(f"GET manifest {record.name}: {status}")
    return None


async def verify_checkpoint(
    h: History,
    raw: RawHttp,
    record: CheckpointRecord,
    rng: random.Random,
    *,
    during_faults: bool,
    may_be_gone: bool = False,
) -> dict[str, str]:
    """Read ``record`` back: its manifest, then every chunk from random nodes (some by
    range), every 200/206 body checked. Returns chunk id -> "ok" | "wrong" | "unread" (no
    node gave it: after faults that is a lost chunk). ``may_be_gone``: the retention
    policy may delete it meanwhile (a 404 for the manifest is no violation even at the
    end)."""
    # A wrong manifest is recorded by check_visible; the chunks are read all the same.
    final = not during_faults and not may_be_gone
    await check_visible(h, raw, record, rng.choice(raw.urls), final=final)
    out: dict[str, str] = {}
    for cid in dict.fromkeys(record.chunks):
        size = h.chunks[cid].size
        urls = list(raw.urls)
        rng.shuffle(urls)
        tries = 1 if during_faults else len(urls)
        out[cid] = "unread"
        for url in urls[:tries]:
            headers: dict[str, str] = {}
            start = 0
            # Ranges while faults run; at the end every chunk is read whole (byte-exact).
            if during_faults and size > 2 and rng.random() < 0.25:
                start = rng.randrange(0, size - 1)
                end = rng.randrange(start, size)
                headers["Range"] = f"bytes={start}-{end}"
            got = await raw.get(url, f"/v1/chunks/{cid}", headers)
            if got is None:
                continue
            status, body = got
            if status in (200, 206):
                ok = h.check_body(cid, status, body, start)
                out[cid] = "ok" if ok else "wrong"
                break
        if during_faults and out[cid] == "unread":
            h.counts["reads_unavailable_during_faults"] += 1
    return out
