"""``storaged.transport.BodyProtocol``, the receive core of the peer protocol and of the
client's direct GETs, driven by hand the way the event loop drives it (``get_buffer``,
then ``buffer_updated``): where each read lands, and what is copied."""

from __future__ import annotations

import os

import pytest

from storaged.transport import BODY, DISCARD, HEAD, HOLD, MAX_READ, BodyProtocol
from tests.test_loadtest_imports import PACKAGES, REPO, imports_of


class LineHeads(BodyProtocol):
    """A toy protocol: a head is ``b"skip size\\n"``; ``size`` body bytes follow ``skip``
    dropped ones; ``size`` -1 means drop ``skip`` bytes and take no body."""

    def __init__(self) -> None:
        super().__init__(64, 16)
        self.bodies: list[bytes] = []
        self.dests: list[memoryview] = []
        self.discards = 0
        self.held = 0

    def _on_head_bytes(self) -> None:
        while self._mode == HEAD:
            end = self._scratch.find(b"\n", self._sbeg, self._send)
            if end < 0:
                return
            skip, size = map(int, bytes(self._smv[self._sbeg : end]).split())
            self._sbeg = end + 1
            if size < 0:
                self._begin_discard(skip)
            else:
                dest = memoryview(bytearray(size))
                self.dests.append(dest)
                self._begin_body(dest, skip)

    def _on_held_bytes(self) -> None:
        self.held += 1

    def _body_complete(self, body: memoryview) -> None:
        assert body is self.dests[-1]  # the caller's own buffer comes back
        self.bodies.append(bytes(body))
        self._mode = HEAD
        self._on_head_bytes()

    def _discard_done(self) -> None:
        self.discards += 1


def feed(proto: BodyProtocol, data: bytes, most: int = 1 << 30) -> list[memoryview]:
    """Deliver ``data`` as the loop would, reads of at most ``most`` bytes; the buffers
    the protocol handed out, in order."""
    given = []
    view = memoryview(data)
    while view:
        buf = proto.get_buffer(-1)
        given.append(buf)
        n = min(len(buf), len(view), most)
        assert n, "the protocol asked for nothing while bytes wait"
        buf[:n] = view[:n]
        view = view[n:]
        proto.buffer_updated(n)
    return given


def test_a_body_is_read_into_the_destination_itself() -> None:
    proto = LineHeads()
    body = os.urandom(100_000)
    given = feed(proto, b"0 100000\n" + body)
    assert proto.bodies == [body]
    # The first read brought the head and the first body bytes (copied out of scratch);
    # every later read went straight into the destination.
    dest = proto.dests[0]
    assert all(buf.obj is dest.obj for buf in given[1:])
    assert proto._mode == HEAD


def test_reads_are_sliced_to_max_read() -> None:
    proto = LineHeads()
    size = 3 * MAX_READ + 5
    feed(proto, b"0 %d\n" % size, most=1 << 30)
    assert proto._mode == BODY
    sizes = []
    data = os.urandom(size)
    view = memoryview(data)
    while proto._mode == BODY:
        buf = proto.get_buffer(-1)
        sizes.append(len(buf))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        proto.buffer_updated(n)
    assert max(sizes) == MAX_READ and proto.bodies == [data]


@pytest.mark.parametrize("most", [1, 3, 16, 1 << 30])
def test_skip_then_body_then_discard_whatever_the_reads(most: int) -> None:
    proto = LineHeads()
    body = os.urandom(50)
    stream = b"7 50\n" + b"S" * 7 + body + b"9 -1\n" + b"D" * 9 + b"0 3\nabc"
    feed(proto, stream, most=most)
    assert proto.bodies == [body, b"abc"]
    assert proto.discards == 1


def test_a_partial_head_moves_to_the_front_of_a_full_scratch() -> None:
    proto = LineHeads()  # 64 bytes of scratch
    stream = b"".join(b"0 2\n%02d" % i for i in range(100))  # 600 bytes of small messages
    feed(proto, stream, most=7)  # reads that end mid-head
    assert proto.bodies == [b"%02d" % i for i in range(100)]
    assert proto._send <= len(proto._scratch)


def test_bytes_while_held_wait_unparsed_and_the_hook_is_told() -> None:
    proto = LineHeads()
    proto._mode = HOLD
    feed(proto, b"0 1\n")
    assert proto.held == 1 and proto.bodies == [] and proto._send == 4
    proto._mode = HEAD
    proto._on_head_bytes()
    feed(proto, b"q")
    assert proto.bodies == [b"q"]


def test_a_long_discard_reads_over_the_start_of_scratch() -> None:
    proto = LineHeads()
    given = feed(proto, b"100000 -1\n")
    assert proto._mode == DISCARD
    given = feed(proto, b"D" * 100_000)
    assert all(buf.obj is proto._scratch for buf in given)
    assert proto.discards == 1 and proto._mode == HEAD


def test_the_core_is_a_leaf() -> None:
    """Both the peer protocol and the client's direct GETs run on it: it imports nothing of
    the project (not the node, not the tiers, not the peer protocol), type-checking imports
    counted, so either user loads it alone."""
    found = imports_of(REPO / "storaged" / "transport.py", type_checking=True)
    assert [m for m in found if m.split(".")[0] in PACKAGES] == []
    users = [REPO / "storaged" / "peer" / "framing.py", REPO / "storaged" / "client" / "direct.py"]
    assert all("storaged.transport" in set(imports_of(path)) for path in users)
