"""The wire of the co-located fast path: framed msgpack over a Unix socket, file
descriptors passed with ``SCM_RIGHTS``. Shared by the node's listener (``storaged.front.shm``)
and the client (``storaged.client.shm``).

A frame is a 4-byte big-endian length and a msgpack map. A frame that carries a file
descriptor is sent with one ``sendmsg``, so the descriptor arrives with its first byte;
the receiver keeps the descriptors it gets in arrival order and the frame says whether
it carries one, so frames and descriptors pair up in order.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgpack

#: the largest frame either side accepts (frames carry ids and sizes, never chunk bytes)
MAX_FRAME = 64 * 1024
_HEADER = struct.Struct(">I")
#: descriptors accepted per recvmsg (the node sends at most one per frame)
_MAX_FDS = 16


class WireError(Exception):
    """The other side closed the socket or broke the framing."""


def host_identity() -> str:
    """Who "the same host" is: the machine id and the boot id (a container sharing the
    host's kernel but not its /dev/shm would have another machine id), hashed."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    parts.append(socket.gethostname())
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def encode(doc: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(doc, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


async def _wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, readable: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if readable:
        loop.add_reader(fd, ready)
    else:
        loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        if readable:
            loop.remove_reader(fd)
        else:
            loop.remove_writer(fd)


async def send_frame(sock: socket.socket, doc: dict[str, Any], fd: int | None = None) -> None:
    """Send one frame (with ``fd`` attached when given) on a non-blocking socket."""
    loop = asyncio.get_running_loop()
    data = memoryview(encode(doc))
    if fd is not None:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        while True:
            try:
                sent = sock.sendmsg([data], rights)
                break
            except (BlockingIOError, InterruptedError):
                await _wait(loop, sock, readable=False)
            except OSError as exc:
                raise WireError(f"send failed: {exc}") from exc
        data = data[sent:]
    if data:
        try:
            await loop.sock_sendall(sock, data)
        except OSError as exc:
            raise WireError(f"send failed: {exc}") from exc


class FrameReader:
    """Reads frames (and the descriptors that come with them) from a non-blocking socket."""

    def __init__(self, sock: socket.socket, *, accept_fds: bool) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._accept_fds = accept_fds
        #: descriptors received and not yet taken, oldest first
        self.fds: list[int] = []

    async def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        space = socket.CMSG_SPACE(_MAX_FDS * 4) if self._accept_fds else 0
        while True:
            try:
                data, ancdata, _flags, _ = self._sock.recvmsg(1 << 16, space)
                break
            except (BlockingIOError, InterruptedError):
                await _wait(loop, self._sock, readable=True)
            except OSError as exc:
                raise WireError(f"receive failed: {exc}") from exc
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.fds.extend(fds)
        if not data:
            raise WireError("connection closed")
        self._buf += data

    async def read(self) -> dict[str, Any]:
        """The next frame; ``WireError`` when the socket closes or the frame is malformed."""
        while len(self._buf) < _HEADER.size:
            await self._fill()
        (length,) = _HEADER.unpack_from(self._buf)
        if length > MAX_FRAME:
            raise WireError(f"frame of {length} bytes is over {MAX_FRAME}")
        while len(self._buf) < _HEADER.size + length:
            await self._fill()
        raw = bytes(self._buf[_HEADER.size : _HEADER.size + length])
        del self._buf[: _HEADER.size + length]
        try:
            doc = msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            raise WireError(f"undecodable frame: {exc}") from exc
        if not isinstance(doc, dict):
            raise WireError("a frame must be a map")
        return doc

    def take_fd(self) -> int:
        if not self.fds:
            raise WireError("a frame announced a descriptor that did not come")
        return self.fds.pop(0)

    def close(self) -> None:
        """Close descriptors received and never taken."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
