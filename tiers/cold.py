"""The cold tier: durable erasure fragments, one checked file each (see ``tiers._durable``).

A key is ``erasure.fragment_key(chunk_id, index)`` (``f"{chunk_id}.{index}"``) and its
value a whole fragment as ``erasure.fragment`` defines it (fragment header + payload).
A value is checked on write (unless the caller says it did) and on every read: the
fragment parses (magic, version, header CRC-32C, payload size and CRC-32C) and names the
chunk id and index of its key.

    tier = await ColdTier.open(root, capacity)
    await tier.put_fragment(fragment)              # header and payload written, not joined
    await tier.put_parts(key, [header, payload])   # the same from parts
    indexes = tier.keys_for(cid)                   # fragments of a chunk held here
    whole = await tier.get(fragment_key(cid, i))   # header + payload: parse_fragment(whole)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import crc32c

from erasure import HEADER_SIZE as FRAGMENT_HEADER_SIZE
from erasure import (
    CorruptFragment,
    Fragment,
    fragment_key,
    parse_fragment,
    parse_fragment_key,
    parse_header,
)
from tiers._durable import KIND_FRAGMENT, DurableTier, InvalidValue
from tiers.base import InvalidKey


class ColdTier(DurableTier):
    """Erasure fragments by fragment key, bounded by ``capacity`` bytes of fragments."""

    name = "cold"
    kind = KIND_FRAGMENT

    def __init__(self, root: Path, capacity: int, *, _token: object = None) -> None:
        super().__init__(root, capacity, _token=_token)
        self._by_chunk: dict[str, set[int]] = {}

    async def put_fragment(self, fragment: Fragment, *, verified: bool = False) -> str:
        """Store a ``Fragment`` (from ``Codec.encode``) under its own fragment key, header and
        payload written with one ``writev``; returns the key. ``verified`` as in ``put``."""
        key = fragment_key(fragment.chunk_id, fragment.index)
        await self.put_parts(key, fragment.parts(), verified=verified)
        return key

    def keys_for(self, chunk_id: str) -> list[int]:
        """The indexes of ``chunk_id``'s fragments held here now, ascending."""
        return sorted(self._by_chunk.get(chunk_id, ()))

    def chunk_ids(self) -> list[str]:
        """The chunks with at least one fragment held here now (a snapshot)."""
        return list(self._by_chunk)

    def _parse_key(self, key: str) -> tuple[bytes, int]:
        try:
            chunk_id, index = parse_fragment_key(key)
        except (ValueError, TypeError, AttributeError):
            raise InvalidKey(key) from None
        return bytes.fromhex(chunk_id), index

    def _check_value(self, key: str, parts: Sequence[memoryview]) -> None:
        chunk_id, index = parse_fragment_key(key)
        try:
            if len(parts) == 1:
                fragment = parse_fragment(parts[0])
                found_id, found_index = fragment.chunk_id, fragment.index
            else:
                found_id, found_index = _check_fragment_parts(parts)
        except CorruptFragment as exc:
            raise InvalidValue(f"bad fragment: {exc}") from None
        if (found_id, found_index) != (chunk_id, index):
            raise InvalidValue(f"fragment is {found_id}.{found_index}, not {key}")

    def _index_added(self, key: str) -> None:
        chunk_id, index = parse_fragment_key(key)
        self._by_chunk.setdefault(chunk_id, set()).add(index)

    def _index_removed(self, key: str) -> None:
        forget_fragment(self._by_chunk, key)


def forget_fragment(by_chunk: dict[str, set[int]], key: str) -> None:
    """Take fragment ``key`` out of ``by_chunk`` (chunk id -> the indexes of its fragments
    held), and the chunk once none is left."""
    chunk_id, index = parse_fragment_key(key)
    held = by_chunk.get(chunk_id)
    if held is not None:
        held.discard(index)
        if not held:
            del by_chunk[chunk_id]


def _check_fragment_parts(parts: Sequence[memoryview]) -> tuple[str, int]:
    """``parse_fragment`` over a fragment given in pieces, without joining the payload."""
    head = bytearray()
    rest: list[memoryview] = []
    for part in parts:
        need = FRAGMENT_HEADER_SIZE - len(head)
        if need > 0:
            head += part[:need]  # at most 80 bytes copied
            if part.nbytes > need:
                rest.append(part[need:])
        else:
            rest.append(part)
    info = parse_header(head)
    size = sum(p.nbytes for p in rest)
    if size != info.payload_size:
        raise CorruptFragment(
            f"fragment {info.index}: payload of {size} bytes, header says {info.payload_size}"
        )
    crc = 0
    for part in rest:
        crc = crc32c.crc32c(part, value=crc)
    if crc != info.payload_crc:
        raise CorruptFragment(f"fragment {info.index}: payload checksum mismatch")
    return info.chunk_id, info.index
