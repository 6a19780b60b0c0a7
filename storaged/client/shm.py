"""The co-located fast path: chunks handed to the node on this host through shared memory.

``Client`` opens a ``ShmPath`` when a node it was given (its first seed URL that
qualifies) reports, in ``/v1/cluster``, the same host identity as this process and a
socket this process can reach (``storaged.shm`` is the node's side). Then:

- a PUT leases a memfd from the node, copies the chunk into it (one memcpy, in a thread,
  straight into pages the node already allocated), unmaps it and asks the node to seal
  it: the node hashes it, keeps it as its RAM copy and replicates it. The client never
  hashes what it uploads this way.
- a GET asks the node for the chunk from its RAM: the node passes a sealed memfd holding
  exactly that chunk; the client maps it read-only, checks its BLAKE3 (as every read is
  checked) and copies the wanted bytes out.

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
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import msgpack
import numpy as np

from storaged.client.errors import (
    BadRange,
    ChecksumMismatch,
    StoragedError,
    error_from_response,
    is_retryable,
)
from storaged.ids import chunk_id_of
from storaged.shmwire import FrameReader, WireError, host_identity, send_frame
from tiers.base import ByteRange, InvalidRange

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the leased pages exist (the node allocated them): map their page tables at once, not
#: one fault per 4 KiB page as the copy touches them
_SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: how long connecting and authenticating may take before the client stays on HTTP
_CONNECT_TIMEOUT = 5.0
#: below this a copy runs on the loop: a thread hop would cost more
_INLINE_COPY_BYTES = 256 << 10


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
    """``func(*args)`` in a thread; a cancelled caller resumes only once the thread is done
    (it may be reading the caller's buffer, which the caller may reuse once we return)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, func, *args)
    thread = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(thread)
    except asyncio.CancelledError:
        while not thread.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([thread])
        if not thread.cancelled():
            thread.exception()
        raise


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` without holding the GIL for large copies (numpy releases it)."""
    if src.nbytes <= _INLINE_COPY_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _stage(fd: int, size: int, data: memoryview) -> None:
    """Map the leased memfd, copy ``data`` in, unmap: after this nothing of ours can write
    it (the node's seal checks that no writable mapping is left)."""
    try:
        with mmap.mmap(
            fd, size, flags=_SHARED_POPULATED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        ) as m:
            view = memoryview(m)
            try:
                _copy(view, data)
            finally:
                view.release()
    finally:
        os.close(fd)


def _fetch(
    fd: int, size: int, chunk_id: str, out: memoryview | None, start: int, end: int
) -> memoryview:
    """Map a sealed chunk read-only, check it whole against its id, copy ``[start, end)``
    into ``out`` (or a new buffer). ``ChecksumMismatch`` when it fails the id."""
    try:
        with mmap.mmap(fd, size, flags=_SHARED_POPULATED, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            try:
                if chunk_id_of(view) != chunk_id:
                    raise ChecksumMismatch(
                        message=f"chunk {chunk_id} in shared memory fails its id"
                    )
                dst = memoryview(bytearray(end - start)) if out is None else out[: end - start]
                _copy(dst, view[start:end])
                return dst
            finally:
                view.release()
    finally:
        os.close(fd)


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
    ) -> None:
        self.node_id = node_id
        self._timeout = timeout
        self._sock = sock
        self._reader = reader
        self._rids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[dict[str, Any], int | None]]] = {}
        self._send_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(limit)
        self.broken = False
        self._reading = asyncio.get_running_loop().create_task(self._read_replies())

    @classmethod
    async def connect(
        cls, node_id: str, path: str, token: str | None, limit: int, timeout: float = 120.0
    ) -> ShmPath:
        """Connect and authenticate; ``OSError``/``WireError``/``StoragedError`` on failure.
        ``limit`` requests at once, each answered within ``timeout`` seconds or the path
        is given up (a node that stopped answering: a paused process, say)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        reader = FrameReader(sock, accept_fds=True)
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT):
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
        return cls(node_id, sock, reader, limit, timeout)

    async def close(self) -> None:
        self.broken = True
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

    async def _ask(self, doc: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """One request and its reply (and the descriptor it carries, ours to close)."""
        if self.broken:
            raise WireError("the shared-memory connection is lost")
        rid = next(self._rids)
        fut: asyncio.Future[tuple[dict[str, Any], int | None]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[rid] = fut
        try:
            async with asyncio.timeout(self._timeout):
                async with self._send_lock:
                    await send_frame(self._sock, {**doc, "rid": rid})
                return await asyncio.shield(fut)
        except TimeoutError:
            # The node may still carry the request out (a PUT is idempotent); hanging up
            # frees what this connection leased.
            self._give_up()
            raise WireError(f"no answer within {self._timeout} s") from None
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
        async with self._slots:
            try:
                reply, fd = await self._ask({"op": "read", "id": chunk_id})
            except (WireError, OSError) as exc:
                log.warning("shared-memory path to %s lost (%s): using HTTP", self.node_id, exc)
                self.broken = True
                return None
            if fd is None:
                return None
            try:
                size = int(reply["size"])
                start, end = (byte_range or ByteRange()).resolve(size)
            except InvalidRange as exc:
                os.close(fd)
                raise BadRange(message=str(exc), status=416) from None  # as HTTP says it
            except BaseException:
                os.close(fd)
                raise
            if out is not None and len(out) < end - start:
                os.close(fd)
                raise ValueError(f"output buffer of {len(out)} bytes < {end - start} to read")
            return await in_thread(_fetch, fd, size, chunk_id, out, start, end)

    @staticmethod
    def _fallback(reply: dict[str, Any]) -> None:
        """A refusal: raise it if HTTP would be refused the same way, else None."""
        error = _error(reply)
        if is_retryable(error) or error.code in ("chunk_not_found", "seal_refused", "internal"):
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
