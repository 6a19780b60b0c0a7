"""The client's write path: chunks hashed, asked after and uploaded (``Client.put_chunk``,
``Client.put_chunks``).

A chunk goes to the node on this host through shared memory when there is one (it hashes
what it is handed), else by ``PUT /v1/chunks/{id}`` to the chunk's first placement node
that is not draining, streamed in slices. ``put_chunks`` works in overlapping batches:
hash (threads), ask ``POST /v1/chunks/missing``, PUT what is missing, each chunk once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import aiohttp
import msgpack

from storaged.client.documents import PutResult
from storaged.client.errors import NvmeFull, ProtocolError, TooLarge
from storaged.client.request import MSGPACK, Requests, decoded
from storaged.client.shm import in_thread, usable
from storaged.client.sources import Links
from storaged.ids import chunk_id_of, chunk_id_of_async, is_chunk_id
from storaged.wire import BytesLike

T = TypeVar("T")

# Bodies are streamed to the socket in slices this big: the transport buffers (copies)
# only what the kernel does not take at once, and memory stays bounded per request.
_SEND_SLICE = 1 << 20


async def _slices(view: memoryview) -> AsyncIterator[memoryview]:
    for offset in range(0, len(view), _SEND_SLICE):
        yield view[offset : offset + _SEND_SLICE]


async def run_all(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Await all, in order; on the first failure cancel the rest, wait for them, and raise it."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _put_result(doc: Any, status: int) -> PutResult:
    """A PUT's answer (HTTP or shared memory) as a ``PutResult``."""
    try:
        return PutResult(
            str(doc["chunk"]),
            int(doc["size"]),
            tuple(str(r) for r in doc.get("replicas", ())),
            str(doc.get("state", "memory")),
            status == 201,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(message=f"malformed PUT answer: {exc!r}") from exc


def _as_bytes_view(data: BytesLike) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise TypeError("chunk data must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


class ChunkWrites:
    """Uploads for one ``Client`` (its requests, its shared-memory path in ``links``)."""

    def __init__(
        self,
        requests: Requests,
        links: Links,
        *,
        hash_slots: asyncio.Semaphore,
        missing_batch: int,
    ) -> None:
        self.requests, self.links = requests, links
        self.stats = requests.stats
        self.hash_slots = hash_slots
        self.missing_batch = missing_batch

    async def put(self, data: BytesLike, chunk_id: str | None) -> PutResult:
        """``Client.put_chunk_result``."""
        view = _as_bytes_view(data)
        if chunk_id is not None and not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        shm = usable(self.links.shm)
        if shm is not None and 0 < len(view) <= self.requests.known_cluster().max_chunk_size:
            # The node hashes what it is handed: no id needed here.
            handed = await shm.put(view, chunk_id)
            if handed is not None:
                result = _put_result(handed[1], handed[0])
                self.stats.chunks_uploaded += 1
                self.stats.bytes_uploaded += len(view)
                self.stats.shm_chunks_uploaded += 1
                self.stats.shm_bytes_uploaded += len(view)
                return result
            if chunk_id is None:
                # As the shared-memory copy did: a cancelled caller (a saver that reuses
                # the buffer) resumes only once no thread reads ``view`` any more.
                chunk_id = await in_thread(chunk_id_of, view)
        if chunk_id is None:
            chunk_id = await chunk_id_of_async(view)
        elif not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        return await self._put_http(view, chunk_id)

    async def _put_http(self, view: memoryview, chunk_id: str) -> PutResult:
        cluster = self.requests.known_cluster()
        limit = cluster.max_chunk_size
        if len(view) > limit:
            raise TooLarge(message=f"chunk of {len(view)} bytes exceeds max_chunk_size {limit}")
        size = len(view)
        # A draining node takes no copy: sent there, the body would take one more hop.
        draining = {n.id for n in cluster.nodes if n.draining}
        placement = [n for n in self.requests.placement(chunk_id) if n not in draining]
        others = [n.id for n in cluster.nodes if n.id not in placement]

        async def handle(resp: aiohttp.ClientResponse) -> PutResult:
            return _put_result(await decoded(resp), resp.status)

        result = await self.requests.call(
            "PUT",
            f"/v1/chunks/{chunk_id}",
            handle,
            candidates=[*placement, *others],
            # A full node refuses at once (E16); another entry node may place the chunk on
            # nodes with room. Each node is tried once: a full disk does not pass by waiting.
            next_node_on=(NvmeFull,),
            # Bodies go at the pace the client's link takes (a 408 narrows the window).
            paced=True,
            body=lambda: _slices(view),
            headers={
                "Content-Length": str(size),
                "Content-Type": "application/octet-stream",
            },
        )
        self.stats.chunks_uploaded += 1
        self.stats.bytes_uploaded += size
        return result

    async def missing(self, chunk_ids: Sequence[str]) -> list[str]:
        """``Client.missing_chunks``."""
        missing: list[str] = []
        for lo in range(0, len(chunk_ids), self.missing_batch):
            batch = list(chunk_ids[lo : lo + self.missing_batch])
            payload: bytes = msgpack.packb({"chunks": batch})

            def body(payload: bytes = payload) -> bytes:
                return payload

            async def handle(resp: aiohttp.ClientResponse) -> list[str]:
                doc = await decoded(resp)
                if not isinstance(doc, dict) or not isinstance(doc.get("missing"), list):
                    raise ProtocolError(message="malformed /v1/chunks/missing answer")
                return [str(c) for c in doc["missing"]]

            missing += await self.requests.call(
                "POST",
                "/v1/chunks/missing",
                handle,
                body=body,
                headers={"Content-Type": MSGPACK},
                # A question, though a POST: asking a second node changes nothing.
                hedge_after=self.requests.deadlines.metadata,
            )
        return missing

    async def chunk_ids(self, chunks: Sequence[BytesLike]) -> list[str]:
        """``Client.chunk_ids``."""

        async def one(data: BytesLike) -> str:
            async with self.hash_slots:
                return await chunk_id_of_async(data)

        return await run_all([one(c) for c in chunks])

    async def put_many(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None
    ) -> list[str]:
        """``Client.put_chunks``."""
        if chunk_ids is not None and len(chunk_ids) != len(chunks):
            raise ValueError("chunk_ids must match chunks one to one")
        ids: list[str] = [""] * len(chunks)
        uploads: dict[str, asyncio.Future[None]] = {}

        async def batch(lo: int, hi: int) -> None:
            if chunk_ids is None:
                ids[lo:hi] = await self.chunk_ids(chunks[lo:hi])
            else:
                ids[lo:hi] = chunk_ids[lo:hi]
            first: dict[str, int] = {}
            for index in range(lo, hi):
                first.setdefault(ids[index], index)
            missing = set(await self.missing(list(first)))
            waits: list[Awaitable[None]] = []
            for chunk, index in first.items():
                if chunk not in missing:
                    self.stats.chunks_skipped += 1
                    self.stats.bytes_skipped += _as_bytes_view(chunks[index]).nbytes
                    continue
                if chunk not in uploads:  # another batch may be uploading it already
                    uploads[chunk] = asyncio.ensure_future(self._put_quiet(chunks[index], chunk))
                waits.append(uploads[chunk])
            await run_all(waits)

        step = self.missing_batch
        try:
            await run_all(
                [batch(lo, min(lo + step, len(chunks))) for lo in range(0, len(chunks), step)]
            )
        finally:
            for future in uploads.values():
                future.cancel()
            await asyncio.gather(*uploads.values(), return_exceptions=True)
        return ids

    async def _put_quiet(self, data: BytesLike, chunk_id: str) -> None:
        await self.put(data, chunk_id)
