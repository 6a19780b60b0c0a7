"""The node's state log describes itself (magic, version, CRC-32C of the header and of every
record) and compacts through the durable write: a torn tail is expected and dropped quietly,
damage is dropped loudly with the file kept aside, the first format is read and upgraded."""

from __future__ import annotations

import asyncio
import logging
import struct
from pathlib import Path

import msgpack
import pytest

from storaged.node.index import StateLog

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _written(path: Path, *batches: list[tuple[str, int, int, float]]) -> None:
    """Open the log, append each batch (as the node does, from its loop), close it."""

    async def append() -> None:
        for batch in batches:
            await log.append(batch, sync=True)

    log = StateLog(path)
    log.load()
    try:
        asyncio.run(append())
    finally:
        log.close()


def _load(path: Path) -> dict[str, tuple[int, int]]:
    log = StateLog(path)
    try:
        return {cid: (i.state, i.size) for cid, i in log.load().items()}
    finally:
        log.close()


def test_states_survive_a_restart_and_never_move_back(tmp_path: Path) -> None:
    path = tmp_path / "chunks.state"
    _written(path, [(A, 1, 10, 1.0), (B, 3, 20, 2.0)], [(A, 2, 10, 3.0), (B, 2, 20, 4.0)])
    assert path.read_bytes()[:4] == b"SDSL"
    assert _load(path) == {A: (2, 10), B: (3, 20)}  # B was cold: a later 2 does not lower it
    _written(path, [(A, 0, 0, 5.0)])  # forgotten
    assert _load(path) == {B: (3, 20)}
    assert _load(path) == {B: (3, 20)}  # compaction kept it
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_torn_tail_is_dropped_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "chunks.state"
    _written(path, [(A, 1, 10, 1.0)], [(B, 2, 20, 2.0)])
    blob = path.read_bytes()
    path.write_bytes(blob[:-3])  # a crash in the middle of the last append
    with caplog.at_level(logging.WARNING, "storaged.node.index"):
        assert _load(path) == {A: (1, 10)}
    assert not caplog.records
    assert not path.with_name("chunks.state.damaged").exists()


def test_a_damaged_record_is_dropped_loudly_and_the_file_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "chunks.state"
    _written(path, [(A, 1, 10, 1.0)], [(B, 2, 20, 2.0)], [(C, 3, 30, 3.0)])
    blob = bytearray(path.read_bytes())
    second = StateLog.HEADER_SIZE + 8 + len(msgpack.packb([A, 1, 10, 1.0]))
    blob[second + 8 + 3] ^= 0x40  # a flipped bit inside B's record body
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, "storaged.node.index"):
        assert _load(path) == {A: (1, 10)}  # what came before the damage counts
    assert any("fails its check" in r.getMessage() for r in caplog.records)
    assert path.with_name("chunks.state.damaged").read_bytes() == bytes(blob)
    assert _load(path) == {A: (1, 10)}  # the rewritten log is whole


def test_an_unreadable_header_keeps_the_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "chunks.state"
    _written(path, [(A, 1, 10, 1.0)])
    blob = bytearray(path.read_bytes())
    struct.pack_into(">H", blob, 4, 9)  # version 9, CRC no longer matching
    path.write_bytes(bytes(blob))
    assert _load(path) == {}
    assert path.with_name("chunks.state.damaged").exists()


def test_a_log_of_the_first_format_is_read_and_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "chunks.state"
    legacy = b"".join(
        struct.pack(">I", len(body)) + body
        for body in (msgpack.packb(r) for r in ([A, 2, 10, 1.0], [B, 3, 20, 2.0], [A, 1, 10, 3.0]))
    )
    path.write_bytes(legacy + b"\x00\x00")  # with a torn tail
    assert _load(path) == {A: (2, 10), B: (3, 20)}
    assert path.read_bytes()[:4] == b"SDSL"
    assert _load(path) == {A: (2, 10), B: (3, 20)}
