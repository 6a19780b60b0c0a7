"""The co-located fast path: chunks handed to the node on this host through shared memory.

``Client`` opens a ``ShmPath`` when a node it was given (its first seed URL that
qualifies) reports, in ``/v1/cluster``, the same host identity as this process and a
socket this process can reach (``storaged.front.shm`` is the node's side). Then:

- a PUT leases a memfd from the node, copies the chunk into it (one memcpy, in a thread,
  straight into pages the node already allocated), unmaps it and asks the node to seal
  it: the node hashes it, keeps it as its RAM copy and replicates it. The client never
  hashes what it uploads this way.
- a GET asks the node for the chunk from its RAM: the node passes a sealed memfd holding
  exactly that chunk; the client maps it read-only, checks its BLAKE3 (as every read is
  checked) and copies the wanted bytes out. The checked mapping serves the other ranges
  of that chunk asked for at the same time or soon after (a DCP restore reads a chunk as
  many tensor ranges): one node request, one mapping and one hash per chunk, not per
  range. The seal makes the mapped bytes unchangeable; mappings are few (``_MAPPED_BYTES``)
  and brief (``_MAPPED_IDLE``, or none after a whole-chunk read), as they keep pages
  alive the node may have let go and count in this process's memory.

Anything the path cannot do (a chunk not in the node's RAM, a refusal worth retrying, a
lost connection) returns ``None`` and the client takes the HTTP way, with its retries and
fail-over. The option ``shm=False`` (or ``STORAGED_SHM=0``) keeps a client on HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import mmap
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import msgpack

from storaged.client.errors import (
    BadRange,
    ChecksumMismatch,
    StoragedError,
    error_from_response,
    is_retryable,
)
from storaged.ids import chunk_id_of
from storaged.shmwire import FrameReader, WireError, host_identity, send_frame
from storaged.wire import ByteRange, InvalidRange

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long connecting and authenticating may take before the client stays on HTTP
_CONNECT_TIMEOUT = 5.0
#: below this a copy runs on the loop: a thread hop would cost more
_INLINE_COPY_BYTES = 256 << 10
#: checked chunk mappings kept for further range reads, at most this many bytes unused,
#: each unmapped once unused for ``_MAPPED_IDLE`` seconds, or at once after a read of the
#: whole chunk (a mapping keeps the node's pages alive after the node itself lets the
#: chunk go, and counts in this process's memory: keep few, briefly)
_MAPPED_BYTES = 64 << 20
_MAPPED_IDLE = 1.0


#: set (by ``http_only``) where a caller wants no shared memory from an open client
_HTTP_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "storaged_http_only", default=False
)


@contextlib.contextmanager
def http_only() -> Iterator[None]:
    """Within this block (and tasks created in it), clients take the HTTP way even when
    they have a shared-memory path (``AsyncSaver(shm=False)`` uses it)."""
    token = _HTTP_ONLY.set(True)
    try:
        yield
    finally:
        _HTTP_ONLY.reset(token)


def usable(path: object) -> ShmPath | None:
    """``path`` (a client's ``shm``) if it may be used here and now, else None."""
    if not isinstance(path, ShmPath) or path.broken or _HTTP_ONLY.get():
        return None
    return path


def shm_wanted(option: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a client with ``shm=option`` tries the path: ``False`` never; otherwise
    unless ``STORAGED_SHM`` is ``0`` (or ``false``/``no``/``off``)."""
    if option is False:
        return False
    env = os.environ if environ is None else environ
    return env.get("STORAGED_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def pick_node(doc: Any, seeds: list[str]) -> tuple[str, str] | None:
    """(node id, socket path) of the first seed URL's node that is on this host and whose
    socket exists, from a ``/v1/cluster`` document; None when there is none."""
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        return None
    here = host_identity()
    by_url = {}
    for node in doc["nodes"]:
        if not isinstance(node, dict) or not node.get("alive"):
            continue
        shm = node.get("shm")
        if not isinstance(shm, dict) or shm.get("host") != here:
            continue
        path = shm.get("socket")
        if isinstance(path, str) and os.path.exists(path):
            by_url[str(node.get("url", "")).rstrip("/")] = (str(node["id"]), path)
    for seed in seeds:
        if seed.rstrip("/") in by_url:
            return by_url[seed.rstrip("/")]
    return None


async def in_thread(func: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread``, except that a cancelled caller resumes only once the thread
    has finished.

    A thread cannot be stopped: cancelled, ``to_thread`` returns at once while its thread
    goes on reading or writing the memory it was handed (a staging buffer, a leased
    segment). After this one returns or raises, nothing it started touches that memory any
    more, so the caller may reuse it or hand it on."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, func, *args)
    thread = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(thread)
    except asyncio.CancelledError:
        while not thread.done():  # bounded by the thread's own work; cancels are deferred
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([thread])
        if not thread.cancelled():
            thread.exception()  # the caller was cancelled: its outcome is nobody's to see
        raise


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` without holding the GIL for large copies (numpy releases it)."""
    if src.nbytes <= _INLINE_COPY_BYTES:
        dst[:] = src
    else:
        import numpy as np  # only here: ``storaged ls`` starts without numpy

        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _stage(fd: int, size: int, data: memoryview) -> None:
    """Map the leased memfd, copy ``data`` in, unmap: after this nothing of ours can write
    it (the node's seal checks that no writable mapping is left). Not ``MAP_POPULATE``:
    measured here, populating a shared mapping for writing cost more (0.76-0.80 s/GB of
    map + copy + unmap) than the faults of the copy itself (0.63-0.70 s/GB)."""
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            view = memoryview(m)
            try:
                _copy(view, data)
            finally:
                view.release()
    finally:
        os.close(fd)


def _map_checked(fd: int, size: int, chunk_id: str) -> mmap.mmap:
    """Map a sealed chunk read-only and check it whole against its id (the descriptor is
    closed either way; the mapping keeps the pages). ``ChecksumMismatch`` when it fails."""
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        view = memoryview(m)
        try:
            good = chunk_id_of(view) == chunk_id
        finally:
            view.release()
    except BaseException:
        m.close()
        raise
    if not good:
        m.close()
        raise ChecksumMismatch(message=f"chunk {chunk_id} in shared memory fails its id")
    return m


def _copy_out(m: mmap.mmap, out: memoryview | None, start: int, end: int) -> memoryview:
    """``[start, end)`` of a mapped chunk copied into ``out`` (or a new buffer)."""
    view = memoryview(m)
    try:
        dst = memoryview(bytearray(end - start)) if out is None else out[: end - start]
        _copy(dst, view[start:end])
        return dst
    finally:
        view.release()


class _Mapped:
    """A sealed chunk mapped read-only in this process and checked once against its id.

    The seal makes its bytes unchangeable by anyone, so every range read of it while it
    stays mapped is served from the one checked mapping: a restore that reads a chunk as
    many tensor ranges hashes it once, not once per range."""

    __slots__ = ("mm", "size")

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.mm = mm
        self.size = size


class _Entry:
    """A chunk's mapping (being made, or made) and who uses it. ``users`` counts every
    read from the moment it asks until its copy is done, so that no mapping is unmapped
    between being made and being read."""

    __slots__ = ("last_used", "task", "users")

    def __init__(self, task: asyncio.Task[_Mapped | None]) -> None:
        self.task = task
        self.users = 0
        self.last_used = time.monotonic()

    def mapped(self) -> _Mapped | None:
        """The mapping once made (None while being made, or when it failed)."""
        task = self.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()


class ShmPath:
    """A connection to the shared-memory listener of the node on this host.

    Not for several loops. ``put`` and ``get`` return ``None`` for "take the HTTP way";
    once the connection is lost the path stays off (``broken``)."""

    def __init__(
        self,
        node_id: str,
        sock: socket.socket,
        reader: FrameReader,
        limit: int,
        timeout: float,
        read_within: float | None = None,
    ) -> None:
        self.node_id = node_id
        self._timeout = timeout
        self._read_within = timeout if read_within is None else read_within
        self._sock = sock
        self._reader = reader
        self._rids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[dict[str, Any], int | None]]] = {}
        self._send_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(limit)
        self.broken = False
        #: chunk id -> its checked mapping (being made, or made), least recently asked first
        self._maps: OrderedDict[str, _Entry] = OrderedDict()
        self._trim_timer: asyncio.TimerHandle | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read_replies())

    @classmethod
    async def connect(
        cls,
        node_id: str,
        path: str,
        token: str | None,
        limit: int,
        timeout: float = 120.0,
        read_within: float | None = None,
    ) -> ShmPath:
        """Connect and authenticate; ``OSError``/``WireError``/``StoragedError`` on failure.
        ``limit`` requests at once, each answered within ``timeout`` seconds or the path
        is given up (a node that stopped answering: a paused process, say); a read (the
        node's answer to "map this chunk", no bytes copied) and the handshake within
        ``read_within`` seconds, when given (a hung node accepts the connection and never
        answers: HTTP to the other holders serves meanwhile)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        reader = FrameReader(sock, accept_fds=True)
        handshake = _CONNECT_TIMEOUT if read_within is None else min(_CONNECT_TIMEOUT, read_within)
        try:
            async with asyncio.timeout(handshake):
                await asyncio.get_running_loop().sock_connect(sock, path)
                await send_frame(sock, {"op": "hello", "token": token or ""})
                answer = await reader.read()
        except BaseException:
            reader.close()
            sock.close()
            raise
        if answer.get("ok") is not True:
            reader.close()
            sock.close()
            raise _error(answer)
        return cls(node_id, sock, reader, limit, timeout, read_within)

    async def close(self) -> None:
        self.broken = True
        self._unmap_all()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reading
        self._sock.close()
        self._reader.close()
        self._fail_waiting(WireError("closed"))

    def _give_up(self) -> None:
        self.broken = True
        self._reading.cancel()
        # Closed once the reader has let go of it (it may be waiting on its descriptor).
        self._reading.add_done_callback(lambda _: self._sock.close())
        self._fail_waiting(WireError("the shared-memory path was given up"))

    def _fail_waiting(self, exc: Exception) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await self._reader.read()
                fd = self._reader.take_fd() if frame.get("fd") else None
                fut = self._waiting.pop(frame.get("rid"), None)  # type: ignore[arg-type]
                if fut is None or fut.done():
                    if fd is not None:
                        os.close(fd)
                    continue
                fut.set_result((frame, fd))
        except WireError as exc:
            self.broken = True
            self._fail_waiting(exc)

    async def _ask(
        self, doc: dict[str, Any], within: float | None = None
    ) -> tuple[dict[str, Any], int | None]:
        """One request and its reply (and the descriptor it carries, ours to close), within
        ``within`` seconds (default: the path's ``timeout``)."""
        limit = self._timeout if within is None else within
        if self.broken:
            raise WireError("the shared-memory connection is lost")
        rid = next(self._rids)
        fut: asyncio.Future[tuple[dict[str, Any], int | None]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[rid] = fut
        try:
            async with asyncio.timeout(limit):
                async with self._send_lock:
                    await send_frame(self._sock, {**doc, "rid": rid})
                return await asyncio.shield(fut)
        except TimeoutError:
            # The node may still carry the request out (a PUT is idempotent); hanging up
            # frees what this connection leased.
            self._give_up()
            raise WireError(f"no answer within {limit} s") from None
        except asyncio.CancelledError:
            # The reply may still come with a descriptor: close it then.
            fut.add_done_callback(_close_fd)
            raise
        finally:
            self._waiting.pop(rid, None)

    async def put(
        self, data: memoryview, chunk_id: str | None
    ) -> tuple[int, dict[str, Any]] | None:
        """Hand ``data`` over; the PUT's (status, document), or None: take the HTTP way.
        Raises the typed error of a refusal that HTTP would get too (a checksum mismatch)."""
        async with self._slots:
            try:
                reply, fd = await self._ask({"op": "lease", "size": data.nbytes})
                if fd is None:
                    return self._fallback(reply)
                lease = reply["lease"]
                try:
                    await in_thread(_stage, fd, data.nbytes, data)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self._ask({"op": "release", "lease": lease})
                    raise
                reply, _ = await self._ask(
                    {"op": "seal", "lease": lease, "length": data.nbytes, "id": chunk_id}
                )
                if reply.get("error") == "seal_refused":
                    # The node keeps a refused lease for its holder to fix or release: this
                    # one falls back to HTTP, so its RAM is freed now, not when it disconnects.
                    await self._ask({"op": "release", "lease": lease})
            except (WireError, OSError) as exc:
                log.warning("shared-memory path to %s lost (%s): using HTTP", self.node_id, exc)
                self.broken = True
                return None
            if int(reply.get("status", 500)) >= 400:
                return self._fallback(reply)
            return int(reply["status"]), reply

    async def get(
        self, chunk_id: str, out: memoryview | None, byte_range: ByteRange | None
    ) -> memoryview | None:
        """The chunk (or ``byte_range`` of it) from the node's RAM, checked, copied into
        ``out`` (or a new buffer); None when the node's RAM does not have it."""
        entry = self._maps.get(chunk_id)
        if entry is None:
            entry = _Entry(asyncio.get_running_loop().create_task(self._map(chunk_id)))
            self._maps[chunk_id] = entry
            entry.task.add_done_callback(functools.partial(self._map_done, chunk_id, entry))
        else:
            self._maps.move_to_end(chunk_id)
        entry.users += 1
        whole = False
        try:
            try:
                mapped = await asyncio.shield(entry.task)
            except (WireError, OSError) as exc:
                log.warning("shared-memory path to %s lost (%s): using HTTP", self.node_id, exc)
                self.broken = True
                return None
            if mapped is None:
                return None
            try:
                start, end = (byte_range or ByteRange()).resolve(mapped.size)
            except InvalidRange as exc:
                raise BadRange(message=str(exc), status=416) from None  # as HTTP says it
            if out is not None and len(out) < end - start:
                raise ValueError(f"output buffer of {len(out)} bytes < {end - start} to read")
            whole = start == 0 and end == mapped.size
            if end - start <= _INLINE_COPY_BYTES:
                return _copy_out(mapped.mm, out, start, end)
            return await in_thread(_copy_out, mapped.mm, out, start, end)
        finally:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if whole and not entry.users:
                # Read whole: nothing is likely to want more of it soon (a restore of
                # large tensors reads each chunk once). Unmapped now, its pages do not
                # stay in this process's memory.
                self._drop(chunk_id, entry)
            self._trim()

    async def _map(self, chunk_id: str) -> _Mapped | None:
        """Ask the node for the chunk, map it and check it; None: not in the node's RAM."""
        async with self._slots:
            reply, fd = await self._ask({"op": "read", "id": chunk_id}, self._read_within)
        if fd is None:
            return None
        try:
            size = int(reply["size"])
        except BaseException:
            os.close(fd)
            raise
        return _Mapped(await in_thread(_map_checked, fd, size, chunk_id), size)

    def _map_done(self, chunk_id: str, entry: _Entry, task: asyncio.Task[_Mapped | None]) -> None:
        """A mapping that failed (or that the node did not have) is not kept."""
        if entry.mapped() is None and self._maps.get(chunk_id) is entry:
            del self._maps[chunk_id]

    def _trim(self) -> None:
        """Unmap mappings nobody uses that have been idle for ``_MAPPED_IDLE`` s, and the
        least recently asked beyond ``_MAPPED_BYTES``; look again later while some are
        left."""
        now = time.monotonic()
        made = [(cid, e, e.mapped()) for cid, e in self._maps.items()]
        total = sum(m.size for _, _, m in made if m is not None)
        for cid, entry, mapped in made:
            if mapped is None or entry.users:
                continue
            if total > _MAPPED_BYTES or now - entry.last_used >= _MAPPED_IDLE:
                del self._maps[cid]
                total -= mapped.size
                with contextlib.suppress(BufferError):
                    mapped.mm.close()
        if self._maps and self._trim_timer is None:
            self._trim_timer = asyncio.get_running_loop().call_later(_MAPPED_IDLE, self._trim_later)

    def _drop(self, chunk_id: str, entry: _Entry) -> None:
        mapped = entry.mapped()
        if mapped is None or self._maps.get(chunk_id) is not entry:
            return
        del self._maps[chunk_id]
        with contextlib.suppress(BufferError):
            mapped.mm.close()

    def _trim_later(self) -> None:
        self._trim_timer = None
        self._trim()

    def _unmap_all(self) -> None:
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
        for entry in self._maps.values():
            mapped = entry.mapped()
            if mapped is not None:
                with contextlib.suppress(BufferError):
                    mapped.mm.close()
            elif not entry.task.done():
                entry.task.cancel()
        self._maps.clear()

    @staticmethod
    def _fallback(reply: dict[str, Any]) -> None:
        """A refusal: raise it if HTTP would be refused the same way, else None."""
        error = _error(reply)
        # nvme_full: this node's disk is full, another node (over HTTP) may take the chunk
        fallback = ("chunk_not_found", "seal_refused", "internal", "nvme_full")
        if is_retryable(error) or error.code in fallback:
            log.debug("shared-memory request refused (%s): using HTTP", error)
            return None
        raise error


def _error(reply: dict[str, Any]) -> StoragedError:
    status = int(reply.get("status", 500))
    body = {k: v for k, v in reply.items() if k not in ("rid", "status", "retry_after")}
    retry = reply.get("retry_after")
    return error_from_response(
        status,
        msgpack.packb(body, use_bin_type=True),
        "application/msgpack",
        None if retry is None else str(retry),
    )


def _close_fd(fut: asyncio.Future[tuple[dict[str, Any], int | None]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fd = fut.result()[1]
        if fd is not None:
            os.close(fd)
