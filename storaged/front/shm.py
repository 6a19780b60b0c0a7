"""The node's shared-memory listener: the co-located fast path of a client on this host.

A Unix socket in the node's data directory (in a directory of mode 0700, the socket
itself 0600) speaks framed msgpack (``storaged.shmwire``). The first frame authenticates
with the client token, as the HTTP API does. Then, each request carrying an ``rid`` the
reply repeats:

- ``lease(size)``: a memfd of the memory tier (``MemoryTier.lease_shared``), passed with
  ``SCM_RIGHTS``. The client maps it, writes the chunk, unmaps it.
- ``seal(lease, length, id?)``: the node seals the memfd against every write (refused
  while the client still maps it writable), hashes it here, and puts it as an HTTP PUT
  would, keeping the sealed pages as its RAM copy when it is a holder, and as a local
  copy (reads only, counted as no copy: ``MemoryTier.put_local_copy``) when it is not:
  the reply is the PUT's answer (status 201/200 and its document) or its error.
- ``release(lease)``: give a lease back unsealed.
- ``read(id)``: the sealed memfd holding exactly that chunk, when this node has it in RAM
  in a shared segment (it was handed over through this path), for the client to map
  read-only and check; ``chunk_not_found`` otherwise (the client goes the HTTP way). A
  chunk in the pooled RAM buffers (a replica's copy, an HTTP PUT's) is not copied into a
  new segment for the asker: measured here, a fresh memfd, the copy into it and the
  client's mapping of it cost about 1.8 CPU s/GB against 0.5 to 0.8 for an HTTP GET of
  the same bytes over loopback (docs/BENCHMARKS.md).

A client sees only the descriptors it was sent: its own leases and the chunks it asked
for by id. Leases not sealed when the connection ends are freed: a client that dies
mid-lease leaks nothing. Errors are mapped to HTTP statuses by the same function as the
HTTP API's middleware, so the client raises the same typed errors on both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from storaged.errors import (
    ApiError,
    NotFound,
    StoragedError,
    TooLarge,
    bad_request,
    unavailable,
)
from storaged.ids import chunk_id_and_crc32c, is_chunk_id
from storaged.shmwire import FrameReader, WireError, host_identity, send_frame
from tiers import ChunkNotFound
from tiers.memory import SealRefused, SharedSegment

if TYPE_CHECKING:
    from storaged.node.services import LocalStore
    from storaged.node.write import WritePath

log = logging.getLogger("storaged.front.shm")

#: a connection must authenticate within this many seconds
_HELLO_TIMEOUT = 10.0
#: requests of one connection in flight at once (each may hold a lease or a PUT)
_MAX_INFLIGHT = 64


def socket_path(data_dir: Path) -> Path:
    """Where the node listens: ``shm/node.sock`` in its data directory, or, when that path
    is too long for a Unix socket (108 bytes), a private directory under the temp dir
    named after the data directory (under ``/tmp`` when ``TMPDIR`` is itself too deep:
    a node must not fail to start over the length of a path)."""
    path = data_dir / "shm" / "node.sock"
    if _fits(path):
        return path
    import hashlib
    import tempfile

    tag = hashlib.blake2b(os.fsencode(data_dir.resolve()), digest_size=8).hexdigest()
    for top in (tempfile.gettempdir(), "/tmp"):
        path = Path(top) / f"storaged-{os.getuid()}" / tag / "node.sock"
        if _fits(path):
            return path
    return path  # the bind names the length in its error


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) < 100


class ShmNode(Protocol):
    """What the listener needs of its node: what it holds, and its write path."""

    @property
    def local(self) -> LocalStore: ...

    @property
    def writes(self) -> WritePath: ...


class ShmListener:
    """The Unix-socket listener of one node. ``to_error`` turns a domain error into the
    ``ApiError`` the HTTP API would answer (the server's one mapping)."""

    def __init__(
        self, node: ShmNode, path: Path, to_error: Callable[[StoragedError], ApiError]
    ) -> None:
        self.node = node
        self.path = path
        self._to_error = to_error
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._lease_ids = itertools.count(1)

    def info(self) -> dict[str, Any]:
        """What ``/v1/cluster`` tells clients about this listener."""
        return {"host": host_identity(), "socket": str(self.path)}

    async def start(self) -> None:
        await asyncio.to_thread(self._bind)
        self._accepting = asyncio.create_task(self._accept_loop(), name="shm-accept")
        log.debug("node %s: shared-memory listener on %s", self.node.local.id, self.path)

    def _bind(self) -> None:
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # nobody else may even reach the socket
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a node that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._conns) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors, for one: clients use HTTP meanwhile
                log.warning("shared-memory listener: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(_Connection(self, conn).run(), name="shm-conn")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)


class _Connection:
    """One client's socket, its leases and its requests in flight."""

    def __init__(self, listener: ShmListener, sock: socket.socket) -> None:
        self.listener = listener
        self.node = listener.node
        self.sock = sock
        self.reader = FrameReader(sock, accept_fds=False)
        self.leases: dict[int, SharedSegment] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.send_lock = asyncio.Lock()
        self.slots = asyncio.Semaphore(_MAX_INFLIGHT)

    async def run(self) -> None:
        try:
            if not await self._hello():
                return
            while True:
                frame = await self.reader.read()
                await self.slots.acquire()
                task = asyncio.create_task(self._request(frame))
                self.tasks.add(task)
                task.add_done_callback(self._done)
        except WireError:
            pass  # the client went away: what it leased goes with it
        finally:
            for task in list(self.tasks):
                task.cancel()
            for task in list(self.tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for lease in list(self.leases):
                seg = self._take_lease(lease)
                if seg is not None:
                    self.node.local.memory.release_shared(seg)
            self.reader.close()
            self.sock.close()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.slots.release()

    # A lease held is a PUT in flight (``writes.inflight``) from the moment it is taken
    # until it is taken back: to be sealed (the seal counts itself until stored), released,
    # or dropped with its connection. A graceful stop waits for it (I5) and background
    # work gives way to it, as to an HTTP PUT whose body is still coming.

    def _add_lease(self, lease: int, seg: SharedSegment) -> None:
        self.leases[lease] = seg
        self.node.writes.inflight += 1
        self.node.local.metrics.shm_leases.inc()

    def _take_lease(self, lease: Any) -> SharedSegment | None:
        seg = self.leases.pop(lease, None) if isinstance(lease, int) else None
        if seg is not None:
            self.node.writes.inflight -= 1
            self.node.local.metrics.shm_leases.dec()
        return seg

    async def _hello(self) -> bool:
        try:
            async with asyncio.timeout(_HELLO_TIMEOUT):
                frame = await self.reader.read()
        except TimeoutError:
            return False
        token = self.node.local.config.token
        given = frame.get("token")
        ok = frame.get("op") == "hello" and (
            not token
            or (isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode()))
        )
        if not ok:
            self.node.local.metrics.shm_ops.labels("hello", "unauthorized").inc()
            with contextlib.suppress(WireError):
                await self._send(
                    {"error": "unauthorized", "message": "missing or wrong token", "status": 401}
                )
            return False
        await self._send(
            {
                "ok": True,
                "node": self.node.local.id,
                "max_chunk_size": self.node.local.config.max_chunk_size,
            }
        )
        return True

    async def _send(self, doc: dict[str, Any], fd: int | None = None) -> None:
        if fd is not None:
            doc["fd"] = True  # the client pairs descriptors with the frames that announce one
        async with self.send_lock:
            await send_frame(self.sock, doc, fd)

    async def _request(self, frame: dict[str, Any]) -> None:
        rid = frame.get("rid")
        op = str(frame.get("op"))
        try:
            handler = {
                "lease": self._lease,
                "seal": self._seal,
                "release": self._release,
                "read": self._read,
            }.get(op)
            if handler is None:
                raise bad_request(f"unknown operation {op!r}")
            await handler(rid, frame)
            self.node.local.metrics.shm_ops.labels(op, "ok").inc()
        except asyncio.CancelledError:
            raise
        except (StoragedError, ApiError) as caught:
            exc = self.listener._to_error(caught) if isinstance(caught, StoragedError) else caught
            self.node.local.metrics.shm_ops.labels(op, exc.code).inc()
            self.node.local.metrics.errors.labels(exc.code).inc()
            retry = exc.headers.get("Retry-After")
            doc = {"rid": rid, "status": exc.status, **exc.body()}
            if retry is not None:
                doc["retry_after"] = retry
            with contextlib.suppress(WireError):
                await self._send(doc)
        except WireError:
            pass
        except Exception as exc:
            log.exception("shared-memory %s failed", op)
            self.node.local.metrics.shm_ops.labels(op, "internal").inc()
            with contextlib.suppress(WireError):
                await self._send(
                    {"rid": rid, "status": 500, "error": "internal", "message": type(exc).__name__}
                )

    async def _lease(self, rid: Any, frame: dict[str, Any]) -> None:
        node = self.node
        size = frame.get("size")
        if not isinstance(size, int) or size <= 0:
            raise bad_request("lease needs a positive integer size")
        if size > node.local.config.max_chunk_size:
            raise TooLarge("too_large", f"{size} bytes is over the max chunk size")
        if node.local.stopping:
            raise unavailable("shutting_down", f"node {node.local.id} is stopping", retry_after=1.0)
        if len(self.leases) >= node.local.config.max_client_puts:
            # As PUTs in flight per client address: one client cannot pin all the RAM.
            raise unavailable(
                "too_many_leases",
                f"{len(self.leases)} leases held on this connection (max_client_puts)",
                retry_after=1.0,
            )
        # In flight from the check above: a stop that begins while this waits for room
        # waits for the lease too.
        node.writes.inflight += 1
        try:
            # memory_full, or nvme_full when RAM waits for a full disk (as a PUT's)
            seg = await node.writes.room(
                size, lambda wait: node.local.memory.lease_shared(size, timeout=wait)
            )
            lease = next(self.listener._lease_ids)
            self._add_lease(lease, seg)
        finally:
            node.writes.inflight -= 1
        try:
            await self._send({"rid": rid, "lease": lease, "size": size}, fd=seg.fd)
        except BaseException:
            if self._take_lease(lease) is seg:
                node.local.memory.release_shared(seg)
            raise

    async def _release(self, rid: Any, frame: dict[str, Any]) -> None:
        seg = self._take_lease(frame.get("lease"))
        if seg is not None:
            self.node.local.memory.release_shared(seg)
        await self._send({"rid": rid, "ok": True})

    async def _seal(self, rid: Any, frame: dict[str, Any]) -> None:
        node = self.node
        if node.local.writes_closed:
            # The stop waited for leases as long as it may: one sealed now could be acked
            # after the last drain. Nothing is stored; the client puts it over HTTP.
            seg = self._take_lease(frame.get("lease"))
            if seg is not None:
                node.local.memory.release_shared(seg)
            raise unavailable("shutting_down", f"node {node.local.id} is stopping", retry_after=1.0)
        # Still a PUT in flight (the lease counted until now) until it is stored.
        node.writes.inflight += 1
        try:
            await self._seal_lease(rid, frame)
        finally:
            node.writes.inflight -= 1

    async def _seal_lease(self, rid: Any, frame: dict[str, Any]) -> None:
        node = self.node
        lease, length, claimed = frame.get("lease"), frame.get("length"), frame.get("id")
        if claimed is not None and not is_chunk_id(claimed):
            raise bad_request(f"{claimed!r} is not a chunk id", code="bad_chunk_id")
        if not isinstance(length, int):
            raise bad_request("seal needs an integer length")
        seg = self._take_lease(lease)
        if seg is None or not isinstance(lease, int):
            raise bad_request(f"no lease {lease!r} on this connection")
        try:
            sealed = await node.local.memory.seal_shared(seg, length)
        except SealRefused as exc:
            self._add_lease(lease, seg)  # still the client's, to fix and seal or release
            raise bad_request(str(exc), code="seal_refused") from exc
        except BaseException:
            node.local.memory.release_shared(seg)
            raise
        # From here the bytes cannot change: what is hashed is what is kept and sent. The
        # CRC-32C goes with the copies so that the replicas need not hash them again.
        try:
            digest, crc = await asyncio.to_thread(chunk_id_and_crc32c, sealed.view)
        except BaseException:
            node.local.memory.release(sealed)
            raise
        if claimed is not None and digest != claimed:
            node.local.memory.release(sealed)
            raise bad_request("the chunk's BLAKE3-256 is not the id", code="checksum_mismatch")
        # Admitted when its lease was handed out (never to a stopping node): a graceful
        # stop lets it finish, as an HTTP PUT already past its admission.
        status, doc = await node.writes.put_sealed(digest, sealed, crc, admitted=True)
        await self._send({"rid": rid, "status": status, **doc})

    async def _read(self, rid: Any, frame: dict[str, Any]) -> None:
        node = self.node
        cid = frame.get("id")
        if not isinstance(cid, str) or not is_chunk_id(cid):
            raise bad_request(f"{cid!r} is not a chunk id", code="bad_chunk_id")
        memory = node.local.memory
        if not memory.is_shared(cid):
            raise NotFound("chunk_not_found", f"{cid} is not in a shared segment of this node")
        try:
            async with memory.lease_fd(cid) as (fd, size):
                await self._send({"rid": rid, "size": size}, fd=fd)
        except ChunkNotFound:
            raise NotFound("chunk_not_found", f"{cid} is not in this node's RAM") from None
        node.local.metrics.restore_bytes.labels("memory").inc(size)
